"""`tinkerless estimate CONFIG` and `train(config, dry_run=True)`: what a run will take before it spends.

On this machine's CPU, a short live calibration: the config's first `CALIBRATION_STEPS` steps run for real (in a
throwaway directory, nothing of the run is written), and the run is extrapolated from them: model load + first
step + (steps - 1) x their mean step + its checkpoints. On each GPU class, the project's measured throughput
(`functions/estimate.py`, each figure naming its device and date), with what fits where from the memory planner.
Every figure is device-seconds (what accounting bills, `compute_s/total`) and dollars at the run's prices.
"""

from __future__ import annotations

import contextlib
import io
import math
import tempfile
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
                f"{100 * (actual - point) / point:+.0f}%")


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
    """Run the config's first steps here (a throwaway run) and extrapolate the whole run from them."""
    from tinkerless.sdk.run.trainer import train

    steps = min(CALIBRATION_STEPS, config.steps)
    # The probe's own report would read like a finished run: it is not shown.
    with tempfile.TemporaryDirectory(prefix="tinkerless-estimate-") as storage, contextlib.redirect_stdout(io.StringIO()):
        probe = train(config.replace(steps=steps, storage=storage, run_id="estimate", resume=False, progress=False,
                                     checkpoint_every=steps, report_to=[], eval_every=None, transcripts_per_step=0,
                                     init_from=None, max_cost_usd=None, max_compute_seconds=None))
    usage = probe.usage
    phases = usage["compute_seconds"]
    per_step = [float(m["compute_s/step"]) for m in probe.metrics]
    checkpoint = float(phases.get("storage", 0.0))  # the probe's one checkpoint
    # A step is their mean: the first carries the warm-up, and on a shared machine either may carry a neighbour's load.
    first, step = per_step[0], sum(per_step) / len(per_step)
    checkpoints = math.ceil(config.steps / config.checkpoint_every)
    point = extrapolated(phases["setup"], per_step, checkpoint, checkpoints, config.steps)
    # The spread of a step on a busy machine: the two measured steps bound it, and at least +-15%.
    spread = max(0.15, abs(first - per_step[-1]) / max(step, 1e-9) / 2) if steps > 1 else 0.3
    runs = (point * (1 - spread), point, point * (1 + spread))
    rate = config.price_table().per_hour("cpu")
    calibration = {"setup_s": phases["setup"], "step_s": per_step, "checkpoint_s": checkpoint, "device": usage["device"]}
    return Estimate("cpu", (step * (1 - spread), step, step * (1 + spread)), runs, rate,
                    f"calibrated here: {steps} steps of this config"), calibration


def dry_run(config: TrainConfig) -> RunEstimate:
    """`train(config, dry_run=True)`: the estimate, printed, and nothing trained."""
    found = estimate(config)
    print(found.table(), flush=True)
    return found


def before_launch(config: TrainConfig, gpu: str | None) -> str:
    """What a cloud launch prints before it spends: the estimate on the GPU class it asked for (from the measured
    tables: no calibration, nothing runs here)."""
    kind = gpu_class(gpu)
    if kind is None:
        return f"estimate: no figures for GPU {gpu!r} (`tinkerless estimate CONFIG` lists the classes it knows)"
    return estimate(config, calibrate=False, gpus=(kind,)).table()


def extrapolated(setup: float, steps: list[float], checkpoint_s: float, checkpoints: int, total_steps: int) -> float:
    """The calibrated estimate's point: setup + first step + (steps - 1) x the mean of the measured steps +
    the checkpoints (one rule for `estimate` and for a finished run's report)."""
    return setup + steps[0] + sum(steps) / len(steps) * (total_steps - 1) + checkpoint_s * checkpoints


def beside_actual(metrics: list[dict], usage: dict) -> str | None:
    """A finished CPU run's report line: what the calibrated estimate would have said from this run's own first
    steps, beside what the run used (None for a run too short to say, or on another device)."""
    if usage.get("device") != "cpu" or len(metrics) < CALIBRATION_STEPS + 1:
        return None
    from tinkerless.sdk.run.accounting import seconds_by_phase, seconds_total

    steps = [float(m.get("compute_s/step", math.nan)) for m in metrics[:CALIBRATION_STEPS]]
    phases, actual = seconds_by_phase(usage), seconds_total(usage)
    if not all(math.isfinite(s) for s in steps) or actual <= 0:
        return None
    # Its checkpoints as they were (the estimate times one checkpoint by their count: the same sum).
    point = extrapolated(float(phases.get("setup", 0.0)), steps, float(phases.get("storage", 0.0)), 1, len(metrics))
    return (f"estimate {point:.1f} s (from its first {CALIBRATION_STEPS} steps, as `tinkerless estimate` "
            f"extrapolates) beside actual {actual:.1f} s: {100 * (point - actual) / actual:+.0f}%")
