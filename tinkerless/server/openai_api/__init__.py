"""The OpenAI API of `tinkerless serve`: the endpoint (`tinkerless.functions.openai_api`) over this server's worker.

- `serve_backend.ServeBackend`: the base model, the caller's checkpoints and live policies, on the scheduler;
- `adapters`: checkpoint names (`<run_id>@<step>`, `tinker://...`) resolved in storage, an LRU cache of adapters.
The routes and protocol types are re-exported here, where they lived before.
"""

from tinkerless.functions.openai_api import (
    CompletionBackend, OpenAIError, SampledChoice, TokenSampling, check_tools, error_body, openai_router,
    parse_tool_calls, render_chat, template_messages, unknown_model,
)

__all__ = [
    "CompletionBackend", "OpenAIError", "SampledChoice", "TokenSampling", "check_tools", "error_body",
    "openai_router", "parse_tool_calls", "render_chat", "template_messages", "unknown_model",
]
