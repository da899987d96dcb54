"""The OpenAI-compatible endpoint (`/v1/models`, `/v1/chat/completions`, `/v1/completions`) over a `CompletionBackend`.

The rollout worker mounts it per rollout for agent functions (`hosting.agent_functions`); `tinkerless serve`
mounts it over its worker (`tinkerless.server.openai_api.ServeBackend`). See docs/openai.md.

- `backend`: the `CompletionBackend` protocol, `TokenSampling`, `SampledChoice`, `OpenAIError`;
- `schemas`: request bodies, validated at the boundary; `router`: the routes and their error bodies;
- `render`: messages and tools through the model's chat template, tool calls parsed back;
- `streaming`, `output`, `replies`: SSE deltas, finished choices and logprobs, the reply bodies.
"""

from tinkerless.functions.openai_api.backend import (
    CompletionBackend, OpenAIError, SampledChoice, TokenSampling, unknown_model,
)
from tinkerless.functions.openai_api.render import check_tools, parse_tool_calls, render_chat, template_messages
from tinkerless.functions.openai_api.router import error_body, openai_router

__all__ = [
    "CompletionBackend", "OpenAIError", "SampledChoice", "TokenSampling", "check_tools", "error_body",
    "openai_router", "parse_tool_calls", "render_chat", "template_messages", "unknown_model",
]
