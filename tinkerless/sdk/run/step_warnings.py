"""Warnings a run's own metrics call for, each said once per run: on the console and in that step's metrics line.

- Episodes cut off by the turn or token limits (`truncation`).
- An async run (`max_staleness` ≥ 1) without `tis_cap` whose sampler and trainer disagree by a lot: the loss's
  importance weights exp(trainer − sampler) are unbounded then, and a stale step can move the policy far (one
  seed of the main job at k = 2 fell from a reward of 0.62 to 0.03 as its gap rose to 1 nat; docs/async.md).
"""

from __future__ import annotations

import math

from tinkerless.sdk.config import TrainConfig
from tinkerless.sdk.run import truncation

# Mean |sampler − trainer| log-prob per trained token above which an async run without tis_cap is warned. In the
# async bench the main job's k = 1 runs stay near 0.1 nats; the k = 2 run that fell apart first passed 0.5 nats at
# step 4, and was at 0.8-1.0 nats over the steps its reward fell.
STALE_GAP_NATS = 0.5


def stale_gap_warning(record: dict, config: TrainConfig) -> str | None:
    gap = record.get("logprob_gap")  # the mean over the step's trained policies; NaN: nothing trained
    if config.max_staleness < 1 or config.tis_cap is not None or not isinstance(gap, float) or not math.isfinite(gap):
        return None
    if gap <= STALE_GAP_NATS:
        return None
    return (
        f"warning: at step {record['step']} the sampler's and the trainer's log-probs of the trained tokens differ by "
        f"{gap:.2f} nats a token (logprob_gap), with max_staleness={config.max_staleness} and no tis_cap: the loss weights "
        "each token by exp(trainer - sampler), unbounded, and a stale step can derail the run. Lower max_staleness or "
        "learning_rate, or set tis_cap=2.0 to bound the weights (docs/async.md). (Said once per run.)"
    )


class StepWarnings:
    """Each kind of warning at most once per run."""

    def __init__(self, config: TrainConfig):
        self.config = config
        self.said: set[str] = set()

    def check(self, record: dict) -> str | None:
        """The warnings `record` calls for that this run has not said yet, as one message (None: none)."""
        found = {
            "truncation": truncation.warning(record, self.config) if truncation.warrants_warning(record) else None,
            "staleness": stale_gap_warning(record, self.config),
        }
        new = {kind: message for kind, message in found.items() if message and kind not in self.said}
        self.said.update(new)
        return "\n".join(new.values()) or None
