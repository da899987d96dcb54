"""The OpenAI Responses API (`POST /v1/responses`) over the same `CompletionBackend` as Chat Completions.

`tinkerless serve` mounts it for the base model, checkpoints and live policies; the rollout worker mounts it per
rollout, so an agent function may use `client.responses` (and the OpenAI Agents SDK's default model), its calls
recorded like any other. See docs/responses.md.

- `schemas`: the request body, validated at the boundary;
- `convert`: `input` (a string or items), `instructions`, function tools and `function_call` /
  `function_call_output` items to the chat messages and tools the model's template renders;
- `store`: earlier responses by id, for `previous_response_id` (in memory, a server's lifetime, per caller);
- `replies`: the response object and its streaming events; `router`: the route, with OpenAI's error body.
"""

from tinkerless.functions.responses_api.router import responses_router

__all__ = ["responses_router"]
