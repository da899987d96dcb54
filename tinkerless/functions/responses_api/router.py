"""`POST /v1/responses`: OpenAI's Responses API over any `CompletionBackend`.

The request is validated (`schemas`), its conversation assembled (`store`: the one `previous_response_id` ended,
then `input`; `instructions` first) and converted to chat messages and tools (`convert`), rendered by the model's
chat template and sampled by the same `ModelCalls` as Chat Completions: the same keys, limits, scheduler and
cancellation. The reply is the response object (`replies`), or with `stream: true` its events. Errors are OpenAI's
error body with the status Chat Completions gives the same failure; after the first byte, an `error` event.
"""

from __future__ import annotations

from typing import AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tinkerless.functions.openai_api.backend import CompletionBackend, OpenAIError
from tinkerless.functions.openai_api.calls import MAX_BODY_BYTES, ModelCalls
from tinkerless.functions.openai_api.render import parse_tool_calls, strict_tool_names
from tinkerless.functions.openai_api.router import _characters, error_body, error_response
from tinkerless.functions.openai_api.streaming import ChoiceText, Ending, named_frame, sse_response, text_then_calls
from tinkerless.functions.responses_api.convert import items_to_chat, to_tools, tools_for_choice
from tinkerless.functions.responses_api.replies import ResponseReply
from tinkerless.functions.responses_api.schemas import ResponsesRequest
from tinkerless.functions.responses_api.store import ResponseStore


def stream_error_body(exc: BaseException) -> tuple[int, dict]:
    """The `error` event of a stream that fails after its first byte: the Responses event's fields, and OpenAI's
    error object (which the `openai` client raises)."""
    status, body = error_body(exc)
    error = body["error"]
    return status, {"type": "error", "code": error["code"], "message": error["message"], "param": error["param"],
                    "error": error}


def _assistant(content: str | None, calls: list[dict]) -> dict:
    message: dict = {"role": "assistant", "content": content if content or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


def responses_router(backend: CompletionBackend, *, caller: Callable[[Request], str | None],
                     max_body_bytes: int = MAX_BODY_BYTES, store: ResponseStore | None = None) -> APIRouter:
    """`POST /v1/responses` over `backend`; `caller(request)` names who is calling (None: 401)."""
    router = APIRouter()
    calls = ModelCalls(backend, caller, max_body_bytes,
                       key_hint="pass api_key= to the OpenAI client (Authorization: Bearer <key>)")
    kept = store if store is not None else ResponseStore()
    router.response_store = kept  # (statistics, tests)

    @router.post("/v1/responses")
    async def responses(request: Request) -> Response:
        try:
            who, body = await calls.who_and_body(request, ResponsesRequest)
            conversation = kept.conversation(who, body.previous_response_id) if body.previous_response_id else []
            conversation += items_to_chat(body.input) if body.input is not None else []
            if not conversation:
                raise OpenAIError("input has no items", param="input")
            chat = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
            calls.refuse_long_text(_characters(chat), "input")
            tools = tools_for_choice(body.tool_choice, to_tools(body.tools))
            prompt_ids, stop_ids, images = await calls.render(chat, tools)
            constrained, schema = body.json_schema
            grammar = None
            forced = None if not tools or body.tool_choice in (None, "auto", "none") else \
                "" if body.tool_choice == "required" else body.tool_choice.get("name")
            if constrained and forced is not None:
                raise OpenAIError("text.format and a required function call cannot both constrain one reply",
                                  param="tool_choice", hint="leave tool_choice at auto, or drop text.format")
            if constrained:  # structured outputs: the reply follows the schema (docs/structured-outputs.md)
                grammar = await calls.grammar(schema, stop_ids, "text.format.schema" if schema else "text.format")
                tools = []  # the reply is the JSON document, not a function call
            elif forced is not None:  # tool_choice "required" or a named function: one call, enforced
                grammar = await calls.forced_call(tools, forced or None, stop_ids, "tools")
            elif tools:  # tool_choice auto: a call the model opens of a `strict: true` tool follows its schema
                grammar = await calls.strict_calls(tools, strict_tool_names(body.tools, nested=False), stop_ids)
            sampling = calls.sampling(prompt_ids, stop_ids, max_tokens=body.max_output_tokens,
                                      temperature=body.temperature, top_p=body.top_p, stop_strings=[], grammar=grammar,
                                      images=images)
            reply = ResponseReply(body, len(prompt_ids), tools)
            tokenizer = backend.tokenizer()

            def parse(finished):
                return parse_tool_calls(finished.text) if tools else (finished.text, [])

            def keep(content: str | None, tool_calls: list[dict]) -> None:
                if body.store is not False:
                    kept.put(who, reply.id, [*conversation, _assistant(content, tool_calls)])

            if body.stream:
                streams = await calls.streams(who, body.model, [sampling])
                text = ChoiceText(tokenizer, [], stop_ids, top_logprobs=False, hold_tool_calls=bool(tools))

                async def pieces() -> AsyncIterator[str | Ending]:
                    async for piece in text_then_calls(streams, text, parse):
                        if isinstance(piece, Ending):
                            keep(parse(piece.finished)[0], piece.calls)
                        yield piece

                return sse_response(request, reply.events(pieces()), streams, stream_error_body, frame=named_frame,
                                    trailer=b"")
            (finished,) = await calls.finished(request, who, body.model, sampling)
            content, tool_calls = parse(finished)
            keep(content, tool_calls)
        except Exception as exc:  # noqa: BLE001 - every failure answers an OpenAI error body
            return error_response(exc)
        return JSONResponse(reply.full(finished, content, tool_calls))

    return router
