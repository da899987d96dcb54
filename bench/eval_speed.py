"""Eval throughput: episodes/s of `tinkerless.evaluate` on the examples' own envs.

    PYTHONPATH=$PWD .venv/bin/python bench/eval_speed.py [--model smollm2] [--tasks 16] [--samples 4] [--repeats 2]

For each example (single-turn arithmetic, multi-turn guess_number) the base model plays
tasks x samples episodes through the training agent loop on the local backend, exactly as
`tinkerless eval FILE --checkpoint base --tasks N --samples K` does. Reported per example:
the rollout's episodes/s and sampled tokens/s (the median over repeats; the first repeat
pays the model load outside the timed rollout), and the whole call's wall time including
loading the model. Prints markdown rows for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def measure(example: str, args) -> dict:
    from tinkerless.sdk.cli.commands import load_config
    from tinkerless.sdk.evaluation.evaluate import evaluate

    config = load_config(str(EXAMPLES / f"{example}.py")).replace(model=args.model, progress=False)
    runs = []
    for repeat in range(args.repeats):
        started = time.perf_counter()
        report = evaluate(config, checkpoint="base", num_tasks=args.tasks, samples=args.samples, seed=repeat)
        runs.append((report, time.perf_counter() - started))
    return {
        "example": example,
        "episodes": runs[0][0].episodes,
        "turns": config.turn_limit(),
        "max_tokens": config.max_tokens,
        "episodes_per_s": statistics.median(r.episodes_per_second for r, _ in runs),
        "tokens_per_s": statistics.median(r.sampled_tokens / r.seconds for r, _ in runs),
        "rollout_s": [round(r.seconds, 2) for r, _ in runs],
        "wall_s": [round(w, 2) for _, w in runs],
        "reward": statistics.mean(r.mean for r, _ in runs),
        "pass_at": runs[-1][0].pass_at,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--examples", nargs="+", default=["arithmetic", "guess_number"])
    args = parser.parse_args()
    print("| example | episodes (tasks x samples) | max turns x tokens | episodes/s | sampled tokens/s | rollout s | whole call s (with model load) | mean reward |")
    print("|---|---|---|---|---|---|---|---|")
    for example in args.examples:
        m = measure(example, args)
        print(
            f"| {m['example']} | {m['episodes']} ({args.tasks} x {args.samples}) | {m['turns']} x {m['max_tokens']} "
            f"| **{m['episodes_per_s']:.2f}** | {m['tokens_per_s']:.0f} | {', '.join(map(str, m['rollout_s']))} "
            f"| {', '.join(map(str, m['wall_s']))} | {m['reward']:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
