"""A TextArena self-play run killed with SIGKILL and resumed ends identical to an uninterrupted one."""

from __future__ import annotations

import json
import signal
import textwrap
import time
from pathlib import Path

import pytest
from conftest import train_in_subprocess as _train, latest_checkpoint_step as _latest

pytest.importorskip("textarena")

from safetensors.torch import load as load_safetensors  # noqa: E402

STEPS = 5


@pytest.fixture()
def example(tmp_path, tiny_model) -> Path:
    path = tmp_path / "tictactoe_selfplay.py"
    path.write_text(textwrap.dedent(f"""
        import time
        import tinkerless
        from tinkerless.envs.adapters.textarena import random_opponent

        TicTacToe = tinkerless.envs.textarena("TicTacToe-v0", response_prefix="[")

        class SlowTicTacToe(TicTacToe):
            def step(self, agent, action):
                time.sleep(0.02)  # keeps each step long enough to be killed inside it
                return super().step(agent, action)

        config = tinkerless.TrainConfig(
            name="ta-resume", model={tiny_model!r}, env=SlowTicTacToe, tasks=TicTacToe.tasks,
            agents=tinkerless.self_play(TicTacToe.agents, policy="player"),
            steps={STEPS}, batch_size=2, group_size=2, max_turns=10, max_tokens=3, max_episode_tokens=2048,
            temperature=1.0, learning_rate=1e-2, checkpoint_every=1, keep_checkpoints=None, seed=3,
            eval_every=2, eval_tasks=[{{"seed": 5}}],  # held-out games against the random player, kept apart from training
            eval_agents=tinkerless.versus("player_1", random_opponent, roles=TicTacToe.agents, policy="player"),
        )
    """))
    return path


def _adapter(storage: Path) -> dict:
    files = sorted((storage / "runs/r/checkpoints" / f"step-{STEPS}").rglob("adapter_model.safetensors"))
    assert files, "no adapter in the final checkpoint"
    return {str(f.relative_to(storage)): load_safetensors(f.read_bytes()) for f in files}


def _lines(storage: Path) -> list[dict]:
    return [json.loads(line) for line in (storage / "runs/r/metrics.jsonl").read_text().splitlines()]


def test_sigkill_and_resume_of_self_play_equals_uninterrupted(tmp_path, example):
    straight = tmp_path / "straight"
    _train(example, straight)

    killed = tmp_path / "killed"
    proc = _train(example, killed, wait=False)
    deadline = time.monotonic() + 300
    while _latest(killed) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed; make it longer"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert 2 <= _latest(killed) < STEPS
    _train(example, killed, "--resume")

    expected, actual = _adapter(straight), _adapter(killed)
    assert expected.keys() == actual.keys()
    for name in expected:
        for tensor in expected[name]:
            assert (expected[name][tensor] == actual[name][tensor]).all(), f"{name}:{tensor} differs after resume"
    columns = ("step", "reward_mean", "sampled_tokens", "episodes_error", "eval_reward_mean/player", "eval_episodes")
    assert [[line.get(c) for c in columns] for line in _lines(killed)] == [[line.get(c) for c in columns] for line in _lines(straight)]
    assert [line["eval_episodes"] for line in _lines(straight) if "eval_episodes" in line] == [2, 2, 2]  # steps 0, 2, 4
    assert [line["step"] for line in _lines(killed)] == list(range(STEPS))
