"""`@tinkerless.env`, `@tinkerless.reward` and `@tinkerless.agent`: mark user code and check its shape early.

The decorators return the class or function unchanged (plus a marker), so
user code stays plain Python that can be unit-tested without tinkerless.
Checks run at decoration time so mistakes surface on the laptop, not on a GPU.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from tinkerless.errors import UserCodeError

T = TypeVar("T")


def env(cls: type[T]) -> type[T]:
    """Mark a class as an environment: `reset(**task) -> str`, `step(action) -> StepResult`."""
    if not inspect.isclass(cls):
        raise UserCodeError(
            f"@tinkerless.env decorates a class, got {type(cls).__name__} {cls!r}",
            hint="define `class MyEnv:` with reset(**task) and step(action) methods",
        )
    for method in ("reset", "step"):
        if not callable(getattr(cls, method, None)):
            raise UserCodeError(
                f"environment {cls.__qualname__} has no {method}() method",
                hint="an env needs reset(**task) -> str and step(action: str) -> StepResult",
            )
    try:
        cls()
    except TypeError as exc:
        raise UserCodeError(
            f"environment {cls.__qualname__} cannot be created with no arguments: {exc}",
            hint="a fresh env is made per episode with `Env()`; pass per-episode data through the task dict to reset()",
        ) from exc
    cls.__tinkerless_env__ = True  # type: ignore[attr-defined]
    return cls


def reward(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark `fn(completion_or_transcript, task) -> float` as a reward function."""
    if not callable(fn):
        raise UserCodeError(f"@tinkerless.reward decorates a function, got {fn!r}")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError as exc:
        raise UserCodeError(
            f"reward {getattr(fn, '__qualname__', fn)!r} must accept (completion, task): {exc}",
            hint="def my_reward(completion: str, task: dict) -> float",
        ) from exc
    except ValueError:
        pass  # builtins without a signature: trust them
    fn.__tinkerless_reward__ = True  # type: ignore[attr-defined]
    return fn


@dataclass
class AgentResult:
    """What an `@tinkerless.agent` may return instead of a bare float: the reward plus metrics of its own
    (numbers, averaged per step into metrics.jsonl as `agent/<name>`)."""

    reward: float
    metrics: dict[str, float] = field(default_factory=dict)


def agent(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark `async def solve(client: openai.AsyncOpenAI, task: dict) -> float | AgentResult` as an agent.

    In training, each copy gets a client whose endpoint samples from the current policy and records
    every completion's tokens (docs/agents.md); outside training the same function runs against any
    OpenAI-compatible server (`tinkerless eval FILE --endpoint URL --model NAME`).
    """
    target = inspect.unwrap(fn) if callable(fn) else fn
    if not inspect.iscoroutinefunction(target):
        raise UserCodeError(
            f"@tinkerless.agent decorates an async function, got {getattr(fn, '__qualname__', fn)!r}",
            hint="async def solve(client: openai.AsyncOpenAI, task: dict) -> float",
        )
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError as exc:
        raise UserCodeError(
            f"agent {fn.__qualname__!r} must accept (client, task): {exc}",
            hint="async def solve(client: openai.AsyncOpenAI, task: dict) -> float",
        ) from exc
    fn.__tinkerless_agent__ = True  # type: ignore[attr-defined]
    return fn


def agent_reward(value: Any, name: str) -> tuple[float, dict[str, float]]:
    """The reward and metrics an agent returned (a number or an AgentResult); RewardError for anything else."""
    from tinkerless.envs.base import check_reward
    from tinkerless.errors import RewardError

    if isinstance(value, AgentResult):
        metrics = getattr(value, "metrics", None) or {}
        if not isinstance(metrics, dict) or not all(isinstance(k, str) for k in metrics):
            raise RewardError(f"{name} returned AgentResult.metrics={metrics!r}, not a dict of name -> number",
                              hint="AgentResult(reward=1.0, metrics={'tool_calls': 2})")
        return check_reward(value.reward, name), {k: check_reward(v, f"{name} metric {k!r}") for k, v in metrics.items()}
    if value is None:
        raise RewardError(f"{name} returned None, not a reward",
                          hint="end the agent with `return reward` (a float) or `return tinkerless.AgentResult(reward=...)`")
    return check_reward(value, name), {}
