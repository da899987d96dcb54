"""The sampler: tokens drawn from the base model and any policy's adapter, many requests in one batch.

- `engine`: the `Engine` interface and the transformers engine (per-row seeds, stop tokens, top logprobs);
- `batcher`: continuous batching, every concurrent generate call decoding in one shared batch;
  `blocks`: that batch's rows between forwards (merged, assembled, replicated) and their draw across calls;
- `kv_cache`: conversations' KV caches kept between turns; `gqa_attention`: copy-free grouped-query attention;
- `lora_inference`: LoRA layers' forward without peft's per-call bookkeeping (one adapter at a time);
  `multi_lora`: several adapters in one forward, stacked, with grouped matmuls (mixed-adapter blocks);
- `device_sampling`: the draw on the device (counter-based uniforms of (row seed, position), per-row settings);
  `device_decode`: several decode steps per host read; `graphed_decode`: decode steps replayed from CUDA graphs;
- `slicing`: the safe points where a long generation lets other tenants' calls run;
- `token_stream`: each drawn token to an asyncio reader as it is drawn (and cancellation back);
- `constraints`: structured outputs, a per-row token mask (a JSON schema, by llguidance) applied before the draw;
- `vllm_engine`: the same interface over vLLM, on a GPU where it is installed.
"""
