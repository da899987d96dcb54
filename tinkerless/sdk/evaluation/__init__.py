"""Measuring a policy without training it.

- `evaluate`: `evaluate()`, the env's own episodes with a checkpoint, an adapter or the base model;
- `games`: a multi-agent env's held-out games (`eval_every` with `eval_agents`, and `evaluate()` of one);
- `agent_eval`: an `@tinkerless.agent` function against any OpenAI-compatible endpoint;
- `pass_at_k`: the unbiased pass@k estimator.
"""
