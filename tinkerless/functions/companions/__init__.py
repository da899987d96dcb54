"""Other models in the loop: a teacher that scores the policy's samples, and a judge that grades them.

Both are another model served beside the policy, metered and failing the same way, so they share a room:

- `alignment`: a teacher's log-probs for the student's sampled tokens when the two tokenize differently
  (the student's text re-rendered with the teacher's chat template, matched by character spans);
- `endpoint`: prompt log-probs from an OpenAI-compatible endpoint (a teacher served elsewhere);
- `tokenizer_files`: a companion model's tokenizer as files and back, from where it is loaded (a server's extra
  model, a Modal container) to the client that aligns with it;
- `judge`: an LLM judge as a reward (`tinkerless.judge`): its prompt with the completion fenced off, its verdict
  parsed (pointwise scores, or a group ranked together), retried when unparseable, cached by content; a judge
  that fails or times out raises `InfrastructureFailure`, never a reward of 0; `judge_engine`: the judge on the
  policy's own worker (prompts in token space, shared KV prefixes, the verdict from ten digits' log-probs).

The client's side of distillation (which teacher, its forward beside the policy, the advantages it gives)
is `tinkerless.sdk.run.distillation`.
"""
