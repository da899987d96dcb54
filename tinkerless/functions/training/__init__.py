"""The trainer's passes: per-token log-probs and the loss's gradients on a batch of datums, in bounded memory.

- `forward_backward`: `forward` (log-probs) and `forward_backward` (loss + gradients) on a policy;
- `micro_batches`: how a batch is cut by a token budget, and when a micro-batch recomputes its layers;
- `shared_prefix`: rows that share a prompt run the prompt's forward once per group;
- `picked_logits`: the output head on the trained tokens only; `chunked_logprobs`: through it in chunks of
  bounded logits; `packing`: the rows end to end with no padding (opt-in);
- `policy_state`: a policy's saved state read back and checked, and the fresh init rebuilt.
The losses themselves are `tinkerless.functions.losses` (its `LossConfig` travels on the wire under that path).
"""
