"""The OpenAI-compatible routes over any `CompletionBackend`: /v1/models, /v1/chat/completions, /v1/completions.

    GET  /v1/models                 the models the caller may name
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
import inspect
import json
import logging
from typing import Any, Awaitable, Callable, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from tinkerless.errors import ModelNotFoundError, ServerBusy, TinkerlessError
from tinkerless.functions.sampling.token_stream import Cancellation
from tinkerless.wire.http import RequestTooLarge, read_body
from tinkerless.functions.openai_api.backend import CompletionBackend, OpenAIError, TokenSampling
from tinkerless.functions.openai_api.generate import GenerateRequest, generate_reply
from tinkerless.functions.openai_api.output import finish
from tinkerless.functions.openai_api.render import chat_format, check_tools, render_chat
from tinkerless.functions.openai_api.replies import ChatReply, CompletionReply
from tinkerless.functions.openai_api.schemas import ChatCompletionRequest, CompletionRequest, FieldError
from tinkerless.functions.openai_api.streaming import ChoiceText, chat_chunks, completion_chunks, open_streams, sse_response
from tinkerless.wire.messages import GREEDY_BELOW

logger = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_MAX_TOKENS = 1024  # a chat completion without max_tokens (capped by the context and the backend)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (capped the same way)
MAX_BODY_BYTES = 16 * 1024 * 1024


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
    # Backends written against the protocol before `cancel` existed still work: they are just not cancelled.
    cancellable = "cancel" in inspect.signature(backend.sample).parameters

    def sample_call(who: str, model: str, request: TokenSampling, cancel: Cancellation):
        return backend.sample(who, model, request, cancel=cancel) if cancellable else backend.sample(who, model, request)

    async def who_and_body(request: Request, schema) -> tuple[str, Any]:
        who = caller(request)
        if who is None:
            raise OpenAIError("missing or invalid API key", status=401, code="invalid_api_key",
                              hint="pass api_key= to the OpenAI client (Authorization: Bearer <key>)")
        try:
            raw = await read_body(request, max_body_bytes)
        except RequestTooLarge as exc:
            raise OpenAIError(f"request body of {exc.size} bytes is over this server's limit of {exc.limit}",
                              status=413, code="request_too_large") from None
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise OpenAIError(f"the request body is not valid JSON: {str(exc)[:200]}", code="invalid_json") from None
        except RecursionError:
            raise OpenAIError("the request body is nested too deeply", code="invalid_json") from None
        if not isinstance(data, dict):
            raise OpenAIError("the request body must be a JSON object", code="invalid_json")
        return who, schema.model_validate(data)

    def refuse_long_text(characters: int, param: str) -> None:
        """Refuse a prompt that cannot fit, on its length in characters, before spending CPU on tokenizing it:
        no token of the vocabulary spells more than `max_token_chars` characters (`prompt_char_limit`)."""
        limit = getattr(backend, "prompt_char_limit", None)
        if limit is not None and characters > limit:
            raise OpenAIError(
                f"the prompt is {characters} characters long, more than the {backend.max_prompt_tokens} tokens this "
                f"server takes could hold", param=param, code="context_length_exceeded",
                hint="shorten the prompt")

    def context_cap(prompt_length: int) -> int:
        """max_tokens when the request gives none: the backend's default, within what the context leaves."""
        default = getattr(backend, "default_max_tokens", DEFAULT_MAX_TOKENS)
        context = getattr(backend, "context_length", None)
        return default if context is None else max(1, min(default, context - prompt_length))

    def sampling(body, prompt_ids: list[int], max_tokens: int | None, top_logprobs: int, stop_ids: list[int]):
        return TokenSampling(
            prompt_ids=prompt_ids, n=body.n,
            max_tokens=max_tokens if max_tokens is not None else context_cap(len(prompt_ids)),
            temperature=_temperature(body.temperature),
            top_p=1.0 if body.top_p is None else float(body.top_p),
            stop_strings=body.stop_strings, stop_token_ids=stop_ids, seed=body.seed, top_logprobs=top_logprobs,
        )

    @router.get("/v1/models")
    async def list_models(request: Request) -> Response:
        try:
            who = caller(request)
            if who is None:
                raise OpenAIError("missing or invalid API key", status=401, code="invalid_api_key")
            names = await asyncio.to_thread(backend.models, who)
        except Exception as exc:  # noqa: BLE001 - every failure answers an OpenAI error body
            return error_response(exc)
        return JSONResponse({"object": "list", "data": [_model_card(name) for name in names]})

    @router.get("/v1/models/{model:path}")
    async def get_model(model: str, request: Request) -> Response:
        try:
            who = caller(request)
            if who is None:
                raise OpenAIError("missing or invalid API key", status=401, code="invalid_api_key")
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
        return JSONResponse(_model_card(model))

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        try:
            who, body = await who_and_body(request, ChatCompletionRequest)
            refuse_long_text(_characters(body.messages), "messages")
            tokenizer = backend.tokenizer()
            tools = check_tools(body.tools) if body.tool_choice != "none" else []
            prompt_ids = await asyncio.to_thread(render_chat, tokenizer, body.messages, tools or None)
            stop_ids = list(chat_format(tokenizer).eos_token_ids)
            top = (body.top_logprobs or 0) if body.logprobs else 0
            request_sampling = sampling(body, prompt_ids, body.token_limit, top, stop_ids)
            reply = ChatReply(body, tokenizer, len(prompt_ids), parse_tools=bool(tools))
            if body.stream:
                streams = await open_streams(backend, who, body.model, [request_sampling])
                texts = [ChoiceText(tokenizer, request_sampling.stop_strings, stop_ids, top_logprobs=bool(top),
                                    hold_tool_calls=bool(tools)) for _ in range(body.n)]
                return sse_response(request, chat_chunks(reply, streams, texts), streams, error_body)
            cancel = Cancellation()
            choices = await _unless_disconnected(request, sample_call(who, body.model, request_sampling, cancel),
                                                 [cancel])
            finished = [finish(tokenizer, c, request_sampling.stop_strings, stop_ids) for c in choices]
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)
        return JSONResponse(reply.full(finished))

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        try:
            who, body = await who_and_body(request, CompletionRequest)
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
            results = await _unless_disconnected(request, asyncio.gather(
                *(sample_call(who, body.model, r, c) for r, c in zip(requests, cancels))), cancels)
            finished = [finish(tokenizer, c, r.stop_strings, stop_ids) for r, choices in zip(requests, results)
                        for c in choices]
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)
        return JSONResponse(reply.full(finished))

    @router.post("/inference/v1/generate")
    async def generate(request: Request) -> Response:
        """vLLM's token route (`generate.py`): the caller's token ids in, sampled ids and log-probs out."""
        try:
            who, body = await who_and_body(request, GenerateRequest)
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
                temperature=_temperature(params.temperature), top_p=float(params.top_p), stop_strings=[],
                stop_token_ids=stop_ids, seed=params.seed, top_logprobs=0,
            )
            cancel = Cancellation()
            choices = await _unless_disconnected(request, sample_call(who, body.model, token_sampling, cancel), [cancel])
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)
        return JSONResponse(generate_reply(body.token_ids, choices))

    return router


async def _unless_disconnected(request: Request, work: Awaitable[T], cancels: list[Cancellation]) -> T:
    """Await `work`, cancelling its jobs if the client hangs up first: a non-streamed request whose client timed
    out (and whose `openai` client retries it) must not keep generating for nobody. The jobs end at their next
    decode step, or never start if still queued; `work` then returns what they have, which nobody reads."""

    async def watch() -> None:  # the body has been read: the next message is the disconnect
        while (await request.receive())["type"] != "http.disconnect":
            pass
        for cancel in cancels:
            cancel.cancel()

    watcher = asyncio.create_task(watch())
    try:
        return await work
    finally:
        watcher.cancel()


def _temperature(value: float | None) -> float:
    """OpenAI's default is 1. Below GREEDY_BELOW, sampling is greedy (the engines' rule for every API: dividing
    logits by a temperature near zero overflows them to inf, and the draw there is the argmax anyway)."""
    if value is None:
        return 1.0
    return 0.0 if value < GREEDY_BELOW else float(value)


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


def _model_card(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "tinkerless"}
