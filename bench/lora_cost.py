"""What a LoRA adapter costs when sampling, against the base model, in the engine alone (no HTTP).

    OMP_NUM_THREADS=2 PYTHONPATH=. python bench/lora_cost.py [--model smollm2] [--rows 1 4 16] [--tokens 32] [--rounds 5]
    TINKERLESS_LEAN_LORA=0 ... the same with peft's own LoRA forward (functions/sampling/lora_inference.py off)

Greedy generations of `--tokens` tokens for `--rows` copies of one chat prompt, base model and a rank-16
all-linear adapter (moved off its zero init) alternating, `--rounds` times; prints the median and best
wall-clock milliseconds per generated token, the adapter's tokens/s as a fraction of the base's (wall, and
process CPU: with several torch threads the CPU time also counts their spinning, so it is the noisier one).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tinkerless.functions.sampling import lora_inference
from tinkerless.functions.worker import Worker
from tinkerless.wire.messages import CreatePolicyRequest, LoraConfig, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    worker = Worker(args.model)
    worker.create_policy(CreatePolicyRequest("adapter", LoraConfig(rank=16, target_modules="all-linear")))
    with torch.no_grad():
        for p in worker.policies["adapter"].params:
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)).to(p.device))
    prompt = worker.chat.prompt_tokens([{"role": "user", "content": "Tell me a long story about a cat and a dog in a town."}])
    sampling = SamplingParams(max_tokens=args.tokens, temperature=0.0, stop_token_ids=[])
    print(f"{args.model}, {torch.get_num_threads()} threads, short LoRA path {'on' if lora_inference.enabled() else 'off'}")
    print("| rows | base wall ms/token (median, best) | adapter wall ms/token (median, best) | adapter vs base, wall (median) "
          "| adapter vs base, CPU (median) |")
    print("|---|---|---|---|---|")
    for rows in args.rows:
        wall: dict[str, list[float]] = {"base": [], "adapter": []}
        cpu: dict[str, list[float]] = {"base": [], "adapter": []}
        for policy in (None, "adapter"):  # warm-up
            worker.engine.generate([prompt] * rows, sampling, policy=policy, seed=0)
        for round_index in range(args.rounds):
            for policy in ("base", "adapter"):
                started, started_cpu = time.perf_counter(), time.process_time()
                worker.engine.generate([prompt] * rows, sampling, policy=None if policy == "base" else policy, seed=round_index)
                wall[policy].append((time.perf_counter() - started) / (args.tokens * rows) * 1000)
                cpu[policy].append((time.process_time() - started_cpu) / (args.tokens * rows) * 1000)
        base, adapter = statistics.median(wall["base"]), statistics.median(wall["adapter"])
        cpu_ratio = statistics.median(cpu["base"]) / statistics.median(cpu["adapter"])
        print(f"| {rows} | {base:.1f}, {min(wall['base']):.1f} | {adapter:.1f}, {min(wall['adapter']):.1f} | {base / adapter:.2f} "
              f"| {cpu_ratio:.2f} |")


if __name__ == "__main__":
    main()
