"""Request bodies of the OpenAI routes, validated at the boundary (pydantic, strict types, no NaN).

Fields this server cannot honour are refused with a 400 that names them, rather than silently ignored
(a penalty or logit bias the caller relies on would change its results); fields that change nothing
about sampling (`user`, `metadata`, `store`, `parallel_tool_calls`...) are accepted and ignored, so
agent libraries that send them work.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
_INT64 = 2**63


class FieldError(ValueError):
    """A model validator's refusal that names its field and code, as the OpenAI error body carries them."""

    def __init__(self, message: str, param: str, code: str = "invalid_value"):
        super().__init__(message)
        self.param = param
        self.code = code


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _Sampling(_Body):
    model: StrictStr = Field(min_length=1, max_length=512)
    n: StrictInt = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: Union[StrictStr, list[StrictStr], None] = None
    seed: StrictInt | None = Field(None, ge=-_INT64, lt=_INT64)
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _supported(self):
        for penalty in ("presence_penalty", "frequency_penalty"):
            if getattr(self, penalty):
                raise FieldError(f"{penalty} is not supported by this server; leave it 0", penalty,
                                 "unsupported_parameter")
        if self.logit_bias:
            raise FieldError("logit_bias is not supported by this server; leave it empty", "logit_bias",
                             "unsupported_parameter")
        stops = self.stop_strings
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise FieldError(f"stop takes 1 to {MAX_STOP_STRINGS} non-empty strings", "stop")
        return self

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)  # checked message by message by render.normalize_messages
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Any] | None = None  # checked by render.check_tools (a 400 naming the bad tool)
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _chat_supported(self):
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs needs logprobs: true", "top_logprobs")
        self.json_schema  # a malformed response_format is refused here
        return self

    @property
    def json_schema(self) -> tuple[bool, dict | None]:
        """(constrained?, the schema: None for any JSON object) of `response_format`."""
        return format_schema(self.response_format, "response_format", nested=True)

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def format_schema(form: dict | None, param: str, *, nested: bool) -> tuple[bool, dict | None]:
    """(constrained?, schema) of a structured-output format: {"type": "text"} (or none) is unconstrained;
    {"type": "json_object"} is any JSON object; {"type": "json_schema", ...} is its schema, under "json_schema"
    (Chat Completions, `nested`) or beside "type" (Responses' `text.format`)."""
    if form is None or form.get("type", "text") == "text":
        return False, None
    kind = form.get("type")
    if kind == "json_object":
        return True, None
    if kind != "json_schema":
        raise FieldError(f"{param}.type {str(kind)[:40]!r} is not one of text, json_object, json_schema", param)
    holder = form.get("json_schema") if nested else form
    where = f"{param}.json_schema" if nested else param
    schema = holder.get("schema") if isinstance(holder, dict) else None
    if not isinstance(schema, dict):
        raise FieldError(f"{where}.schema must be a JSON schema object", f"{where}.schema")
    return True, schema


Prompt = Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]


class CompletionRequest(_Sampling):
    prompt: Prompt
    max_tokens: StrictInt | None = Field(None, ge=1)  # None: OpenAI's default of 16 (within the server's limit)
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: StrictBool | None = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _completion_supported(self):
        if self.echo:
            raise FieldError("echo is not supported by this server", "echo", "unsupported_parameter")
        if self.suffix:
            raise FieldError("suffix (insertion) is not supported by this server", "suffix", "unsupported_parameter")
        if self.best_of is not None and self.best_of != self.n:
            raise FieldError("best_of must equal n (or be left out): this server returns every sample", "best_of",
                             "unsupported_parameter")
        if isinstance(self.prompt, list) and not self.prompt:
            raise FieldError("prompt is an empty list", "prompt")
        return self

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: a string or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]
