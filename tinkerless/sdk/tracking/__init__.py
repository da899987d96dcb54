"""Experiment trackers: a run's metrics, config, transcripts, cost summary and plots sent to Weights & Biases,
TensorBoard and MLflow (`TrainConfig.report_to`, docs/tracking.md), from the client process only.

- `base`: the `Tracker` protocol, the trackers by name (`TRACKERS`) and the check that a named one is
  installed (`check_report_to`, a ConfigError before any model loads);
- `fanout`: `Trackers`, the fan-out that keeps each tracker's failure to itself, and `trackers.json`,
  what a resume needs to continue the same tracker runs without sending a step twice;
- `runs`: what train, SFT, eval and Modal runs send;
- `wandb_tracker`, `tensorboard_tracker`, `mlflow_tracker`: one module per tracker, imported only when named.
"""

from tinkerless.sdk.tracking.base import TRACKERS, Tracker, TrackerContext, check_report_to, tracker_names
from tinkerless.sdk.tracking.fanout import STATE_FILE, Trackers, TrackerWarning, open_trackers

__all__ = [
    "STATE_FILE", "TRACKERS", "Tracker", "TrackerContext", "TrackerWarning", "Trackers", "check_report_to",
    "open_trackers", "tracker_names",
]
