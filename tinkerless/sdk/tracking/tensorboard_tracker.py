"""TensorBoard: event files in `runs/<run_id>/tensorboard/` (`tensorboard --logdir runs` shows every run).

A resumed run writes into the same directory with `purge_step` at the step it resumes from: TensorBoard
then drops whatever an earlier attempt wrote from that step on (a killed writer may have left steps
after the checkpoint, or flushed only part of them), and the resumed run logs those steps once more.
(From an earlier step if TensorBoard had failed and was off: the steps it missed come from metrics.jsonl.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tinkerless.sdk.tracking.base import TrackerContext, flatten, markdown_transcripts

LOG_DIR = "tensorboard"


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, context: TrackerContext):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = str(context.saved.get("log_dir") or Path(context.run_dir) / LOG_DIR)
        if context.saved:  # an earlier attempt of this run wrote here
            # Rewritten from the resumed step on, or from the first step it missed (it had failed and was off).
            first = min(context.start_step, int(context.saved.get("last_step", -1)) + 1)
            self.writer = SummaryWriter(self.log_dir, purge_step=first)
            self.holds_through = first - 1  # the steps from `first` on come again: replayed, or from metrics.jsonl
        else:
            self.writer = SummaryWriter(self.log_dir)
            self.holds_through = -1
        self.step = max(context.start_step, 0)

    def log_config(self, config: dict[str, Any]) -> None:
        text = json.dumps(config, indent=1, sort_keys=True, default=str)
        self.writer.add_text("config", f"```\n{text}\n```", self.step)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.step = step
        self.writer.flush()  # a step is on disk when the fan-out counts it as logged

    def log_transcripts(self, step: int, rows: list[dict[str, Any]]) -> None:
        self.writer.add_text("transcripts", markdown_transcripts(rows), step)
        self.writer.flush()

    def log_summary(self, summary: dict[str, Any]) -> None:
        lines = ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in flatten(summary).items()]
        self.writer.add_text("summary", "\n".join(lines), self.step)

    def log_artifact(self, path: Path) -> None:
        from matplotlib.image import imread

        image = imread(str(path))  # H x W x channels, floats in [0, 1]
        self.writer.add_image(f"plot/{path.stem}", image[..., :3], self.step, dataformats="HWC")

    def state(self) -> dict[str, Any]:
        return {"log_dir": self.log_dir}

    def close(self, status: str = "finished") -> None:
        self.writer.close()


def open_tracker(context: TrackerContext) -> TensorBoardTracker:
    return TensorBoardTracker(context)
