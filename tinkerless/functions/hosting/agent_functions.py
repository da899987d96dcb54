"""Agent functions on the rollout worker: `group_size` copies per task, concurrently, against the current policy.

Each copy of an `@tinkerless.agent` function gets a real `openai.AsyncOpenAI` client whose endpoint
is the worker's OpenAI-compatible app: the router of `tinkerless serve`
(`tinkerless.server.openai_api`) over `PolicyBackend`, reached through an in-process ASGI transport
(the default) or a loopback HTTP server (`transport="http"`); the same route code either way.

The copies run as tasks of one asyncio loop (in a thread of its own, so a caller's running loop is
never in the way). Completion calls sample in worker threads through `engine.generate`: calls that
wait on the model together go as one generate call (`_Gather`), and the continuous batcher
(`functions/sampling/batcher.py`) batches that with every other call in flight: 32 agents waiting on the
model decode in one batch, not one after another.

The API key of each copy's client is its episode id: `PolicyBackend` records every call under it
(`recording.EpisodeRecorder`), and the calls become the episode's training sequences. An agent that
raises, runs past `agent_timeout` or returns something that is not a reward ends as an `error`
episode with its traceback, dropped from training like a failing env.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import astuple, dataclass, field
from typing import Any, Callable

import numpy as np

from tinkerless.errors import infra_cause_tag
from tinkerless.functions.sampling.engine import Engine, row_seed
from tinkerless.functions.rollout.recording import EpisodeRecorder, Sequence, TokenProofError, prove_tokens
from tinkerless.functions.hosting.agent_host import play_copy
from tinkerless.functions.openai_api.backend import OpenAIError, SampledChoice, TokenSampling
from tinkerless.wire.messages import Episode, EpisodeLimits, SamplingParams

POLICY_MODEL = "policy"  # the model name agents ask for; in training it is always the policy being trained
ENDPOINT_HOST = "http://tinkerless-worker"  # the base URL's host for the in-process transport (never resolved)
MAX_SAMPLING_THREADS = 256


@dataclass
class _Copy:
    """One agent copy: its task, its episode id (the API key of its client) and what it recorded."""

    index: int
    task_index: int
    task: dict
    episode_id: str
    recorder: EpisodeRecorder
    seed: int
    reward: float = math.nan
    metrics: dict = field(default_factory=dict)
    images: list[tuple] = field(default_factory=list)  # per recorded call: its prompt's processed images
    error: str | None = None
    traceback: str | None = None
    infra_cause: str | None = None  # the copy failed for an infrastructure reason (errors.infra_cause): retried, never scored

    def settle(self, outcome: dict) -> None:
        """Take a `play_copy` outcome: the reward and metrics, or the error, its traceback and infra cause."""
        if outcome["error"] is None:
            self.reward, self.metrics = outcome["reward"], outcome["metrics"]
        else:
            self.error, self.traceback = outcome["error"], outcome["traceback"]
            cause = outcome.get("infra_cause")  # from a sandbox too: checked again
            self.infra_cause = infra_cause_tag(cause) if cause else None


class PolicyBackend:
    """The `CompletionBackend` of one rollout: samples from `policy` and records each copy's calls.

    The run's sampling settings apply to every call: `temperature` and `top_p` (a group of copies
    explores at the run's temperature whatever the agent asks), and `max_tokens` caps each call's own.
    `n` must be 1 (copies are `group_size`). `limits.max_turns` bounds the calls of one copy, and
    `limits.max_episode_tokens` the prompt + completion of one call.
    """

    def __init__(self, engine: Engine, tokenizer: Any, *, policy: str | None, sampling: SamplingParams,
                 limits: EpisodeLimits, copies: dict[str, _Copy], executor: ThreadPoolExecutor, vision: Any = None):
        self.engine, self._tokenizer, self.policy = engine, tokenizer, policy
        self.vision = vision  # a vision-language model's runtime (`functions/vision`): calls may carry images
        self.sampling, self.limits, self.copies, self.executor = sampling, limits, copies, executor
        self.calls = 0  # every call sampled in this rollout (a statistic)
        self.gather = _Gather(
            lambda prompts, sampling, seeds, constraints: engine.generate(
                prompts, sampling, policy=policy, seed=seeds[0], row_seeds=seeds,
                **({"constraints": constraints} if any(c is not None for c in constraints) else {})),
            executor, live=len(copies),
        )

    def tokenizer(self) -> Any:
        return self._tokenizer

    def vision_chat(self) -> Any:
        return self.vision.chat if self.vision is not None else None

    def models(self, caller: str) -> list[str]:
        return [POLICY_MODEL]

    async def sample(self, caller: str, model: str, request: TokenSampling, cancel=None) -> list[SampledChoice]:
        # (`cancel` is not needed here: the rollout that made this endpoint owns every call's lifetime)
        run = self.copies.get(caller)
        if run is None:
            raise OpenAIError("this API key is not an episode of the running rollout", status=401, type="authentication_error",
                              code="invalid_api_key", hint="use the client the agent function was given")
        if model != POLICY_MODEL:
            raise OpenAIError(f"the model {model[:200]!r} does not exist on a training rollout's endpoint", status=404,
                              param="model", code="model_not_found",
                              hint=f"in training an agent calls model={POLICY_MODEL!r} (the policy being trained); "
                                   f"`tinkerless eval --model NAME` sends those calls to NAME")
        if request.n != 1:
            raise OpenAIError(f"n={request.n}: a training rollout samples one choice per call", param="n",
                              hint="leave n at 1; group_size runs that many copies of the agent per task")
        recorder = run.recorder
        if len(recorder.calls) >= self.limits.max_turns:
            raise OpenAIError(f"this episode has made its max_turns={self.limits.max_turns} completion calls",
                              code="max_turns_exceeded", hint="raise max_turns in the run's config, or make fewer calls")
        prompt = recorder.prompt_for(list(request.prompt_ids))
        max_tokens = min(request.max_tokens, self.sampling.max_tokens, self.limits.max_episode_tokens - len(prompt))
        if max_tokens < 1:
            raise OpenAIError(f"the prompt has {len(prompt)} tokens: no room left within max_episode_tokens="
                              f"{self.limits.max_episode_tokens}", code="context_length_exceeded", param="messages",
                              hint="raise max_episode_tokens in the run's config, or send a shorter context")
        sampling = SamplingParams(max_tokens=max_tokens, temperature=self.sampling.temperature, top_p=self.sampling.top_p,
                                  top_k=self.sampling.top_k, stop_token_ids=list(request.stop_token_ids))
        seed = (run.seed * 1_000_003 + len(recorder.calls)) % (1 << 62)
        if request.grammar is not None and not request.grammar.required and (
                request.images or not hasattr(self.engine, "batcher")):
            request = dataclasses.replace(request, grammar=None)
        if request.grammar is not None and not hasattr(self.engine, "batcher"):
            raise OpenAIError("structured outputs and required tool calls need the transformers engine (its sampler "
                              "applies the token masks); this rollout runs another", code="unsupported_parameter")
        constraint = request.grammar.constraint() if request.grammar is not None else None  # structured outputs
        if request.images:  # image features merged in the prefill, one call at a time (functions/vision/sampler.py)
            if constraint is not None:
                raise OpenAIError("structured outputs are not supported with images in the prompt yet",
                                  code="unsupported_parameter")
            from tinkerless.functions.vision.sampler import VisionPrompt

            generation = (await asyncio.get_running_loop().run_in_executor(
                self.executor, lambda: self.vision.sampler.generate(
                    [VisionPrompt(prompt, list(request.images))], sampling, policy=self.policy, seed=seed)))[0]
        else:
            generation = await self.gather.generate(prompt, sampling, seed=seed, constraint=constraint)
        tokens, logprobs = cut_at_stop_strings(self._tokenizer, generation.tokens, generation.logprobs, request.stop_strings)
        stopped = generation.stop_reason == "stop" or len(tokens) < len(generation.tokens)
        recorder.record(prompt, tokens, logprobs, request.stop_token_ids, request.stop_strings)
        run.images.append(tuple(request.images))
        self.calls += 1
        return [SampledChoice(token_ids=tokens, logprobs=logprobs, top_logprobs=None, stopped=stopped)]


class _Gather:
    """Calls that wait on the model together go to the engine as one generate call (one prefill, one start).

    The continuous batcher would batch them anyway, but a call that arrives a step late joins with a
    prefill of its own and runs on past the others: on a CPU those tails cost about as much as the
    batch. Here a call waits until every agent copy still running is waiting on the model (no other
    call can come), or `window` seconds after the last call came (at most `most` after the first):
    copies doing tool work or thinking do not hold the others up for longer than that.
    """

    def __init__(self, generate: Callable, executor: ThreadPoolExecutor, *, live: int,
                 window: float = 0.02, most: float = 0.25):
        self.generate_many, self.executor, self.live = generate, executor, live
        self.window, self.most = window, most
        self._pending: list[tuple[list[int], SamplingParams, int, asyncio.Future, Any]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._first = 0.0
        self.flushes = 0  # generate calls made (a statistic: calls / flushes is the gathered batch)

    async def generate(self, prompt: list[int], sampling: SamplingParams, *, seed: int, constraint: Any = None) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self._pending:
            self._first = loop.time()
        self._pending.append((prompt, sampling, seed, future, constraint))
        self._schedule(loop)
        return await future

    def agent_done(self) -> None:
        """One copy finished: fewer calls can still come."""
        self.live -= 1
        if self._pending:
            self._schedule(asyncio.get_running_loop())

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiting = sum(not item[3].done() for item in self._pending)
        if waiting >= self.live:
            self._flush()
        else:
            delay = min(self.window, max(0.0, self._first + self.most - loop.time()))
            self._timer = loop.call_later(delay, self._flush)

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pending = [p for p in self._pending if not p[3].done()]  # a copy past its timeout no longer waits
        self._pending = []
        groups: dict[tuple, list] = {}
        for item in pending:  # one generate call takes one SamplingParams
            # Every field of the call's settings (a list made hashable; None, the model's stop tokens, is not []).
            key = tuple(tuple(v) if isinstance(v, list) else v for v in astuple(item[1]))
            groups.setdefault(key, []).append(item)
        loop = asyncio.get_running_loop()
        for items in groups.values():
            self.flushes += 1
            # Each call's row draws from its own seed, exactly as it would alone (row 0 of a call seeded with it):
            # which calls happen to be gathered together, and in what order, changes nothing they sample.
            prompts, seeds = [item[0] for item in items], [row_seed(item[2], 0) for item in items]
            constraints = [item[4] for item in items]
            job = loop.run_in_executor(self.executor, self.generate_many, prompts, items[0][1], seeds, constraints)
            job.add_done_callback(lambda done, items=items: _deliver(done, [item[3] for item in items]))


def _deliver(done: asyncio.Future, futures: list[asyncio.Future]) -> None:
    error = done.exception()
    for i, future in enumerate(futures):
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(done.result()[i])


def cut_at_stop_strings(tokenizer: Any, tokens: list[int], logprobs: list[float], stops: list[str]) -> tuple[list[int], list[float]]:
    """The tokens up to the one that completes the first stop string: what the agent's reply is made of
    (the sampler drew those; the ones after it were never seen by the agent, so they are not trained)."""
    stops = [s for s in stops if s]
    if not stops or not any(s in tokenizer.decode(tokens) for s in stops):
        return list(tokens), list(logprobs)
    for end in range(1, len(tokens) + 1):
        if any(s in tokenizer.decode(tokens[:end]) for s in stops):
            return list(tokens[:end]), list(logprobs[:end])
    return list(tokens), list(logprobs)


def same_reply_checker(tokenizer: Any) -> Callable[[list[int], list[int], tuple[str, ...]], bool]:
    """Whether a reply re-rendered into a later prompt says what the sampled reply said: the same text and
    tool calls (parsed as the router parses them), up to whitespace around them and a stop string."""
    from tinkerless.functions.openai_api.render import parse_tool_calls

    def meaning(text: str) -> tuple[str, list]:
        content, calls = parse_tool_calls(text)
        return (content or "").strip(), [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]

    def same(rendered: list[int], sampled: list[int], stops: tuple[str, ...]) -> bool:
        text = tokenizer.decode(sampled, skip_special_tokens=True)
        for stop in stops:
            if stop and stop in text:
                text = text[: text.index(stop)]
        try:
            return meaning(tokenizer.decode(rendered, skip_special_tokens=True)) == meaning(text)
        except Exception:  # noqa: BLE001 - an unparsable reply is simply not the same one
            return False

    return same


def run_agent_episodes(
    engine: Engine,
    tokenizer: Any,
    *,
    agent: Callable,
    policy: str | None,
    tasks: list[dict],
    group_size: int,
    sampling: SamplingParams,
    limits: EpisodeLimits,
    seed: int,
    timeout: float,
    transport: str = "asgi",
    vision: Any = None,
) -> list[Episode]:
    """Run `group_size` copies of `agent` per task against the policy; one episode per copy, in task order.
    With `vision` (a VLM's runtime) the agent's calls may carry images (`image_url` parts)."""
    if getattr(agent, "__tinkerless_loopback__", False):
        transport = "http"  # an external agent (external_agents.py) reaches the endpoint from another process
    copies = make_copies(tokenizer, tasks, group_size, seed)
    with ThreadPoolExecutor(max_workers=max(1, min(len(copies), MAX_SAMPLING_THREADS)), thread_name_prefix="agent-sample") as executor:
        backend = PolicyBackend(engine, tokenizer, policy=policy, sampling=sampling, limits=limits,
                                copies={c.episode_id: c for c in copies}, executor=executor, vision=vision)
        _in_own_loop(lambda: _play(agent, copies, backend, timeout, transport))
    return [_episode(c, tokenizer) for c in copies]


def make_copies(tokenizer: Any, tasks: list[dict], group_size: int, seed: int) -> list[_Copy]:
    """`group_size` copies per task, in task order; each episode id is a fresh secret (its client's API key)."""
    same_reply = same_reply_checker(tokenizer)
    pairs = [(t, task) for t, task in enumerate(tasks) for _ in range(group_size)]
    return [_Copy(index=i, task_index=t, task=task, episode_id=f"episode-{i}-{secrets.token_urlsafe(18)}",
                  recorder=EpisodeRecorder(same_reply), seed=seed * 7919 + i) for i, (t, task) in enumerate(pairs)]


def _in_own_loop(main: Callable[[], Any]) -> None:
    """asyncio.run(main()) in a thread of its own: the caller may be inside a running loop (a notebook, a server)."""
    failure: list[BaseException] = []

    def target() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=target, name="agent-loop", daemon=True)  # Ctrl-C must not wait for it
    thread.start()
    thread.join()
    if failure:
        raise failure[0]


def endpoint_app(backend: Any):
    """The worker's OpenAI-compatible app: the serve router over `backend`; the bearer token names the caller."""
    from fastapi import FastAPI

    from tinkerless.functions.apis import api_routers
    from tinkerless.functions.openai_api.router import openai_router

    app = FastAPI()
    app.include_router(openai_router(backend, caller=bearer_token))
    for more in api_routers(backend, caller=bearer_token):  # Anthropic Messages, OpenAI Responses
        app.include_router(more)
    if hasattr(backend, "copies"):  # a rollout's endpoint: external agents post their rewards to it
        from tinkerless.functions.hosting.external_agents import reward_router

        app.include_router(reward_router(backend, bearer_token))
    return app


def bearer_token(request: Any) -> str | None:
    """The API key of a request (an episode id here): the bearer token (OpenAI's clients), else the x-api-key
    header (Anthropic's); None without one (the router answers 401)."""
    header = request.headers.get("authorization", "")
    if header[:7].lower() == "bearer ":
        return header[7:].strip() or None
    return request.headers.get("x-api-key") or None


async def _play(agent: Callable, copies: list[_Copy], backend: PolicyBackend, timeout: float, transport: str) -> None:
    import httpx
    import openai

    from tinkerless.functions.hosting.clients import register

    app = endpoint_app(backend)
    server = None
    if transport == "http":
        base_url, http_client, server = await _loopback(app)
    else:
        base_url, http_client = f"{ENDPOINT_HOST}/v1", httpx.AsyncClient(transport=httpx.ASGITransport(app=app), timeout=timeout)
    try:
        async def play(run: _Copy) -> None:
            client = openai.AsyncOpenAI(api_key=run.episode_id, base_url=base_url, http_client=http_client, max_retries=0)
            register(client, http_client)  # tinkerless.anthropic_client(client) sends through it too
            try:
                run.settle(await play_copy(agent, client, run.task, timeout))
            finally:
                backend.gather.agent_done()

        await asyncio.gather(*(play(run) for run in copies))
    finally:
        await http_client.aclose()
        if server is not None:
            server.should_exit = True
            await server.task


async def _loopback(app: Any) -> tuple[str, Any, Any]:
    """Serve `app` on 127.0.0.1 (a free port) in this loop; the base URL, a client and the server."""
    import httpx
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    server.task = asyncio.create_task(server.serve())
    while not server.started:
        if server.task.done():
            server.task.result()  # raises the reason it could not start
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    return f"http://127.0.0.1:{port}/v1", httpx.AsyncClient(timeout=None), server


def _episode(run: _Copy, tokenizer: Any) -> Episode:
    sequences = run.recorder.sequences()
    first = sequences[0] if sequences else Sequence()
    ok = run.error is None
    calls = run.recorder.calls
    # A sequence's images are its last call's: that call's prompt holds every image token of the sequence.
    last_call = list(itertools.accumulate(s.calls for s in sequences))
    images = [list(run.images[end - 1]) if end - 1 < len(run.images) else [] for end in last_call]
    extra = [s.as_wire() for s in sequences[1:]]
    for sequence, own in zip(extra, images[1:]):
        sequence.images = own
    info = {"agent_metrics": run.metrics} if run.metrics else {}
    info.update(sequences=len(sequences), render_drift_turns=run.recorder.drift_turns)
    episode = Episode(
        task_index=run.task_index,
        tokens=np.asarray(first.tokens, dtype=np.int32),
        mask=np.asarray(first.mask, dtype=np.float32),
        sampler_logprobs=np.asarray(first.logprobs, dtype=np.float32),
        prompt_length=first.prompt_length,
        reward=run.reward if ok else math.nan,
        turn_rewards=[run.reward] if ok else [],
        num_turns=len(calls),
        status="ok" if ok else ("infra_failed" if run.infra_cause else "error"),
        error=run.error,
        traceback=run.traceback,
        transcript=_transcript(run, tokenizer),
        info=info,
        extra_sequences=extra,
        images=images[0] if images and ok else [],
        infra_cause=run.infra_cause if not ok else None,
    )
    return proven(episode, calls, [s.spans for s in sequences] or [[]])


def proven(episode: Episode, calls: list, spans: list[list[tuple[int, int]]]) -> Episode:
    """`episode` if the arrays it ships prove its tokens (`recording.prove_tokens`); else the same episode refused:
    an error episode (never trained) that says why."""
    arrays = [(episode.tokens, episode.mask, episode.sampler_logprobs),
              *[(s.tokens, s.mask, s.sampler_logprobs) for s in episode.extra_sequences]]
    try:
        prove_tokens(calls, arrays, spans)
    except TokenProofError as exc:
        episode.status, episode.reward, episode.turn_rewards = "error", math.nan, []
        episode.error = f"the episode's token proof failed, so it is not trained: {exc}"
        episode.info["token_proof_failed"] = True
    return episode


def _transcript(run: _Copy, tokenizer: Any) -> list[dict]:
    """What the model read and wrote, call by call: each prompt's new part (all of it after a rewritten
    context) with the template's markup, then the reply."""
    messages: list[dict] = []
    previous: list[int] = []
    for call in run.recorder.calls:
        extends = call.prompt_ids[: len(previous)] == previous and len(previous) > 0
        new = call.prompt_ids[len(previous):] if extends else call.prompt_ids
        messages.append({"role": "prompt", "content": tokenizer.decode(new, skip_special_tokens=False)})
        messages.append({"role": "assistant", "content": tokenizer.decode(call.token_ids, skip_special_tokens=True)})
        previous = call.prompt_ids + call.token_ids
    if not messages or messages[-1]["role"] != "assistant":
        messages.append({"role": "assistant", "content": ""})  # an agent that made no call: still one line to show
    return messages
