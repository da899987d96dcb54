"""Multi-turn rollouts with and without KV caches kept across turns, against the single-turn main job.

    PYTHONPATH=. .venv/bin/python bench/multiturn.py [--steps 3] [--model smollm2] [--batch-size 8 --group-size 4]

Trains, each run in a process of its own (peak RSS is a per-process high-water mark), on the local
backend for `--steps` steps: the main job (examples/arithmetic.py, single-turn), guess_number and
gomoku_vs_random, the multi-turn ones with the cache off (TINKERLESS_KV_CACHE=0: every turn
re-prefills the whole conversation, the "before") and on (the "after"). Every example runs with the
same model and the same batch (`--batch-size` tasks x `--group-size` samples; `--own-batch` keeps
each example's own). Prints, per run: the rollout's sampled tokens/s, seconds per step and per
rollout (medians over the steps after the first, which warms up), the peak RSS, the prompt tokens
prefilled, reused from kept caches and the tokens decoded per step, and each multi-turn run's
tokens/s as a fraction of the main job's (target: at least 0.70), with the machine's load average.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

EXAMPLES = {
    "main job (arithmetic)": REPO / "examples/arithmetic.py",
    "guess_number": REPO / "examples/guess_number.py",
    "gomoku_vs_random": REPO / "examples/gomoku_vs_random.py",
}
SINGLE_TURN = "main job (arithmetic)"


def run_child(args: argparse.Namespace) -> None:
    """One training run in this process; prints one RESULT line of JSON."""
    import tinkerless
    from tinkerless.sdk.backends import LocalBackend
    from tinkerless.sdk.cli import load_config

    overrides = dict(model=args.model, steps=args.steps, progress=False, checkpoint_every=10**6)
    if not args.own_batch:
        overrides.update(batch_size=args.batch_size, group_size=args.group_size)
    config = load_config(str(EXAMPLES[args.child])).replace(**overrides)
    backend = LocalBackend(args.model)
    worker = backend.worker
    counts: list[dict] = []
    for method in ("rollout", "rollout_multi"):  # the rollout's own stats (prefill/cached/decoded tokens)
        def counted(request, _real=getattr(worker, method)):
            result = _real(request)
            counts.append(dict(result.stats))
            return result
        setattr(worker, method, counted)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tinkerless-multiturn-") as storage:
        result = tinkerless.train(config, backend=backend, storage=storage, run_id="bench")
    wall = time.perf_counter() - started
    steps = result.metrics[1:] if len(result.metrics) > 1 else result.metrics
    per_step = counts[1:] if len(counts) > 1 else counts

    def median(values):
        return statistics.median(values) if values else float("nan")

    print("RESULT " + json.dumps({
        "example": args.child,
        "cache": worker.engine.sessions.enabled,
        "tokens_per_s": median([m["tokens_per_s"] for m in steps]),
        "step_s": median([m["step_s"] for m in steps]),
        "rollout_s": median([m["rollout_s"] for m in steps]),
        "sampled_tokens": median([m["sampled_tokens"] for m in steps]),
        "turns_mean": median([m.get("turns_mean", 1.0) for m in steps]),
        "prefill_tokens": sum(c.get("prefill_tokens", 0.0) for c in per_step) / max(len(per_step), 1),
        "cached_prompt_tokens": sum(c.get("cached_prompt_tokens", 0.0) for c in per_step) / max(len(per_step), 1),
        "decoded_tokens": sum(c.get("decoded_tokens", 0.0) for c in per_step) / max(len(per_step), 1),
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "rewards": [round(m["reward_mean"], 3) for m in result.metrics],
        "wall_s": wall,
        "threads": worker.threads.threads,
        "batch": f"{config.batch_size} x {config.group_size}",
    }), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--own-batch", action="store_true", help="each example's own batch_size and group_size")
    parser.add_argument("--gomoku-batch", default="own", help="'own' (2 x 4 games: its config, the RSS target's) or 'same'")
    parser.add_argument("--only", nargs="*", default=list(EXAMPLES), help="examples to run (names as printed)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_child(args)
        return
    same = None if args.own_batch else (args.batch_size, args.group_size)
    # gomoku's steps are long: by default it keeps its own batch, and the main job runs at that batch too to compare.
    if args.gomoku_batch == "same":
        gomoku = same
    else:
        from tinkerless.sdk.cli import load_config

        own = load_config(str(EXAMPLES["gomoku_vs_random"]))
        gomoku = (own.batch_size, own.group_size)
    runs = [(name, cache, gomoku if name == "gomoku_vs_random" else same) for name in args.only
            for cache in ((True,) if name == SINGLE_TURN else (False, True))]
    if "gomoku_vs_random" in args.only and gomoku != same and SINGLE_TURN in args.only:
        runs.append((SINGLE_TURN, True, gomoku))
    results = []
    loads = []
    for name, cache, batch in runs:
        env = {**os.environ, "TINKERLESS_KV_CACHE": "1" if cache else "0", "PYTHONPATH": str(REPO)}
        command = [sys.executable, __file__, "--child", name, "--steps", str(args.steps), "--model", args.model]
        command += ["--own-batch"] if batch is None else ["--batch-size", str(batch[0]), "--group-size", str(batch[1])]
        loads.append(os.getloadavg()[0])
        out = subprocess.run(command, env=env, capture_output=True, text=True)
        line = next((line for line in out.stdout.splitlines() if line.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"{name} (cache {'on' if cache else 'off'}) failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        results.append(json.loads(line[len("RESULT "):]))
        print(f"done: {name}, cache {'on' if cache else 'off'}: {results[-1]['tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
    loads.append(os.getloadavg()[0])
    print(f"model {args.model}, {args.steps} steps per run (medians over steps 2..), "
          f"load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} CPUs, "
          f"torch threads {results[0]['threads']}")
    single = {r["batch"]: r["tokens_per_s"] for r in results if r["example"] == SINGLE_TURN}
    print("| example | batch (tasks x samples) | KV cache across turns | rollout tok/s | vs main job, same batch | s/step | "
          "rollout s/step | turns | prefilled / cached / decoded tokens per step | peak RSS GB | rewards |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ratio = f"{r['tokens_per_s'] / single[r['batch']]:.2f}" if r["batch"] in single else "-"
        mode = "-" if r["example"] == SINGLE_TURN else ("on" if r["cache"] else "off")
        print(f"| {r['example']} | {r['batch']} | {mode} | {r['tokens_per_s']:.1f} | {ratio} | {r['step_s']:.1f} | {r['rollout_s']:.1f} | "
              f"{r['turns_mean']:.1f} | {r['prefill_tokens']:.0f} / {r['cached_prompt_tokens']:.0f} / {r['decoded_tokens']:.0f} | "
              f"{r['peak_rss_gb']:.2f} | {r['rewards']} |")


if __name__ == "__main__":
    main()
