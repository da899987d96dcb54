"""Warnings a run's metrics call for (`sdk/run/step_warnings.py`): each said once per run, naming what to change."""

from __future__ import annotations

import pytest

from tinkerless.sdk.config import TrainConfig
from tinkerless.sdk.run.step_warnings import STALE_GAP_NATS, StepWarnings, stale_gap_warning


def record(step: int, gap: float | None = None, truncated: float = 0.0) -> dict:
    out = {"step": step, "episodes": 8, "episodes_truncated_frac": truncated,
           "episodes_truncated_by_turns": int(8 * truncated), "episodes_truncated_by_tokens": 0}
    if gap is not None:
        out["logprob_gap"] = gap
    return out


def test_an_async_run_without_tis_cap_is_told_when_its_sampler_drifts():
    config = TrainConfig(max_staleness=2)
    message = stale_gap_warning(record(12, gap=0.8), config)
    assert message is not None
    for words in ("step 12", "0.80 nats", "max_staleness=2", "tis_cap=2.0", "docs/async.md"):
        assert words in message


@pytest.mark.parametrize("config, gap", [
    (TrainConfig(max_staleness=0), 0.9),  # synchronous: a gap is numerics, TIS's own business (docs/performance.md)
    (TrainConfig(max_staleness=2, tis_cap=2.0), 0.9),  # already capped
    (TrainConfig(max_staleness=1), STALE_GAP_NATS),  # at the threshold, not over it
    (TrainConfig(max_staleness=1), None),  # a step with nothing trained has no gap
    (TrainConfig(max_staleness=1), float("nan")),  # or a NaN one
])
def test_no_staleness_warning_where_nothing_is_unbounded_or_drifting(config, gap):
    assert stale_gap_warning(record(3, gap=gap), config) is None


def test_each_kind_is_said_once_per_run_and_kinds_do_not_hide_each_other():
    warnings = StepWarnings(TrainConfig(max_staleness=1, max_turns=4))
    assert warnings.check(record(0, gap=0.01)) is None
    first = warnings.check(record(1, gap=0.9, truncated=1.0))
    assert "cut off" in first and "tis_cap" in first  # both, in one metrics line
    assert warnings.check(record(2, gap=0.9, truncated=1.0)) is None  # neither again
    warnings = StepWarnings(TrainConfig(max_staleness=1, max_turns=4))
    assert "cut off" in warnings.check(record(0, truncated=1.0))
    assert "tis_cap" in warnings.check(record(1, gap=0.9, truncated=1.0))  # the other kind still gets said once
