"""The GPU functions and what they run on.

- `worker.Worker`: one base model, one LoRA adapter + optimizer per policy; `handle(method, bytes)`
  runs `rollout`, `forward`, `update` (and `sample`, `forward_backward`, `optim_step`,
  `save_state`, `load_state`) on wire types;
- `agent_loop`: the per-episode state machine with token masks;
- `engine` / `vllm_engine`: generation behind one interface (transformers; vLLM on GPU);
- `training`: per-token log-probs and loss backward; `losses`: the RL/SFT losses;
- `models`: model resolution (SmolLM2 from its GGUF package, HF ids, local paths, tiny test models).
"""
