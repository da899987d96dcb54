"""What every API's route does around the model, whatever its wire shape: one `ModelCalls` per router.

Chat Completions, Anthropic Messages and OpenAI Responses differ in their bodies, their replies and their
SSE events; they share everything between the HTTP request and the sampled tokens, here:
  * who is calling (`caller(request)`: a tenant's key, an episode's key; None is a 401);
  * the body, read within the size limit, parsed as JSON and validated by the route's pydantic schema;
  * a prompt refused on its length before it is tokenized, the default `max_tokens` within the context;
  * the one `backend.sample` (whole choices: a client that hangs up cancels the job) or `open_streams`
    (token by token: `sse_response` cancels the jobs when the client goes).
So the keys, limits, scheduler, cancellation and error categories are the same on every route: each route
only maps the exceptions raised here onto its own error body.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from functools import partial
from typing import Any, Awaitable, Callable, TypeVar

from fastapi import Request

from tinkerless.functions.openai_api.backend import CompletionBackend, OpenAIError, SampledChoice, TokenSampling
from tinkerless.functions.openai_api.output import FinishedChoice, finish
from tinkerless.functions.openai_api.render import chat_format, render_chat
from tinkerless.functions.openai_api.streaming import open_streams
from tinkerless.functions.openai_api.vision import has_image_parts, render_vision_chat
from tinkerless.functions.sampling.token_stream import Cancellation, TokenStream
from tinkerless.wire.http import RequestTooLarge, read_body
from tinkerless.wire.messages import GREEDY_BELOW

T = TypeVar("T")

DEFAULT_MAX_TOKENS = 1024  # a chat completion without max_tokens (capped by the context and the backend)
MAX_BODY_BYTES = 16 * 1024 * 1024


class ModelCalls:
    """The shared steps of the routes over `backend` (see the module docstring)."""

    def __init__(self, backend: CompletionBackend, caller: Callable[[Request], str | None],
                 max_body_bytes: int = MAX_BODY_BYTES, *, key_hint: str = "pass api_key= to the client"):
        self.backend, self.caller, self.max_body_bytes, self.key_hint = backend, caller, max_body_bytes, key_hint
        # Backends written against the protocol before `cancel` existed still work: they are just not cancelled.
        self.cancellable = "cancel" in inspect.signature(backend.sample).parameters

    def who(self, request: Request) -> str:
        who = self.caller(request)
        if who is None:
            raise OpenAIError("missing or invalid API key", status=401,
                              code="invalid_api_key", hint=self.key_hint)
        return who

    async def who_and_body(self, request: Request, schema) -> tuple[str, Any]:
        who = self.who(request)
        try:
            raw = await read_body(request, self.max_body_bytes)
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

    def refuse_long_text(self, characters: int, param: str) -> None:
        """Refuse a prompt that cannot fit, on its length in characters, before spending CPU on tokenizing it:
        no token of the vocabulary spells more than `max_token_chars` characters (`prompt_char_limit`)."""
        limit = getattr(self.backend, "prompt_char_limit", None)
        if limit is not None and characters > limit:
            raise OpenAIError(
                f"the prompt is {characters} characters long, more than the {self.backend.max_prompt_tokens} tokens "
                f"this server takes could hold", param=param, code="context_length_exceeded", hint="shorten the prompt")

    def context_cap(self, prompt_length: int) -> int:
        """max_tokens when the request gives none: the backend's default, within what the context leaves."""
        default = getattr(self.backend, "default_max_tokens", DEFAULT_MAX_TOKENS)
        context = getattr(self.backend, "context_length", None)
        return default if context is None else max(1, min(default, context - prompt_length))

    async def render(self, messages: list[dict], tools: list[dict] | None, *,
                     prefill: bool = False) -> tuple[list[int], list[int], tuple]:
        """(prompt ids, the template's stop ids, processed images) of chat `messages` (+ `tools`), off the event
        loop. Messages holding image parts are rendered by the model's processor (`vision.render_vision_chat`: a
        400 for a text-only model or a hostile image). With `prefill`, the last (assistant) message is left open
        and the reply continues it (`render_chat`)."""
        tokenizer = self.backend.tokenizer()
        if has_image_parts(messages):
            if prefill:
                raise OpenAIError("a prefilled assistant turn cannot be continued in a conversation with images",
                                  param="messages", code="unsupported_prefill",
                                  hint="end with a user turn, or send the conversation without images")
            prompt_ids, images = await asyncio.to_thread(render_vision_chat, self.backend, messages, tools or [])
        else:
            prompt_ids, images = await asyncio.to_thread(
                partial(render_chat, continue_final=prefill), tokenizer, messages, tools or None), ()
        return prompt_ids, list(chat_format(tokenizer).eos_token_ids), images

    async def grammar(self, schema: dict | None, stop_ids: list[int], param: str, *, lark: str | None = None):
        """The compiled `Grammar` of a JSON schema (None: any JSON object) or Lark grammar for constrained decoding,
        off the loop; a schema the library cannot compile is the caller's 400, naming the construct and the field."""
        from tinkerless.functions.sampling.constraints import Grammar, GrammarError

        tokenizer = self.backend.tokenizer()
        try:
            return await asyncio.to_thread(partial(Grammar, lark=lark), tokenizer, schema, stop_ids, len(tokenizer))
        except GrammarError as exc:
            raise OpenAIError(exc.message, param=param, code="unsupported_schema", hint=exc.hint) from None

    async def forced_call(self, tools: list[dict], name: str | None, stop_ids: list[int], param: str):
        """The grammar of a reply that is one tool call (of the tool `name`, or of any of `tools`) whose arguments
        follow the tool's parameters: tool_choice "required" / a named function, enforced (`render.tool_call_grammar`)."""
        from tinkerless.functions.openai_api.render import tool_call_grammar

        return await self.grammar(None, stop_ids, param, lark=tool_call_grammar(tools, name))

    async def strict_calls(self, tools: list[dict], strict: set[str], stop_ids: list[int]):
        """Under tool_choice auto: the grammar that holds every tool call the reply opens to its tool's schema when
        some tool is `strict: true` (`render.strict_tools_grammar`); None when none is (nothing is masked)."""
        from tinkerless.functions.openai_api.render import strict_tools_grammar

        strict = strict & {t["function"]["name"] for t in tools}
        if not strict:
            return None
        grammar = await self.grammar(None, stop_ids, "tools", lark=strict_tools_grammar(tools, strict))
        grammar.required = False  # an engine that cannot mask samples unconstrained, as before (docs/structured-outputs.md)
        return grammar

    def sampling(self, prompt_ids: list[int], stop_ids: list[int], *, max_tokens: int | None, temperature: float | None,
                 top_p: float | None, stop_strings: list[str], n: int = 1, seed: int | None = None,
                 top_logprobs: int = 0, top_k: int | None = None, grammar=None, images: tuple = ()) -> TokenSampling:
        return TokenSampling(
            prompt_ids=prompt_ids, n=n,
            max_tokens=max_tokens if max_tokens is not None else self.context_cap(len(prompt_ids)),
            temperature=temperature_of(temperature), top_p=1.0 if top_p is None else float(top_p),
            stop_strings=stop_strings, stop_token_ids=stop_ids, seed=seed, top_logprobs=top_logprobs,
            top_k=top_k or 0, grammar=grammar, images=images,
        )

    def sample_call(self, who: str, model: str, request: TokenSampling, cancel: Cancellation):
        if self.cancellable:
            return self.backend.sample(who, model, request, cancel=cancel)
        return self.backend.sample(who, model, request)

    async def sample(self, request: Request, who: str, model: str, sampling: TokenSampling) -> list[SampledChoice]:
        """The whole choices of one request; the job is cancelled if the client hangs up first."""
        cancel = Cancellation()
        return await unless_disconnected(request, self.sample_call(who, model, sampling, cancel), [cancel])

    async def finished(self, request: Request, who: str, model: str, sampling: TokenSampling) -> list[FinishedChoice]:
        """`sample`, each choice cut at its stop string or token, with its text."""
        choices = await self.sample(request, who, model, sampling)
        tokenizer = self.backend.tokenizer()
        return [finish(tokenizer, c, sampling.stop_strings, sampling.stop_token_ids) for c in choices]

    async def streams(self, who: str, model: str, requests: list[TokenSampling]) -> list[TokenStream]:
        return await open_streams(self.backend, who, model, requests)


async def unless_disconnected(request: Request, work: Awaitable[T], cancels: list[Cancellation]) -> T:
    """Await `work`, cancelling its jobs if the client hangs up first: a non-streamed request whose client timed
    out (and whose client retries it) must not keep generating for nobody. The jobs end at their next decode
    step, or never start if still queued; `work` then returns what they have, which nobody reads."""

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


def temperature_of(value: float | None) -> float:
    """OpenAI's and Anthropic's default is 1. Below GREEDY_BELOW, sampling is greedy (the engines' rule for every
    API: dividing logits by a temperature near zero overflows them to inf, and the draw there is the argmax)."""
    if value is None:
        return 1.0
    return 0.0 if value < GREEDY_BELOW else float(value)
