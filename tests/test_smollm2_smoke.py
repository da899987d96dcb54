"""Smoke test on the real model: one GRPO step on SmolLM2-135M-Instruct through the local backend."""

from __future__ import annotations

import json
import math

import pytest

import tinkerless

pytestmark = pytest.mark.slow


@tinkerless.reward
def last_number_is_sum(completion: str, task: dict) -> float:
    import re

    numbers = re.findall(r"-?\d+", completion)  # the last number: "7 + 5 is 12" is right
    return float(bool(numbers) and int(numbers[-1]) == task["answer"])


def test_one_real_grpo_step(tmp_path):
    tasks = [{"prompt": "What is 7 + 5? Answer with a number.", "answer": 12},
             {"prompt": "What is 3 + 4? Answer with a number.", "answer": 7}]
    result = tinkerless.train(
        model="smollm2", reward=last_number_is_sum, tasks=tasks, steps=1, batch_size=2, group_size=4,
        max_tokens=8, temperature=0.7, storage=str(tmp_path), progress=False, run_id="smoke",
    )
    record = result.metrics[0]
    assert record["episodes"] == 8 and record["episodes_error"] == 0
    assert 0.0 <= record["reward_mean"] <= 1.0
    assert record["sampled_tokens"] > 0 and math.isfinite(record["entropy"] if record["entropy"] is not None else 0.0)
    # The real model can do these sums, so some answers must be right.
    assert record["reward_mean"] > 0
    manifest = json.loads((tmp_path / "runs/smoke/checkpoints/step-1/manifest.json").read_text())
    assert "adapter/adapter_model.safetensors" in manifest["files"]
    assert (result.run_dir / "metrics.png").stat().st_size > 0
