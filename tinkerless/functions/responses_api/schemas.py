"""The body of `POST /v1/responses`, validated at the boundary (pydantic, strict types, no NaN).

Fields this server cannot honour are refused with a 400 naming them (reasoning effort,
background mode, stored conversations, logprobs); fields that change nothing about sampling (`metadata`, `user`,
`include`, `parallel_tool_calls`, `truncation`, `service_tier`, `prompt_cache_key`...) are accepted and ignored.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import Field, StrictBool, StrictInt, StrictStr, model_validator

from tinkerless.functions.openai_api.schemas import FieldError, _Body, format_schema


class ResponsesRequest(_Body):
    model: StrictStr = Field(min_length=1, max_length=512)
    input: Union[StrictStr, list[Any], None] = None  # checked item by item by convert.to_chat
    instructions: StrictStr | None = None
    tools: list[Any] | None = None  # checked by convert.to_tools
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: StrictBool | None = False
    store: StrictBool | None = True
    previous_response_id: StrictStr | None = Field(None, min_length=1, max_length=200)
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    background: StrictBool | None = False
    conversation: Any = None
    top_logprobs: StrictInt | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _supported(self):
        if self.input is None and self.previous_response_id is None:
            raise FieldError("input is required", "input")
        if isinstance(self.input, str) and not self.input:
            raise FieldError("input is an empty string", "input")
        form = (self.text or {}).get("format")
        if form is not None and not isinstance(form, dict):
            raise FieldError("text.format must be an object", "text.format")
        self.json_schema  # a malformed text.format is refused here
        if self.reasoning and self.reasoning.get("effort") not in (None, "none"):
            raise FieldError("reasoning effort is not supported by this server: its models do not reason apart from "
                             "their reply; leave `reasoning` out", "reasoning.effort", "unsupported_parameter")
        if self.background:
            raise FieldError("background mode is not supported by this server", "background", "unsupported_parameter")
        if self.conversation is not None:
            raise FieldError("conversations are not supported by this server; use previous_response_id",
                             "conversation", "unsupported_parameter")
        if self.top_logprobs:
            raise FieldError("top_logprobs is not supported on /v1/responses; use /v1/chat/completions",
                             "top_logprobs", "unsupported_parameter")
        return self

    @property
    def json_schema(self) -> tuple[bool, dict | None]:
        """(constrained?, the schema: None for any JSON object) of `text.format`."""
        return format_schema((self.text or {}).get("format"), "text.format", nested=False)
