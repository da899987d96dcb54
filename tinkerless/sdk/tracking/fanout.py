"""`Trackers`: one run's calls fanned out to every tracker it names, each failure kept to its own tracker.

- A tracker that raises is switched off for the rest of the run: the run keeps training, a warning says
  so once, and the failure is noted in metrics.jsonl (`tracker_error` on the next step's line, or a line of
  its own after the last step).
- `runs/<run_id>/trackers.json` keeps what a resume needs to continue the same tracker runs (W&B id,
  TensorBoard log dir, MLflow run id) and the last step each tracker holds, so a step a resumed run
  replays after its checkpoint is never sent twice.
"""

from __future__ import annotations

import json
import os
import tempfile
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable

from tinkerless.sdk.run.metrics import jsonable
from tinkerless.sdk.tracking.base import TRACKERS, Tracker, TrackerContext, scalar_metrics, tracker_names, transcript_rows

STATE_FILE = "trackers.json"


class TrackerWarning(UserWarning):
    """A tracker failed and was switched off for the rest of the run (the run itself goes on)."""


class Trackers:
    """The trackers of one run; with none named, every call is a no-op."""

    def __init__(self, trackers: list[Tracker], *, state_path: Path | None = None, policies: Iterable[str] = (),
                 table_every: int = 1, last_step: int | None = None, saved: dict | None = None):
        self.live: dict[str, Tracker] = {t.name: t for t in trackers}
        self.state_path = state_path
        self.policies = tuple(policies)  # multi-agent: these policies' columns go under their own prefix
        self.table_every = max(1, table_every)  # transcripts go to the trackers every this many steps, and at the last
        self.last_step = last_step
        self.errors: list[dict[str, str]] = []  # failures not yet noted in metrics.jsonl
        self._saved = dict(saved or {})
        self._last = {t.name: int(t.holds_through) for t in trackers}
        self._save_warned = False

    def __bool__(self) -> bool:
        return bool(self.live)

    # ---- what a run sends ------------------------------------------------------------
    def log_config(self, config: dict[str, Any]) -> None:
        for tracker in list(self.live.values()):
            self._call(tracker, "log_config", config)

    def log_step(self, record: dict[str, Any], episodes: list[dict[str, Any]] | None = None) -> None:
        """A step's metrics.jsonl record (and sample transcripts) to every tracker that does not hold that step yet.

        Called before the record is written, so a failure (this step's, or one pending from opening) is noted in
        it as `tracker_error`."""
        step = record.get("step")
        if self.live and isinstance(step, int):
            self._send(step, record, episodes if self._table_step(step) else None)
        if self.errors:
            record["tracker_error"] = self.errors
            self.errors = []

    def catch_up(self, records: Iterable[dict[str, Any]]) -> None:
        """Steps already in metrics.jsonl that a tracker does not hold yet (one newly named on resume, or a
        Modal run's metrics, logged here after it): sent in order, without transcripts."""
        for record in sorted((r for r in records if isinstance(r.get("step"), int)), key=lambda r: r["step"]):
            if self.live:
                self._send(record["step"], record, None)

    def _send(self, step: int, record: dict[str, Any], episodes: list[dict[str, Any]] | None) -> None:
        metrics = scalar_metrics(jsonable(record), self.policies)  # the numbers as metrics.jsonl writes them
        rows = transcript_rows(episodes) if episodes else []
        changed = False
        for tracker in list(self.live.values()):
            if step <= self._last[tracker.name]:
                continue  # it has this step already: logged before a kill, replayed after the resume
            if self._call(tracker, "log_metrics", step, metrics) and (not rows or self._call(tracker, "log_transcripts", step, rows)):
                self._last[tracker.name] = step
                changed = True
        if changed:
            self.save()

    def finish(self, summary: dict[str, Any], artifacts: Iterable[Path | str | None] = (), *, status: str = "finished",
               note: Callable[[dict], None] | None = None) -> None:
        """The run's summary and its plots, then close; failures from here on go to `note` (a metrics.jsonl line)."""
        for tracker in list(self.live.values()):
            if self._call(tracker, "log_summary", summary):
                for path in artifacts:
                    if path is not None and Path(path).is_file() and not self._call(tracker, "log_artifact", Path(path)):
                        break
        self.close(status, note=note)

    def close(self, status: str = "finished", *, note: Callable[[dict], None] | None = None) -> None:
        """Close every tracker (a failed or interrupted run: `status` says which), at most once."""
        for tracker in list(self.live.values()):
            self._call(tracker, "close", status)
        self.live.clear()
        if self.errors and note is not None:
            try:
                note({"tracker_error": self.errors})
            except OSError:  # the warning already told the user; the run's own outcome is what matters
                pass
            self.errors = []

    # ---- isolation and state -----------------------------------------------------------
    def _call(self, tracker: Tracker, method: str, *args: Any) -> bool:
        try:
            getattr(tracker, method)(*args)
            return True
        except Exception as exc:  # any tracker failure: W&B unreachable, a full store, a bug in a tracker library
            self.fail(tracker.name, method, exc)
            if method != "close":
                try:  # let it release what it holds (a W&B service process, open files); its errors add nothing
                    tracker.close("failed")
                except Exception:
                    pass
            return False

    def fail(self, name: str, during: str, exc: BaseException) -> None:
        self.live.pop(name, None)
        message = f"{type(exc).__name__}: {exc}".strip()
        self.errors.append({"tracker": name, "during": during, "error": message[:2000]})
        where = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        warnings.warn(
            f"tracker {name!r} failed in {during} and is off for the rest of this run, which goes on ({where[:500]})",
            TrackerWarning, stacklevel=3,
        )

    def _table_step(self, step: int) -> bool:
        return step % self.table_every == 0 or step == self.last_step

    def save(self) -> None:
        if self.state_path is None:
            return
        state = dict(self._saved)
        try:
            for name, tracker in self.live.items():
                state[name] = {**tracker.state(), "last_step": self._last[name]}
            write_state(self.state_path, state)
        except Exception as exc:  # a full disk: the run goes on; a resume may then log a step again or start anew
            if not self._save_warned:
                self._save_warned = True
                warnings.warn(f"could not write {self.state_path}: {exc}", TrackerWarning, stacklevel=3)
            return
        self._saved = state


def read_state(path: Path) -> dict[str, Any]:
    """trackers.json, or {} when there is none (a new run) or it cannot be read (the trackers start afresh)."""
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def write_state(path: Path, state: dict[str, Any]) -> None:
    # Replaced whole through a temp file: a kill mid-write leaves the previous state, never half of one.
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(state, handle, indent=1, default=str)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def open_trackers(report_to: Any, *, run_id: str, run_dir: Path, kind: str, config: dict[str, Any] | None = None,
                  start_step: int = 0, history: Iterable[dict] = (), policies: Iterable[str] = (),
                  table_every: int = 1, last_step: int | None = None, keep_state: bool = True) -> Trackers:
    """Open the trackers `report_to` names for a run, continuing the tracker runs an earlier attempt left.

    A tracker that fails to open is off for the run, like one that fails later. `history`: the run's
    metrics.jsonl records so far, for trackers that do not hold them yet (`Trackers.catch_up`)."""
    names = tracker_names(report_to)
    if not names:
        return Trackers([])
    run_dir = Path(run_dir)
    state_path = run_dir / STATE_FILE if keep_state else None
    saved = read_state(state_path) if state_path is not None else {}
    opened: list[Tracker] = []
    failed = Trackers([])
    for name in names:
        context = TrackerContext(run_id=run_id, run_dir=run_dir, kind=kind, start_step=start_step,
                                 saved=dict(saved.get(name) or {}))
        try:
            opened.append(TRACKERS[name].opener()(context))
        except Exception as exc:
            failed.fail(name, "open", exc)
    trackers = Trackers(opened, state_path=state_path, policies=policies, table_every=table_every, last_step=last_step,
                        saved=saved)
    trackers.errors = failed.errors
    trackers.save()  # the ids first: a run killed before its first step resumes the same tracker runs
    if config is not None:
        trackers.log_config(config)
    trackers.catch_up(history)
    return trackers
