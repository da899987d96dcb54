"""What a run will take on each GPU class, before it starts: device-seconds and dollars, with a range.

Beside the memory planner (`memory_plan`: what fits where) this adds time and money. A GPU class's seconds come
from the throughput the project measured (`MEASURED`: bench/gpu_shapes.py on one device, its date and file
named), interpolated over model size and scaled to other classes by their memory bandwidth (decoding a batch
is bandwidth-bound), so a class that was not measured gets a wider range. A CPU's seconds come from a short
live calibration instead (`sdk/run/estimate.py` runs the config's first steps), since a CPU's speed depends on
the machine and what else runs on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tinkerless.functions.memory_plan import GPU_MEMORY_GIB, SHAPES, ModelShape, fits_sampler, fits_update
from tinkerless.functions.prices import PriceTable

# bench/results/gpu-h200-shapes-2026-11-26.jsonl: tinkerless's sampler (CUDA graphs, 64 rows) and update, bf16.
MEASURED_ON = {"device": "NVIDIA H200", "date": "2026-11-26", "file": "bench/results/gpu-h200-shapes-2026-11-26.jsonl"}
MEASURED = {  # model -> (decode tokens/s over a batch of 64 rows, update tokens/s)
    "135M": (7427.0, 13990.0),
    "1.7B": (7817.0, 18195.0),
    "8B": (2501.0, 8540.0),
}
MEASURED_ROWS = 64
# Nominal HBM bandwidth (TB/s), the scale from the measured class to another (public spec sheets).
BANDWIDTH_TBS = {"T4": 0.32, "L4": 0.30, "A10G": 0.60, "L40S": 0.86, "A100-40GB": 1.56, "A100-80GB": 2.04,
                 "H100": 3.35, "H200": 4.8, "B200": 8.0}
ESTIMATE_GPUS = tuple(BANDWIDTH_TBS)
SETUP_SECONDS = (20.0, 90.0)  # loading the model and compiling the sampler on a GPU: a range, not measured here
MEASURED_SPREAD, SCALED_SPREAD = 0.3, 0.6  # +- around the point estimate


@dataclass(frozen=True)
class Workload:
    """What a run asks of its device per step (the config's numbers)."""

    steps: int
    episodes: int  # batch_size * group_size
    prompt_tokens: int  # per episode, roughly
    max_new_tokens: int  # per episode: max_tokens * turns (a batch decodes until its longest row ends)
    lora_rank: int = 16


@dataclass
class Estimate:
    """One device class's estimate: seconds per step and for the run (low, point, high), and dollars."""

    device: str
    step_seconds: tuple[float, float, float]
    run_seconds: tuple[float, float, float]
    price_per_hour: float | None
    source: str
    fits: bool = True
    note: str = ""
    phases: dict = field(default_factory=dict)

    def dollars(self, which: str = "run") -> tuple[float, float, float] | None:
        if self.price_per_hour is None:
            return None
        seconds = self.run_seconds if which == "run" else self.step_seconds
        return tuple(s * self.price_per_hour / 3600.0 for s in seconds)  # type: ignore[return-value]


def shape_of(model: str) -> ModelShape | None:
    if model in ("smollm2", "smollm2-135m", "SmolLM2-135M-Instruct", "tiny"):
        return SHAPES["135M"]
    try:
        return ModelShape.of(model)
    except Exception:  # noqa: BLE001 - a model whose config cannot be read here: no GPU estimate, said so
        return None


def _throughput(params: float) -> tuple[float, float]:
    """Decode and update tokens/s on the measured device for a model of `params`, log-log between measurements."""
    points = sorted((_params(name), rates) for name, rates in MEASURED.items())
    if params <= points[0][0]:
        return points[0][1]
    if params >= points[-1][0]:  # beyond the largest measured: throughput falls with size
        scale = points[-1][0] / params
        return points[-1][1][0] * scale, points[-1][1][1] * scale
    for (p0, r0), (p1, r1) in zip(points, points[1:]):
        if p0 <= params <= p1:
            t = (math.log(params) - math.log(p0)) / (math.log(p1) - math.log(p0))
            return tuple(math.exp(math.log(a) + t * (math.log(b) - math.log(a))) for a, b in zip(r0, r1))  # type: ignore[return-value]
    raise AssertionError("unreachable")


def _params(name: str) -> float:
    from tinkerless.functions.scaling_table import LADDER

    shape = SHAPES.get(name) or LADDER[name]
    return float(shape.params())


def gpu_estimate(shape: ModelShape, work: Workload, gpu: str, prices: PriceTable | None = None) -> Estimate:
    """`work` on one GPU of class `gpu`, from the measured throughput (see the module docstring)."""
    decode_tps, update_tps = _throughput(float(shape.params()))
    scale = BANDWIDTH_TBS[gpu] / BANDWIDTH_TBS["H200"]
    measured = gpu == "H200"
    spread = MEASURED_SPREAD if measured else SCALED_SPREAD
    # A batch decodes one token for all its rows per step; past 64 rows, more steps' worth of rows.
    batches = max(1, math.ceil(work.episodes / MEASURED_ROWS))
    rollout = batches * work.max_new_tokens * MEASURED_ROWS / (decode_tps * scale)
    trained = work.episodes * (work.prompt_tokens + work.max_new_tokens)
    update = trained / (update_tps * scale)
    point = rollout + update
    step = (point * (1 - spread), point, point * (1 + spread))
    setup = (SETUP_SECONDS[0], sum(SETUP_SECONDS) / 2, SETUP_SECONDS[1])
    run = tuple(a + s * work.steps for a, s in zip(setup, step))
    tokens = work.prompt_tokens + work.max_new_tokens
    fits = fits_update(shape, gpu, 1, lora_rank=work.lora_rank, tokens=tokens) and fits_sampler(
        shape, gpu, 1, lora_rank=work.lora_rank, tokens=tokens)
    source = (f"measured on {MEASURED_ON['device']} ({MEASURED_ON['date']}, {MEASURED_ON['file']})" if measured else
              f"{MEASURED_ON['device']}'s measurement scaled by memory bandwidth ({BANDWIDTH_TBS[gpu]} TB/s)")
    return Estimate(gpu, step, run, (prices or PriceTable()).per_hour(gpu), source, fits,
                    "" if fits else f"does not fit one {gpu} ({GPU_MEMORY_GIB[gpu]} GB)",
                    {"rollout": rollout, "update": update})


def gpu_class(name: str | None) -> str | None:
    """The estimate's class for a GPU name as Modal and SkyPilot spell it ("H100!", "A100", "A100-80GB:4")."""
    if not name:
        return None
    base = str(name).split(":")[0].rstrip("!+").strip()
    base = {"A100": "A100-40GB", "A10": "A10G"}.get(base, base)
    return base if base in BANDWIDTH_TBS else None
