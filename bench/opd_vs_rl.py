"""On-policy distillation against RL on the same job and budget, SmolLM2 on this CPU.

    python bench/opd_vs_rl.py                      # RL 20 steps (the teacher), then OPD 8 steps from the base
    python bench/opd_vs_rl.py --rl-steps 20 --opd-steps 8 --out bench/results

The job is examples/arithmetic.py's (sums of two digits, 8 prompts x 4 samples, 12 new tokens, temperature
0.7, lr 5e-4, LoRA r16). First RL trains from the base model for --rl-steps steps: its final checkpoint is the
teacher, and its steps are RL's curve. Then OPD trains from the base model with `teacher="rl@<last>"`, no
reward in its advantages (the teacher's per-token reverse KL only). Every checkpoint of both runs is then
played on the same held-out tasks (sums the runs never trained on, each sampled twice at the training
temperature, the same seed), so both curves are the same measurement; the teacher's reward is RL's last
checkpoint's. Reported: for each run the first step whose held-out reward reaches 90% of the teacher's, the
training wall-clock up to it (the steps' own seconds), both curves, and the teacher's forward cost per
trained token against the student's own (compute_s/teacher vs the update's forward+backward, and a direct
forward of each on the same batch, alternated).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import tinkerless  # noqa: E402


def make_task(rng):
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return {"prompt": f"What is {a} + {b}? Answer with a number.", "answer": a + b}


@tinkerless.reward
def arithmetic_reward(completion: str, task: dict) -> float:
    numbers = re.findall(r"-?\d+", completion)
    if not numbers or int(numbers[0]) != task["answer"]:
        return 0.0
    return 1.0 + (0.5 if completion.strip().rstrip(".") == str(task["answer"]) else 0.0)


def held_out() -> list[dict]:
    """32 sums of two digits in an order the training stream does not start with (a seed of their own)."""
    import random

    rng = random.Random(20261128)
    return [make_task(rng) for _ in range(32)]


def config(storage: str, **changes):
    base = tinkerless.TrainConfig(
        name="bench", model="smollm2", reward=arithmetic_reward, tasks=make_task, steps=20, batch_size=8, group_size=4,
        max_tokens=12, temperature=0.7, learning_rate=5e-4, lora_rank=16, checkpoint_every=1, keep_checkpoints=None,
        storage=storage, progress=False, transcripts_per_step=0,
    )
    return base.replace(**changes)


def curve(storage: str, run_id: str, steps: int, eval_config) -> list[float]:
    """Held-out mean reward of the base model (step 0) and of each checkpoint 1..steps."""
    from tinkerless.sdk.evaluation.evaluate import evaluate

    cache = Path(storage, f"heldout-{run_id}.json")  # a rerun (--skip-train) reuses the evaluations done
    done = json.loads(cache.read_text()) if cache.is_file() else {}
    out = []
    for step in range(steps + 1):
        checkpoint = "base" if step == 0 else f"{run_id}@{step}"
        if checkpoint not in done:
            done[checkpoint] = float(evaluate(eval_config, checkpoint=checkpoint, tasks=held_out(), samples=2, seed=7).mean)
            cache.write_text(json.dumps(done))
        out.append(done[checkpoint])
        print(f"eval {checkpoint}: {out[-1]:.3f}", flush=True)
    return out


def first_reaching(values: list[float], target: float) -> int | None:
    return next((i for i, v in enumerate(values) if v >= target), None)


def forward_costs(storage: str, teacher: str, rounds: int = 3) -> dict:
    """The teacher's forward (an adapter on the policy's worker) against the student's own, on the same batch."""
    from tinkerless.sdk.backends.base import LocalBackend
    from tinkerless.sdk.backends.client import TrainingClient
    from tinkerless.sdk.backends.run_host import run_host_for
    from tinkerless.sdk.run.distillation import _sequence_datums, load_teacher
    from tinkerless.sdk.run.accounting import PriceTable, RunUsage
    from tinkerless.sdk.run.rollouts import RolloutRequests

    backend = LocalBackend("smollm2")
    host = run_host_for(backend, storage, None)
    usage = RunUsage(backend.usage, PriceTable())
    student = TrainingClient(backend, "default", namespace="bench")
    teacher = load_teacher(teacher, model="smollm2", backend=backend, namespace="bench", host=host, usage=usage)
    cfg = config(storage)
    request = RolloutRequests(cfg).single_agent([make_task(__import__("random").Random(i)) for i in range(8)], 0)
    episodes = student.rollout(request).episodes
    data, _ = _sequence_datums(episodes)
    trained = float(sum((d.mask > 0).sum() for d in data))
    times = {"teacher": [], "student": []}
    for _ in range(rounds):
        for who in ("teacher", "student"):
            started = time.perf_counter()
            (teacher.client if who == "teacher" else student).forward(data)
            times[who].append(time.perf_counter() - started)
    backend.close()
    best = {who: min(values) for who, values in times.items()}
    return {"trained_tokens": trained, "teacher_forward_s": best["teacher"], "student_forward_s": best["student"],
            "teacher_ms_per_trained_token": 1000 * best["teacher"] / trained,
            "student_ms_per_trained_token": 1000 * best["student"] / trained,
            "ratio_teacher_to_student": best["teacher"] / best["student"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rl-steps", type=int, default=20)
    parser.add_argument("--opd-steps", type=int, default=8)
    parser.add_argument("--storage", default="/tmp/opd_vs_rl")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--skip-train", action="store_true", help="evaluate runs already in --storage")
    parser.add_argument("--opd-group-size", type=int, default=4,
                        help="OPD's samples per prompt (1: the cookbook's; OPD needs no group baseline)")
    parser.add_argument("--opd-batch-size", type=int, default=8, help="OPD's prompts per step")
    parser.add_argument("--opd-run", default="opd", help="the OPD run's id (a second OPD variant beside the first)")
    parser.add_argument("--reuse-rl", action="store_true", help="the RL run (the teacher) is already in --storage")
    parser.add_argument("--suffix", default="", help="appended to the result file's name")
    parser.add_argument("--no-forward-costs", action="store_true", help="skip the teacher/student forward timing")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    teacher = f"rl@{args.rl_steps}"
    if not args.skip_train:
        if not args.reuse_rl:
            tinkerless.train(config(args.storage, run_id="rl", steps=args.rl_steps))
        tinkerless.train(config(args.storage, run_id=args.opd_run, steps=args.opd_steps, reward=None, teacher=teacher,
                                group_size=args.opd_group_size, batch_size=args.opd_batch_size))
    records = {}
    for run, run_id in (("rl", "rl"), ("opd", args.opd_run)):
        lines = [json.loads(l) for l in Path(args.storage, "runs", run_id, "metrics.jsonl").read_text().splitlines()]
        records[run] = [l for l in lines if "step" in l]
    eval_config = config(args.storage)
    rl_curve = curve(args.storage, "rl", args.rl_steps, eval_config)
    opd_curve = curve(args.storage, args.opd_run, args.opd_steps, eval_config)
    target = 0.9 * rl_curve[-1]
    result = {"date": time.strftime("%Y-%m-%d"), "device": "2-core CPU, shared with other jobs",
              "opd_run": args.opd_run, "opd_group_size": args.opd_group_size, "opd_batch_size": args.opd_batch_size,
              "teacher": teacher, "teacher_reward": rl_curve[-1], "target_90pct": target,
              "rl_heldout": rl_curve, "opd_heldout": opd_curve,
              "rl_train_reward": [r["reward_mean"] for r in records["rl"]],
              "opd_train_teacher_gap": [r.get("teacher_logprob_gap") for r in records["opd"]],
              "rl_step_s": [r["step_s"] for r in records["rl"]], "opd_step_s": [r["step_s"] for r in records["opd"]],
              "opd_compute_s_teacher": [r.get("compute_s/teacher") for r in records["opd"]],
              "opd_compute_s_update": [r.get("compute_s/update") for r in records["opd"]],
              "opd_trained_tokens": [r.get("trained_tokens") for r in records["opd"]]}
    for run, values in (("rl", rl_curve), ("opd", opd_curve)):
        step = first_reaching(values, target)
        result[f"{run}_steps_to_90pct"] = step
        result[f"{run}_seconds_to_90pct"] = sum(result[f"{run}_step_s"][:step]) if step is not None else None
    if not args.no_forward_costs:
        result["forward_costs"] = forward_costs(args.storage, teacher)
    path = Path(args.out) / f"opd_vs_rl-{result['date']}{args.suffix}.json"
    path.write_text(json.dumps(result, indent=1))
    _plot(result, Path(args.out) / f"opd_vs_rl{args.suffix}.png")
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}, indent=1))
    print(f"wrote {path}")


def _plot(result: dict, png: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 3.2), constrained_layout=True)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.plot(range(len(result["rl_heldout"])), result["rl_heldout"], marker="o", label="RL (held-out reward)")
    ax.plot(range(len(result["opd_heldout"])), result["opd_heldout"], marker="s",
            label=f"OPD from the RL teacher ({result['opd_batch_size']} x {result['opd_group_size']} per step)")
    ax.axhline(result["target_90pct"], color="gray", linestyle="--", label="90% of the teacher")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out reward")
    ax.legend(fontsize="small")
    ax.set_title("SmolLM2-135M, sums of two digits, 2-core CPU")
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main()
