"""bench/gpu_shapes.py runs end to end (on the CPU, at the tiny shape): every measurement is written as it is
taken, the tinkerless and baseline rows alike. Its speeds are for a GPU and BENCHMARKS.md, never asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_the_gpu_shapes_benchmark_runs_and_writes_each_measurement(tmp_path):
    out = tmp_path / "shapes.jsonl"
    script = Path(__file__).resolve().parents[1] / "bench" / "gpu_shapes.py"
    done = subprocess.run([sys.executable, str(script), "--shapes", "tiny", "--device", "cpu", "--batch", "3",
                           "--prompt-tokens", "6", "--new-tokens", "5", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["what"] == "device" and rows[0]["new_tokens"] == 5
    measured = {r["what"]: r for r in rows[1:]}
    assert set(measured) == {"tinkerless sampling", "tinkerless update", "transformers generate, static cache",
                             "plain peft update"}
    assert all(r["tokens_per_s"] > 0 and r["shape"] == "tiny" for r in measured.values())
    assert measured["tinkerless sampling"]["dtype"] == "fp32"  # auto on a CPU
    assert "| tiny | tinkerless update |" in done.stdout


def test_with_the_pooled_decoder_it_measures_eager_and_graphed_sampling_and_their_exactness(tmp_path):
    """TINKERLESS_STATIC_DECODE=1 runs the graphed decoder's layout on the CPU: the rows a GPU run writes for the
    graphs (eager "before", graphed "after", fp32 exactness) are all there, and the exactness check agrees."""
    import os

    out = tmp_path / "shapes.jsonl"
    script = Path(__file__).resolve().parents[1] / "bench" / "gpu_shapes.py"
    done = subprocess.run([sys.executable, str(script), "--shapes", "tiny", "--device", "cpu", "--batch", "6",
                           "--prompt-tokens", "6", "--new-tokens", "8", "--exactness", "tiny", "--skip-baselines",
                           "--out", str(out)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TINKERLESS_STATIC_DECODE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    measured = {r["what"]: r for r in map(json.loads, out.read_text().splitlines()[1:])}
    assert not [r for r in measured.values() if "error" in r], measured
    for name in ("graphs vs eager, greedy", "graphs vs eager, sampled, rows stop"):
        assert measured[name]["rows_identical"] == 1.0 and measured[name]["max_logprob_diff"] < 1e-4
    pooled = measured["tinkerless sampling, pooled decode (no capture)"]
    assert pooled["tokens_per_s"] > 0 and measured["tinkerless sampling, eager decode"]["tokens_per_s"] > 0
    assert pooled["rows_identical"] == 1.0 and pooled["eager_steps"] == 0


def test_issue_36s_measurements_run_and_the_device_decode_passes_its_exactness_check(tmp_path):
    """The rows the next GPU run writes for the device decode (its fp32 exactness against the eager one-step loop
    on rows that stop, its speed against the one-step loop at two batch sizes with first and steady calls, mixed
    adapters, the whole RL step) are all there at the tiny shape, through the pooled layout, with no error."""
    import os

    out = tmp_path / "shapes.jsonl"
    script = Path(__file__).resolve().parents[1] / "bench" / "gpu_shapes.py"
    done = subprocess.run([sys.executable, str(script), "--shapes", "tiny", "--device", "cpu", "--batch", "4",
                           "--large-batch", "4", "--exact-rows", "9", "--decode-steps", "3", "--prompt-tokens", "5",
                           "--new-tokens", "7", "--extras", "tiny", "--exactness", "", "--skip-baselines",
                           "--out", str(out)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TINKERLESS_STATIC_DECODE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    measured = {r["what"]: r for r in map(json.loads, out.read_text().splitlines()[1:])}
    assert not [r for r in measured.values() if "error" in r], measured
    for name in ("greedy", "sampled, top-p"):
        check = measured[f"device decode vs eager one-step, {name}"]
        assert check["passes"] and check["rows"] == 9 and check["chunks"] > 0, check
        assert check["lengths"][0] < 7, "rows must stop at their own times"
    for label in ("device decode, 3 steps per host read", "one-step loop",  # --large-batch equal: one batch size
                  "device decode, 3 steps per host read, grouped LoRA"):
        row = measured[f"sampling at batch 4, {label}"]
        assert row["tokens_per_s"] > 0 and row["first_call_tokens_per_s"] > 0
    mixed = measured["sampling, 4 adapters mixed in one batch"]
    assert mixed["tokens_per_s"] > 0 and mixed["mixed_over_one"] > 0
    step = measured["whole RL step, 4 x 7 tokens"]
    assert step["first_step_s"] > 0 and step["steady_step_s"] > 0 and len(step["logprob_gap"]) == 3
    train = measured["local train() step, 4 episodes"]
    assert len(train["step_s"]) == 3 and train["steady_step_s"] > 0 and all(t > 0 for t in train["sampled_tokens"])
