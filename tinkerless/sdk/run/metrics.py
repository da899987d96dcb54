"""Training metrics as JSON lines, plus a PNG plot of reward and loss.

One JSON object per line, each with a "step" key. The file is append-only
except for `truncate_after`, which a resumed run uses so no step appears twice.
matplotlib is imported lazily so importing this module stays cheap.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

from tinkerless.sdk.run.accounting import renamed_metric


class MetricsWriter:
    """Appends one JSON line per `log` call to `path`, flushed immediately."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _drop_torn_tail(self.path)

    def log(self, record: dict) -> None:
        line = json.dumps(jsonable(record), allow_nan=False, separators=(",", ":"))
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(line + "\n")
            handle.flush()

    def truncate_after(self, step: int) -> None:
        """Drop records whose step is greater than `step` (records without a step are kept)."""
        kept = [r for r in read_metrics(self.path) if not (isinstance(r.get("step"), (int, float)) and r["step"] > step)]
        # Rewrite via a temp file + rename so a crash here never leaves a half-written file.
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                for record in kept:
                    handle.write(json.dumps(record, allow_nan=False, separators=(",", ":")) + "\n")
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def read_metrics(path: str | Path) -> list[dict]:
    """All records in `path` (empty if it does not exist), skipping a torn last line."""
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    records: list[dict] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            # The last line may be torn by a process killed mid-write; that is expected.
            if number != len(lines):
                warnings.warn(f"{path}:{number}: skipping a line that is not valid JSON", stacklevel=2)
            continue
        if isinstance(record, dict):
            records.append({renamed_metric(k): v for k, v in record.items()})  # older files: current names
    return records


def reward_summary(records: list[dict]) -> dict:
    """The run's reward at its start and its end: the mean of the first and of the last `reward_window`
    steps, at most 3 and never overlapping (1 step: the one step; 2-3 steps: the first and the last one)."""
    rewards = [float(r["reward_mean"]) for r in records if _is_number(r.get("reward_mean"))]
    window = len(rewards) if len(rewards) < 2 else min(3, len(rewards) // 2)
    mean = lambda values: sum(values) / len(values) if values else None  # noqa: E731
    return {
        "steps": len(records),
        "reward_window": window,
        "reward_first": mean(rewards[:window]),
        "reward_last": mean(rewards[-window:]) if window else None,
    }


def describe_rewards(summary: dict) -> str:
    """`reward_summary` in words, right for any number of steps."""
    window, first, last = summary.get("reward_window", 0), summary.get("reward_first"), summary.get("reward_last")
    if not window or first is None:
        return "no step logged a reward"
    if window == 1 and summary.get("steps", 0) <= 1:
        return f"reward {first:.3f} (1 step)"
    if window == 1:
        return f"reward {first:.3f} on the first step → {last:.3f} on the last"
    return f"reward {first:.3f} over the first {window} steps → {last:.3f} over the last {window}"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def plot_metrics(metrics_path: str | Path, png_path: str | Path, *, title: str | None = None) -> str:
    """Plot reward (mean ± std band) and loss against step; extra panels for win_rate/kl/entropy and held-out
    win rates if logged."""
    # Figure + Agg canvas directly: no pyplot global state, works headless.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = [r for r in read_metrics(metrics_path) if isinstance(r.get("step"), (int, float))]
    records.sort(key=lambda r: r["step"])
    steps = [r["step"] for r in records]

    def series(key: str) -> list[float]:
        return [_as_float(r.get(key)) for r in records]

    # Optional panels appear only when some step logged a finite value for them.
    optional = ("win_rate", "kl", "entropy", "kl_sample_train", "teacher_logprob_gap", "teacher_aligned_share",
                "judge_share", "eval_pass@1")
    panels = ["reward_mean", "loss"] + [k for k in optional if any(math.isfinite(v) for v in series(k))]
    # A multi-agent run's held-out games (evaluation/games.py): one panel per policy's win rate.
    panels += sorted({k for r in records for k in r if k.startswith("eval_win_rate/") and _is_number(r[k])})
    fig = Figure(figsize=(7, 2.4 * len(panels)), constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]

    for ax, key in zip(axes, panels):
        values = series(key)
        ax.set_ylabel(key)
        ax.grid(True, alpha=0.3)
        if not any(math.isfinite(v) for v in values):
            ax.text(0.5, 0.5, f"no {key} logged", ha="center", va="center", transform=ax.transAxes, color="gray")
            continue
        if key == "reward_mean":
            ax.plot(steps, values, marker="o", markersize=3, linewidth=1.5, label="train")
            _plot_held_out(ax, steps, series("eval_reward_mean"))
            std = [s if math.isfinite(s) else 0.0 for s in series("reward_std")]
            low = [m - s for m, s in zip(values, std)]
            high = [m + s for m, s in zip(values, std)]
            ax.fill_between(steps, low, high, alpha=0.25, label="± reward_std")
            ax.legend(loc="best", fontsize="small")
        elif key.startswith("eval_"):  # logged every eval_every steps: join the steps that have it
            _plot_held_out(ax, steps, values)
        else:
            ax.plot(steps, values, marker="o", markersize=3, linewidth=1.5)
    return _save(fig, axes, png_path, title)


def _plot_held_out(ax, steps: list, values: list[float]) -> None:
    """eval_every's reward on the held-out tasks, beside the training reward (only the steps that ran it)."""
    points = [(s, v) for s, v in zip(steps, values) if math.isfinite(v)]
    if points:
        ax.plot(*zip(*points), marker="s", markersize=4, linewidth=1.5, color="tab:orange", label="eval (held-out)")


def jsonable(value: Any) -> Any:
    """Convert numpy/torch scalars and containers to plain JSON; non-finite floats -> None."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    # numpy scalars, 0-d arrays and one-element torch tensors all expose .item().
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return jsonable(item())
        except (ValueError, RuntimeError):
            pass
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return jsonable(tolist())
    return str(value)


def _as_float(value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return math.nan


def _drop_torn_tail(path: Path) -> None:
    """Cut a partial last line (no trailing newline) so the next record starts on its own line."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as handle:
        data = handle.read()
        if data.endswith(b"\n"):
            return
        tail_start = data.rfind(b"\n") + 1
        try:
            json.loads(data[tail_start:])
        except ValueError:
            handle.truncate(tail_start)  # torn: drop it
        else:
            handle.write(b"\n")  # complete record that only lacks its newline: keep it


def plot_outcomes(metrics_path: str | Path, png_path: str | Path, policies: list[str], *, title: str | None = None) -> str:
    """Win/draw/loss rate against step, one panel per trained policy (multi-agent runs)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = sorted((r for r in read_metrics(metrics_path) if isinstance(r.get("step"), (int, float))), key=lambda r: r["step"])
    steps = [r["step"] for r in records]
    fig = Figure(figsize=(7, 2.4 * max(1, len(policies))), constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = fig.subplots(max(1, len(policies)), 1, sharex=True, squeeze=False)[:, 0]
    for ax, policy in zip(axes, policies):
        for outcome, color in (("win", "tab:green"), ("draw", "tab:gray"), ("loss", "tab:red")):
            values = [_as_float(r.get(f"{outcome}_rate/{policy}")) for r in records]
            ax.plot(steps, values, marker="o", markersize=3, color=color, label=outcome)
        ax.set_ylabel(f"{policy}\nrate")
        ax.set_ylim(-0.05, 1.05)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    return _save(fig, axes, png_path, title)


def _save(fig, axes, png_path: str | Path, title: str | None) -> str:
    axes[-1].set_xlabel("step")
    if title:
        fig.suptitle(title)
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, format="png", dpi=100)
    return str(png_path)
