"""The sharded update's speed: tokens/s of `forward_backward` + `optim_step` over N ranks against one process.

    # CPU (gloo): one Worker, then 1 and 2 ranks, the same global batch and the same cores
    PYTHONPATH=$PWD .venv/bin/python bench/sharded_update.py --out bench/results/sharded-update-cpu.jsonl
    # GPU: the sharded code path at world size 1 against the unsharded Worker, in the same run (target: <= 5%)
    python bench/sharded_update.py --device cuda --shape 1.7B,8B --world-size 1 --out sharded-gpu.jsonl
    # ... with both loaded at once and their steps alternated (fits an H200): the figure in BENCHMARKS.md
    python bench/sharded_update.py --device cuda --shape 1.7B,8B --world-size 1 --steps 12 --interleave

Each shape is built with random weights (speed does not depend on their values): on the CPU a small Llama
(`--shape cpu`: hidden 256, 4 layers, vocab 49152), on a GPU the shapes of bench/gpu_shapes.py. For each
configuration the model loads once, one update warms up (it allocates the optimizer state), then `--steps`
updates are timed; tokens/s is the batch's tokens over the median step. Every row is appended to `--out` (JSON
lines) as soon as it is measured, so a run cut short keeps what it measured; a markdown table ends the run.
On a GPU the rows carry the peak memory of the process that held the model (rank 0 for the sharded rows).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/gpu_shapes.py: the GPU shapes

CPU_SHAPE = (256, 4, 4, 2, 768)  # hidden, layers, heads, kv heads, intermediate (vocab 49152, tied)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--shape", default=None, help="cpu (default on a CPU), or 1.7B,8B on a GPU")
    parser.add_argument("--world-size", default=None, help="rank counts to measure: 1,2 on a CPU, 1 on a GPU")
    parser.add_argument("--rows", type=int, default=None, help="sequences a step (8 on a CPU; 64, 16 for 8B, on a GPU)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens a sequence (128 on a CPU, 192 on a GPU)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads in all (split between the ranks)")
    parser.add_argument("--interleave", action="store_true",
                        help="on a GPU too: load every configuration at once and alternate their steps (needs the memory "
                             "of all of them; a card's clock and the host's noise then fall on each alike)")
    parser.add_argument("--out", default="sharded_update.jsonl")
    args = parser.parse_args()
    gpu = args.device == "cuda"
    shapes = (args.shape or ("1.7B,8B" if gpu else "cpu")).split(",")
    worlds = [int(w) for w in (args.world_size or ("1" if gpu else "1,2")).split(",")]
    out = Path(args.out)
    out.write_text("")
    header = {"what": "device", "device": _device_name(gpu), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "threads": args.threads, "steps": args.steps,
              "interleaved": not gpu or args.interleave}
    _write(out, header)
    rows = []
    for shape in shapes:
        with tempfile.TemporaryDirectory(prefix=f"tinkerless-sharded-{shape}-") as tmp:
            model_dir = _build(shape, Path(tmp), gpu)
            n_rows = args.rows or (8 if not gpu else 16 if shape == "8B" else 64)
            n_tokens = args.tokens or (128 if not gpu else 192)
            data = _data(n_rows, n_tokens)
            configs = [("worker", 1), *(("sharded", w) for w in worlds)]
            measure = _one_by_one if gpu and not args.interleave else _interleaved
            measured = measure(configs, model_dir, data, args)
            for (kind, world), row in zip(configs, measured):
                row.update(shape=shape, what=kind, world_size=world, rows=n_rows, tokens=n_tokens)
                _write(out, row)
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(_markdown(header, rows))


def _one_by_one(configs: list, model_dir: str, data: list, args) -> list[dict]:
    """On a GPU: one configuration at a time (two copies of an 8B model and their peaks would not share a card)."""
    rows = []
    for kind, world in configs:
        try:
            worker, load_s = _start(kind, world, model_dir, data, args)
            try:
                seconds, result = zip(*[_step(worker, data, args) for _ in range(args.steps)])
                rows.append(_row(list(seconds), result[-1], load_s, data, kind, args))
            finally:
                _stop(worker, True)
                worker = None
                _free(True)
        except Exception as exc:  # noqa: BLE001 - one failed configuration must not lose the others
            rows.append({"error": f"{type(exc).__name__}: {exc}"[:500]})
            _free(True)
    return rows


def _interleaved(configs: list, model_dir: str, data: list, args) -> list[dict]:
    """On a CPU: every configuration loaded at once and their steps taken in turn, so that a change in the
    machine's load (a shared machine) falls on all of them alike. Ranks waiting for a call use no CPU."""
    started = [_start(kind, world, model_dir, data, args) for kind, world in configs]
    seconds: list[list[float]] = [[] for _ in configs]
    results: list = [None] * len(configs)
    try:
        for _ in range(args.steps):
            for i, (worker, _) in enumerate(started):
                took, results[i] = _step(worker, data, args)
                seconds[i].append(took)
    finally:
        for worker, _ in started:
            _stop(worker, args.device == "cuda")
    return [_row(seconds[i], results[i], started[i][1], data, kind, args) for i, (kind, _) in enumerate(configs)]


def _start(kind: str, world: int, model_dir: str, data: list, args):
    from tinkerless.wire.messages import CreatePolicyRequest, LoraConfig

    gpu = args.device == "cuda"
    began = time.perf_counter()
    if kind == "worker":
        from tinkerless.functions.worker import Worker

        worker = Worker(model_dir, device=args.device, threads=None if gpu else args.threads)
    else:
        from tinkerless.functions.sharding.group import ShardedWorker

        worker = ShardedWorker(model_dir, world_size=world, device=args.device, threads=None if gpu else args.threads,
                               rank_hook=record_peak if gpu else None)  # fmt: skip
    load_s = time.perf_counter() - began
    worker.create_policy(CreatePolicyRequest("bench", LoraConfig(rank=16)))
    _step(worker, data, args)  # warm-up: the optimizer state, cuBLAS's kernel choices for these shapes
    if gpu and kind == "worker":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    return worker, load_s


def _step(worker, data: list, args):
    from tinkerless.functions.losses import LossConfig
    from tinkerless.wire.messages import AdamParams, UpdateRequest

    began = time.perf_counter()
    result = worker.update(UpdateRequest("bench", data, LossConfig(), AdamParams(learning_rate=1e-5)))
    if args.device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - began, result


def _stop(worker, gpu: bool) -> None:
    close = getattr(worker, "close", None)
    if close is not None:
        close()
    _free(gpu)


def _row(seconds: list[float], result, load_s: float, data: list, kind: str, args) -> dict:
    median = statistics.median(seconds)
    tokens = sum(len(d.tokens) for d in data)
    row = {"tokens_per_s": tokens / median, "step_s": median, "mean_step_s": statistics.fmean(seconds),
           "steps_s": seconds, "load_s": load_s,
           "loss": result.metrics.get("loss"), "grad_norm": result.metrics.get("grad_norm")}
    if args.device == "cuda":
        row["peak_gib"] = (torch.cuda.max_memory_allocated() / 2**30 if kind == "worker"
                           else result.metrics.get("peak_gib"))  # fmt: skip
    return row


def record_peak(worker) -> None:
    """A rank hook: rank 0's peak GPU memory goes into each update's metrics (the driver holds no model)."""
    original = worker.update

    def update(request):
        torch.cuda.reset_peak_memory_stats()
        result = original(request)
        torch.cuda.synchronize()
        result.metrics["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        return result

    worker.update = update


def _build(shape: str, directory: Path, gpu: bool) -> str:
    if shape != "cpu":
        from gpu_shapes import build_shape

        return build_shape(shape, directory, None)
    from transformers import LlamaConfig, LlamaForCausalLM

    from tinkerless.functions.models import build_tiny_model

    hidden, layers, heads, kv_heads, intermediate = CPU_SHAPE
    config = LlamaConfig(vocab_size=49152, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=intermediate, tie_word_embeddings=True,
                         max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    from transformers import AutoTokenizer

    tokenizer = build_tiny_model(directory / "tokenizer", hidden_size=64, num_layers=1, seed=0)
    AutoTokenizer.from_pretrained(tokenizer).save_pretrained(directory)  # prompts are token ids: any tokenizer
    return str(directory)


def _data(rows: int, tokens: int) -> list:
    from tinkerless.wire.messages import Datum

    rng = np.random.default_rng(0)
    out = []
    for _ in range(rows):
        ids = rng.integers(10, 250, tokens).astype(np.int32)  # within every tokenizer's range
        mask = np.zeros(tokens, np.float32)
        mask[tokens // 3 :] = 1
        advantages = (mask * rng.normal(size=tokens)).astype(np.float32)
        out.append(Datum(ids, mask, advantages=advantages, sampler_logprobs=np.full(tokens, -2.0, np.float32)))
    return out


def _markdown(header: dict, rows: list[dict]) -> str:
    lines = [f"{header['device']}, torch {header['torch']}, {header['date']}", "",
             "| shape | what | ranks | tokens/s | median step s | vs one Worker | mean step s | vs one Worker (means) | peak GiB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    base = {r["shape"]: r.get("tokens_per_s") for r in rows if r["what"] == "worker"}
    base_mean = {r["shape"]: r.get("mean_step_s") for r in rows if r["what"] == "worker"}
    for r in rows:
        speed = r.get("tokens_per_s")
        ratio = f"{speed / base[r['shape']]:.3f}" if speed and base.get(r["shape"]) else "-"
        peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") else "-"
        mean, mean_base = r.get("mean_step_s"), base_mean.get(r["shape"])
        mean_ratio = f"{mean_base / mean:.3f}" if mean and mean_base else "-"
        lines.append(f"| {r['shape']} | {r['what']} | {r['world_size']} | "
                     f"{f'{speed:,.0f}' if speed else r.get('error', '-')} | {r.get('step_s', 0):.3f} | {ratio} | "
                     f"{mean or 0:.3f} | {mean_ratio} | {peak} |")
    return "\n".join(lines)


def _device_name(gpu: bool) -> str:
    if gpu:
        return f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})"
    return f"CPU: {platform.processor() or platform.machine()}"


def _free(gpu: bool) -> None:
    gc.collect()
    if gpu:
        torch.cuda.empty_cache()


def _write(out: Path, row: dict) -> None:
    with out.open("a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
