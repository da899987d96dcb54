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


def test_evaluate_a_multi_agent_checkpoint_replays_the_runs_own_held_out_games(tiny_model, tmp_path, capsys):
    """`evaluate()` of a checkpoint plays the eval seatings with the checkpoint's policies: the same games and
    columns as the run's own eval at that step (same tasks, samples and seed); the base model and an adapter too."""
    from tinkerless.sdk.evaluation.games import GamesReport

    config = _gomoku(tiny_model, tmp_path, steps=3, eval_every=2, checkpoint_every=1, keep_checkpoints=None,
                     learning_rate=5e-2, run_id="ma")
    result = tinkerless.train(config)
    at_step_2 = _lines(result)[2]
    report = tinkerless.evaluate(config, checkpoint="ma@2", samples=config.group_size, seed=config.seed)
    assert isinstance(report, GamesReport) and report.step == 2
    columns = {k: v for k, v in report.columns.items() if k != "eval_s"}
    assert columns == {k: at_step_2[k] for k in columns}  # the run's own eval at step 2, column for column
    assert "p: win" in report.describe() and report.to_dict()["step"] == 2
    base = tinkerless.evaluate(config, checkpoint="base", samples=config.group_size, seed=config.seed)
    assert {k: v for k, v in base.columns.items() if k != "eval_s"} == {k: _lines(result)[0][k] for k in columns}
    adapter = result.run_dir / "checkpoints" / "step-2" / "policies" / "p" / "adapter"
    from_dir = tinkerless.evaluate(config, adapter=str(adapter), samples=config.group_size, seed=config.seed)

    def tokens(r):
        return [e.tokens.tolist() for e in r.played if e.info["policy"] == "p"]
    # A random tiny model loses every game the same way, so the run never trained (tied groups): its checkpoint's
    # adapter and the base play the same tokens. An adapter with weights of its own plays others.
    assert len(tokens(report)) == 8 and tokens(from_dir) == tokens(report) == tokens(base)
    from safetensors.torch import load_file, save_file

    moved = tmp_path / "moved"
    moved.mkdir()
    (moved / "adapter_config.json").write_bytes((adapter / "adapter_config.json").read_bytes())
    weights = load_file(adapter / "adapter_model.safetensors")
    save_file({k: v + 0.5 if "lora_B" in k else v for k, v in weights.items()}, moved / "adapter_model.safetensors")
    other = tinkerless.evaluate(config, adapter=str(moved), samples=config.group_size, seed=config.seed)
    assert tokens(other) != tokens(base) and other.columns["eval_episodes"] == 8
    with pytest.raises(ConfigError, match="single-agent"):
        tinkerless.evaluate(config, checkpoint="ma@2", pass_threshold=0.5)
