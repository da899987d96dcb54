"""What every tracker speaks (`Tracker`), which trackers exist, and the checks made before a run starts.

A tracker module only has to turn these calls into its own library's; which steps it is sent,
what happens when it raises and what a resume must remember are the fan-out's business (`fanout`).
"""

from __future__ import annotations

import difflib
import importlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from tinkerless.errors import ConfigError


class Tracker(Protocol):
    """One experiment tracker's run, opened for one tinkerless run (or eval) in the client process."""

    name: str
    # The last step this tracker already holds from an earlier attempt of the run: the fan-out never sends it
    # a step at or below this again (a resumed run replays the steps after its checkpoint).
    holds_through: int

    def log_config(self, config: dict[str, Any]) -> None: ...

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None: ...

    def log_transcripts(self, step: int, rows: list[dict[str, Any]]) -> None: ...

    def log_summary(self, summary: dict[str, Any]) -> None: ...

    def log_artifact(self, path: Path) -> None: ...

    def state(self) -> dict[str, Any]:
        """What a resume needs to reopen the same tracker run (ids, directories), kept in trackers.json."""
        ...

    def close(self, status: str = "finished") -> None: ...


@dataclass(frozen=True)
class TrackerContext:
    """Where and what a tracker logs: one run (or eval), from the step this process starts at."""

    run_id: str
    run_dir: Path  # the run's local directory on the client (metrics.jsonl, trackers.json)
    kind: str  # "train" | "sft" | "eval"
    start_step: int = 0  # the first step this process logs; a resumed run starts at its checkpoint
    saved: dict[str, Any] = field(default_factory=dict)  # this tracker's entry of trackers.json, {} the first time


@dataclass(frozen=True)
class TrackerSpec:
    """A tracker by name: the package it needs, the extra that installs it, and how to open one."""

    name: str
    package: str  # imported to check that it is installed
    extra: str  # pip install 'tinkerless[<extra>]'
    module: str  # the tinkerless module with `open_tracker(context) -> Tracker`

    def opener(self) -> Callable[[TrackerContext], Tracker]:
        return importlib.import_module(self.module).open_tracker


# Imported only when a run names them: a run without trackers never pays for their imports.
TRACKERS: dict[str, TrackerSpec] = {
    "wandb": TrackerSpec("wandb", "wandb", "wandb", "tinkerless.sdk.tracking.wandb_tracker"),
    "tensorboard": TrackerSpec("tensorboard", "tensorboard", "tensorboard", "tinkerless.sdk.tracking.tensorboard_tracker"),
    "mlflow": TrackerSpec("mlflow", "mlflow", "mlflow", "tinkerless.sdk.tracking.mlflow_tracker"),
}


def tracker_names(report_to: Any) -> list[str]:
    """`report_to` as a list of names, in order, once each: a list, or one string ("wandb,tensorboard")."""
    if report_to is None:
        return []
    items = report_to.split(",") if isinstance(report_to, str) else report_to
    if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
        raise ConfigError(
            f"report_to must be a list of tracker names, got {report_to!r}", hint=f"e.g. report_to=['wandb'] ({_known()})"
        )
    names = [i.strip().lower() for i in items if i.strip()]
    return list(dict.fromkeys(n for n in names if n != "none"))


def check_report_to(report_to: Any) -> list[str]:
    """The trackers `report_to` names, each known and installed: a ConfigError now, before any model loads."""
    names = tracker_names(report_to)
    for name in names:
        if name not in TRACKERS:
            close = difflib.get_close_matches(name, list(TRACKERS), n=1, cutoff=0.6)
            raise ConfigError(
                f"unknown tracker {name!r} in report_to" + (f" (did you mean {close[0]!r}?)" if close else ""),
                hint=f"report_to takes {_known()}",
            )
        spec = TRACKERS[name]
        try:
            importlib.import_module(spec.package)
        except ImportError as exc:  # also a package set to None in sys.modules, as a test does
            raise ConfigError(
                f"report_to names {name!r}, but the {spec.package} package is not installed ({exc})",
                hint=f"pip install 'tinkerless[{spec.extra}]'",
            ) from None
    return names


def _known() -> str:
    return ", ".join(repr(n) for n in TRACKERS)


def scalar_metrics(record: dict[str, Any], policies: list[str] | tuple[str, ...] = ()) -> dict[str, float]:
    """A metrics.jsonl record's finite numbers, keyed as trackers show them.

    Per-policy columns of a multi-agent run (`reward_mean/<policy>`, `win_rate/<policy>`) move under the
    policy's own prefix (`<policy>/reward_mean`), so each policy gets a section of its own in a tracker's UI."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue  # text (sample, warning), lists (errors) and missing values (NaN, written as null) stay out
        metric, _, policy = key.rpartition("/")
        out[f"{policy}/{metric}" if metric and policy in policies else key] = float(value)
    return out


def transcript_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Episode records (as episodes.jsonl holds them) as one flat row each, the conversation as text."""
    rows = []
    for record in records:
        messages = record.get("messages") or []
        text = "\n\n".join(f"{m.get('role', '?')}: {_content(m.get('content'))}" for m in messages if isinstance(m, dict))
        rows.append({
            "step": record.get("step"), "policy": record.get("policy", "default"), "task_index": record.get("task_index"),
            "reward": record.get("reward"), "status": record.get("status"), "turns": record.get("num_turns"),
            "transcript": text,
        })
    return rows


def _content(content: Any) -> str:
    return content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)


def flatten(values: dict[str, Any], prefix: str = "", sep: str = "/") -> dict[str, Any]:
    """Nested dicts as one level of `a/b` keys (a usage summary's seconds per phase, a config's options)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(flatten(value, name, sep))
        else:
            out[name] = value
    return out


def markdown_transcripts(rows: list[dict[str, Any]]) -> str:
    """Transcript rows as Markdown (TensorBoard's text plugin renders it): a heading and the conversation each."""
    parts = []
    for row in rows:
        heading = " · ".join(f"{k} {row[k]}" for k in ("policy", "task_index", "reward", "status", "turns") if row.get(k) is not None)
        body = row["transcript"].replace("```", "'''")  # a fence inside the text would end the block early
        parts.append(f"**{heading}**\n\n```\n{body}\n```")
    return "\n\n".join(parts)


def safe_key(key: str) -> str:
    """A metric name trackers with strict names accept (MLflow: letters, digits, `_-. /:`): `pass@1` → `pass_at_1`."""
    return re.sub(r"[^\w\-. /:]", "_", key.replace("@", "_at_"))
