"""The GPU functions (rollout, forward, update) and what they run on, one room per job.

- `worker.Worker`: one base model, one LoRA adapter + optimizer per policy; `handle(method, bytes)` runs
  `rollout`, `forward`, `update` (and `sample`, `forward_backward`, `optim_step`, `save_state`, `load_state`)
  on wire types. It is the function surface every backend calls;
- `policies`: the policies' LoRA adapters on the one peft model (adding, re-initializing, dropping, switching
  them; the vLLM engine's adapter directories);
- `sampling/`: the sampler (engines, continuous batching, KV caches, the LoRA fast path);
- `training/`: log-probs and gradients in bounded memory; `losses`: the RL and SFT losses;
- `sharding/`: the update over the GPUs of one machine (N ranks, FSDP2), behind the Worker's call surface;
  `memory_plan`: what a model's update and sampler need per GPU (`scaling_table`: docs/scaling.md's table);
  `prices`: what a device-hour costs (list prices per GPU class), for the client's accounting and the server's budgets;
- `rollout/`: a rollout request served (`requests`: its episode loop and the code its client shipped), the
  episode loops, single- and multi-agent, and chat formatting in token space;
- `hosting/`: users' env, reward and agent code next to the model, behind the sandbox;
- `openai_api/`: the OpenAI-compatible endpoint agents and `tinkerless serve` share (`calls`: what every API's
  route does around the model); `anthropic_api/` and `responses_api/`: Anthropic Messages and OpenAI Responses
  over the same backend, in their own wire shapes; `apis`: the list of those routers every endpoint mounts;
- `companions/`: other models in the loop, beside the policy: a distillation teacher's alignment across
  tokenizers and its scores from an endpoint, an LLM judge's prompt, verdicts and cache;
- `precision`: the base weights' dtype (adapters stay fp32); `handoff`: the proof a writer commits with each
  policy version, which readers check when they load it;
- `models`: model resolution and loading (SmolLM2 from its GGUF package, HF ids, local paths, tiny test models);
  `hf_cache`: a local model placed in the HF cache; `threads`: the worker's CPU thread count.
"""
