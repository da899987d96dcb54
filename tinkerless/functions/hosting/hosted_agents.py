"""Agent rollouts on a shared server: the copies run in the tenant's sandbox, the model stays here.

The in-process path (`agent_functions.run_agent_episodes`) runs the copies in the worker. On a shared
multi-tenant server the tenant's agent function lives in its sandboxed host (`user_code.py`), so here:

1. a fresh socketpair is the rollout's model channel; one end goes into the host with the "agents"
   request (`user_code_host.py` -> `agent_host.run_agents`), whose copies' `openai` clients send their
   HTTP requests over it (`agent_channel.ChannelTransport`);
2. `ChannelServer` (`agent_channel_server.py`) checks each request and answers it with the same
   endpoint app and `PolicyBackend` as the in-process path: the recording, the gathering of concurrent
   copies into one generate call, masks and tool rendering are that code, unchanged;
3. the generate calls run on the thread that called this function, which on a server is the
   scheduler's job thread (`ModelThread`): they pause at the batcher's safe points like any other
   generation, and while every copy is busy elsewhere (tool work, thinking, or waiting on the
   sandbox) the job gives its turn to other tenants' queued calls. An agent rollout therefore holds
   the model only while it generates, in time slices, never for the whole rollout.

A host that breaks the channel protocol is killed; its episodes become error episodes naming why, and
the tenant's next rollout starts a fresh host.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import queue
import socket
import threading
from typing import Any

from tinkerless.errors import UserError
from tinkerless.functions.hosting.agent_channel_server import ChannelServer
from tinkerless.functions.hosting.agent_functions import PolicyBackend, _Copy, _episode, endpoint_app, make_copies
from tinkerless.functions.sampling.slicing import slice_due, yield_slice
from tinkerless.functions.hosting.user_code import HostedCodeError, HostedFunction
from tinkerless.functions.hosting.user_code_protocol import HostRequest
from tinkerless.envs.decorators import AgentResult, agent_reward
from tinkerless.wire.messages import Episode, EpisodeLimits, SamplingParams

HOST_MARGIN_SECONDS = 60.0  # past agent_timeout, for the host's own start and imports, before it is killed
EXTRA_REQUESTS_PER_COPY = 16  # the request budget: copies x (max_turns + this), e.g. /v1/models lookups
IDLE_POLL_SECONDS = 0.02


class ModelThread(concurrent.futures.Executor):
    """An executor whose work (the rollout's generate calls) runs on the thread that calls `serve()`.

    That thread is the scheduler's job thread, with its slice host: generation pauses for other
    tenants at the batcher's safe points, and while no call is waiting `serve` yields the turn when
    the slice is up and others wait, instead of holding the model idle.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.calls = 0
        self.idle_yields = 0  # turns given to other calls while the copies were not generating (a statistic)

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((future, fn, args, kwargs))
        return future

    def finish(self) -> None:
        self._queue.put(None)

    def serve(self) -> None:
        """Run submitted calls until `finish()`; calls still queued then are cancelled."""
        while True:
            try:
                item = self._queue.get(timeout=IDLE_POLL_SECONDS)
            except queue.Empty:
                if slice_due():
                    self.idle_yields += 1
                    yield_slice()
                continue
            if item is None:
                break
            future, fn, args, kwargs = item
            if future.set_running_or_notify_cancel():
                self.calls += 1
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as exc:  # noqa: BLE001 - delivered to the copy that asked
                    future.set_exception(exc)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item[0].cancel()


def run_hosted_agent_episodes(
    engine: Any, tokenizer: Any, *, agent: HostedFunction, policy: str | None, tasks: list[dict], group_size: int,
    sampling: SamplingParams, limits: EpisodeLimits, seed: int, timeout: float, vision: Any = None,
) -> tuple[list[Episode], dict]:
    """Like `run_agent_episodes`, with the copies in `agent`'s sandboxed host; the episodes and statistics.
    With `vision` (a VLM's runtime) the copies' calls may carry images (`image_url` data URLs in the request
    bodies, within the channel's MAX_BODY_BYTES), sampled and recorded as in-process."""
    if not isinstance(agent, HostedFunction):
        raise UserError(f"the agent is a {type(agent).__name__}, not a function",
                        hint="decorate an `async def agent(client, task)` function with @tinkerless.agent")
    copies = make_copies(tokenizer, tasks, group_size, seed)
    model = ModelThread()
    backend = PolicyBackend(engine, tokenizer, policy=policy, sampling=sampling, limits=limits,
                            copies={c.episode_id: c for c in copies}, executor=model, vision=vision)
    result: dict[str, Any] = {}

    def drive() -> None:
        try:
            result.update(asyncio.run(_drive(agent, copies, backend, limits, timeout)))
        except BaseException as exc:  # noqa: BLE001 - re-raised on the job thread
            result["crash"] = exc
        finally:
            model.finish()

    thread = threading.Thread(target=drive, name="hosted-agents", daemon=True)
    thread.start()
    model.serve()
    thread.join()
    if "crash" in result:
        raise result["crash"]
    _settle(copies, result, str(getattr(agent, "__qualname__", "agent"))[:200])
    stats = {"agent_requests": float(result["requests"]), "agent_generate_calls": float(model.calls),
             "agent_idle_yields": float(model.idle_yields)}
    return [_episode(c, tokenizer) for c in copies], stats


async def _drive(agent: HostedFunction, copies: list[_Copy], backend: PolicyBackend, limits: EpisodeLimits,
                 timeout: float) -> dict:
    """Serve the channel while the host plays the copies; what the host answered and what the channel saw."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    host = agent.host
    server = ChannelServer(ours, endpoint_app(backend), keys={c.episode_id for c in copies},
                           budget=len(copies) * (limits.max_turns + EXTRA_REQUESTS_PER_COPY),
                           on_done=lambda key: backend.gather.agent_done(), on_violation=lambda reason: host.kill())
    serving = asyncio.create_task(server.serve())
    request = HostRequest("agents", handle=agent.handle, args=[[c.task for c in copies], [c.episode_id for c in copies]],
                          kwargs={"timeout": float(timeout)})
    outcomes, failure, trace, cause = None, None, None, None
    try:
        reply = await asyncio.get_running_loop().run_in_executor(
            None, lambda: host.request(request, timeout=timeout + HOST_MARGIN_SECONDS, channel=theirs))
        outcomes = reply.value
    except HostedCodeError as exc:
        failure, trace = f"{exc.message}" + (f" ({exc.hint})" if exc.hint else ""), exc.traceback
        cause = "hosted_agent_died" if exc.infra_cause == "sandbox_died" else exc.infra_cause
    finally:
        theirs.close()
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
    if server.failure is not None:  # the channel killed the host: that is the reason, not "the host died"
        failure, trace, cause = server.failure, None, None
    elif failure is None and not _well_formed(outcomes, len(copies)):
        host.kill()
        failure = "the agent's sandbox answered the rollout with malformed outcomes; it was stopped"
    return {"outcomes": outcomes, "failure": failure, "traceback": trace, "infra_cause": cause, "over_budget": server.over_budget,
            "requests": server.requests}


def _well_formed(outcomes: Any, count: int) -> bool:
    return (isinstance(outcomes, list) and len(outcomes) == count
            and all(isinstance(o, dict) and {"reward", "metrics", "error", "traceback"} <= set(o) for o in outcomes))


def _settle(copies: list[_Copy], result: dict, name: str) -> None:
    """Each copy's outcome, checked again here (the sandbox could send anything a well-formed frame holds)."""
    for i, run in enumerate(copies):
        if result["failure"] is not None:
            run.error, run.traceback, run.infra_cause = result["failure"], result["traceback"], result["infra_cause"]
            continue
        if run.episode_id in result["over_budget"]:
            run.error = ("the agent made more requests than this rollout allows (copies x (max_turns + "
                         f"{EXTRA_REQUESTS_PER_COPY})); its episode is dropped")
            continue
        outcome = result["outcomes"][i]
        if outcome["error"] is not None:
            run.settle({"error": str(outcome["error"])[:2000], "traceback": str(outcome["traceback"] or "")[-8000:],
                        "infra_cause": outcome.get("infra_cause")})
            continue
        try:  # the same checks as in the sandbox: a finite number, metrics a dict of name -> finite number
            run.reward, run.metrics = agent_reward(AgentResult(reward=outcome["reward"], metrics=outcome["metrics"]), name)
        except Exception as exc:  # noqa: BLE001 - not a reward: the episode is an error, like in-process
            run.reward, run.error = math.nan, f"{name}: {type(exc).__name__}: {exc}"[:2000]


__all__ = ["ModelThread", "run_hosted_agent_episodes"]
