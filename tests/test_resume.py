"""A run killed with SIGKILL and resumed from its checkpoint ends with exactly the adapter of an uninterrupted run."""

from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path

import pytest
from conftest import write_resumable_example, train_in_subprocess as _train, latest_checkpoint_step as _latest
from safetensors.torch import load as load_safetensors

STEPS = 10


@pytest.fixture()
def example(tmp_path, tiny_model) -> Path:
    return write_resumable_example(tmp_path / "resumable.py", tiny_model, STEPS)


def _final_adapter(storage: Path) -> dict:
    data = (storage / "runs/r/checkpoints" / f"step-{STEPS}" / "adapter/adapter_model.safetensors").read_bytes()
    return load_safetensors(data)


def test_sigkill_and_resume_equals_uninterrupted(tmp_path, example):
    straight = tmp_path / "straight"
    _train(example, straight)

    killed = tmp_path / "killed"
    proc = _train(example, killed, wait=False)
    deadline = time.monotonic() + 300
    while _latest(killed) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(random.uniform(0.0, 0.25))  # land anywhere inside the following step(s)
    assert proc.poll() is None, "the run finished before it could be killed; make it longer"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert 3 <= _latest(killed) < STEPS

    _train(example, killed, "--resume")

    expected, actual = _final_adapter(straight), _final_adapter(killed)
    assert expected.keys() == actual.keys() and expected
    for name in expected:
        assert (expected[name] == actual[name]).all(), f"{name} differs after resume"

    steps = [json.loads(line)["step"] for line in (killed / "runs/r/metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(STEPS)), "metrics must hold every step exactly once"
    straight_rewards = [json.loads(l)["reward_mean"] for l in (straight / "runs/r/metrics.jsonl").read_text().splitlines()]
    killed_rewards = [json.loads(l)["reward_mean"] for l in (killed / "runs/r/metrics.jsonl").read_text().splitlines()]
    assert straight_rewards == killed_rewards
