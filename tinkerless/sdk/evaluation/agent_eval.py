"""An `@tinkerless.agent` function outside training: run it against any OpenAI-compatible server.

    tinkerless eval examples/openai_agent.py --endpoint http://127.0.0.1:8000/v1 --model <run_id>@latest

The agent asks for `model="policy"` (the policy being trained, in training); here every request that
names `policy` goes to `--model` instead, so the same file runs unchanged against `tinkerless serve`
(a trained adapter or the base model), vLLM or a hosted API. Requests naming any other model pass
as they are. Tasks come from the config's `tasks`, one episode each, `concurrency` at a time.
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
import os
import time
import traceback as tb
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx

from tinkerless.errors import ConfigError, TinkerlessError, UserError
from tinkerless.envs.decorators import agent_reward
from tinkerless.functions.hosting.clients import register
from tinkerless.sdk.run.tasks import TaskSource

POLICY_MODEL = "policy"  # the name agents use for the trained policy (tinkerless.functions.hosting.agent_functions)


@dataclass
class AgentEpisode:
    task_index: int
    task: dict
    reward: float = math.nan
    metrics: dict = field(default_factory=dict)
    error: str | None = None
    traceback: str | None = None
    calls: list[dict] = field(default_factory=list)  # per completion call: the request's messages and the reply
    seconds: float = 0.0


@dataclass
class AgentEvalReport:
    endpoint: str
    model: str
    episodes: list[AgentEpisode]
    seconds: float
    transcripts: Path | None = None

    @property
    def rewards(self) -> list[float]:
        return [e.reward for e in self.episodes if e.error is None]

    @property
    def mean(self) -> float:
        return sum(self.rewards) / len(self.rewards) if self.rewards else math.nan

    def describe(self) -> str:
        failed = [e for e in self.episodes if e.error is not None]
        calls = sum(len(e.calls) for e in self.episodes)
        lines = [f"{self.model} at {self.endpoint}: mean reward {self.mean:.3f} over {len(self.rewards)} episodes "
                 f"({len(failed)} failed), {calls} completion calls in {self.seconds:.1f} s"]
        lines += [f"  failed: {e.error}" for e in failed[:3]]
        if self.transcripts is not None:
            lines.append(f"  transcripts: {self.transcripts}")
        return "\n".join(lines)


class _RenamingTransport(httpx.AsyncBaseTransport):
    """An httpx transport that sends `model: "policy"` as the evaluated model and keeps each call's
    messages and reply for the transcripts (the agent's client never knows)."""

    def __init__(self, inner: Any, model: str, calls_of: Callable[[], list[dict]]):
        self.inner, self.model, self.calls_of = inner, model, calls_of

    async def handle_async_request(self, request: Any) -> Any:
        body = None
        if request.method == "POST" and request.headers.get("content-type", "").startswith("application/json"):
            try:
                body = json.loads(await request.aread())
            except ValueError:
                body = None
        if isinstance(body, dict) and body.get("model") == POLICY_MODEL:
            body["model"] = self.model
            content = json.dumps(body).encode()
            headers = [(k, v) for k, v in request.headers.raw if k.lower() != b"content-length"]
            request = httpx.Request(request.method, request.url, headers=headers, content=content,
                                    extensions=request.extensions)
        response = await self.inner.handle_async_request(request)
        if isinstance(body, dict) and not body.get("stream"):
            await response.aread()
            try:
                reply = json.loads(response.content)
            except ValueError:
                reply = {"status": response.status_code}
            calls = self.calls_of()
            if calls is not None:
                keys = ("model", "system", "instructions", "messages", "input", "prompt", "tools")
                calls.append({"request": {k: body.get(k) for k in keys if k in body},
                              "reply": reply.get("choices") if isinstance(reply, dict) and "choices" in reply else reply})
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


async def _run(agent: Callable, tasks: list[dict], endpoint: str, model: str, api_key: str, concurrency: int,
               timeout: float) -> list[AgentEpisode]:
    import contextvars

    import openai

    current: contextvars.ContextVar[list | None] = contextvars.ContextVar("agent_eval_calls", default=None)
    transport = _RenamingTransport(httpx.AsyncHTTPTransport(), model, current.get)
    http_client = httpx.AsyncClient(transport=transport, timeout=timeout)
    client = openai.AsyncOpenAI(api_key=api_key, base_url=endpoint, http_client=http_client, max_retries=2)
    register(client, http_client)  # tinkerless.anthropic_client(client) sends through the renaming transport too
    gate = asyncio.Semaphore(concurrency)
    name = getattr(agent, "__qualname__", "agent")

    async def play(index: int, task: dict) -> AgentEpisode:
        episode = AgentEpisode(index, task)
        async with gate:
            current.set(episode.calls)  # this task's context: the transport files its calls here
            started = time.perf_counter()
            try:
                value = await asyncio.wait_for(agent(client, copy.deepcopy(task)), timeout)
                episode.reward, episode.metrics = agent_reward(value, name)
            except asyncio.TimeoutError:
                episode.error = f"{name}: timed out after {timeout:g} s"
            except TinkerlessError as exc:
                episode.error, episode.traceback = f"{name}: {type(exc).__name__}: {exc.message}", tb.format_exc()
            except Exception as exc:  # noqa: BLE001 - one failing episode is reported, the others go on
                episode.error, episode.traceback = f"{name}: {type(exc).__name__}: {exc}", tb.format_exc()
            episode.seconds = time.perf_counter() - started
        return episode

    try:
        return list(await asyncio.gather(*(play(i, task) for i, task in enumerate(tasks))))
    finally:
        await http_client.aclose()


def evaluate_agent(agent: Callable, tasks: Any, *, endpoint: str, model: str, api_key: str | None = None,
                   episodes: int = 32, seed: int = 12345, concurrency: int = 16, timeout: float = 300.0,
                   transcripts: str | Path | None = None) -> AgentEvalReport:
    """Play `episodes` tasks (one copy each) with `agent` against the OpenAI-compatible `endpoint`."""
    if not getattr(agent, "__tinkerless_agent__", False):
        from tinkerless.envs.decorators import agent as check

        check(agent)
    if not endpoint.startswith(("http://", "https://")):
        raise UserError(f"--endpoint {endpoint!r} is not an http(s) URL", hint="e.g. http://127.0.0.1:8000/v1")
    if episodes < 1 or concurrency < 1:
        raise UserError("--episodes and --concurrency must be at least 1")
    key = api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("TINKERLESS_API_KEY") or "none"
    chosen, _ = TaskSource(tasks, seed=seed).batch(0, episodes)
    started = time.perf_counter()
    played = asyncio.run(_run(agent, chosen, endpoint.rstrip("/"), model, key, concurrency, timeout))
    report = AgentEvalReport(endpoint, model, played, time.perf_counter() - started)
    if transcripts is not None:
        path = Path(transcripts)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            for e in played:
                f.write(json.dumps({"task_index": e.task_index, "task": e.task, "reward": e.reward, "metrics": e.metrics,
                                    "error": e.error, "traceback": e.traceback, "seconds": e.seconds, "calls": e.calls},
                                   default=str) + "\n")
        report.transcripts = path
    return report


def agent_eval_command(args: Any, config: Any) -> int:
    """`tinkerless eval FILE --endpoint URL --model NAME` for a config whose `agent` is set."""
    if config.agent is None:
        raise ConfigError(f"--endpoint evaluates an agent function, and {args.file} sets no `agent`",
                          hint="use --endpoint with a config of TrainConfig(agent=...); an env/reward config evaluates without it")
    if not args.endpoint or not args.model:
        raise ConfigError(f"{args.file} trains an agent function: evaluate it against an OpenAI-compatible server",
                          hint="tinkerless eval FILE --endpoint http://127.0.0.1:8000/v1 --model <run_id>@latest "
                               "(tinkerless serve), or a vLLM / hosted endpoint and its model name")
    report = evaluate_agent(config.agent, config.tasks, endpoint=args.endpoint, model=args.model, api_key=args.api_key,
                            episodes=args.episodes, seed=args.seed, concurrency=args.concurrency,
                            timeout=config.agent_timeout, transcripts=args.transcripts)
    print(report.describe())
    return 0
