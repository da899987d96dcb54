"""The plot of an SFT run: train NLL per step and eval NLL on the held-out split."""

from __future__ import annotations

import math
from pathlib import Path

from tinkerless.sdk.run.metrics import _as_float, _save, read_metrics


def plot_sft(metrics_path: str | Path, png_path: str | Path, *, title: str | None = None) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = sorted((r for r in read_metrics(metrics_path) if isinstance(r.get("step"), (int, float))), key=lambda r: r["step"])
    fig = Figure(figsize=(7, 3.2), constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 1, squeeze=False)[:, 0]
    ax = axes[0]
    for key, label in (("train_nll", "train NLL"), ("eval_nll", "eval NLL (held out)")):
        points = [(r["step"], _as_float(r.get(key))) for r in records]
        points = [(s, v) for s, v in points if math.isfinite(v)]
        if points:
            ax.plot([s for s, _ in points], [v for _, v in points], marker="o", markersize=3, label=label)
    ax.set_ylabel("NLL per assistant token")
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend(loc="best", fontsize="small")
    else:
        ax.text(0.5, 0.5, "no NLL logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    return _save(fig, axes, png_path, title)
