"""Peak RSS and time of one training update on long multi-turn (gomoku-like) episodes.

Each configuration runs in its own child process, so its peak RSS (ru_maxrss) is its own:

    PYTHONPATH=. OMP_NUM_THREADS=2 python bench/train_memory.py --model smollm2 --rows 8 --length 2048 --turns 8

An episode is `length` tokens: `turns` assistant turns of `turn_tokens` sampled (masked) tokens,
each after an env observation, like gomoku_vs_random's board renderings. `--compare` also runs the
code of an earlier commit (`--before REF`: exported with `git archive` into a temp dir) for a
before/after figure in one invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def episode(length: int, turns: int, turn_tokens: int, vocab: int, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, min(vocab, 30000), size=length).tolist()
    mask = np.zeros(length, dtype=np.float32)
    # The sampled tokens close each turn: observation, then `turn_tokens` sampled ones.
    span = length // turns
    for turn in range(turns):
        end = (turn + 1) * span
        mask[end - turn_tokens : end] = 1.0
    logprobs = np.where(mask > 0, -1.5, 0.0).astype(np.float32)
    return tokens, mask, logprobs


def child(args) -> dict:
    from tinkerless.functions.training import forward_backward as training
    from tinkerless.functions.worker import Worker
    from tinkerless.wire.messages import AdamParams, CreatePolicyRequest, Datum, LoraConfig, UpdateRequest
    from tinkerless.functions.losses import LossConfig

    worker = Worker(args.model, micro_batch_size=args.micro_batch_size, threads=args.threads)
    worker.create_policy(CreatePolicyRequest("default", LoraConfig(rank=16, target_modules="all-linear")))
    data = []
    for row in range(args.rows):
        length = args.length if not args.ragged else max(args.length // 4, int(args.length * (0.25 + 0.75 * row / max(args.rows - 1, 1))))
        tokens, mask, logprobs = episode(length, args.turns, args.turn_tokens, worker.vocab_size, row)
        advantage = 1.0 if row % 2 else -1.0
        data.append(Datum(tokens=tokens, mask=mask, advantages=mask * advantage, sampler_logprobs=logprobs))
    plan = getattr(training, "plan_micro_batches", None)  # absent in code from before issue #16
    baseline_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    result = worker.update(UpdateRequest("default", data, LossConfig(), AdamParams(learning_rate=1e-5)))
    seconds = time.perf_counter() - started
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "code": args.code_label,
        "attn": worker.model.config._attn_implementation,
        "rows": args.rows,
        "length": args.length,
        "tokens": int(sum(len(d.tokens) for d in data)),
        "update_s": round(seconds, 2),
        "peak_rss_gb": round(peak_kb / 2**20, 2),
        "rss_before_update_gb": round(baseline_kb / 2**20, 2),
        "loss": result.metrics["loss"],
        "micro_batches": len(plan([len(d.tokens) for d in data], args.micro_batch_size, worker.model)) if plan else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--turn-tokens", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--ragged", action="store_true", help="episode lengths spread from length/4 to length")
    parser.add_argument("--before", metavar="REF", help="also run the code of this git commit first (e.g. 7f63bef)")
    parser.add_argument("--code-label", default="HEAD", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return
    forwarded = [a for a in sys.argv[1:] if a != "--before" and a != args.before]
    repo = Path(__file__).resolve().parent.parent
    runs = [(repo, "working tree")]
    with tempfile.TemporaryDirectory(prefix="train-memory-") as tmp:
        if args.before:
            archive = subprocess.run(["git", "-C", str(repo), "archive", args.before], capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
            runs.insert(0, (Path(tmp), args.before))
        for root, label in runs:
            env = {**os.environ, "PYTHONPATH": str(root)}
            # This same script measures both: only the imported tinkerless differs.
            command = [sys.executable, str(Path(__file__).resolve()), *forwarded, "--code-label", label, "--child"]
            out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=root)
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                raise SystemExit(out.returncode)
            print(out.stdout.strip().splitlines()[-1], flush=True)

if __name__ == "__main__":
    main()
