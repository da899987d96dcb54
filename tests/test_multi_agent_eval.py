"""Held-out games for multi-agent runs (`eval_every` with `eval_agents`): win rates per policy, on native and
TextArena games, the same games at every eval, and the seatings refused at the boundary."""

from __future__ import annotations

import json

import pytest

import tinkerless
from tinkerless.envs.gomoku import GomokuEnv, random_opponent as gomoku_random
from tinkerless.errors import ConfigError
from tinkerless.sdk.evaluation.games import play_games
from tinkerless.wire.messages import CreatePolicyRequest, LoraConfig

ROLES = ("black", "white")


def _gomoku(tiny_model, tmp_path, **overrides):
    settings = dict(model=tiny_model, env=GomokuEnv, tasks=lambda rng: {"size": 3, "win_length": 3},
                    agents=tinkerless.self_play(ROLES, policy="p"), steps=2, batch_size=1, group_size=2, max_turns=16,
                    max_tokens=4, max_episode_tokens=4096, temperature=1.0, storage=str(tmp_path), progress=False,
                    eval_every=1, eval_tasks=[{"size": 3, "win_length": 3}] * 2,
                    eval_agents=[tinkerless.versus(role, gomoku_random, roles=ROLES, policy="p") for role in ROLES])
    settings.update(overrides)
    return tinkerless.TrainConfig(**settings)


def _lines(result):
    return [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_self_play_run_logs_its_win_rate_against_the_eval_opponent_every_eval_step(tiny_model, tmp_path):
    result = tinkerless.train(_gomoku(tiny_model, tmp_path))
    lines = _lines(result)
    assert [line["step"] for line in lines] == [0, 1]
    for line in lines:
        # 2 tasks x group 2 x 2 seatings, one learner episode per game (the scripted seat has none)
        assert line["eval_episodes"] == 8 and line["eval_errors"] == 0 and line["eval_s"] > 0
        rates = [line[f"eval_{o}_rate/p"] for o in ("win", "draw", "loss")]
        assert all(0.0 <= r <= 1.0 for r in rates) and sum(rates) == pytest.approx(1.0)
        assert -2.0 < line["eval_reward_mean/p"] < 2.0
        assert line["win_rate/p"] == pytest.approx(0.5) or line["draw_rate/p"] > 0  # training is still self-play
    assert (result.run_dir / "metrics.png").exists()


def test_every_eval_plays_the_same_games_so_only_the_policy_moves_the_curve(worker, tiny_model, tmp_path):
    worker.create_policy(CreatePolicyRequest("p", LoraConfig(rank=4, seed=1)))
    config = _gomoku(tiny_model, tmp_path)
    runs = [play_games(worker.rollout_multi, config, config.eval_tasks, policies=["p"], frozen={}) for _ in range(2)]
    for run in runs:
        run.pop("eval_s")
    assert runs[0] == runs[1] and runs[0]["eval_episodes"] == 8


def test_textarena_self_play_against_the_random_player_and_the_base_model(tiny_model, tmp_path):
    pytest.importorskip("textarena")
    from tinkerless.envs.adapters.textarena import random_opponent

    Game = tinkerless.envs.textarena("TicTacToe-v0", response_prefix="[")
    eval_agents = [tinkerless.versus("player_0", random_opponent, roles=Game.agents, policy="player"),
                   {"player_0": tinkerless.Frozen(), "player_1": "player"}]
    result = tinkerless.train(model=tiny_model, env=Game, tasks=Game.tasks, agents=tinkerless.self_play(Game.agents, policy="player"),
                              steps=1, batch_size=1, group_size=2, max_turns=8, max_tokens=3, max_episode_tokens=2048,
                              storage=str(tmp_path), progress=False, eval_every=1, eval_tasks=[{"seed": 3}, {"seed": 4}],
                              eval_agents=eval_agents)
    line = _lines(result)[0]
    # 2 tasks x group 2: the learner's game against random (1 episode each), then against the base (1 each; the
    # frozen seat's own episodes are not the policy's)
    assert line["eval_episodes"] == 8 and line["eval_errors"] == 0
    assert sum(line[f"eval_{o}_rate/player"] for o in ("win", "draw", "loss")) == pytest.approx(1.0)


def test_eval_seatings_are_checked_before_the_model_loads(tiny_model, tmp_path):
    with pytest.raises(ConfigError, match="only those"):
        _gomoku(tiny_model, tmp_path, eval_agents=tinkerless.versus("black", gomoku_random, roles=ROLES, policy="q")).validate()
    with pytest.raises(ConfigError, match="only those"):
        _gomoku(tiny_model, tmp_path, eval_agents={"black": tinkerless.Frozen(), "white": gomoku_random}).validate()
    with pytest.raises(ConfigError, match="roles"):
        _gomoku(tiny_model, tmp_path, eval_agents={"black": "p"}).validate()
    with pytest.raises(ConfigError, match="a dict role"):
        _gomoku(tiny_model, tmp_path, eval_agents=[]).validate()
    with pytest.raises(ConfigError, match="multi-agent envs"):
        tinkerless.TrainConfig(model=tiny_model, reward=lambda p, c, t: 0.0, tasks=[{"prompt": "x"}],
                               eval_agents={"a": "p"}).validate()
    _gomoku(tiny_model, tmp_path, eval_agents=None).validate()  # default: the run's own seating
