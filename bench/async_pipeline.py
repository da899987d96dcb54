"""Synchronous against async training (`max_staleness`) on the same two processes: seconds a step and reward.

    .venv/bin/python bench/async_pipeline.py --out runs/bench-async            # the main job and guess_number
    .venv/bin/python bench/async_pipeline.py --seeds 0,1 --out runs/bench-async     # each job and k on two seeds
    .venv/bin/python bench/async_pipeline.py --jobs arithmetic --steps 4 --staleness 0,1   # a quick look

Every run uses one reader process (the rollouts, 1 thread) and one writer process (the update, 1 thread):
`backend="local", rollout_workers=1, threads=2`. Synchronous (k = 0) takes turns: the reader idles while the
writer updates and the other way round; with k ≥ 1 step s samples from policy version s − k while the updates
of the steps before it run. For each job and k it reports the mean seconds a step (after the first, which loads
and warms), the rewards against wall-clock time (`async_pipeline.png`), the staleness and the sampler/trainer
log-prob gap, as JSON lines written as each run ends, and a markdown table for BENCHMARKS.md. With several
`--seeds` the table's figures are means over them: a run's rewards steer how many tokens its policy samples, so
one seed's step time mixes the pipeline's speed with its policy's verbosity.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JOBS = {"arithmetic": REPO / "examples/arithmetic.py", "guess_number": REPO / "examples/guess_number.py"}


def load_config(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.config


def run(job: str, staleness: int, steps: int, out: Path, seed: int = 0, tis_cap: float | None = None) -> dict:
    import tinkerless

    config = load_config(JOBS[job])
    tis_cap = config.tis_cap if tis_cap is None else tis_cap
    config = config.replace(
        tis_cap=tis_cap,
        steps=steps, max_staleness=staleness, rollout_workers=1, threads=2, backend="local", progress=False,
        storage=str(out / (f"{job}-k{staleness}-seed{seed}" + (f"-tis{tis_cap}" if tis_cap else ""))), run_id="r",
        checkpoint_every=steps, report_to=[],
        seed=seed)
    started = time.perf_counter()
    result = tinkerless.train(config)
    wall = time.perf_counter() - started
    metrics = result.metrics
    # wall-clock at the end of each step, from the records' own step seconds (setup excluded)
    clock, elapsed = [], 0.0
    for record in metrics:
        elapsed += record["step_s"]
        clock.append(elapsed)
    warm = [r["step_s"] for r in metrics[1:]] or [metrics[0]["step_s"]]
    return {"job": job, "max_staleness": staleness, "seed": seed, "tis_cap": tis_cap, "steps": steps, "wall_s": wall,
            "mean_step_s": statistics.mean(warm), "clock_s": clock, "reward": [r["reward_mean"] for r in metrics],
            "staleness": [r.get("staleness", 0) for r in metrics],
            "logprob_gap": [r.get("logprob_gap") for r in metrics], "rollout_s": [r["rollout_s"] for r in metrics],
            "update_s": [r.get("update_s") for r in metrics],
            "trained_tokens": [r.get("trained_tokens") for r in metrics]}


def reward_at(row: dict, seconds: float, window: int = 3) -> float:
    """The mean reward of the last `window` steps finished by `seconds` of training."""
    done = [r for r, t in zip(row["reward"], row["clock_s"]) if t <= seconds] or row["reward"][:1]
    return statistics.mean(done[-window:])


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    jobs = sorted({r["job"] for r in rows})
    figure, axes = plt.subplots(1, len(jobs), figsize=(6 * len(jobs), 4), squeeze=False)
    for axis, job in zip(axes[0], jobs):
        for row in (r for r in rows if r["job"] == job):
            style = ["-", "--", ":", "-."][row.get("seed", 0) % 4]  # colour: k; line: seed
            axis.plot(row["clock_s"], row["reward"], style, marker=".", color=f"C{row['max_staleness']}",
                      label=f"max_staleness={row['max_staleness']}, seed {row.get('seed', 0)}")
        axis.set(title=f"{job}: reward against wall-clock", xlabel="seconds of training", ylabel="reward_mean")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def table(rows: list[dict]) -> str:
    """One line per job and k, each figure the mean over the seeds run (a run's reward path depends on its seed,
    and with it how many tokens its policy samples: the trained tokens column shows the work each k did)."""
    lines = ["| job | max_staleness | seeds | s/step | steps/s vs sync | trained tokens a step | reward, last 3 steps "
             "| reward at sync's half time | mean staleness | mean logprob_gap |", "|---|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r["job"], r["max_staleness"], r.get("tis_cap")) for r in rows},
                  key=lambda k: (list(JOBS).index(k[0]), k[2] or 0, k[1]))
    for job, staleness, tis_cap in keys:
        runs = [r for r in rows if (r["job"], r["max_staleness"], r.get("tis_cap")) == (job, staleness, tis_cap)]
        # the synchronous runs of the same job and tis_cap, else of the same job (the baseline of a later k-only run)
        syncs = {r["seed"]: r for r in rows if r["job"] == job and r["max_staleness"] == 0 and r.get("tis_cap") is None}
        syncs.update({r["seed"]: r for r in rows if (r["job"], r["max_staleness"], r.get("tis_cap")) == (job, 0, tis_cap)})
        if not syncs:
            lines.append(f"| {job} | {staleness} | {len(runs)} | (no synchronous run in these rows) |||||||")
            continue
        mean_step = statistics.mean(r["mean_step_s"] for r in runs)
        sync_step = statistics.mean(r["mean_step_s"] for r in syncs.values())
        gaps = [g for r in runs for g in r["logprob_gap"] if g is not None]
        label = job if tis_cap is None else f"{job} (tis_cap {tis_cap})"
        lines.append(
            f"| {label} | {staleness} | {len(runs)} | {mean_step:.2f} | {sync_step / mean_step:.2f}x "
            f"| {statistics.mean(t for r in runs for t in r['trained_tokens'][1:] if t is not None):.0f} "
            f"| {statistics.mean(statistics.mean(r['reward'][-3:]) for r in runs):.3f} "
            f"| {statistics.mean(reward_at(r, syncs[r['seed']]['clock_s'][-1] / 2) for r in runs):.3f} "
            f"| {statistics.mean(s for r in runs for s in r['staleness']):.2f} | {statistics.mean(gaps) if gaps else 0:.4f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", default="arithmetic,guess_number")
    parser.add_argument("--staleness", default="0,1,2")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seeds", default="0", help="comma-separated TrainConfig seeds; every job and k runs each")
    parser.add_argument("--tis-cap", type=float, default=None, help="TrainConfig.tis_cap for every run (default: the job's)")
    parser.add_argument("--out", default="runs/bench-async")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "async_pipeline.jsonl"
    results.write_text("")
    rows = []
    for job in args.jobs.split(","):
        for seed in (int(x) for x in args.seeds.split(",")):
            for staleness in (int(k) for k in args.staleness.split(",")):
                row = run(job, staleness, args.steps, out, seed, args.tis_cap)
                rows.append(row)
                with results.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"{job} seed={seed} k={staleness}: {row['mean_step_s']:.2f} s/step, reward {row['reward'][-1]:.3f}",
                      flush=True)
    plot(rows, out / "async_pipeline.png")
    print(table(rows))


if __name__ == "__main__":
    main()
