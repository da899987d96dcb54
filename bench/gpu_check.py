"""GPU check: sampling and training speed of the engines on a tiny model, on whatever device is here.

    .venv/bin/python bench/gpu_check.py [--hidden 256] [--layers 4] [--batch 64] [--new-tokens 128]

Runs the transformers engine (and the vLLM engine when vllm is importable and a GPU
is present) through a real `Worker`: a LoRA policy, a batch of sampled continuations
with stopping disabled (every row generates exactly --new-tokens), then one
forward_backward + optim_step on those tokens. Prints the device name, tokens/s and a
markdown row per engine, for BENCHMARKS.md. Without a GPU it runs on the CPU and says so.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from tinkerless.functions.losses import LossConfig
from tinkerless.functions.models import build_tiny_model
from tinkerless.functions.worker import Worker
from tinkerless.wire.messages import (
    AdamParams,
    CreatePolicyRequest,
    Datum,
    ForwardBackwardRequest,
    LoraConfig,
    OptimStepRequest,
    SamplingParams,
)


def device_name() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda}, torch {torch.__version__})"
    return f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads (no GPU found)"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_engine(model: str, engine: str, args) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    worker = Worker(model, device=device, engine=engine, max_batch_size=args.batch)
    worker.create_policy(CreatePolicyRequest("check", LoraConfig(rank=16)))
    prompts = [[(7 * i + j) % 200 + 10 for j in range(16)] for i in range(args.batch)]
    sampling = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, stop_token_ids=[])
    worker.engine.generate(prompts[:2], SamplingParams(max_tokens=4, stop_token_ids=[]), policy="check", seed=0)  # warm-up
    sync()
    started = time.perf_counter()
    generations = worker.engine.generate(prompts, sampling, policy="check", seed=1)
    sync()
    sample_s = time.perf_counter() - started
    sampled = sum(len(g.tokens) for g in generations)

    data = []
    for prompt, g in zip(prompts, generations):
        tokens = np.asarray(prompt + list(g.tokens), dtype=np.int32)
        mask = np.concatenate([np.zeros(len(prompt)), np.ones(len(g.tokens))]).astype(np.float32)
        data.append(Datum(tokens, mask, advantages=mask.copy(), sampler_logprobs=np.concatenate([np.zeros(len(prompt)), g.logprobs]).astype(np.float32)))
    sync()
    started = time.perf_counter()
    worker.forward_backward(ForwardBackwardRequest("check", data, LossConfig()))
    worker.optim_step(OptimStepRequest("check", AdamParams(learning_rate=1e-4)))
    sync()
    train_s = time.perf_counter() - started
    trained = sum(len(d.tokens) for d in data)
    return {
        "engine": worker.engine.name,
        "sampled_tokens": sampled,
        "sample_tokens_per_s": sampled / sample_s,
        "train_tokens_per_s": trained / train_s,
        "peak_gpu_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    model = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny", hidden_size=args.hidden, num_layers=args.layers)
    engines = ["transformers"]
    try:
        import vllm  # noqa: F401

        if torch.cuda.is_available():
            engines.append("vllm")
        else:
            print("vllm is importable but there is no GPU: skipping the vLLM engine")
    except ImportError:
        print("vllm is not installed: only the transformers engine runs")
    name = device_name()
    print(f"device: {name}")
    print(f"model: tiny Qwen2, hidden {args.hidden}, {args.layers} layers; batch {args.batch} x {args.new_tokens} new tokens")
    print("| device | engine | sampled tokens | sampling tok/s | train tok/s | peak GPU memory |")
    print("|---|---|---|---|---|---|")
    results = []
    for engine in engines:
        r = run_engine(model, engine, args)
        results.append({"device": name, **r})
        memory = f"{r['peak_gpu_memory_gb']:.2f} GB" if r["peak_gpu_memory_gb"] is not None else "-"
        print(f"| {name} | {r['engine']} | {r['sampled_tokens']} | {r['sample_tokens_per_s']:,.0f} | {r['train_tokens_per_s']:,.0f} | {memory} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
