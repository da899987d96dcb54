"""A tqdm progress bar with live reward, loss, tokens/s and the run's compute so far (seconds, $), and the
report a finished run prints."""

from __future__ import annotations

import math
import sys

from tinkerless.sdk.run.accounting import format_cost, format_usage
from tinkerless.sdk.run.metrics import describe_rewards, reward_summary
from tinkerless.sdk.run.transcripts import TRANSCRIPTS_FILE


class Progress:
    def __init__(self, total: int, initial: int = 0, *, enabled: bool = True, description: str = ""):
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=description, unit="step", dynamic_ncols=True)
            from tinkerless.sdk.backends import http

            http.wait_listeners.append(self.waiting)  # a busy server's Retry-After waits show on the bar

    def waiting(self, seconds: float, why: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"waiting: {why}", refresh=True)

    def update(self, record: dict) -> None:
        if self.bar is None:
            return
        self.bar.set_postfix(
            reward=_fmt(record.get("reward_mean")),
            loss=_fmt(record.get("loss"), 3, "g"),
            tok_s=_fmt(record.get("tokens_per_s"), 1),
            kl_st=_fmt(record.get("kl_sample_train"), 2, "e"),  # the sampler/trainer gap (tis_cap corrects it)
            err=record.get("episodes_error", 0),
            compute_s=_fmt(record.get("compute_s/total"), 1),
            trunc=_percent(record.get("episodes_truncated_frac")),
            cost=_cost(record),
            **_teacher(record),
            refresh=False,
        )
        self.bar.update(1)

    def write(self, message: str) -> None:
        if self.bar is not None:
            self.bar.write(message)

    def warn(self, message: str) -> None:
        """A message the user must see even without a progress bar (then it goes to stderr)."""
        if self.bar is not None:
            self.bar.write(message)
        else:
            print(message, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            from tinkerless.sdk.backends import http

            if self.waiting in http.wait_listeners:
                http.wait_listeners.remove(self.waiting)
            self.bar.close()


def _fmt(value, digits: int = 3, kind: str = "f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}{kind}}"


def _percent(fraction) -> str:
    return "-" if fraction is None else f"{100 * fraction:.0f}%"


def _teacher(record: dict) -> dict:
    """With a teacher: its log-prob gap to the sampler (the reverse KL left to close) and the aligned share."""
    if "teacher_logprob_gap" not in record:
        return {}
    return {"t_gap": _fmt(record.get("teacher_logprob_gap")), "aligned": _percent(record.get("teacher_aligned_share"))}


def _cost(record: dict) -> str:
    return format_cost(record["cost_usd"]) if "cost_usd" in record else "-"


def final_report(result) -> str:
    """What a finished run prints: rewards, where its files are, how to resume it, what it used."""
    return (
        f"run {result.run_id} finished: {describe_rewards(reward_summary(result.metrics))}\n"
        f"  metrics: {result.run_dir / 'metrics.jsonl'}\n  plot:    {result.plot_path}\n"
        f"  episodes: {result.run_dir / TRANSCRIPTS_FILE}\n"
        f"  checkpoint: step-{result.last_checkpoint_step} (resume with --resume --run-id {result.run_id})"
        + (f"\n  compute: {format_usage(result.usage)}" if result.usage else "")
        + (f"\n  estimate: {line}" if (line := _estimate_line(result)) else "")
    )


def _estimate_line(result) -> str | None:
    from tinkerless.sdk.run.estimate import beside_actual

    return beside_actual(result.metrics, result.usage) if result.usage else None
