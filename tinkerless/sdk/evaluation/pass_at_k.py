"""pass@k: the chance that at least one of k attempts at a task passes, estimated from n >= k samples.

The unbiased estimator (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"):
with c of n samples passing, pass@k = 1 - C(n-c, k) / C(n, k), averaged over tasks. Sampling k
and checking "any passed" would be noisier; this uses every one of the n samples.

What "pass" means is the caller's (`PassRule`): an episode passes when its reward is above 0 by
default, or at least a threshold given with `--pass-threshold`. An episode that failed with an
error is an attempt that did not pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from tinkerless.errors import ConfigError


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one task with `c` passing samples out of `n` (0 <= c <= n, 1 <= k <= n)."""
    for name, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"pass@k needs whole numbers; {name} is {value!r}")
    if not (0 <= c <= n and 1 <= k <= n):
        raise ConfigError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}",
                          hint="draw at least k samples per task (--samples)")
    if n - c < k:  # every k-subset holds a passing sample
        return 1.0
    # 1 - C(n-c, k) / C(n, k) as a product: no huge binomials, no cancellation.
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def mean_pass_at_k(counts: Iterable[tuple[int, int]], k: int) -> float:
    """pass@k averaged over tasks, from each task's (n, c)."""
    values = [pass_at_k(n, c, k) for n, c in counts]
    return sum(values) / len(values) if values else math.nan


@dataclass(frozen=True)
class PassRule:
    """When an episode counts as passed: reward >= `threshold`, or reward > 0 when there is none."""

    threshold: float | None = None

    def __post_init__(self) -> None:
        t = self.threshold
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t)):
            raise ConfigError(f"pass threshold must be a finite number, got {t!r}", hint="e.g. --pass-threshold 1.0")

    def passed(self, reward: float, errored: bool = False) -> bool:
        if errored or not math.isfinite(reward):
            return False
        return reward > 0 if self.threshold is None else reward >= self.threshold

    def describe(self) -> str:
        return "reward > 0" if self.threshold is None else f"reward >= {self.threshold:g}"
