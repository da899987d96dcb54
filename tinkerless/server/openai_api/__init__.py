"""OpenAI-compatible routes (`/v1/models`, `/v1/chat/completions`, `/v1/completions`) over a `CompletionBackend`.

`tinkerless serve` mounts them over its worker (`serve_backend.ServeBackend`: the base model and the
caller's trained adapters); the rollout worker mounts them per rollout for agent functions. See docs/openai.md.
"""

from tinkerless.server.openai_api.backend import (
    CompletionBackend, OpenAIError, SampledChoice, TokenSampling, unknown_model,
)
from tinkerless.server.openai_api.render import check_tools, parse_tool_calls, render_chat, template_messages
from tinkerless.server.openai_api.router import error_body, openai_router

__all__ = [
    "CompletionBackend", "OpenAIError", "SampledChoice", "TokenSampling", "check_tools", "error_body",
    "openai_router", "parse_tool_calls", "render_chat", "template_messages", "unknown_model",
]
