"""The update over the GPUs of one machine: N ranks, the model and its LoRA adapters sharded with FSDP2.

- `group.ShardedWorker`: what a backend calls in place of a `Worker` (the same `handle` and typed methods):
  it starts the ranks, sends each request to all of them, returns rank 0's reply, and is their watchdog (a
  rank that dies fails the call with `RankFailed` naming it; the ranks restart with the saved policies);
- `process`: one rank's process (the process group, its `RankWorker`, the requests from its pipe);
- `rank.RankWorker`: the `Worker` on one rank: FSDP2 over the model once its policies exist, its share of
  each batch, results gathered to every rank, full (unsharded) adapter and optimizer files in and out, so a
  state saved by N ranks loads on any other number;
- `base_weights`: the base model on a rank, built with placeholder weights and filled with the rank's rows of
  each weight from the checkpoint's safetensors files once sharded, so no rank holds the whole model.

Parameters, gradients and Adam's moments are sharded; base weights stay in the run's dtype and LoRA weights
fp32 (`precision.py`); long micro-batches recompute their layers in backward (`training/micro_batches.py`).
Sampling is not served here: the rollout role samples (vLLM's tensor parallelism for a model too large for
one GPU). `memory_plan` says how many GPUs a model needs.
"""
