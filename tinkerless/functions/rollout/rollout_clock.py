"""Where a rollout's seconds go: generation, the env's own code, encoding prompts and decoding samples.

The worker opens a `RolloutClock` around a rollout; the agent loop and the chat format mark their
parts with `measure("env")`, `measure("encode")`, ... . Outside an open clock `measure` costs a
context-variable read and records nothing, so the same code runs unmeasured elsewhere. Parts nest
exclusively: time inside an inner part (a prompt encoded while the env runs) counts for the inner
part only, so the parts never add up to more than the rollout.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections import defaultdict
from typing import Iterator

PARTS = ("generate", "env", "encode", "decode")

_clock: contextvars.ContextVar["RolloutClock | None"] = contextvars.ContextVar("tinkerless_rollout_clock", default=None)


class RolloutClock:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._stack: list[tuple[str, float]] = []

    def as_stats(self) -> dict[str, float]:
        """Seconds per part, as rollout stats: {"generate_s": ..., "env_s": ..., "encode_s": ..., "decode_s": ...}."""
        return {f"{part}_s": float(self.seconds.get(part, 0.0)) for part in PARTS}

    def _enter(self, part: str) -> None:
        now = time.perf_counter()
        if self._stack:  # pause the enclosing part
            outer, since = self._stack[-1]
            self.seconds[outer] += now - since
        self._stack.append((part, now))

    def _exit(self) -> None:
        now = time.perf_counter()
        part, since = self._stack.pop()
        self.seconds[part] += now - since
        if self._stack:  # resume the enclosing part
            outer, _ = self._stack[-1]
            self._stack[-1] = (outer, now)


@contextlib.contextmanager
def rollout_clock() -> Iterator[RolloutClock]:
    """Measure the rollout run in this block (this thread or task, and what it calls)."""
    clock = RolloutClock()
    token = _clock.set(clock)
    try:
        yield clock
    finally:
        _clock.reset(token)


@contextlib.contextmanager
def measure(part: str) -> Iterator[None]:
    clock = _clock.get()
    if clock is None:
        yield
        return
    clock._enter(part)
    try:
        yield
    finally:
        clock._exit()


class TimedEngine:
    """An engine whose `generate` calls count as "generate" (everything else passes through)."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def generate(self, *args, **kwargs):
        with measure("generate"):
            return self._engine.generate(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._engine, name)
