"""On-policy distillation against RL on the same job and budget, SmolLM2 on this CPU.

    python bench/opd_vs_rl.py                      # RL 20 steps (the teacher), then OPD 8 steps from the base
    python bench/opd_vs_rl.py --rl-steps 20 --opd-steps 8 --out bench/results
    python bench/opd_vs_rl.py --job sums-plain --rl-only --rl-steps 40     # a slower job for RL: RL alone first,
    python bench/opd_vs_rl.py --job sums-plain --reuse-rl --rl-steps 40 --opd-steps 10 --heldout-tasks 64
    python bench/opd_vs_rl.py --job sums-plain --retime rl --retime-steps 12   # RL's first steps timed again now

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

`--job sums-plain` asks the same sums without "Answer with a number." ("What is 4 + 5?"), with the same reward
(the reply must start with the sum): the base model starts its reply with the sum about 3% of the time (14% with
the instruction; it mostly restates the question, "4 + 5 = 9"), so RL's groups rarely differ for its first steps
while the teacher's per-token signal is there from step 1. `--job sums3` (three one-digit terms, with the
instruction) was too hard for RL here: its groups mostly tie at 0 and 48 steps did not move its reward;
`--job sums-start` (the same question, the reply must begin with the sum: 0.8% of the base model's) neither
(40 steps, 24 sequences trained in all).
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


def make_task_plain(rng):
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return {"prompt": f"What is {a} + {b}?", "answer": a + b}


def make_task_sums3(rng):
    a, b, c = rng.randint(1, 9), rng.randint(1, 9), rng.randint(1, 9)
    return {"prompt": f"What is {a} + {b} + {c}? Answer with a number.", "answer": a + b + c}


# --job: its task function (the reward: the first number in the reply must be the sum, but for sums-start).
JOBS = {"sums": make_task, "sums-plain": make_task_plain, "sums3": make_task_sums3, "sums-start": make_task_plain}


@tinkerless.reward
def arithmetic_reward(completion: str, task: dict) -> float:
    numbers = re.findall(r"-?\d+", completion)
    if not numbers or int(numbers[0]) != task["answer"]:
        return 0.0
    return 1.0 + (0.5 if completion.strip().rstrip(".") == str(task["answer"]) else 0.0)


@tinkerless.reward
def starts_with_sum_reward(completion: str, task: dict) -> float:
    """sums-start: the reply must begin with the sum ("13", "13 is ..."; not "The answer is 13" nor "9 + 4 = 13")."""
    if not re.match(rf"\s*{task['answer']}(?!\d)", completion):
        return 0.0
    return 1.0 + (0.5 if completion.strip().rstrip(".") == str(task["answer"]) else 0.0)


JOB_REWARDS = {"sums-start": starts_with_sum_reward}


def held_out(job: str = "sums", count: int = 32) -> list[dict]:
    """`count` of the job's tasks in an order the training stream does not start with (a seed of their own)."""
    import random

    rng = random.Random(20261128)
    return [JOBS[job](rng) for _ in range(count)]


def config(storage: str, job: str = "sums", **changes):
    base = tinkerless.TrainConfig(
        name="bench", model="smollm2", reward=JOB_REWARDS.get(job, arithmetic_reward), tasks=JOBS[job], steps=20, batch_size=8, group_size=4,
        max_tokens=12, temperature=0.7, learning_rate=5e-4, lora_rank=16, checkpoint_every=1, keep_checkpoints=None,
        storage=storage, progress=False, transcripts_per_step=0,
    )
    return base.replace(**changes)


def curve(storage: str, run_id: str, steps: int, eval_config, tasks: list[dict]) -> list[float]:
    """Held-out mean reward of the base model (step 0) and of each checkpoint 1..steps."""
    from tinkerless.sdk.evaluation.evaluate import evaluate

    cache = Path(storage, f"heldout-{run_id}.json")  # a rerun (--skip-train) reuses the evaluations done
    done = json.loads(cache.read_text()) if cache.is_file() else {}
    out = []
    for step in range(steps + 1):
        checkpoint = "base" if step == 0 else f"{run_id}@{step}"
        if checkpoint not in done:
            done[checkpoint] = float(evaluate(eval_config, checkpoint=checkpoint, tasks=tasks, samples=2, seed=7).mean)
            cache.write_text(json.dumps(done))
        out.append(done[checkpoint])
        print(f"eval {checkpoint}: {out[-1]:.3f}", flush=True)
    return out


def first_reaching(values: list[float], target: float) -> int | None:
    return next((i for i, v in enumerate(values) if v >= target), None)


def forward_costs(storage: str, teacher: str, job: str = "sums", rounds: int = 3) -> dict:
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
    cfg = config(storage, job)
    request = RolloutRequests(cfg).single_agent([JOBS[job](__import__("random").Random(i)) for i in range(8)], 0)
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
    parser.add_argument("--job", choices=sorted(JOBS), default="sums",
                        help="sums: two one-digit terms; sums-plain: the same without 'Answer with a number.'; sums3: three "
                             "terms; sums-start: sums-plain, the reply beginning with the sum")
    parser.add_argument("--heldout-tasks", type=int, default=32, help="held-out tasks, each played twice")
    parser.add_argument("--rl-only", action="store_true", help="train the RL run (the teacher) and stop")
    parser.add_argument("--rl-resume", action="store_true", help="continue the RL run in --storage to --rl-steps")
    parser.add_argument("--teacher-step", type=int, default=None, help="the RL checkpoint OPD learns from (default: the last)")
    parser.add_argument("--opd-lr", type=float, default=None, help="OPD's learning rate (default: RL's, 5e-4)")
    parser.add_argument("--opd-loss", choices=("reverse_kl", "topk_forward_kl"), default="reverse_kl",
                        help="OPD's loss: the sampled tokens' reverse KL as the advantage, or the teacher's top-k rows")
    parser.add_argument("--opd-topk", type=int, default=64, help="k of topk_forward_kl")
    parser.add_argument("--plot-from", nargs="+", metavar="JSON",
                        help="only plot these results (RL from the first, every OPD run) to --plot-to")
    parser.add_argument("--plot-to", default=str(REPO / "docs" / "opd-vs-rl.png"))
    parser.add_argument("--retime", choices=("rl", "opd"), default=None,
                        help="only train that run's first --retime-steps steps again from the base (the same seed, so the "
                             "same steps), to time them under the machine's load now; appended to STORAGE/retimes.jsonl")
    parser.add_argument("--retime-steps", type=int, default=10)
    args = parser.parse_args()
    if args.plot_from:
        _plot([json.loads(Path(f).read_text()) for f in args.plot_from], Path(args.plot_to))
        return
    os.makedirs(args.out, exist_ok=True)
    teacher = f"rl@{args.teacher_step or args.rl_steps}"
    opd_changes = {"learning_rate": args.opd_lr} if args.opd_lr else {}
    if args.opd_loss != "reverse_kl":
        opd_changes.update(distill_loss=args.opd_loss, distill_topk=args.opd_topk)
    opd_config = dict(reward=None, teacher=teacher, group_size=args.opd_group_size, batch_size=args.opd_batch_size,
                      **opd_changes)
    if args.retime:
        _retime(args, opd_config if args.retime == "opd" else {})
        return
    loads = {}
    if not args.skip_train:
        if not args.reuse_rl:
            loads["rl_before"] = os.getloadavg()
            tinkerless.train(config(args.storage, args.job, run_id="rl", steps=args.rl_steps, resume=args.rl_resume))
            loads["rl_after"] = os.getloadavg()
            Path(args.storage, "loads-rl.json").write_text(json.dumps(loads))
        if args.rl_only:
            return
        loads["opd_before"] = os.getloadavg()
        tinkerless.train(config(args.storage, args.job, run_id=args.opd_run, steps=args.opd_steps, **opd_config))
        loads["opd_after"] = os.getloadavg()
    rl_loads = Path(args.storage, "loads-rl.json")
    if rl_loads.is_file():
        loads = {**json.loads(rl_loads.read_text()), **loads}
    records = {}
    for run, run_id in (("rl", "rl"), ("opd", args.opd_run)):
        lines = [json.loads(l) for l in Path(args.storage, "runs", run_id, "metrics.jsonl").read_text().splitlines()]
        records[run] = [l for l in lines if "step" in l]
    eval_config = config(args.storage, args.job)
    tasks = held_out(args.job, args.heldout_tasks)
    rl_curve = curve(args.storage, "rl", args.rl_steps, eval_config, tasks)
    opd_curve = curve(args.storage, args.opd_run, args.opd_steps, eval_config, tasks)
    target = 0.9 * rl_curve[args.teacher_step or args.rl_steps]
    result = {"date": time.strftime("%Y-%m-%d"), "device": "2-core CPU, shared with other jobs", "job": args.job,
              "heldout_episodes": 2 * len(tasks), "opd_learning_rate": args.opd_lr or eval_config.learning_rate,
              "opd_loss": args.opd_loss if args.opd_loss == "reverse_kl" else f"{args.opd_loss} k={args.opd_topk}",
              "load_avg_1_5_15": loads,
              "opd_run": args.opd_run, "opd_group_size": args.opd_group_size, "opd_batch_size": args.opd_batch_size,
              "teacher": teacher, "teacher_reward": target / 0.9, "target_90pct": target,
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
        result["forward_costs"] = forward_costs(args.storage, teacher, args.job)
    path = Path(args.out) / f"opd_vs_rl-{result['date']}{args.suffix}.json"
    path.write_text(json.dumps(result, indent=1))
    _plot([result], Path(args.out) / f"opd_vs_rl{args.suffix}.png")
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}, indent=1))
    print(f"wrote {path}")


def _retime(args, changes: dict) -> None:
    """Train the first steps of a run again (a fresh run id, the same config and seed) and record their seconds
    beside the original's, with the load: RL and OPD timed alternately, under the same machine state."""
    import shutil

    original = "rl" if args.retime == "rl" else args.opd_run
    run_id = f"{original}-retime"
    shutil.rmtree(Path(args.storage, "runs", run_id), ignore_errors=True)
    load_before = os.getloadavg()
    run = tinkerless.train(config(args.storage, args.job, run_id=run_id, steps=args.retime_steps,
                                  checkpoint_every=args.retime_steps, keep_checkpoints=1, **changes))
    lines = [json.loads(l) for l in Path(args.storage, "runs", original, "metrics.jsonl").read_text().splitlines()]
    first = [l for l in lines if "step" in l][:args.retime_steps]
    row = {"run": original, "time": time.strftime("%H:%M:%S"), "load_before": load_before, "load_after": os.getloadavg(),
           "step_s": [r["step_s"] for r in run.metrics], "original_step_s": [r["step_s"] for r in first],
           # the same seed draws the same episodes: a replay's rewards, losses and teacher gaps equal the original's
           "same_outcomes": len(run.metrics) == len(first) and all(
               _same_outcome(a, b) for a, b in zip(run.metrics, first))}
    with Path(args.storage, "retimes.jsonl").open("a") as out:
        out.write(json.dumps(row) + "\n")
    print(json.dumps(row))


def _same_outcome(a: dict, b: dict) -> bool:
    """The same step to float rounding (the teacher's gap and the loss may come from other passes, e.g. across a
    fix of how the teacher's forward or the update batches its sequences)."""
    close = [x == y or (x is not None and y is not None and abs(x - y) < 1e-4)
             for x, y in ((a.get(key), b.get(key)) for key in ("teacher_logprob_gap", "loss"))]
    return a.get("reward_mean") == b.get("reward_mean") and all(close)


def _opd_label(result: dict) -> str:
    loss = result.get("opd_loss", "reverse_kl").replace("reverse_kl", "reverse KL").replace("topk_forward_kl", "top-k KL")
    lr = result.get("opd_learning_rate")
    return (f"OPD {loss}, {result['opd_batch_size']} x {result['opd_group_size']}"
            f"{'' if lr in (None, 5e-4) else f', lr {lr:g}'}")


def _plot(results: list[dict], png: Path) -> None:
    """Held-out reward against step and against training seconds: RL (from the first result) and each OPD run."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.4), constrained_layout=True)
    FigureCanvasAgg(fig)
    by_step, by_time = fig.subplots(1, 2)
    rl = results[0]
    lines = [("RL, 8 x 4", rl["rl_heldout"], rl["rl_step_s"], "o")]
    lines += [(_opd_label(r), r["opd_heldout"], r["opd_step_s"], "s^vD"[i % 4]) for i, r in enumerate(results)]
    for label, heldout, step_s, marker in lines:
        by_step.plot(range(len(heldout)), heldout, marker=marker, markersize=3, label=label)
        by_time.plot(np.concatenate([[0.0], np.cumsum(step_s)])[:len(heldout)], heldout, marker=marker, markersize=3,
                     label=label)
    for ax, xlabel in ((by_step, "step"), (by_time, "training seconds (the steps' own)")):
        ax.axhline(rl["target_90pct"], color="gray", linestyle="--", label="90% of the teacher")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out reward")
    by_step.legend(fontsize="small")
    job = {"sums3": "sums of three one-digit terms", "sums-plain": "'What is a + b?' (no 'Answer with a number.')"}
    fig.suptitle(f"SmolLM2-135M, {job.get(rl.get('job'), 'sums of two one-digit terms')}, "
                 f"teacher {rl['teacher']}, 2-core CPU (shared)")
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main()
