"""`@tinkerless.env` and `@tinkerless.reward`: mark user code and check its shape early.

The decorators return the class or function unchanged (plus a marker), so
user code stays plain Python that can be unit-tested without tinkerless.
Checks run at decoration time so mistakes surface on the laptop, not on a GPU.
"""

from __future__ import annotations

import inspect
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
