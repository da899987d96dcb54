"""Multi-agent training end to end on the tiny model: barriers, per-policy updates, checkpoints, metrics."""

from __future__ import annotations

import json

import pytest

import tinkerless
from tinkerless.envs.gomoku import GomokuEnv, random_opponent
from tinkerless.errors import ConfigError

TASKS = [{"size": 4, "win_length": 3, "max_invalid": 1}]


def _train(tmp_path, tiny_model, **overrides):
    settings = dict(
        model=tiny_model, env=GomokuEnv, tasks=TASKS, steps=2, batch_size=1, group_size=2, max_turns=8,
        max_tokens=4, temperature=1.0, storage=str(tmp_path), progress=False, checkpoint_every=1, run_id="ma",
    )
    settings.update(overrides)
    return tinkerless.train(**settings)


def test_round_robin_barriers_hold_updates_until_all_rollouts_are_in(tmp_path, tiny_model):
    agents = tinkerless.round_robin(["p", "q", "s"], roles=("black", "white"))
    result = _train(tmp_path, tiny_model, agents=agents)
    for step in range(2):
        events = [(e, p) for s, e, p in result.events if s == step]
        rollouts = [i for i, (e, _) in enumerate(events) if e == "rollouts_in"]
        updates = [i for i, (e, _) in enumerate(events) if e == "update_start"]
        assert sorted(p for e, p in events if e == "rollouts_in") == ["p", "q", "s"]
        assert sorted(p for e, p in events if e == "update_start") == ["p", "q", "s"]
        assert max(rollouts) < min(updates), f"an update started before every rollout of step {step} was in: {events}"
        assert events[-1] == ("committed", "*")
    record = result.metrics[-1]
    # Every seating's rollout accounts for its time: generation and the env's own code, summed over seatings.
    assert record["generate_s"] > 0 and record["env_s"] > 0 and record["decoded_tokens"] > 0
    assert record["generate_s"] + record["env_s"] <= record["rollout_s"] * len(agents)  # seatings may overlap
    for policy in ("p", "q", "s"):
        assert f"win_rate/{policy}" in record and f"reward_mean/{policy}" in record
    assert (result.run_dir / "outcomes.png").stat().st_size > 0
    files = json.loads((tmp_path / "runs/ma/checkpoints/step-2/manifest.json").read_text())["files"]
    assert {f"policies/{p}/adapter/adapter_model.safetensors" for p in "pqs"} <= set(files)


def test_versus_a_scripted_opponent_trains_only_the_learner(tmp_path, tiny_model):
    agents = tinkerless.versus("black", random_opponent, roles=("black", "white"), policy="learner")
    result = _train(tmp_path, tiny_model, agents=agents)
    record = result.metrics[-1]
    assert "win_rate/learner" in record and not any(k.endswith("/white") for k in record)
    # One episode per game: only the learner's side is trained.
    assert record["episodes"] == 2
    files = json.loads((tmp_path / "runs/ma/checkpoints/step-2/manifest.json").read_text())["files"]
    assert all(name.startswith(("policies/learner/", "client.json")) for name in files)


def test_self_play_and_frozen_base_opponent_resume(tmp_path, tiny_model):
    agents = {"black": "me", "white": tinkerless.Frozen()}
    _train(tmp_path, tiny_model, agents=agents, steps=2)
    resumed = _train(tmp_path, tiny_model, agents=agents, steps=3, resume=True)
    assert [r["step"] for r in resumed.metrics] == [0, 1, 2]
    selfplay = _train(tmp_path / "sp", tiny_model, agents=tinkerless.self_play(("black", "white"), policy="me"), steps=1)
    assert selfplay.metrics[0]["episodes"] == 4  # two seats x two games, all trained into one policy


def test_multi_agent_env_needs_agents(tmp_path, tiny_model):
    with pytest.raises(ConfigError, match="multi-agent env with roles"):
        _train(tmp_path, tiny_model)
    with pytest.raises(ConfigError, match="miss \\['white'\\]"):
        _train(tmp_path, tiny_model, agents={"black": "me"})
    with pytest.raises(ConfigError, match="no role is played by a trained policy"):
        _train(tmp_path, tiny_model, agents={"black": tinkerless.Frozen(), "white": random_opponent})


def test_eval_of_a_multi_agent_env_plays_its_games_and_refuses_single_agent_options(tiny_model, tmp_path):
    from tinkerless.sdk.evaluation.evaluate import evaluate

    config = tinkerless.TrainConfig(model=tiny_model, env=GomokuEnv, tasks=TASKS, storage=str(tmp_path),
                                    agents=tinkerless.self_play(("black", "white")))
    report = evaluate(config, num_tasks=1, samples=1)  # one game, both seats the policy: two of its episodes
    assert report.columns["eval_episodes"] == 2 and "policy: win" in report.describe()
    with pytest.raises(ConfigError, match="single-agent"):
        evaluate(config, num_tasks=1, samples=1, transcripts=str(tmp_path / "t.jsonl"))
