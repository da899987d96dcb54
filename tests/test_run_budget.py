"""A run's own budget (max_cost_usd, max_compute_seconds): it stops before a step that would not fit, with a
checkpoint, and once the limit is raised it resumes to exactly the run that never stopped."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
from safetensors.torch import load as load_safetensors

import tinkerless
from tinkerless.errors import BudgetExceeded, ConfigError

STEPS = 5
PRICE = 3600.0  # $ per hour: one compute-second costs $1


@tinkerless.reward
def vowels(completion, task):
    time.sleep(0.05)  # a step's cost is mostly this (8 episodes): steady from run to run, unlike a warm-up
    return sum(c in "aeiou" for c in completion) / max(len(completion), 1)


def _train(tiny_model: str, storage: Path, **overrides):
    settings = dict(model=tiny_model, reward=vowels, tasks=lambda rng: {"prompt": "say " + str(rng.randint(0, 99))},
                    steps=STEPS, batch_size=2, group_size=4, max_tokens=6, temperature=1.0, learning_rate=1e-2,
                    checkpoint_every=STEPS, keep_checkpoints=None, seed=5, storage=str(storage), progress=False,
                    run_id="b", price_per_hour=PRICE)
    settings.update(overrides)
    return tinkerless.train(**settings)


def _adapter(storage: Path, step: int) -> dict:
    return load_safetensors((storage / f"runs/b/checkpoints/step-{step}/adapter/adapter_model.safetensors").read_bytes())


def _metrics(storage: Path) -> list[dict]:
    return [json.loads(line) for line in (storage / "runs/b/metrics.jsonl").read_text().splitlines()]


def test_a_run_stopped_by_its_budget_resumes_to_the_run_that_never_stopped(tiny_model, tmp_path):
    straight = _train(tiny_model, tmp_path / "straight")
    # A budget that runs out after about two steps of the same run (this one is warm: it may get further).
    limit = straight.metrics[1]["cost_usd"]
    stopped = tmp_path / "stopped"
    with pytest.raises(BudgetExceeded) as caught:
        _train(tiny_model, stopped, max_cost_usd=limit)
    at = json.loads((stopped / "runs/b/checkpoints/latest").read_text())["step"]
    assert 1 <= at < STEPS and f"stopped before step {at} of {STEPS}" in caught.value.message
    assert f"of its max_cost_usd=${limit:g}" in caught.value.message and "resume" in caught.value.hint
    assert f"checkpoint of step {at} is saved" in caught.value.message
    assert [m["step"] for m in _metrics(stopped)] == list(range(at))
    assert json.loads((stopped / "runs/b/state.json").read_text())["status"] == "interrupted"
    spent = _metrics(stopped)[-1]["cost_usd"]
    assert spent <= limit  # it stopped before the step that would not fit, not after it

    # Resumed without raising the limit: refused again before any work.
    with pytest.raises(BudgetExceeded):
        _train(tiny_model, stopped, max_cost_usd=spent, resume=True)
    assert len(_metrics(stopped)) == at

    resumed = _train(tiny_model, stopped, max_cost_usd=1e6, resume=True)
    expected, actual = _adapter(tmp_path / "straight", STEPS), _adapter(stopped, STEPS)
    assert expected.keys() == actual.keys() and expected
    for name in expected:
        assert (expected[name] == actual[name]).all(), f"{name} differs from the run that never stopped"
    assert [m["reward_mean"] for m in resumed.metrics] == [m["reward_mean"] for m in straight.metrics]
    assert [m["step"] for m in resumed.metrics] == list(range(STEPS))
    assert resumed.usage["cost_usd"] > spent  # the attempts' costs add up


def test_a_compute_seconds_budget_stops_the_run_too(tiny_model, tmp_path):
    with pytest.raises(BudgetExceeded, match="max_compute_seconds=1e-06"):
        _train(tiny_model, tmp_path, max_compute_seconds=1e-6, steps=2)


def test_a_dollar_budget_on_a_free_device_never_stops_the_run(tiny_model, tmp_path):
    # The local CPU's list price is $0: whatever it computes costs nothing, so no dollar limit is reached.
    result = _train(tiny_model, tmp_path, max_cost_usd=1e-9, price_per_hour=None, steps=1)
    assert result.usage["cost_usd"] == 0.0 and len(result.metrics) == 1


@pytest.mark.parametrize("name", ["max_cost_usd", "max_compute_seconds"])
@pytest.mark.parametrize("bad", [0, -1, math.nan, math.inf, 1e12, "5", True, [1]])
def test_hostile_run_budgets_are_refused(tiny_model, tmp_path, name, bad):
    with pytest.raises(ConfigError, match=name):
        tinkerless.TrainConfig(model=tiny_model, reward=vowels, tasks=[{"prompt": "x"}], **{name: bad}).validate()
