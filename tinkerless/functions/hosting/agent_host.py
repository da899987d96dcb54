"""Playing agent copies: one copy's outcome (both paths), and a whole sandboxed rollout (inside the sandbox).

`play_copy` is what the in-process path (`agent_functions._play`) and the sandboxed path share: run the
agent with its client and task under `agent_timeout`, and turn what it returned or raised into
(reward, metrics, error, traceback), so a copy ends the same way wherever it ran.

`run_agents` runs inside a tenant's sandboxed host (`user_code_host.py`, op "agents"): every copy of a
rollout as tasks of one asyncio loop, each with an `openai.AsyncOpenAI` client whose transport is the
rollout's model channel (`agent_channel.ChannelTransport`) and whose API key is the copy's secret key.
It imports nothing heavy: no torch in the sandbox.
"""

from __future__ import annotations

import asyncio
import copy
import socket
import traceback as tb
from typing import Any, Callable

from tinkerless.errors import TinkerlessError, infra_cause
from tinkerless.envs.decorators import agent_reward

BASE_URL = "http://tinkerless-worker/v1"  # never resolved: the transport carries every request


async def play_copy(agent: Callable, client: Any, task: dict, timeout: float) -> dict:
    """{"reward", "metrics", "error", "traceback", "infra_cause"} of one agent copy; its own failure ends only its
    episode. `infra_cause` is set when the agent raised an `InfrastructureFailure` (a service it needed failed)."""
    name = getattr(agent, "__qualname__", "agent")
    cause = None
    try:
        value = await asyncio.wait_for(agent(client, copy.deepcopy(task)), timeout)
        reward, metrics = agent_reward(value, name)
        return {"reward": reward, "metrics": metrics, "error": None, "traceback": None, "infra_cause": None}
    except asyncio.TimeoutError as exc:
        error, trace = f"{name}: timed out after agent_timeout={timeout:g} s", "".join(tb.format_exception(exc))
    except TinkerlessError as exc:
        error, trace, cause = f"{name}: {type(exc).__name__}: {exc.message}", tb.format_exc(), infra_cause(exc)
    except Exception as exc:  # noqa: BLE001 - the agent's own failure ends only its episode
        error, trace = f"{name}: {type(exc).__name__}: {exc}", tb.format_exc()
    return {"reward": None, "metrics": {}, "error": error, "traceback": trace, "infra_cause": cause}


def run_agents(agent: Callable, channel: socket.socket, tasks: list[dict], keys: list[str], timeout: float) -> list[dict]:
    """Copy i plays tasks[i] with key keys[i]; one outcome (see `play_copy`) per copy, in order."""
    return asyncio.run(_run(agent, channel, tasks, keys, timeout))


async def _run(agent: Callable, channel: socket.socket, tasks: list[dict], keys: list[str], timeout: float) -> list[dict]:
    import httpx
    import openai

    from tinkerless.functions.hosting.agent_channel import ChannelTransport
    from tinkerless.functions.hosting.clients import register

    transport = ChannelTransport(channel)
    http_client = httpx.AsyncClient(transport=transport, timeout=timeout)

    async def play(task: dict, key: str) -> dict:
        client = openai.AsyncOpenAI(api_key=key, base_url=BASE_URL, http_client=http_client, max_retries=0)
        register(client, http_client)  # tinkerless.anthropic_client(client) sends through the channel too
        try:
            return await play_copy(agent, client, task, timeout)
        finally:
            await transport.done(key)

    try:
        return list(await asyncio.gather(*(play(t, k) for t, k in zip(tasks, keys))))
    finally:
        await http_client.aclose()


__all__ = ["BASE_URL", "play_copy", "run_agents"]
