"""What a LoRA adapter costs when sampling, against the base model, in the engine alone (no HTTP).

    OMP_NUM_THREADS=1 PYTHONPATH=. python bench/lora_cost.py [--model smollm2] [--rows 1 4 16] [--tokens 32] [--rounds 5]
    TINKERLESS_LEAN_LORA=0 ... the same with peft's own LoRA forward (functions/lora_inference.py off)

Greedy generations of `--tokens` tokens for `--rows` copies of one chat prompt, base model and a rank-16
all-linear adapter (moved off its zero init) alternating, `--rounds` times; prints the median and best
process-CPU milliseconds per generated token and the adapter's tokens/s as a fraction of the base's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tinkerless.functions import lora_inference
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
    print("| rows | base ms/token (median, best) | adapter ms/token (median, best) | adapter vs base (median) |")
    print("|---|---|---|---|")
    for rows in args.rows:
        times: dict[str, list[float]] = {"base": [], "adapter": []}
        worker.engine.generate([prompt] * rows, sampling, policy="adapter", seed=0)  # warm-up
        for round_index in range(args.rounds):
            for policy in ("base", "adapter"):
                started = time.process_time()
                worker.engine.generate([prompt] * rows, sampling, policy=None if policy == "base" else policy, seed=round_index)
                times[policy].append((time.process_time() - started) / (args.tokens * rows) * 1000)
        base, adapter = statistics.median(times["base"]), statistics.median(times["adapter"])
        print(f"| {rows} | {base:.1f}, {min(times['base']):.1f} | {adapter:.1f}, {min(times['adapter']):.1f} | {base / adapter:.2f} |")


if __name__ == "__main__":
    main()
