"""The body of `POST /v1/messages`, validated at the boundary (pydantic, strict types, no NaN).

Anthropic's own bounds apply (`temperature` in [0, 1], `max_tokens` required). Fields this server cannot honour
are refused with a 400 that names them (extended thinking, MCP servers, server tools: see `convert`); fields
that change nothing about sampling (`metadata`, `service_tier`, `container`) are accepted and ignored, so
clients that send them work.
"""

from __future__ import annotations

from typing import Any, Union

from pydantic import Field, StrictBool, StrictInt, StrictStr, model_validator

from tinkerless.functions.openai_api.schemas import MAX_STOP_STRINGS, FieldError, _Body, format_schema


class MessagesRequest(_Body):
    model: StrictStr = Field(min_length=1, max_length=512)
    max_tokens: StrictInt = Field(ge=1)
    messages: list[Any] = Field(min_length=1)  # checked block by block by convert.to_chat
    system: Union[StrictStr, list[Any], None] = None
    stop_sequences: list[StrictStr] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=0, le=1 << 20)
    stream: StrictBool | None = False
    tools: list[Any] | None = None  # checked by convert.to_tools
    tool_choice: dict[str, Any] | None = None  # checked by convert.tools_for_choice
    thinking: dict[str, Any] | None = None
    mcp_servers: list[Any] | None = None
    output_config: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _supported(self):
        stops = self.stop_sequences or []
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise FieldError(f"stop_sequences takes 1 to {MAX_STOP_STRINGS} non-empty strings", "stop_sequences")
        if self.thinking is not None and self.thinking.get("type") not in ("disabled", None):
            raise FieldError("extended thinking is not supported by this server; leave `thinking` out", "thinking",
                             "unsupported_parameter")
        self.json_schema  # a malformed output_config.format is refused here
        if self.mcp_servers:
            raise FieldError("mcp_servers is not supported by this server: run the MCP tools in the client",
                             "mcp_servers", "unsupported_parameter")
        return self

    @property
    def json_schema(self) -> tuple[bool, dict | None]:
        """(constrained?, the schema) of `output_config.format` ({"type": "json_schema", "schema": {...}})."""
        form = (self.output_config or {}).get("format")
        if form is not None and not isinstance(form, dict):
            raise FieldError("output_config.format must be an object", "output_config.format")
        return format_schema(form, "output_config.format", nested=False)
