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
