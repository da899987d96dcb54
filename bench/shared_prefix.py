"""One update with each group's prompt run once (`functions/training/shared_prefix.py`) against every row's own forward.

    PYTHONPATH=. python bench/shared_prefix.py [--model smollm2] [--repeats 3] [--threads 2]

The vs_trl job's batch (bench/limits.py `vs_trl_batch`: 8 chat prompts x 4 samples of 12 tokens),
one `Worker.update` (LoRA r16 all-linear, forward + backward + AdamW) with sharing off
(`TINKERLESS_SHARED_PREFIX=0`) and on, alternating in one process so both see the same load. Reports
wall and process-CPU seconds per update (CPU time is far less inflated than wall time on a shared
machine), tokens through the model, and the losses (equal up to float rounding).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from limits import vs_trl_batch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from tinkerless.functions.training import shared_prefix, forward_backward as training
    from tinkerless.functions.losses import LossConfig
    from tinkerless.functions.worker import Worker
    from tinkerless.wire.messages import AdamParams, CreatePolicyRequest, LoraConfig, UpdateRequest

    worker = Worker(args.model)
    worker.create_policy(CreatePolicyRequest("default", LoraConfig(rank=16, target_modules="all-linear")))
    _, data = vs_trl_batch(worker)
    groups, alone = shared_prefix.find_prefix_groups([d.tokens for d in data], [d.mask for d in data])
    shared_tokens = sum(g.prefix + sum(len(data[i].tokens) - g.prefix for i in g.rows) for g in groups)
    shared_tokens += sum(len(data[i].tokens) for i in alone)
    results: dict = {"plain": [], "shared": []}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for mode in ("plain", "shared"):
            os.environ[training.SHARED_PREFIX_ENV] = "0" if mode == "plain" else "1"
            wall, cpu = time.perf_counter(), time.process_time()
            reply = worker.update(UpdateRequest("default", data, LossConfig(), AdamParams(learning_rate=0.0)))
            row = {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu, "loss": reply.metrics["loss"]}
            if repeat:
                results[mode].append(row)
            print(mode, {k: round(v, 6) for k, v in row.items()}, flush=True)
    summary = {
        "model": args.model, "threads": args.threads, "rows": len(data), "load_average": os.getloadavg()[0],
        "tokens": {"plain": sum(len(d.tokens) for d in data), "shared": shared_tokens},
    }  # fmt: skip
    for mode, rows in results.items():
        summary[mode] = {k: statistics.median(r[k] for r in rows) for k in ("wall_s", "cpu_s")}
    summary["speedup_wall"] = summary["plain"]["wall_s"] / summary["shared"]["wall_s"]
    summary["speedup_cpu"] = summary["plain"]["cpu_s"] / summary["shared"]["cpu_s"]
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
