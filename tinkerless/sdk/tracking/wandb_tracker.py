"""Weights & Biases: one W&B run per tinkerless run, resumed under the id kept in trackers.json.

Everything is logged from the client process, so `WANDB_API_KEY` (or `wandb login`) is needed only
there, never on the machines that run the functions. The project is `$WANDB_PROJECT` (default
`tinkerless`), the entity `$WANDB_ENTITY` (W&B's own default otherwise); files go to `$WANDB_DIR`, else
to the run's directory; `WANDB_MODE=offline` keeps the run on disk for `wandb sync`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from tinkerless.sdk.tracking.base import TrackerContext, flatten

INIT_TRIES, INIT_WAIT_S = 6, 5.0  # how long a resume waits for a killed client's W&B run to be let go
TABLE_COLUMNS = ("step", "policy", "task_index", "reward", "status", "turns", "transcript")


class WandbTracker:
    name = "wandb"

    def __init__(self, context: TrackerContext):
        import wandb

        self._wandb = wandb
        self.id = context.saved.get("id") or wandb.util.generate_id()
        self.offline_files: list[str] = list(context.saved.get("offline_files") or [])
        directory = os.environ.get("WANDB_DIR") or str(context.run_dir)
        Path(directory).mkdir(parents=True, exist_ok=True)
        settings = dict(
            project=os.environ.get("WANDB_PROJECT") or "tinkerless",
            id=self.id,
            name=context.run_id,
            resume="allow",  # the same W&B run again after a kill, or a new one the first time
            job_type=context.kind,
            dir=directory,
            # A run of its own even when the user's code already has one open: theirs is left as it is.
            reinit="create_new",
        )
        for attempt in range(INIT_TRIES):
            try:
                self.run = wandb.init(**settings)
                break
            except Exception as exc:
                # A W&B service shared between processes ($WANDB_SERVICE) holds a killed client's run until it notices
                # the death: a resume started at once waits for it, rather than log nothing to W&B.
                if "in use" not in str(exc) or attempt == INIT_TRIES - 1:
                    raise
                time.sleep(INIT_WAIT_S)
        self.holds_through = self._held(int(context.saved.get("last_step", -1)))
        if self.run.offline:
            self.offline_files.append(str(self.run.settings.sync_file))

    def _held(self, logged: int) -> int:
        """The last step W&B really holds from earlier attempts: never sent again, and every later one is (the
        fan-out sends the missing ones from metrics.jsonl).

        Online, the server says (a resumed run starts at the step after its last). Offline, the earlier attempts'
        transaction logs say: a killed client's W&B process dies with the records it had not written yet."""
        if not self.run.offline:
            return self.run.starting_step - 1
        if not self.offline_files:
            return logged
        try:
            return offline_last_step(self.offline_files)
        except Exception:  # W&B's file format is its own business: fall back to what was handed over
            return logged

    def log_config(self, config: dict[str, Any]) -> None:
        # A resumed run may change a setting (steps, resume): the newest value wins.
        self.run.config.update(config, allow_val_change=True)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def log_transcripts(self, step: int, rows: list[dict[str, Any]]) -> None:
        table = self._wandb.Table(columns=list(TABLE_COLUMNS), data=[[row.get(c) for c in TABLE_COLUMNS] for row in rows])
        self.run.log({"transcripts": table}, step=step)

    def log_summary(self, summary: dict[str, Any]) -> None:
        self.run.summary.update(flatten(summary))

    def log_artifact(self, path: Path) -> None:
        # As a summary image (shown on the run's overview), not at a step: it covers the whole run.
        self.run.summary[f"plot/{path.stem}"] = self._wandb.Image(str(path))

    def state(self) -> dict[str, Any]:
        return {"id": self.id, "project": self.run.project, "offline_files": self.offline_files}

    def close(self, status: str = "finished") -> None:
        self.run.finish(exit_code=0 if status == "finished" else 1)


def offline_last_step(files: list[str]) -> int:
    """The highest step in the history of W&B offline transaction logs (`run-<id>.wandb`); -1 for none."""
    from wandb.proto import wandb_internal_pb2 as pb
    from wandb.sdk.internal import datastore

    last = -1
    for file in files:
        if not os.path.exists(file):
            continue
        store = datastore.DataStore()
        store.open_for_scan(file)
        try:
            while (data := store.scan_data()) is not None:
                record = pb.Record()
                record.ParseFromString(data)
                if record.WhichOneof("record_type") == "history":
                    for item in record.history.item:
                        if (item.key or "/".join(item.nested_key)) == "_step":
                            last = max(last, int(json.loads(item.value_json)))
        except Exception:  # a torn last block (the writer was killed): the records before it count
            continue
    return last


def open_tracker(context: TrackerContext) -> WandbTracker:
    return WandbTracker(context)
