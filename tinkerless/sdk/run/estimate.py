"""`tinkerless estimate CONFIG` and `train(config, dry_run=True)`: what a run will take before it spends.

On this machine's CPU, a short live calibration: the config's first `CALIBRATION_STEPS` steps run for real (in a
throwaway directory, nothing of the run is written), and the run is modelled from what they measured
(`StepModel`: fixed costs apart, later steps priced per sampled token and per trained sequence, the machine's
load measured as the calibration's share of its cores). On each GPU class, the project's measured throughput
(`functions/estimate.py`, each figure naming its device and date), with what fits where from the memory planner.
Every figure is device-seconds (what accounting bills, `compute_s/total`) and dollars at the run's prices.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import tempfile
import time
from dataclasses import dataclass, field

from tinkerless.functions.estimate import ESTIMATE_GPUS, Estimate, Workload, gpu_class, gpu_estimate, shape_of
from tinkerless.sdk.config import TrainConfig
from tinkerless.sdk.run.accounting import format_cost

CALIBRATION_STEPS = 2
PROMPT_TOKENS = 64  # a chat-templated prompt, roughly, for the GPU figures (the CPU calibration measures its own)


@dataclass
class RunEstimate:
    steps: int
    estimates: list[Estimate] = field(default_factory=list)
    calibration: dict = field(default_factory=dict)  # the CPU run's measured seconds: setup, steps, checkpoint

    def for_device(self, device: str) -> Estimate | None:
        return next((e for e in self.estimates if e.device == device), None)

    def table(self) -> str:
        lines = [f"estimate for {self.steps} steps (device-seconds; dollars at list or configured prices):",
                 f"  {'device':<10} {'per step':>22} {'whole run':>26} {'dollars':>24}  source"]
        for e in self.estimates:
            dollars = e.dollars()
            cost = "n/a" if dollars is None else f"{format_cost(dollars[1])} ({format_cost(dollars[0])}-{format_cost(dollars[2])})"
            step = f"{e.step_seconds[1]:.2f} ({e.step_seconds[0]:.2f}-{e.step_seconds[2]:.2f})"
            run = f"{e.run_seconds[1]:.0f} ({e.run_seconds[0]:.0f}-{e.run_seconds[2]:.0f})"
            lines.append(f"  {e.device:<10} {step:>22} {run:>26} {cost:>24}  {e.note or e.source}")
        return "\n".join(lines)

    def beside(self, usage: dict) -> str:
        """The estimate for the device a run used, beside what it used (a run's `RunResult.usage`)."""
        device = str(usage.get("device", "unknown"))
        mine = self.for_device("cpu" if device == "cpu" else next((e.device for e in self.estimates
                                                                 if e.device.lower() in device.lower()), device))
        actual = float(usage.get("compute_seconds_total", math.nan))
        if mine is None:
            return f"actual: {actual:.1f} device-seconds on {device} (no estimate for this device)"
        low, point, high = mine.run_seconds
        return (f"estimate {point:.1f} s ({low:.1f}-{high:.1f}) beside actual {actual:.1f} s on {device}: "
                f"{100 * (point - actual) / actual:+.0f}% (estimate over actual)")


def workload(config: TrainConfig) -> Workload:
    turns = config.turn_limit()
    return Workload(steps=config.steps, episodes=config.batch_size * config.group_size, prompt_tokens=PROMPT_TOKENS * turns,
                    max_new_tokens=config.max_tokens * turns, lora_rank=config.lora_rank)


def estimate(config: TrainConfig, *, calibrate: bool = True, gpus: tuple[str, ...] = ESTIMATE_GPUS) -> RunEstimate:
    """The run's estimate on this CPU (calibrated, unless `calibrate` is False) and on each of `gpus`."""
    config.validate()
    result = RunEstimate(config.steps)
    if calibrate:
        cpu, result.calibration = _calibrated(config)
        result.estimates.append(cpu)
    shape = shape_of(config.model)
    prices = config.price_table()
    for gpu in gpus if shape is not None else ():
        result.estimates.append(gpu_estimate(shape, workload(config), gpu, prices))
    return result


def _calibrated(config: TrainConfig) -> tuple[Estimate, dict]:
    """Run the config's first steps here (a throwaway run) and model the whole run from what they measured."""
    from tinkerless.sdk.run.trainer import train

    steps = min(CALIBRATION_STEPS, config.steps)
    wall, cpu = time.perf_counter(), time.process_time()
    # The probe's own report would read like a finished run: it is not shown.
    with tempfile.TemporaryDirectory(prefix="tinkerless-estimate-") as storage, contextlib.redirect_stdout(io.StringIO()):
        probe = train(config.replace(steps=steps, storage=storage, run_id="estimate", resume=False, progress=False,
                                     checkpoint_every=steps, report_to=[], eval_every=None, transcripts_per_step=0,
                                     init_from=None, max_cost_usd=None, max_compute_seconds=None))
    share = cpu_share(time.process_time() - cpu, time.perf_counter() - wall)
    phases = probe.usage["compute_seconds"]
    model = StepModel.measured(probe.metrics, setup_s=phases["setup"], checkpoint_s=float(phases.get("storage", 0.0)),
                               cpu_share=share)
    checkpoints = math.ceil(config.steps / config.checkpoint_every)
    runs = model.run_seconds(config.steps, checkpoints, max_sampled_tokens(config))
    per_step = model.later_step_seconds(max_sampled_tokens(config))
    rate = config.price_table().per_hour("cpu")
    threads = _threads()
    note = (f"calibrated here: {steps} steps of this config, which had {100 * share:.0f}% of the "
            f"{threads} core{'s' if threads > 1 else ''} it uses" + ("" if share >= 0.85 else " (a busy machine: the range runs from an idle one to "
                                                                 "one this much busier)"))
    return Estimate("cpu", per_step, runs, rate, note), {**model.describe(), "device": probe.usage["device"]}


def cpu_share(cpu_seconds: float, wall_seconds: float) -> float:
    """The share of its cores this process had: its CPU time over what its threads could have used in the wall
    time (1.0 on an idle machine; 0.5 when other jobs took half). Clamped to [0.1, 1]."""
    if wall_seconds <= 0:
        return 1.0
    return min(1.0, max(0.1, cpu_seconds / (wall_seconds * _threads())))


def _threads() -> int:
    import torch

    return max(1, min(torch.get_num_threads(), os.cpu_count() or 1))


def max_sampled_tokens(config: TrainConfig) -> int:
    """The most tokens one step can sample: every episode's every turn to max_tokens."""
    return config.batch_size * config.group_size * config.max_tokens * config.turn_limit()


@dataclass(frozen=True)
class StepModel:
    """A CPU run from its first steps: fixed costs apart from per-step costs, and each step's cost from what it
    does rather than from how the first steps went.

    - fixed: model load (setup) and each checkpoint, once per run or per checkpoint;
    - the first step as measured (it carries the warm-up: the first generation and backward);
    - every later step: sampling at the measured seconds per sampled token (the warm calibration step), times the
      tokens a step samples, plus the update at the measured seconds per trained sequence, times the sequences a
      step trains. A step trains only the groups whose rewards differ: on a job that learns, more groups agree as
      it goes and are skipped, so the trained share is a range, from none to the first steps' share, with the
      point at half of it; the sampled tokens range from 0.75x the warm step's (answers shorten) to the most a
      step may sample (max_tokens on every episode);
    - the machine's load: the calibration's share of its cores (`cpu_share`). The point assumes the run gets the
      same share; the range runs from an idle machine (x share) to one that much busier again (/ share).
    """

    setup_s: float
    first_step_s: float
    checkpoint_s: float
    rollout_s_per_token: float
    update_s_per_sequence: float
    sampled_tokens: float  # the warm step's
    trained_sequences: tuple[float, float]  # (mean, max) over the calibration steps
    cpu_share: float = 1.0
    rollout_fixed_s: float = 0.0  # a warm step that sampled nothing (its rollout was all environment): as it was

    @classmethod
    def measured(cls, metrics: list[dict], *, setup_s: float, checkpoint_s: float, cpu_share: float = 1.0) -> "StepModel":
        def seconds(m: dict, phase: str) -> float:
            return float(m.get(f"compute_s/{phase}", 0.0) or 0.0)

        warm = metrics[-1]  # the last calibration step: past the warm-up
        tokens = float(warm.get("sampled_tokens") or 0.0)
        trained = [float(m.get("trained_sequences") or 0.0) for m in metrics]
        update = sum(seconds(m, "update") + seconds(m, "forward") for m in metrics)
        return cls(setup_s=setup_s, first_step_s=seconds(metrics[0], "step"), checkpoint_s=checkpoint_s,
                   rollout_s_per_token=seconds(warm, "rollout") / tokens if tokens else 0.0,
                   rollout_fixed_s=0.0 if tokens else seconds(warm, "rollout"),
                   update_s_per_sequence=update / sum(trained) if sum(trained) else 0.0,
                   sampled_tokens=tokens, trained_sequences=(sum(trained) / len(trained), max(trained)),
                   cpu_share=cpu_share)

    def later_step_seconds(self, max_tokens_per_step: int) -> tuple[float, float, float]:
        """A step after the first: (low, point, high) device-seconds at the calibration's load."""
        tokens = (0.75 * self.sampled_tokens, self.sampled_tokens, max(self.sampled_tokens, float(max_tokens_per_step)))
        mean, most = self.trained_sequences
        trained = (0.0, mean / 2, most)
        return tuple(self.rollout_fixed_s + self.rollout_s_per_token * t + self.update_s_per_sequence * n  # type: ignore[return-value]
                     for t, n in zip(tokens, trained))

    def run_seconds(self, steps: int, checkpoints: int, max_tokens_per_step: int) -> tuple[float, float, float]:
        fixed = self.setup_s + self.checkpoint_s * checkpoints
        low, point, high = (fixed + self.first_step_s + later * max(0, steps - 1)
                            for later in self.later_step_seconds(max_tokens_per_step))
        return low * self.cpu_share, point, high / self.cpu_share

    def describe(self) -> dict:
        return {"setup_s": self.setup_s, "first_step_s": self.first_step_s, "checkpoint_s": self.checkpoint_s,
                "rollout_s_per_token": self.rollout_s_per_token, "update_s_per_sequence": self.update_s_per_sequence,
                "sampled_tokens": self.sampled_tokens, "trained_sequences": list(self.trained_sequences),
                "cpu_share": self.cpu_share, "rollout_fixed_s": self.rollout_fixed_s}


def dry_run(config: TrainConfig) -> RunEstimate:
    """`train(config, dry_run=True)`: the estimate, printed, and nothing trained."""
    found = estimate(config)
    print(found.table(), flush=True)
    return found


def before_launch(config: TrainConfig, gpu: str | list[str] | None) -> str:
    """What a cloud launch prints before it spends: the estimate on the GPU class it asked for, or on each of the
    classes it accepts (from the measured tables: no calibration, nothing runs here)."""
    asked = [gpu] if gpu is None or isinstance(gpu, str) else list(gpu)
    kinds = list(dict.fromkeys(kind for kind in map(gpu_class, asked) if kind is not None))
    unknown = [name for name in asked if gpu_class(name) is None]
    lines = [estimate(config, calibrate=False, gpus=tuple(kinds)).table()] if kinds else []
    if unknown:
        lines.append(f"estimate: no figures for GPU {', '.join(map(repr, unknown))} (`tinkerless estimate CONFIG` "
                     "lists the classes it knows)")
    return "\n".join(lines)


def beside_actual(metrics: list[dict], usage: dict) -> str | None:
    """A finished CPU run's report line: what the calibrated estimate would have said from this run's own first
    steps, beside what the run used (None for a run too short to say, or on another device)."""
    if usage.get("device") != "cpu" or len(metrics) < CALIBRATION_STEPS + 1:
        return None
    from tinkerless.sdk.run.accounting import seconds_by_phase, seconds_total

    calibration = metrics[:CALIBRATION_STEPS]
    phases, actual = seconds_by_phase(usage), seconds_total(usage)
    if actual <= 0 or not all(math.isfinite(float(m.get("compute_s/step", math.nan))) for m in calibration):
        return None
    # Its checkpoints as they were (the estimate times one checkpoint by their count: the same sum).
    model = StepModel.measured(calibration, setup_s=float(phases.get("setup", 0.0)), checkpoint_s=float(phases.get("storage", 0.0)))
    tokens = max(float(m.get("sampled_tokens") or 0.0) for m in metrics)  # the most this run sampled in a step
    point = model.run_seconds(len(metrics), 1, int(tokens))[1]
    return (f"estimate {point:.1f} s (from its first {CALIBRATION_STEPS} steps, as `tinkerless estimate` "
            f"models a run) beside actual {actual:.1f} s: {100 * (point - actual) / actual:+.0f}%")
