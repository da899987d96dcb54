"""The Anthropic Messages API (`POST /v1/messages`) over the same `CompletionBackend` as the OpenAI routes.

`tinkerless serve` mounts it for the base model, checkpoints and live policies; the rollout worker mounts it
per rollout, so an agent function may call the policy with `anthropic.AsyncAnthropic` (its calls recorded
like any other). See docs/anthropic-messages.md.

- `schemas`: the request body, validated at the boundary;
- `convert`: content blocks, `system`, `tools` and `tool_choice` to the chat messages and tools the model's
  template renders (the one place a block becomes a message part);
- `replies`: the reply body, `stop_reason` and `usage`, and the SSE event sequence;
- `router`: the route and Anthropic's error body.
The keys, limits, cancellation and sampling are the OpenAI routes' own (`openai_api.calls.ModelCalls`).
"""

from tinkerless.functions.anthropic_api.router import anthropic_error_body, messages_router

__all__ = ["anthropic_error_body", "messages_router"]
