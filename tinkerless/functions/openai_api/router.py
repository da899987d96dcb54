"""The OpenAI-compatible routes over any `CompletionBackend`: /v1/models, /v1/chat/completions, /v1/completions.

    GET  /v1/models                 the models the caller may name (cards with vLLM's max_model_len)
    GET  /v1/models/{model}         one of them
    POST /v1/chat/completions       messages (+ tools) through the model's chat template; `tool_calls` parsed
    POST /v1/completions            raw text or token-id prompts
    POST /inference/v1/generate     vLLM's token route: token ids in, token ids and log-probs out (`generate.py`)

Both POST routes answer JSON (`replies.py`) or, with `stream: true`, server-sent events sent as the model
draws the tokens, then `data: [DONE]` (`streaming.py`). A request is validated, and its job has drawn its
first token, before the first byte is sent, so an error up to then, streaming or not, is an HTTP 4xx/5xx with
the OpenAI error body `{"error": {"message", "type", "param", "code"}}`; a later one ends the stream with an
SSE `error` event of the same body.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import replace
from typing import Any, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from tinkerless.errors import BudgetExceeded, ModelNotFoundError, ServerBusy, TinkerlessError
from tinkerless.functions.sampling.token_stream import Cancellation
from tinkerless.functions.openai_api.backend import CompletionBackend, OpenAIError, TokenSampling
from tinkerless.functions.openai_api.calls import (DEFAULT_MAX_TOKENS, MAX_BODY_BYTES, ModelCalls, temperature_of,
                                                   unless_disconnected)
from tinkerless.functions.openai_api.generate import GenerateRequest, generate_reply
from tinkerless.functions.openai_api.output import finish
from tinkerless.functions.openai_api.render import chat_format, check_tools, render_chat, strict_tool_names
from tinkerless.functions.openai_api.vision import has_image_parts, render_vision_chat
from tinkerless.functions.openai_api.replies import ChatReply, CompletionReply
from tinkerless.functions.openai_api.schemas import ChatCompletionRequest, CompletionRequest, FieldError
from tinkerless.functions.openai_api.streaming import ChoiceText, chat_chunks, completion_chunks, open_streams, sse_response

logger = logging.getLogger(__name__)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (capped the same way)
__all__ = ["DEFAULT_MAX_TOKENS", "error_body", "error_response", "openai_router"]


def error_body(exc: BaseException) -> tuple[int, dict]:
    """(HTTP status, OpenAI error body) for any exception; a bug is a logged 500 that names no internals."""
    if isinstance(exc, OpenAIError):
        status, kind, param, code = exc.status, exc.type, exc.param, exc.code
    elif isinstance(exc, ValidationError):
        first = exc.errors()[0]
        refusal = (first.get("ctx") or {}).get("error")
        if isinstance(refusal, FieldError):  # a model validator's: it names its own field and code
            return 400, _error(str(refusal)[:500], "invalid_request_error", refusal.param, refusal.code)
        where = ".".join(str(part) for part in first.get("loc", ()))
        detail = str(first.get("msg", "invalid value")).removeprefix("Value error, ")  # pydantic's, not ours
        message = f"{where + ': ' if where else ''}{detail}"
        return 400, _error(message[:500], "invalid_request_error", where or None, "invalid_value")
    elif isinstance(exc, ModelNotFoundError):
        status, kind, param, code = 404, "invalid_request_error", "model", "model_not_found"
    elif isinstance(exc, ServerBusy):
        status, kind, param, code = 429, "rate_limit_error", None, "server_busy"
    elif isinstance(exc, BudgetExceeded):  # OpenAI names a spent quota "insufficient_quota"; 402: nothing ran
        status, kind, param, code = 402, "insufficient_quota", None, "budget_exceeded"
    elif isinstance(exc, TinkerlessError) and exc.category == "user":
        status, kind, param, code = 400, "invalid_request_error", None, type(exc).__name__
    elif isinstance(exc, TinkerlessError):
        status, kind, param, code = 500, "server_error", None, type(exc).__name__
    else:
        logger.error("unexpected error in an OpenAI route", exc_info=exc)
        return 500, _error(f"internal error ({type(exc).__name__}); this is a server bug, see the server's log",
                           "server_error", None, "internal_error")
    message = exc.message if exc.hint is None else f"{exc.message} ({exc.hint})"
    return status, _error(message, kind, param, code)


def _error(message: str, kind: str, param: str | None, code: str | None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(exc: BaseException, headers: dict[str, str] | None = None) -> JSONResponse:
    status, body = error_body(exc)
    if status == 429 and headers is None:
        headers = {"Retry-After": "1"}
    return JSONResponse(body, status_code=status, headers=headers)


def openai_router(
    backend: CompletionBackend,
    *,
    caller: Callable[[Request], str | None],
    max_body_bytes: int = MAX_BODY_BYTES,
) -> APIRouter:
    """The routes over `backend`. `caller(request)` names who is calling (a tenant, an episode);
    None means the request carries no valid API key (401)."""
    router = APIRouter()
    calls = ModelCalls(backend, caller, max_body_bytes,
                       key_hint="pass api_key= to the OpenAI client (Authorization: Bearer <key>)")
    refuse_long_text, context_cap = calls.refuse_long_text, calls.context_cap

    def sampling(body, prompt_ids: list[int], max_tokens: int | None, top_logprobs: int, stop_ids: list[int]):
        return calls.sampling(prompt_ids, stop_ids, max_tokens=max_tokens, temperature=body.temperature,
                              top_p=body.top_p, stop_strings=body.stop_strings, n=body.n, seed=body.seed,
                              top_logprobs=top_logprobs)

    @router.get("/v1/models")
    async def list_models(request: Request) -> Response:
        try:
            who = calls.who(request)
            names = await asyncio.to_thread(backend.models, who)
        except Exception as exc:  # noqa: BLE001 - every failure answers an OpenAI error body
            return error_response(exc)
        return JSONResponse({"object": "list", "data": [_model_card(name, backend) for name in names]})

    @router.get("/v1/models/{model:path}")
    async def get_model(model: str, request: Request) -> Response:
        try:
            who = calls.who(request)
            names = await asyncio.to_thread(backend.models, who)
            if model not in names:
                # Every name the POST routes accept resolves here too (aliases of the base model, checkpoints).
                resolve = getattr(backend, "resolve", None)
                if resolve is None:
                    from tinkerless.functions.openai_api.backend import unknown_model

                    raise unknown_model(model, names)
                await asyncio.to_thread(resolve, who, model)
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)
        return JSONResponse(_model_card(model, backend))

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        try:
            who, body = await calls.who_and_body(request, ChatCompletionRequest)
            refuse_long_text(_characters(body.messages), "messages")
            tokenizer = backend.tokenizer()
            tools = check_tools(body.tools) if body.tool_choice != "none" else []
            images: tuple = ()
            if has_image_parts(body.messages):  # rendered by the model's processor (functions/vision)
                prompt_ids, images = await asyncio.to_thread(render_vision_chat, backend, body.messages, tools)
            else:
                prompt_ids = await asyncio.to_thread(render_chat, tokenizer, body.messages, tools or None)
            stop_ids = list(chat_format(tokenizer).eos_token_ids)
            top = (body.top_logprobs or 0) if body.logprobs else 0
            request_sampling = sampling(body, prompt_ids, body.token_limit, top, stop_ids)
            if images:
                request_sampling = dataclasses.replace(request_sampling, images=images)
            constrained, schema = body.json_schema
            forced = forced_tool(body.tool_choice, tools)
            if constrained and forced is not None:
                raise OpenAIError("response_format and a required tool call cannot both constrain one reply",
                                  param="tool_choice", hint="leave tool_choice at auto, or drop response_format")
            if constrained:  # structured outputs: every choice follows the schema (docs/structured-outputs.md)
                request_sampling = replace(request_sampling, grammar=await calls.grammar(
                    schema, stop_ids, "response_format.json_schema.schema" if schema else "response_format"))
                tools = []  # the reply is the JSON document, not a tool call
            elif forced is not None:  # tool_choice "required" or a named function: one call, enforced
                request_sampling = replace(request_sampling, grammar=await calls.forced_call(
                    tools, forced or None, stop_ids, "tools"))
            elif tools:  # tool_choice auto: a call the model opens of a `strict: true` tool follows its schema
                request_sampling = replace(request_sampling, grammar=await calls.strict_calls(
                    tools, strict_tool_names(body.tools, nested=True), stop_ids))
            reply = ChatReply(body, tokenizer, len(prompt_ids), parse_tools=bool(tools))
            if body.stream:
                streams = await open_streams(backend, who, body.model, [request_sampling])
                texts = [ChoiceText(tokenizer, request_sampling.stop_strings, stop_ids, top_logprobs=bool(top),
                                    hold_tool_calls=bool(tools)) for _ in range(body.n)]
                return sse_response(request, chat_chunks(reply, streams, texts), streams, error_body)
            finished = await calls.finished(request, who, body.model, request_sampling)
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)
        return JSONResponse(reply.full(finished))

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        try:
            who, body = await calls.who_and_body(request, CompletionRequest)
            for prompt in body.prompts():
                refuse_long_text(len(prompt) if isinstance(prompt, str) else 0, "prompt")
            tokenizer = backend.tokenizer()
            stop_ids = list(chat_format(tokenizer).eos_token_ids)
            max_choices = getattr(backend, "max_choices", None)
            if max_choices is not None and len(body.prompts()) * body.n > max_choices:
                raise OpenAIError(f"{len(body.prompts())} prompts x n={body.n} is over this server's limit of "
                                  f"{max_choices} choices per request", param="n", code="limit_exceeded",
                                  hint="send fewer prompts per request")
            prompts = [p if isinstance(p, list) else await asyncio.to_thread(_encode, tokenizer, p)
                       for p in body.prompts()]
            if any(not p for p in prompts):
                raise OpenAIError("a prompt is empty", param="prompt", hint="send at least one token per prompt")
            limit = body.max_tokens if body.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
            requests = [sampling(body, p, min(limit, context_cap(len(p))) if body.max_tokens is None else limit,
                                 body.logprobs or 0, stop_ids) for p in prompts]
            reply = CompletionReply(body, tokenizer, sum(len(p) * body.n for p in prompts))
            if body.stream:
                streams = await open_streams(backend, who, body.model, requests)
                texts = [ChoiceText(tokenizer, r.stop_strings, stop_ids, top_logprobs=bool(r.top_logprobs))
                         for r in requests for _ in range(body.n)]
                return sse_response(request, completion_chunks(reply, streams, texts), streams, error_body)
            # Every prompt at once: the backend batches concurrent requests into one generation.
            cancels = [Cancellation() for _ in requests]
            results = await unless_disconnected(request, asyncio.gather(
                *(calls.sample_call(who, body.model, r, c) for r, c in zip(requests, cancels))), cancels)
            finished = [finish(tokenizer, c, r.stop_strings, stop_ids) for r, choices in zip(requests, results)
                        for c in choices]
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)
        return JSONResponse(reply.full(finished))

    @router.post("/inference/v1/generate")
    async def generate(request: Request) -> Response:
        """vLLM's token route (`generate.py`): the caller's token ids in, sampled ids and log-probs out."""
        try:
            who, body = await calls.who_and_body(request, GenerateRequest)
            body.check_unsupported()
            params = body.sampling_params
            stop_ids = list(params.stop_token_ids)
            if not params.ignore_eos:  # vLLM stops at the model's end-of-sequence unless told not to
                stop_ids += [i for i in chat_format(backend.tokenizer()).eos_token_ids if i not in stop_ids]
            max_choices = getattr(backend, "max_choices", None)
            if max_choices is not None and params.n > max_choices:
                raise OpenAIError(f"n={params.n} is over this server's limit of {max_choices} choices per request",
                                  param="sampling_params.n", code="limit_exceeded")
            token_sampling = TokenSampling(
                prompt_ids=list(body.token_ids), n=params.n,
                max_tokens=params.max_tokens if params.max_tokens is not None else context_cap(len(body.token_ids)),
                temperature=temperature_of(params.temperature), top_p=float(params.top_p), stop_strings=[],
                stop_token_ids=stop_ids, seed=params.seed, top_logprobs=0,
            )
            cancel = Cancellation()
            choices = await unless_disconnected(request, calls.sample_call(who, body.model, token_sampling, cancel), [cancel])
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)
        return JSONResponse(generate_reply(body.token_ids, choices))

    return router


def _encode(tokenizer, text: str) -> list[int]:
    ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    if not ids:
        raise OpenAIError("the prompt is empty (it encodes to no tokens)", param="prompt")
    return ids


def _characters(messages: Any) -> int:
    """Characters of the text the template renders (contents, text parts, tool-call arguments), without
    tokenizing: only what becomes tokens counts, so the bound never refuses a prompt that fits."""
    total = 0
    for message in messages if isinstance(messages, list) else ():
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        for call in message.get("tool_calls") or () if isinstance(message.get("tool_calls"), list) else ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                total += len(function["arguments"])
    return total


def _model_card(name: str, backend: CompletionBackend) -> dict:
    """OpenAI's model card, with vLLM's `max_model_len` where the backend knows its longest prompt: harness clients
    read it to refuse an overlong prompt before sending it (renderers' pre-flight, the one verifiers' training
    client runs each turn) and to size context compaction; without it both are silently off. The longest prompt,
    not the model's context: a prompt over the server's `max_prompt_tokens` is refused as surely."""
    card = {"id": name, "object": "model", "created": 0, "owned_by": "tinkerless"}
    longest_prompt = getattr(backend, "max_prompt_tokens", None)
    if isinstance(longest_prompt, int):
        card["max_model_len"] = longest_prompt
    return card


def forced_tool(tool_choice: Any, tools: list[dict]) -> str | None:
    """None when the reply may be anything; "" when it must be a call of any tool (tool_choice "required"); a
    function's name when it must call that one (a name that is not in `tools` is a 400)."""
    if not tools or tool_choice in (None, "auto", "none"):
        return None
    if tool_choice == "required":
        return ""
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    if tool_choice.get("type") != "function" or not any(t["function"]["name"] == name for t in tools):
        raise OpenAIError(f"tool_choice {str(tool_choice)[:120]} names no function of tools", param="tool_choice")
    return name

