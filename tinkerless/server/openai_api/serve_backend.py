"""The `CompletionBackend` of `tinkerless serve`: the base model, the caller's trained adapters and live policies.

`model` names, for a caller (its API key's tenant):
  * the base model: its Hub id or any alias (`smollm2`, the path the server was started with);
  * `<run_id>@<step>`, `<run_id>@latest` (`<run_id>/<agent>@...` for a multi-agent run): a checkpoint of one of
    the caller's runs on this server, or a `tinker://...` checkpoint path of the caller's Tinker runs, loaded on
    first use into an LRU cache of adapters (`adapters.py`);
  * the name of one of the caller's live policies on the worker (as `/v1/call` names it, e.g. "default"):
    its current weights, with no copy, so a sample right after an `update` uses the new adapter.

Every request is one job on the server's `Scheduler` like any other sample call (tenants take turns,
long generations yield between slices, the queue bounds apply) and is checked against the server's
`ServingLimits` first. Requests that run at the same time decode in one batch (`functions/sampling/batcher.py`),
whatever adapter each names: peft's mixed-adapter forward. A streamed request (`sample_stream`) is the
same job, with a `TokenStream` that receives each token as the engine draws it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import secrets
from typing import Any

from tinkerless.errors import ServerBusy
from tinkerless.functions.models import model_aliases, public_model_id
from tinkerless.functions.sampling.token_stream import Cancellation, TokenStream, replay
from tinkerless.server.limits import ServingLimits
from tinkerless.server.openai_api.adapters import SLOT_PREFIX, AdapterCache, AdapterNames, AdapterRef, NotFound
from tinkerless.functions.openai_api.backend import OpenAIError, SampledChoice, TokenSampling, unknown_model
from tinkerless.server.scheduler import QueueFull, Scheduler
from tinkerless.server.tenancy import tenant_prefix
from tinkerless.storage import ObjectStore
from tinkerless.wire.messages import BASE_POLICY, SamplingParams


class ServeBackend:
    def __init__(
        self, worker, scheduler: Scheduler, store: ObjectStore, *, limits: ServingLimits | None = None,
        max_adapters: int = 8, extra_models: list[str] = (),
    ):
        self.worker = worker
        self.scheduler = scheduler
        self.limits = limits or ServingLimits()
        self.names = AdapterNames(store)
        self.adapters = AdapterCache(worker, max_adapters)
        self.base_model = public_model_id(worker.model_name)
        self.base_names = model_aliases(worker.model_name)
        # The server's other base models (`served_models`): listed, answering forward and sample over /v1/call.
        self.extra_models = {name: spec for spec in extra_models for name in model_aliases(spec)}
        config = getattr(getattr(worker, "base_model", None), "config", None)
        self.context_length: int | None = getattr(config, "max_position_embeddings", None)
        self.max_choices = self.limits.max_samples  # choices one request may ask for, all prompts together
        self.default_max_tokens = min(1024, self.limits.max_tokens)  # a request without max_tokens
        self.cancelled_choices = 0  # choices whose stream's reader hung up mid-generation (statistics, tests)
        self._jobs: set[TokenStream | Cancellation] = set()  # the cancel handles of jobs queued or running

    def cancel_all(self) -> int:
        """Cancel every job this backend queued that has not ended (shutdown): queued ones never run, running
        ones end at their next decode step. The number cancelled."""
        jobs = list(self._jobs)
        for job in jobs:
            job.cancel()
        return len(jobs)

    def tokenizer(self) -> Any:
        return self.worker.tokenizer

    def vision_chat(self) -> Any:
        """A vision-language model's chat with images (`functions/vision`), or None: the model reads text only."""
        return self.worker.vision.chat if getattr(self.worker, "vision", None) is not None else None

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt a request may send: the server's limit, within the model's context."""
        return min(self.limits.max_prompt_tokens, self.context_length or self.limits.max_prompt_tokens)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters the longest token of the vocabulary spells (a byte-level or sentencepiece vocabulary
        spells each byte with one character, so no token decodes to more characters than this)."""
        vocab = self.worker.tokenizer.get_vocab()
        return max((len(token) for token in vocab), default=1)

    @property
    def prompt_char_limit(self) -> int:
        """A prompt of more characters than this is surely over `max_prompt_tokens`: refused untokenized."""
        return self.max_prompt_tokens * self.max_token_chars

    def resolve(self, caller: str, model: str) -> None:
        """Raise the 404 the POST routes would for `model` (an alias, a live policy, a checkpoint); else nothing."""
        self._resolve(caller, model)

    # -- names ---------------------------------------------------------------------------

    def _live_policy(self, caller: str, model: str) -> str | None:
        """The caller's own live policy named `model` on the worker (tenant-scoped, as /v1/call scopes it)."""
        if model == BASE_POLICY or model.startswith(SLOT_PREFIX):
            return None
        name = tenant_prefix(caller) + model if caller else model
        return name if name in self.worker.policies else None

    def _live_policies(self, caller: str) -> list[str]:
        prefix = tenant_prefix(caller) if caller else ""
        names = [p[len(prefix):] for p in list(self.worker.policies) if p.startswith(prefix)]
        hidden = ("t", SLOT_PREFIX) if not caller else ()  # other tenants' and the cache's slots
        return sorted(n for n in names if not (hidden and (n.startswith(SLOT_PREFIX) or _is_scoped(n))))

    def models(self, caller: str) -> list[str]:
        extras = sorted({public_model_id(spec) for spec in self.extra_models.values()})
        return [self.base_model, *extras, *self._live_policies(caller), *self.names.list(caller)]

    def _resolve(self, caller: str, model: str) -> tuple[str, AdapterRef | str]:
        """("base", BASE_POLICY) | ("live", worker policy) | ("adapter", AdapterRef) (storage reads: off the loop)."""
        if model in self.base_names:
            return "base", BASE_POLICY
        if model in self.extra_models:
            raise OpenAIError(f"model {model[:200]!r} is served beside this server's main model for log-probs and "
                              f"sampling over its msgpack API only", param="model", code="model_not_supported",
                              hint=f"POST /v1/call/sample or /v1/call/forward with header X-Tinkerless-Model: {model[:200]} "
                              f"(HTTPBackend(url, model=...)); chat and completions here serve {self.base_model!r} and its adapters")
        live = self._live_policy(caller, model)
        if live is not None:
            return "live", live
        if AdapterNames.looks_like_adapter(model):
            try:
                return "adapter", self.names.resolve(caller, model)
            except NotFound:
                pass
        raise unknown_model(model, [self.base_model])  # the same answer for every name: no listing, no hints

    # -- sampling ----------------------------------------------------------------------------

    def _check(self, request: TokenSampling) -> None:
        prompt = len(request.prompt_ids)
        if request.images and request.top_logprobs:
            raise OpenAIError("top_logprobs with images is not supported yet", param="top_logprobs",
                              hint="ask for logprobs=true without top_logprobs, or send the images without it")
        if self.context_length is not None and prompt + request.max_tokens > self.context_length:
            if prompt >= self.context_length:
                message = f"the prompt is {prompt} tokens, longer than the model's context of {self.context_length}"
            else:
                message = (f"the prompt ({prompt} tokens) plus max_tokens ({request.max_tokens}) is over the "
                           f"model's context of {self.context_length} tokens")
            raise OpenAIError(message, param="messages", code="context_length_exceeded",
                              hint="shorten the prompt or lower max_tokens")
        vocab = self.worker.vocab_size
        bad = next((t for t in request.prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise OpenAIError(f"prompt token id {bad} is outside this model's vocabulary [0, {vocab})", param="prompt",
                              code="invalid_token_id")
        for name, value, what, param in (("max_samples", request.n, "n", "n"),
                                         ("max_tokens", request.max_tokens, "max_tokens", "max_tokens"),
                                         ("max_prompt_tokens", prompt, "the prompt length in tokens", "messages")):
            limit = getattr(self.limits, name)
            if value > limit:
                raise OpenAIError(
                    f"{what} is {value}, over this server's limit of {limit} ({name})", param=param,
                    code="limit_exceeded",
                    hint=f"ask for less, or start `tinkerless serve` with a larger {ServingLimits.flag(name)}",
                )

    async def sample(
        self, caller: str, model: str, request: TokenSampling, cancel: Cancellation | None = None
    ) -> list[SampledChoice]:
        """The whole choices; with `cancel`, a caller that hangs up ends the job (queued: it never runs)."""
        cancel = cancel or Cancellation()
        future = await self._submit(caller, model, request, cancel)
        self._jobs.add(cancel)
        future.add_done_callback(lambda _: self._jobs.discard(cancel))
        # Shielded: a client that hangs up must not cancel a job that may be loading an adapter.
        return await asyncio.shield(asyncio.wrap_future(future))

    async def sample_stream(self, caller: str, model: str, request: TokenSampling) -> TokenStream:
        """The same job as `sample` (same checks, scheduler, tenancy and limits), whose tokens arrive on the
        returned stream as they are drawn, then its `list[SampledChoice]` as the stream's result. A request
        the checks refuse raises here, before anything is streamed; cancelling the stream ends the job."""
        stream = TokenStream(asyncio.get_running_loop())
        future = await self._submit(caller, model, request, stream)
        self._jobs.add(stream)
        future.add_done_callback(lambda _: self._jobs.discard(stream))

        def done(f) -> None:  # on the scheduler's thread: the stream hands it to the loop
            if f.cancelled():
                stream.fail(ServerBusy("the server stopped before the request ran"))
            elif f.exception() is not None:
                stream.fail(f.exception())
            else:
                stream.end(f.result())

        future.add_done_callback(done)
        return stream

    async def _submit(self, caller: str, model: str, request: TokenSampling,
                      stream: TokenStream | Cancellation | None):
        """Check `request`, resolve `model` and queue its job on the scheduler; the job's future."""
        self._check(request)
        kind, target = await asyncio.to_thread(self._resolve, caller, model)
        seed = secrets.randbelow(2**31) if request.seed is None else request.seed % (1 << 63)
        sampling = SamplingParams(max_tokens=request.max_tokens, temperature=request.temperature,
                                  top_p=request.top_p, top_k=request.top_k, stop_token_ids=list(request.stop_token_ids))
        files = None
        if kind == "adapter" and not self.adapters.cached(target):  # read off the scheduler thread
            files = await asyncio.to_thread(self.names.load_files, target)
        engine = self.worker.engine
        streams = hasattr(engine, "batcher")  # the transformers engine: tokens (and top logprobs) as drawn
        if request.grammar is not None and not request.grammar.required and (request.images or not streams):
            request = dataclasses.replace(request, grammar=None)
        if request.grammar is not None and not streams:
            raise OpenAIError("structured outputs need the transformers engine (its sampler applies the token "
                              "masks); this server runs another", param="response_format", code="unsupported_parameter")

        def run() -> list[SampledChoice]:
            if stream is not None and stream.cancelled:  # its client hung up while it was queued
                return []
            slot = self.adapters.acquire(target, lambda _: files or self.names.load_files(target)) \
                if kind == "adapter" else target
            try:
                if kind == "live" and slot not in self.worker.policies:  # deleted while queued
                    raise unknown_model(model, [])
                prompts = [list(request.prompt_ids)] * request.n
                if request.images:  # image features merged in the prefill (functions/vision/sampler.py)
                    from tinkerless.functions.vision.sampler import VisionPrompt

                    generations = self.worker.vision.sampler.generate(
                        [VisionPrompt(p, list(request.images)) for p in prompts], sampling, policy=slot, seed=seed)
                    top = [None] * len(generations)
                elif streams:
                    constraints = None if request.grammar is None else \
                        [request.grammar.constraint() for _ in range(request.n)]
                    generations = engine.generate(prompts, sampling, policy=slot, seed=seed, stream=stream,
                                                  top_logprobs=request.top_logprobs, constraints=constraints)
                    top = [g.top_logprobs for g in generations]
                else:
                    generations = engine.generate(prompts, sampling, policy=slot, seed=seed)
                    top = [self._top_logprobs(slot, request.prompt_ids, g.tokens, request.top_logprobs)
                           for g in generations] if request.top_logprobs else [None] * len(generations)
            finally:
                if kind == "adapter":
                    self.adapters.release(slot)
            if stream is not None and (not streams or request.images):  # whole generations: replay them
                replay(stream, [(g.tokens, g.logprobs, t, g.stop_reason) for g, t in zip(generations, top)])
            self.cancelled_choices += sum(g.stop_reason == "cancelled" for g in generations)
            return [SampledChoice(g.tokens, g.logprobs, t, g.stop_reason == "stop") for g, t in zip(generations, top)]

        try:
            return self.scheduler.submit(run, tenant=caller, charge="openai")
        except QueueFull as full:
            raise ServerBusy(str(full), hint=f"retry after {full.retry_after:.0f}s") from None

    def _top_logprobs(self, policy: str, prompt: list[int], tokens: list[int], k: int) -> list[list[tuple[int, float]]]:
        """The k most likely tokens at each sampled position, by the model's own log-softmax (temperature 1, the
        distribution the sampled tokens' logprobs come from), from one forward over prompt + completion."""
        import torch

        if not tokens:
            return []
        worker = self.worker
        with torch.no_grad(), worker._activate(policy):  # the worker's adapter switch, as its forward() uses it
            device = next(worker.model.parameters()).device
            ids = torch.tensor([list(prompt) + list(tokens[:-1])], device=device)
            logits = worker.model(input_ids=ids).logits[0, len(prompt) - 1:].float()
        top = torch.log_softmax(logits, dim=-1).topk(min(k, logits.shape[-1]), dim=-1)
        return [list(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]


def _is_scoped(name: str) -> bool:
    """A tenant-scoped worker name ("t" + 12 hex + "_"): another tenant's, hidden from a key-less caller."""
    return len(name) > 14 and name[0] == "t" and name[13] == "_" and all(c in "0123456789abcdef" for c in name[1:13])
