"""One RL run, driven from the client and identical for every backend.

- `trainer`: `train()`, the loop: rollouts, advantages, update, metrics, checkpoints, resume;
- `tasks`: task sources (lists, JSONL, task functions, streams); `advantages`: GRPO and Dr.GRPO estimators;
- `agents` / `multi_agent`: who plays a multi-agent env, and that step's rollout phase behind its barrier;
- `metrics`, `step_metrics`, `transcripts`, `progress`, `truncation`: what a step leaves and shows;
- `accounting`: compute seconds per function and phase, and their cost; `lifecycle`: signals and heartbeats.
"""
