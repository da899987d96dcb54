"""Transcripts (runs/<id>/episodes.jsonl, eval --transcripts) and the end-of-run reward summary."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import tinkerless
from tinkerless.envs.gomoku import GomokuEnv, random_opponent
from tinkerless.errors import ConfigError
from tinkerless.sdk.cli.commands import main
from tinkerless.sdk.run.metrics import describe_rewards, reward_summary
from tinkerless.sdk.run.step_metrics import step_record
from tinkerless.sdk.run.transcripts import episode_record, sample, token_counts
from tinkerless.wire.messages import Episode, EpisodeLimits, TrainingSequence

RECORD_KEYS = {
    "step", "task_index", "policy", "status", "truncated_by", "reward", "turn_rewards", "num_turns", "tokens",
    "messages", "task", "info", "error",
}


@tinkerless.env
class Counting:
    """Wants three turns; each turn earns 0.25, so a run with max_turns=2 is cut by max_turns."""

    def reset(self, start: int) -> str:
        self.turn = 0
        return f"count up from {start}"

    def step(self, action: str) -> tinkerless.StepResult:
        self.turn += 1
        done = self.turn >= 3
        return tinkerless.StepResult(observation=None if done else f"now {self.turn}", reward=0.25, done=done)


def _train(tiny_model, storage: Path, **overrides):
    settings = dict(
        model=tiny_model, env=Counting, tasks=[{"start": 1}, {"start": 5}], steps=2, batch_size=2, group_size=2,
        max_turns=2, max_tokens=4, temperature=1.0, storage=str(storage), progress=False, run_id="t",
        transcripts_per_step=3,
    )
    settings.update(overrides)
    return tinkerless.train(**settings)


def _episodes(run_dir: Path) -> list[dict]:
    path = run_dir / "episodes.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _check_whole_episode(record: dict) -> None:
    assert RECORD_KEYS <= set(record)
    assistant = [m for m in record["messages"] if m["role"] == "assistant"]
    assert len(assistant) == record["num_turns"]
    tokens = record["tokens"]
    assert len(tokens["sampled_per_turn"]) <= record["num_turns"]  # a turn that sampled nothing has no tokens
    assert sum(tokens["sampled_per_turn"]) == tokens["sampled"] <= tokens["total"] - tokens["prompt"]
    if record["status"] != "error":
        assert record["reward"] == pytest.approx(sum(record["turn_rewards"]))


def test_a_run_writes_a_sample_of_whole_episodes_per_step(tiny_model, tmp_path, capsys):
    result = _train(tiny_model, tmp_path)
    records = _episodes(result.run_dir)
    assert [r["step"] for r in records] == [0, 0, 0, 1, 1, 1]
    for record in records:
        _check_whole_episode(record)
        assert record["policy"] == "default" and record["task"]["start"] in (1, 5)
        assert (record["status"], record["truncated_by"], record["num_turns"]) == ("truncated", "max_turns", 2)
        assert record["turn_rewards"] == [0.25, 0.25]
        roles = [m["role"] for m in record["messages"]]
        assert roles == ["user", "assistant", "user", "assistant"]
    # The sample is spread over the step's tasks, not the first group only.
    assert {r["task_index"] for r in records if r["step"] == 0} == {0, 1}
    assert "episodes.jsonl" in capsys.readouterr().out


def test_transcripts_through_a_server_match_a_local_run(tiny_model, worker, tmp_path):
    from tinkerless.sdk.backends.http import HTTPBackend
    from tinkerless.server import create_app
    from tinkerless.server import serve_in_thread as running

    local = _episodes(_train(tiny_model, tmp_path / "local").run_dir)
    with running(create_app(worker, storage=str(tmp_path / "server"))) as url:
        remote = _episodes(_train(tiny_model, tmp_path / "client", backend=HTTPBackend(url)).run_dir)
    assert (tmp_path / "client/runs/t/episodes.jsonl").exists(), "the client writes them, from its rollout results"
    assert len(remote) == len(local) == 6
    for a, b in zip(local, remote):
        _check_whole_episode(b)
        assert (a["step"], a["task_index"], a["status"], a["truncated_by"]) == (b["step"], b["task_index"], b["status"], b["truncated_by"])


def test_multi_agent_transcripts_name_the_policy_and_role(tiny_model, tmp_path):
    agents = tinkerless.versus("black", random_opponent, roles=("black", "white"), policy="learner")
    result = tinkerless.train(
        model=tiny_model, env=GomokuEnv, tasks=[{"size": 4, "win_length": 3, "max_invalid": 1}], agents=agents,
        steps=1, batch_size=1, group_size=2, max_turns=8, max_tokens=4, storage=str(tmp_path), progress=False,
        run_id="ma", transcripts_per_step=8,
    )
    records = _episodes(result.run_dir)
    assert len(records) == 2 and all(r["policy"] == "learner" and r["info"]["role"] == "black" for r in records)
    for record in records:
        assert record["info"]["outcome"] in ("win", "draw", "loss", "unfinished")


@pytest.mark.parametrize("bad", [-1, True, 2.5, "4"])
def test_transcripts_per_step_is_validated(tiny_model, tmp_path, bad):
    with pytest.raises(ConfigError, match="transcripts_per_step"):
        _train(tiny_model, tmp_path, transcripts_per_step=bad)


def test_zero_transcripts_per_step_writes_none(tiny_model, tmp_path):
    assert _episodes(_train(tiny_model, tmp_path, steps=1, transcripts_per_step=0).run_dir) == []


def test_eval_transcripts_writes_every_episode(tiny_model, tmp_path, capsys):
    file = tmp_path / "count.py"
    file.write_text(
        "import tinkerless\n"
        "from test_transcripts import Counting\n"
        f"config = tinkerless.TrainConfig(model={tiny_model!r}, env=Counting, tasks=[{{'start': 1}}, {{'start': 2}}],\n"
        "    max_turns=3, max_tokens=4, progress=False)\n"
    )
    out = tmp_path / "eval" / "episodes.jsonl"
    assert main(["eval", str(file), "--episodes", "5", "--transcripts", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 5 and all(r["step"] is None for r in records)
    for record in records:
        _check_whole_episode(record)
        assert record["status"] == "ok" and record["truncated_by"] is None and record["turn_rewards"] == [0.25] * 3
    # A path that cannot be written fails before any episode is played.
    assert main(["eval", str(file), "--transcripts", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_truncation_reason_and_token_counts():
    mask = np.array([0, 0, 0, 1, 1, 0, 0, 1, 1, 1], dtype=np.float32)
    episode = Episode(
        task_index=0, tokens=np.arange(10, dtype=np.int32), mask=mask, sampler_logprobs=np.zeros(10, np.float32),
        prompt_length=3, num_turns=2, status="truncated", transcript=[], turn_rewards=[0.5, float("nan")],
        reward=float("nan"),
    )
    assert token_counts(episode) == {"prompt": 3, "sampled": 5, "total": 10, "sampled_per_turn": [2, 3], "sequences": 1}
    record = episode_record(episode, EpisodeLimits(max_turns=2, max_episode_tokens=100))
    assert record["truncated_by"] == "max_turns"
    assert record["reward"] is None and record["turn_rewards"] == [0.5, None]  # strict JSON: no NaN
    json.dumps(record, allow_nan=False)
    assert episode_record(episode, EpisodeLimits(max_turns=5, max_episode_tokens=10))["truncated_by"] == "max_episode_tokens"


def test_token_counts_cover_every_sequence_of_an_agent_that_rewrote_its_context():
    # An agent function's second call did not extend its first: two trained sequences, one episode.
    first = np.array([0, 0, 1, 1, 1], dtype=np.float32)
    second = np.array([0, 0, 0, 0, 1, 1, 0, 1], dtype=np.float32)
    episode = Episode(
        task_index=0, tokens=np.arange(5, dtype=np.int32), mask=first, sampler_logprobs=np.zeros(5, np.float32),
        prompt_length=2, num_turns=2, transcript=[{"role": "assistant", "content": "12"}],
        extra_sequences=[TrainingSequence(np.arange(8, dtype=np.int32), second, np.zeros(8, np.float32))],
    )
    assert episode.sampled_tokens() == 6
    assert token_counts(episode) == {"prompt": 2, "sampled": 6, "total": 13, "sampled_per_turn": [3, 2, 1], "sequences": 2}
    record = step_record(0, [episode], {}, {"rollout_s": 2.0}, {}, 2.5)
    assert record["sampled_tokens"] == 6.0 and record["tokens_per_s"] == 3.0


def test_sample_spreads_over_the_step():
    assert sample(list(range(16)), 4) == [0, 4, 8, 12]
    assert sample(list(range(3)), 4) == [0, 1, 2]
    assert sample(list(range(5)), 0) == [] and sample([], 3) == []


# ---- the end-of-run reward summary --------------------------------------------------------------


@pytest.mark.parametrize(
    "steps, window, first, last",
    [(1, 1, 0.0, 0.0), (2, 1, 0.0, 1.0), (3, 1, 0.0, 2.0), (4, 2, 0.5, 2.5), (5, 2, 0.5, 3.5), (6, 3, 1.0, 4.0), (10, 3, 1.0, 8.0)],
)
def test_reward_summary_windows_never_overlap(steps, window, first, last):
    summary = reward_summary([{"step": i, "reward_mean": float(i)} for i in range(steps)])
    assert (summary["steps"], summary["reward_window"]) == (steps, window)
    assert (summary["reward_first"], summary["reward_last"]) == (pytest.approx(first), pytest.approx(last))
    text = describe_rewards(summary)
    assert "3 steps" not in text or steps >= 6
    if steps == 1:
        assert text == "reward 0.000 (1 step)"
    elif window == 1:
        assert "first step" in text and "last" in text


def test_reward_summary_without_rewards():
    summary = reward_summary([{"step": 0, "reward_mean": None}])
    assert summary["reward_first"] is None and describe_rewards(summary) == "no step logged a reward"
    assert describe_rewards(reward_summary([])) == "no step logged a reward"


def test_one_step_run_report_speaks_of_one_step(tiny_model, tmp_path, capsys):
    _train(tiny_model, tmp_path, steps=1)
    out = capsys.readouterr().out
    assert "(1 step)" in out and "first 3" not in out and "last 3" not in out
