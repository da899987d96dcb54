"""A run's own budget: `TrainConfig.max_cost_usd` and `max_compute_seconds`, checked between steps.

A step is never cut in half: after each step (and before the first step of an attempt) the run asks whether the
next step still fits, expecting it to cost as much as the costliest step so far. When it does not, the run
saves a checkpoint of the step it reached and stops with `BudgetExceeded` (marked `interrupted`). Raise the
limit and resume: the run goes on from that checkpoint exactly as if it had never stopped (a resume is exact,
docs/errors.md). What earlier attempts used counts (`RunUsage` carries it over a resume).
"""

from __future__ import annotations

import math

from tinkerless.errors import BudgetExceeded, ConfigError
from tinkerless.sdk.run.accounting import RunUsage, seconds_total

MAX_LIMIT = 1e9


def check_limit(name: str, value: object) -> None:
    """None, or a finite number in (0, 1e9]; NaN, negatives, strings and the like are refused."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 < value <= MAX_LIMIT:
        raise ConfigError(f"{name} must be a number above 0 and at most {MAX_LIMIT:.0e}, or None, got {value!r}",
                          hint=f"e.g. {name}=5.0; None for no limit")


class RunBudget:
    def __init__(self, max_cost_usd: float | None, max_compute_seconds: float | None, usage: RunUsage, *,
                 step: int = 0):
        self.max_cost_usd, self.max_compute_seconds, self.usage = max_cost_usd, max_compute_seconds, usage
        # A resumed run expects its next step to cost what its earlier steps did on average.
        prior = seconds_total(usage.prior)
        self.step_seconds = prior / step if step and prior else 0.0
        self._last_total = usage.total_seconds()

    @property
    def limited(self) -> bool:
        return self.max_cost_usd is not None or self.max_compute_seconds is not None

    def step_done(self, run_id: str, step: int, steps: int) -> bool:
        """Note the step that just ended (the costliest step so far is what the next one is expected to cost);
        True when the run must stop before step `step`, so its checkpoint is saved now."""
        total = self.usage.total_seconds()
        self.step_seconds = max(self.step_seconds, total - self._last_total)
        self._last_total = total
        return self.stop_reason(run_id, step, steps) is not None

    def stop_reason(self, run_id: str, step: int, steps: int) -> str | None:
        """Why the run must stop before step `step` (None when the next step fits)."""
        if not self.limited or step >= steps:
            return None
        seconds = self.usage.total_seconds()
        if self.max_compute_seconds is not None and seconds + self.step_seconds > self.max_compute_seconds:
            return (f"run {run_id} stopped before step {step} of {steps}: it used {seconds:.1f} compute-seconds of its "
                    f"max_compute_seconds={self.max_compute_seconds:g}, and a step takes up to {self.step_seconds:.1f}")
        if self.max_cost_usd is not None:
            cost = self.usage.cost_usd()
            if cost is None:
                raise ConfigError(
                    f"max_cost_usd={self.max_cost_usd:g} needs a price for the device {self.usage.device!r}",
                    hint="set TrainConfig(prices={'<device>': dollars_per_hour}) or price_per_hour=..., or use "
                    "max_compute_seconds",
                )
            rate = self.usage.prices.per_hour(self.usage.device) or 0.0
            next_cost = self.step_seconds * rate / 3600.0
            if cost + next_cost > self.max_cost_usd:
                return (f"run {run_id} stopped before step {step} of {steps}: it spent ${cost:.4f} of its "
                        f"max_cost_usd=${self.max_cost_usd:g}, and a step costs up to ${next_cost:.4f}")
        return None


def stopped(reason: str, run_id: str, checkpoint_step: int | None) -> BudgetExceeded:
    saved = f"; its checkpoint of step {checkpoint_step} is saved" if checkpoint_step is not None else ""
    return BudgetExceeded(
        reason + saved,
        hint=f"raise the limit and resume: train(config, resume=True, run_id={run_id!r}, max_cost_usd=...) or "
        f"`tinkerless train CONFIG --resume --run-id {run_id}` with the config's limit raised; it goes on exactly "
        "where it stopped",
    )
