"""One RL run, driven from the client and identical for every backend.

- `trainer`: `train()`, the loop: rollouts, advantages, update, metrics, checkpoints, resume;
- `rollouts`: a step's rollout requests and its failed episodes; `batches`: episodes → advantages → `Datum`s;
- `checkpointing`: what a run's checkpoint holds (policies, client state), its writes, restore on resume;
- `tasks`: task sources (lists, JSONL, task functions, streams); `advantages`: GRPO and Dr.GRPO estimators;
- `agents` / `multi_agent`: who plays a multi-agent env, and that step's rollout phase behind its barrier;
- `metrics`, `step_metrics`, `transcripts`, `progress`, `truncation`: what a step leaves and shows;
- `accounting`: compute seconds per function and phase, and their cost; `lifecycle`: signals and heartbeats.
"""
