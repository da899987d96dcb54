"""`POST /v1/messages`: Anthropic's Messages API over any `CompletionBackend`.

The request is validated (`schemas`), converted to chat messages and tools (`convert`), rendered by the model's
chat template and sampled by the same `ModelCalls` as Chat Completions: the same keys (`x-api-key` or a bearer
token), limits, scheduler and cancellation. The reply is Anthropic's message (`replies`), or with `stream: true`
its SSE events. Errors are Anthropic's body, `{"type": "error", "error": {"type", "message"}}`, with the status
and category the OpenAI routes give the same failure (a caller's mistake is a 4xx; a bug a logged 500).
"""

from __future__ import annotations

from typing import Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tinkerless.functions.anthropic_api.convert import to_chat, to_tools, tools_for_choice
from tinkerless.functions.anthropic_api.replies import MessageReply
from tinkerless.functions.anthropic_api.schemas import MessagesRequest
from tinkerless.functions.openai_api.backend import CompletionBackend, OpenAIError
from tinkerless.functions.openai_api.calls import MAX_BODY_BYTES, ModelCalls
from tinkerless.functions.openai_api.render import parse_tool_calls, strict_tool_names
from tinkerless.functions.openai_api.router import _characters, error_body
from tinkerless.functions.openai_api.streaming import ChoiceText, named_frame, sse_response, text_then_calls

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_body(exc: BaseException) -> tuple[int, dict]:
    """(HTTP status, Anthropic error body) of any exception: the OpenAI routes' status and message, Anthropic's
    shape (the field at fault, OpenAI's `param`, leads the message, as Anthropic writes it)."""
    status, body = error_body(exc)
    error = body["error"]
    message, param = error["message"], error.get("param")
    if param and not message.startswith(param):
        message = f"{param}: {message}"
    kind = _TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")
    return status, {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_error_response(exc: BaseException) -> JSONResponse:
    status, body = anthropic_error_body(exc)
    return JSONResponse(body, status_code=status, headers={"Retry-After": "1"} if status == 429 else None)


def messages_router(backend: CompletionBackend, *, caller: Callable[[Request], str | None],
                    max_body_bytes: int = MAX_BODY_BYTES) -> APIRouter:
    """`POST /v1/messages` over `backend`; `caller(request)` names who is calling (None: 401)."""
    router = APIRouter()
    calls = ModelCalls(backend, caller, max_body_bytes,
                       key_hint="pass api_key= to the Anthropic client (the x-api-key header)")

    @router.post("/v1/messages")
    async def messages(request: Request) -> Response:
        try:
            who, body = await calls.who_and_body(request, MessagesRequest)
            chat, prefill = to_chat(body.system, body.messages)
            calls.refuse_long_text(_characters(chat), "messages")
            tools = tools_for_choice(body.tool_choice, to_tools(body.tools))
            prompt_ids, stop_ids, images = await calls.render(chat, tools, prefill=prefill)
            constrained, schema = body.json_schema
            grammar = None
            kind = (body.tool_choice or {}).get("type")
            forced = None if not tools or kind not in ("any", "tool") else \
                "" if kind == "any" else body.tool_choice.get("name")
            if constrained and forced is not None:
                raise OpenAIError("output_config.format and a required tool use cannot both constrain one reply",
                                  param="tool_choice", hint="use tool_choice auto, or drop output_config.format")
            if prefill and (constrained or forced is not None):
                raise OpenAIError("a prefilled assistant turn cannot be continued under output_config.format or a "
                                  "required tool use (the constrained reply starts a turn)", param="messages",
                                  code="unsupported_prefill", hint="end with a user turn")
            if constrained:  # structured outputs: the reply follows the schema (docs/structured-outputs.md)
                grammar = await calls.grammar(schema, stop_ids, "output_config.format.schema")
                tools = []
            elif forced is not None:  # tool_choice "any" or a named tool: one tool_use, enforced
                grammar = await calls.forced_call(tools, forced or None, stop_ids, "tools")
            elif tools:  # tool_choice auto: a call the model opens of a `strict: true` tool follows its schema
                grammar = await calls.strict_calls(tools, strict_tool_names(body.tools, nested=False), stop_ids)
            sampling = calls.sampling(prompt_ids, stop_ids, max_tokens=body.max_tokens, temperature=body.temperature,
                                      top_p=body.top_p, top_k=body.top_k, stop_strings=body.stop_sequences or [],
                                      grammar=grammar, images=images)
            reply = MessageReply(body.model, len(prompt_ids))
            tokenizer = backend.tokenizer()

            def parse(finished):
                return parse_tool_calls(finished.text) if tools else (finished.text, [])

            if body.stream:
                streams = await calls.streams(who, body.model, [sampling])
                text = ChoiceText(tokenizer, sampling.stop_strings, stop_ids, top_logprobs=False,
                                  hold_tool_calls=bool(tools))
                return sse_response(request, reply.events(text_then_calls(streams, text, parse)), streams,
                                    anthropic_error_body, frame=named_frame, trailer=b"")
            (finished,) = await calls.finished(request, who, body.model, sampling)
            content, tool_calls = parse(finished)
        except Exception as exc:  # noqa: BLE001 - every failure answers an Anthropic error body
            return anthropic_error_response(exc)
        return JSONResponse(reply.full(finished, content, tool_calls))

    return router
