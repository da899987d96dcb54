"""MetricsWriter / read_metrics / plot_metrics."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from tinkerless.sdk.run.metrics import MetricsWriter, plot_metrics, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_round_trip_creates_parent_dirs(tmp_path):
    path = tmp_path / "nested" / "dir" / "metrics.jsonl"
    writer = MetricsWriter(path)
    writer.log({"step": 0, "reward_mean": 0.25, "loss": 1.5, "note": "start"})
    writer.log({"step": 1, "reward_mean": 0.5, "loss": 1.25, "tags": ["a", "b"]})

    assert read_metrics(path) == [
        {"step": 0, "reward_mean": 0.25, "loss": 1.5, "note": "start"},
        {"step": 1, "reward_mean": 0.5, "loss": 1.25, "tags": ["a", "b"]},
    ]
    # One JSON object per line.
    assert len(path.read_text().splitlines()) == 2


def test_non_finite_floats_become_null(tmp_path):
    path = tmp_path / "m.jsonl"
    MetricsWriter(path).log({"step": 0, "loss": float("nan"), "kl": float("inf"), "x": -math.inf})
    line = path.read_text().strip()
    assert "NaN" not in line and "Infinity" not in line
    assert json.loads(line) == {"step": 0, "loss": None, "kl": None, "x": None}


def test_numpy_and_torch_scalars_are_converted(tmp_path):
    path = tmp_path / "m.jsonl"
    MetricsWriter(path).log(
        {
            "step": np.int64(3),
            "reward_mean": np.float32(0.5),
            "loss": torch.tensor(2.0),
            "nan_tensor": torch.tensor(float("nan")),
            "flag": np.bool_(True),
            "vec": np.array([1.0, 2.0]),
        }
    )
    (record,) = read_metrics(path)
    assert record == {"step": 3, "reward_mean": 0.5, "loss": 2.0, "nan_tensor": None, "flag": True, "vec": [1.0, 2.0]}
    assert isinstance(record["step"], int)


def test_truncate_after_drops_later_steps(tmp_path):
    path = tmp_path / "m.jsonl"
    writer = MetricsWriter(path)
    for step in range(6):
        writer.log({"step": step, "loss": float(step)})
    writer.truncate_after(2)
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2]

    # A resumed run appends from step 3 again without duplicates.
    writer.log({"step": 3, "loss": 30.0})
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2, 3]
    assert read_metrics(path)[-1]["loss"] == 30.0


def test_read_missing_file_is_empty(tmp_path):
    assert read_metrics(tmp_path / "absent.jsonl") == []


def test_torn_last_line_is_tolerated_and_repaired(tmp_path):
    path = tmp_path / "m.jsonl"
    writer = MetricsWriter(path)
    writer.log({"step": 0, "loss": 1.0})
    writer.log({"step": 1, "loss": 0.9})
    with open(path, "a") as handle:
        handle.write('{"step": 2, "lo')  # a process killed mid-write

    assert [r["step"] for r in read_metrics(path)] == [0, 1]

    # A new writer (the resumed process) cuts the torn line so its records stay intact.
    resumed = MetricsWriter(path)
    resumed.log({"step": 2, "loss": 0.8})
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2]


def test_complete_last_line_without_newline_is_kept(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 0, "loss": 1.0}')
    MetricsWriter(path).log({"step": 1, "loss": 0.5})
    assert [r["step"] for r in read_metrics(path)] == [0, 1]


def test_bad_middle_line_warns_and_is_skipped(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 0}\nnot json\n{"step": 1}\n')
    with pytest.warns(UserWarning, match="not valid JSON"):
        records = read_metrics(path)
    assert [r["step"] for r in records] == [0, 1]


def test_plot_creates_png(tmp_path):
    metrics = tmp_path / "m.jsonl"
    writer = MetricsWriter(metrics)
    for step in range(5):
        writer.log({"step": step, "reward_mean": 0.1 * step, "reward_std": 0.05, "loss": 1.0 / (step + 1), "kl": 0.01 * step})
    writer.log({"step": 5, "reward_mean": 0.5, "reward_std": float("nan"), "loss": float("nan")})

    png = tmp_path / "plots" / "metrics.png"
    result = plot_metrics(metrics, png, title="test run")
    assert result == str(png)
    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert len(data) > 1000


def test_plot_with_no_records_still_writes_png(tmp_path):
    png = tmp_path / "empty.png"
    plot_metrics(tmp_path / "absent.jsonl", png)
    assert png.read_bytes().startswith(PNG_MAGIC)
