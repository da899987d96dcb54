"""Agents in another process or language: the capture endpoint of a rollout.

`tinkerless.external_agent(["node", "agent.js"])` is an agent function whose body is an external program. Each
episode copy starts the program with the rollout's endpoint in its environment:

    OPENAI_BASE_URL     http://127.0.0.1:<port>/v1   (Chat Completions, Responses)
    ANTHROPIC_BASE_URL  http://127.0.0.1:<port>      (Messages: the Anthropic SDK adds /v1/messages)
    TINKERLESS_API_KEY  the episode's secret key (also OPENAI_API_KEY and ANTHROPIC_API_KEY)
    TINKERLESS_TASK     the task, as JSON
    TINKERLESS_REWARD_URL  where the program posts its reward: POST {"reward": r, "metrics": {...}} with the key

The endpoint is the rollout's own loopback server (`agent_transport="http"`, chosen for it): every call the program
makes through any of the three APIs is recorded into its episode under the same proof as an in-process agent's
(`recording.prove_tokens`), with the same keys, limits (`max_turns`, `max_episode_tokens`) and `agent_timeout`
(past it the program is killed and the episode dropped as an error). A program that exits without posting a reward,
exits non-zero, or posts a second one ends its episode as an error with its stderr.

Shared multi-tenant servers run agents in the tenant's sandbox, where no program of the tenant's may listen or be
reached on the worker's loopback: external agents run only in the worker's own process (`backend="local"`,
`tinkerless serve --single-user`).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import threading
from typing import Any, Sequence

from fastapi import Request

from tinkerless.envs.decorators import AgentResult
from tinkerless.errors import UserCodeError

_posted: dict[str, tuple[float, dict[str, float]]] = {}  # episode key -> (reward, metrics), until the copy reads it
_lock = threading.Lock()
STDERR_TAIL = 2000


def external_agent(command: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | None = None):
    """An agent function that runs `command` once per episode copy (see the module docstring)."""
    if not command or not all(isinstance(part, str) for part in command):
        raise UserCodeError(f"external_agent takes a command as a list of strings, got {command!r}",
                            hint='external_agent(["node", "agent.js"])')
    command, extra = list(command), dict(env or {})

    async def external(client, task: dict):
        base = str(client.base_url).rstrip("/")
        if not base.startswith("http://127.0.0.1"):
            raise UserCodeError("an external agent needs the rollout's loopback endpoint, not " + base[:80],
                                hint="run it with backend='local' or `tinkerless serve --single-user`")
        key = client.api_key
        variables = {**os.environ, **extra, "OPENAI_BASE_URL": base, "OPENAI_API_KEY": key,
                     "ANTHROPIC_BASE_URL": base.removesuffix("/v1"), "ANTHROPIC_API_KEY": key,
                     "TINKERLESS_API_KEY": key, "TINKERLESS_TASK": json.dumps(task),
                     "TINKERLESS_REWARD_URL": f"{base}/episode/reward"}
        process = await asyncio.create_subprocess_exec(*command, env=variables, cwd=cwd,
                                                       stdout=asyncio.subprocess.DEVNULL,
                                                       stderr=asyncio.subprocess.PIPE, start_new_session=True)
        try:
            _, stderr = await process.communicate()
        except BaseException:  # agent_timeout (a cancellation) or the rollout ending: the program goes too,
            try:  # with every process it started (its own process group)
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await process.wait()
            _take(key)
            raise
        posted = _take(key)
        tail = stderr.decode(errors="replace")[-STDERR_TAIL:]
        if process.returncode != 0:
            raise RuntimeError(f"{command[0]} exited with status {process.returncode}: {tail}")
        if posted is None:
            raise RuntimeError(f"{command[0]} exited without posting a reward to TINKERLESS_REWARD_URL: {tail}")
        return AgentResult(reward=posted[0], metrics=posted[1])

    external.__qualname__ = external.__name__ = f"external_agent({command[0]})"
    external.__tinkerless_agent__ = True
    external.__tinkerless_loopback__ = True  # run_agent_episodes serves its endpoint over loopback HTTP
    return external


def _take(key: str) -> tuple[float, dict[str, float]] | None:
    with _lock:
        return _posted.pop(key, None)


def reward_router(backend: Any, caller):
    """`POST /v1/episode/reward` on a rollout's endpoint: an external agent's reward, by its episode key."""
    from fastapi import APIRouter
    from fastapi.responses import JSONResponse

    from tinkerless.functions.openai_api.backend import OpenAIError
    from tinkerless.functions.openai_api.router import error_response

    router = APIRouter()

    @router.post("/v1/episode/reward")
    async def post_reward(request: Request):
        try:
            key = caller(request)
            if key is None or key not in getattr(backend, "copies", {}):
                raise OpenAIError("this API key is not an episode of the running rollout", status=401,
                                  code="invalid_api_key", hint="send TINKERLESS_API_KEY as the bearer token")
            try:
                body = json.loads(await request.body())
            except (ValueError, UnicodeDecodeError):
                raise OpenAIError("the body must be JSON: {\"reward\": number, \"metrics\": {...}}",
                                  code="invalid_json") from None
            reward = body.get("reward") if isinstance(body, dict) else None
            metrics = body.get("metrics") or {} if isinstance(body, dict) else {}
            if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
                raise OpenAIError("reward must be a finite number", param="reward")
            if not isinstance(metrics, dict) or not all(
                    isinstance(k, str) and not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
                    for k, v in metrics.items()):
                raise OpenAIError("metrics must map names to finite numbers", param="metrics")
            with _lock:
                if key in _posted:
                    raise OpenAIError("this episode's reward was already posted", status=409, code="already_posted")
                _posted[key] = (float(reward), {k: float(v) for k, v in metrics.items()})
        except Exception as exc:  # noqa: BLE001 - every failure answers an OpenAI error body
            return error_response(exc)
        return JSONResponse({"ok": True})

    return router
