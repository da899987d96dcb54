"""What `train()`, `sft()`, `evaluate()` and a Modal run send to their trackers, in a few calls each.

Every call here runs in the client process, beside metrics.jsonl, whatever the backend: the functions
on a server, Modal or SkyPilot never see a tracker or its credentials.
"""

from __future__ import annotations

import random
import re
import time
from pathlib import Path
from typing import Any, Iterable

from tinkerless.sdk.tracking.base import tracker_names
from tinkerless.sdk.tracking.fanout import Trackers, open_trackers

# About this many transcript tables per run (and one at the last step): enough to watch the samples change,
# few enough that a long run does not upload thousands of tables.
TABLES_PER_RUN = 10


def run_config(summary: dict[str, Any], *, run_id: str, kind: str, backend: str) -> dict[str, Any]:
    """The config a tracker shows: the run's own settings, plus what ran it."""
    from tinkerless import __version__

    return {**summary, "run_id": run_id, "kind": kind, "backend_kind": backend, "tinkerless_version": __version__}


def open_run_trackers(report_to: Any, *, summary: dict[str, Any], run_id: str, run_dir: Path, kind: str, backend: str,
                      start_step: int, steps: int, policies: Iterable[str] = ()) -> Trackers:
    """A training or SFT run's trackers, continuing an earlier attempt's tracker runs from `start_step`."""
    if not tracker_names(report_to):
        return Trackers([])
    from tinkerless.sdk.run.metrics import read_metrics

    return open_trackers(
        report_to, run_id=run_id, run_dir=run_dir, kind=kind, start_step=start_step,
        config=run_config(summary, run_id=run_id, kind=kind, backend=backend),
        history=read_metrics(Path(run_dir) / "metrics.jsonl"),  # what the run holds so far (truncated on resume)
        policies=policies, table_every=max(1, steps // TABLES_PER_RUN), last_step=steps - 1,
    )


def finish_run_trackers(trackers: Trackers, summary: dict[str, Any], plots: Iterable[Path | str | None],
                        metrics_path: Path) -> None:
    """The run's summary (rewards or NLL, compute seconds and cost) and plots; a failure here gets its own
    line in metrics.jsonl, after the last step's."""
    if not trackers and not trackers.errors:
        return
    from tinkerless.sdk.run.metrics import MetricsWriter

    trackers.finish(summary, plots, note=MetricsWriter(metrics_path).log)


def report_modal_run(report_to: Any, *, config: Any, run_id: str, run_dir: Path, records: list[dict],
                     summary: dict[str, Any], plot: Path | None) -> None:
    """A run trained in Modal's Coordinator: its metrics come back to this machine, and are logged from here."""
    if not tracker_names(report_to):
        return
    trackers = open_trackers(
        report_to, run_id=run_id, run_dir=run_dir, kind="train", start_step=0, history=records,
        config=run_config(config.summary(), run_id=run_id, kind="train", backend="modal"),
    )
    finish_run_trackers(trackers, summary, [plot], Path(run_dir) / "metrics.jsonl")


def report_eval(config: Any, report: Any, tasks: list[dict], *, checkpoint: str | None, samples: int, seed: int,
                transcripts: int = 16) -> None:
    """An evaluation as a tracker run of its own: the report's columns at the checkpoint's step, a table of
    episodes, and the report as its summary."""
    from tinkerless.sdk.evaluation.evaluate import eval_columns
    from tinkerless.sdk.run.transcripts import episode_record, sample

    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{random.randrange(16**4):04x}"
    what = Path((checkpoint or "base").split("@")[0].rstrip("/")).name  # a run id, or an adapter directory's name
    eval_id = f"eval-{re.sub(r'[^A-Za-z0-9_.-]', '-', what) or 'adapter'}-{stamp}"
    root = Path(config.storage) if "://" not in str(config.storage) else Path(".")  # a cloud store: here, like metrics
    step = report.step or 0
    settings = {**config.summary(), "checkpoint": checkpoint or "base", "samples": samples, "eval_seed": seed,
                "eval_tasks": len(tasks), "source": report.source}
    trackers = open_trackers(
        config.report_to, run_id=eval_id, run_dir=root / "runs" / eval_id, kind="eval",
        config=run_config(settings, run_id=eval_id, kind="eval", backend=config.backend), keep_state=False,
    )
    limits = config.episode_limits()
    rows = [episode_record(e, limits, step=step, task=tasks[e.task_index] if 0 <= e.task_index < len(tasks) else None)
            for e in sample(report.played, transcripts)]
    trackers.log_step({"step": step, **eval_columns(report)}, rows)
    trackers.finish(report.to_dict())
