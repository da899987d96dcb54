"""MLflow: one MLflow run per tinkerless run, in the experiment `$MLFLOW_EXPERIMENT_NAME` (default `tinkerless`).

The store is `$MLFLOW_TRACKING_URI`, else MLflow's own default (`sqlite:///mlflow.db` in the current
directory); the URI actually used and the run's id are kept in trackers.json, so a resume logs into
the same run of the same store. Through `MlflowClient` only: no global active run is started or changed.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from tinkerless.sdk.tracking.base import TrackerContext, flatten, safe_key

# MLflow's limits: a param value's length, and metrics per log_batch call.
MAX_PARAM_LENGTH = 6000
BATCH = 1000
STATUS = {"finished": "FINISHED", "interrupted": "KILLED"}


class MlflowTracker:
    name = "mlflow"

    def __init__(self, context: TrackerContext):
        from mlflow.tracking import MlflowClient

        saved = context.saved
        self.client = MlflowClient(tracking_uri=saved.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI") or None)
        self.tracking_uri = self.client.tracking_uri
        self.holds_through = int(saved.get("last_step", -1))
        self.step = max(context.start_step, 0)
        if saved.get("run_id"):
            self.run_id = saved["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")  # it was marked killed or failed when it stopped
        else:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "tinkerless"
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
            tags = {"tinkerless.run_id": context.run_id, "tinkerless.kind": context.kind}
            self.run_id = self.client.create_run(experiment_id, run_name=context.run_id, tags=tags).info.run_id

    def log_config(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        # MLflow refuses to change a param a run already has: a resume (resume=True, maybe more steps) adds only the
        # params the run does not have yet; the first attempt's values stay.
        have = self.client.get_run(self.run_id).data.params
        values = {safe_key(k): _text(v)[:MAX_PARAM_LENGTH] for k, v in flatten(config, sep=".").items()}
        params = [Param(k, v) for k, v in values.items() if k not in have]
        for first in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[first:first + 100])
        for key in ("model", "backend", "tinkerless_version"):
            if key in config:
                self.client.set_tag(self.run_id, f"tinkerless.{key}", _text(config[key]))

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [Metric(safe_key(k), v, now, step) for k, v in metrics.items()]
        for first in range(0, len(rows), BATCH):
            self.client.log_batch(self.run_id, metrics=rows[first:first + BATCH])
        self.step = step

    def log_transcripts(self, step: int, rows: list[dict[str, Any]]) -> None:
        text = "".join(json.dumps(row, ensure_ascii=False, default=str) + "\n" for row in rows)
        self.client.log_text(self.run_id, text, f"transcripts/step-{step:06d}.jsonl")

    def log_summary(self, summary: dict[str, Any]) -> None:
        self.client.log_text(self.run_id, json.dumps(summary, indent=1, default=str), "summary.json")
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        numbers = {k: v for k, v in flatten(summary).items() if _finite(v)}
        if numbers:  # as metrics too, so the runs table can sort and compare them (cost, compute seconds)
            self.client.log_batch(self.run_id, metrics=[Metric(safe_key(f"summary/{k}"), float(v), now, self.step)
                                                        for k, v in numbers.items()])

    def log_artifact(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def state(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "tracking_uri": self.tracking_uri}

    def close(self, status: str = "finished") -> None:
        self.client.set_terminated(self.run_id, STATUS.get(status, "FAILED"))


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


def open_tracker(context: TrackerContext) -> MlflowTracker:
    return MlflowTracker(context)
