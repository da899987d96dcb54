"""The environment protocol user envs follow, and the `StepResult` they return.

An env is a class with:
- `reset(**task) -> str`: start an episode, return the first observation;
- `step(action: str) -> StepResult`: react to the model's text;
- optional `system_prompt() -> str` and `initial_user_message() -> str`.
A fresh instance is made per episode, so envs may keep per-episode state on `self`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tinkerless.errors import EnvError, RewardError


@dataclass
class StepResult:
    observation: str | None = None
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)


def as_step_result(value: Any, env_name: str) -> StepResult:
    """Accept a StepResult, or a (observation, reward, done[, info]) tuple."""
    if isinstance(value, StepResult):
        result = value
    elif isinstance(value, tuple) and len(value) in (3, 4):
        result = StepResult(*value)
    else:
        raise EnvError(
            f"{env_name}.step returned {type(value).__name__}, not a StepResult",
            hint="return tinkerless.StepResult(observation=..., reward=..., done=...)",
        )
    result.reward = check_reward(result.reward, f"{env_name}.step")
    return result


def check_reward(value: Any, source: str) -> float:
    """A reward must be a finite real number; anything else is a user error that names the source."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise RewardError(
            f"{source} returned {value!r} ({type(value).__name__}), not a number",
            hint="return a float reward",
        )
    number = float(value)
    if not math.isfinite(number):
        raise RewardError(
            f"{source} returned {number}, which is not a finite number",
            hint="guard divisions and logs in the reward; return 0.0 for undefined cases",
        )
    return number


@dataclass
class MultiStepResult:
    """What a multi-agent env's `step(agent, action)` returns.

    `rewards` maps role -> reward earned at this step (an invalid-move penalty,
    the terminal zero-sum outcome, ...). Roles not named get 0.
    """

    rewards: dict[str, float] = field(default_factory=dict)
    done: bool = False
    info: dict = field(default_factory=dict)


def is_multi_agent(env_cls: Any) -> bool:
    """A multi-agent env declares its roles in `agents` and whose turn it is with `turn()`."""
    return bool(getattr(env_cls, "agents", None)) and callable(getattr(env_cls, "turn", None))
