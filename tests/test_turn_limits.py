"""max_turns defaults by run kind, and truncated episodes are reported in the metrics and once on the console."""

from __future__ import annotations

import pytest

import tinkerless
from tinkerless.errors import ConfigError
from tinkerless.sdk.config import DEFAULT_ENV_MAX_TURNS, TrainConfig


@tinkerless.env
class SixTurnGame:
    """Ends itself after six turns, rewarding later turns more (so groups have reward variance)."""

    def reset(self, start: int) -> str:
        self.turn = 0
        return f"count from {start}"

    def step(self, action: str) -> tinkerless.StepResult:
        self.turn += 1
        done = self.turn >= 6
        return tinkerless.StepResult(observation=None if done else f"turn {self.turn}", reward=len(action) / 100, done=done)


@tinkerless.reward
def length_reward(completion: str, task: dict) -> float:
    return len(completion) / 10


TASKS = [{"start": 1}, {"start": 2}]


def test_max_turns_default_depends_on_the_run_kind():
    assert TrainConfig(reward=length_reward, tasks=TASKS).turn_limit() == 1
    assert TrainConfig(env=SixTurnGame, tasks=TASKS).turn_limit() == DEFAULT_ENV_MAX_TURNS == 16
    assert TrainConfig(env=SixTurnGame, tasks=TASKS, max_turns=3).turn_limit() == 3
    # The default follows the env even when it is set later.
    assert TrainConfig(tasks=TASKS, reward=length_reward).replace(env=SixTurnGame).turn_limit() == 16


@pytest.mark.parametrize("bad", [0, -2, 2.5, "4", True])
def test_invalid_max_turns_is_a_config_error(bad):
    with pytest.raises(ConfigError, match=r"max_turns must be (an integer \(at least 1\)|at least 1), got"):
        TrainConfig(env=SixTurnGame, tasks=TASKS, max_turns=bad).validate()


def _train(tiny_model, tmp_path, **settings):
    return tinkerless.train(
        model=tiny_model, env=SixTurnGame, tasks=TASKS, batch_size=2, group_size=2, max_tokens=4,
        temperature=1.0, storage=str(tmp_path), progress=False, checkpoint_every=100, **settings,
    )


def test_an_env_run_plays_every_turn_by_default(tiny_model, tmp_path, capsys):
    result = _train(tiny_model, tmp_path, steps=1)
    record = result.metrics[0]
    assert record["turns_mean"] == 6 and record["episodes_truncated"] == 0
    assert record["episodes_truncated_frac"] == 0.0 and "warning" not in record
    assert "cut off" not in capsys.readouterr().err


def test_truncation_by_max_turns_is_reported_once(tiny_model, tmp_path, capsys):
    result = _train(tiny_model, tmp_path, steps=2, max_turns=2)
    first, second = result.metrics
    for record in (first, second):
        assert record["episodes_truncated_frac"] == 1.0 and record["episodes_truncated_by_turns"] == 4
        assert record["episodes_truncated_by_tokens"] == 0 and record["turns_mean"] == 2
    assert "max_turns=2: raise max_turns" in first["warning"] and "warning" not in second
    err = capsys.readouterr().err
    assert err.count("episodes were cut off") == 1 and "4 of 4 episodes" in err


def test_truncation_by_episode_tokens_names_that_knob(tiny_model, tmp_path, capsys):
    result = _train(tiny_model, tmp_path, steps=1, max_episode_tokens=60)
    record = result.metrics[0]
    assert record["episodes_truncated_frac"] == 1.0 and record["episodes_truncated_by_tokens"] == 4
    assert "max_episode_tokens=60: raise max_episode_tokens" in record["warning"]
    assert "max_turns" not in record["warning"]
    assert "raise max_episode_tokens" in capsys.readouterr().err


def test_the_progress_line_shows_the_truncated_share(monkeypatch):
    from tinkerless.sdk.run.progress import Progress

    progress = Progress(total=1, enabled=True)
    progress.update({"episodes_truncated_frac": 0.75})
    assert progress.bar.postfix and "trunc=75%" in progress.bar.postfix
    progress.close()
