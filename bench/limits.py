"""How close tinkerless gets to this machine's limits, on the vs_trl job's batch (SmolLM2, 8 x 4, 12 tokens).

    PYTHONPATH=. OMP_NUM_THREADS=2 python bench/limits.py [--model smollm2] [--repeats 3]

- matmul peak: the best float32 `torch.matmul` FLOP/s of square matrices (1024..2048) on these threads;
- update: one `Worker.update` (LoRA r16 all-linear, forward + backward + AdamW) on 32 chat prompts with
  12 sampled tokens each; its FLOPs are counted from the model's shapes (below) and divided by its time;
- generation: the worker's sampling (`Worker.sample`, the base policy) of those 32 prompts (12 new tokens, temperature 0.7) in tokens/s,
  against a bare `model.generate` of the same left-padded batch on the same weights.

Update FLOPs: every linear layer of the decoder costs 2 x in x out per token forward and as much again
backward for the input gradient (LoRA's frozen base needs no weight gradient; the adapters' own cost,
rank 16, is counted too); attention scores and values 4 x T x hidden per token per layer, forward,
twice that backward; the vocabulary projection only at the trained positions. Recomputed layers
(long micro-batches) would add a forward; this batch has none.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

from tinkerless.functions.training.micro_batches import plan_micro_batches

PROMPTS, GROUP, NEW_TOKENS, TEMPERATURE = 8, 4, 12, 0.7


def matmul_peak(repeats: int) -> dict:
    best = {}
    for n in (1024, 1536, 2048):
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.matmul(a, b)  # warm-up
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            torch.matmul(a, b)
            times.append(time.perf_counter() - started)
        best[n] = 2 * n**3 / min(times)
    size = max(best, key=best.get)
    return {"flops": best[size], "size": size, "by_size": {str(k): v for k, v in best.items()}}


def linear_shapes(model) -> list[tuple[int, int, int]]:
    """(in, out, lora rank or 0) of every linear layer of the decoder (not the vocabulary projection)."""
    shapes = []
    for name, module in model.named_modules():
        base = getattr(module, "base_layer", None)
        if base is not None and isinstance(base, torch.nn.Linear):
            rank = max((a.out_features for a in getattr(module, "lora_A", {}).values()), default=0)
            shapes.append((base.in_features, base.out_features, rank))
        elif isinstance(module, torch.nn.Linear) and not name.endswith("base_layer") and "lora_" not in name and "lm_head" not in name:
            shapes.append((module.in_features, module.out_features, 0))
    return shapes


def update_flops(model, lengths: list[int], trained: int) -> float:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    tokens = sum(lengths)
    linear = sum(2 * i * o + (2 * r * (i + o) if r else 0) for i, o, r in linear_shapes(model))
    forward = linear * tokens
    attention = sum(4 * n * n * config.hidden_size for n in lengths) * config.num_hidden_layers / 2  # causal: half
    head = 2 * config.hidden_size * config.vocab_size * trained
    backward = linear * tokens + 2 * attention + head  # input gradients (and the adapters' weight gradients, in `linear`)
    return forward + attention + head + backward


def vs_trl_batch(worker, seed: int = 0):
    """The vs_trl job's update batch: 8 chat prompts x 4 samples of 12 random tokens, random advantages."""
    from tinkerless.wire.messages import Datum

    rng = np.random.default_rng(seed)
    prompts = [
        worker.chat.prompt_tokens([{"role": "user", "content": f"What is {a} + {b}? Answer with a number."}])
        for a, b in rng.integers(0, 10, size=(PROMPTS, 2))
    ]
    data = []
    for prompt in prompts:
        for _ in range(GROUP):
            sampled = rng.integers(3, min(30000, worker.vocab_size), size=NEW_TOKENS).tolist()
            mask = np.array([0.0] * len(prompt) + [1.0] * NEW_TOKENS, dtype=np.float32)
            adv = float(rng.normal())
            data.append(Datum(tokens=prompt + sampled, mask=mask, advantages=mask * adv, sampler_logprobs=mask * -2.0))
    return prompts, data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from tinkerless.functions.losses import LossConfig
    from tinkerless.functions.models import resolve_model
    from tinkerless.functions.worker import Worker
    from tinkerless.wire.messages import BASE_POLICY, AdamParams, CreatePolicyRequest, LoraConfig, SampleRequest, SamplingParams, UpdateRequest

    out: dict = {"threads": torch.get_num_threads(), "torch": torch.__version__}
    out["matmul_peak"] = matmul_peak(args.repeats)

    worker = Worker(args.model)
    worker.create_policy(CreatePolicyRequest("default", LoraConfig(rank=16, target_modules="all-linear")))
    prompts, data = vs_trl_batch(worker)
    lengths = [len(d.tokens) for d in data]
    plan = plan_micro_batches(lengths, worker.micro_batch_size, worker.model)
    update_times = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        worker.update(UpdateRequest("default", data, LossConfig(), AdamParams(learning_rate=1e-6)))
        update_times.append(time.perf_counter() - started)
    flops = update_flops(worker.model, lengths, PROMPTS * GROUP * NEW_TOKENS)
    seconds = statistics.median(update_times)
    out["update"] = {
        "seconds_median": seconds, "seconds": update_times, "tokens": sum(lengths), "flops": flops,
        "flops_per_s": flops / seconds, "fraction_of_matmul_peak": flops / seconds / out["matmul_peak"]["flops"],
        "micro_batches": len(plan), "recomputed": sum(m.recompute for m in plan),
    }  # fmt: skip

    sampling = SamplingParams(max_tokens=NEW_TOKENS, temperature=TEMPERATURE)
    batch = [p for p in prompts for _ in range(GROUP)]
    ours = []
    for repeat in range(args.repeats):
        started = time.perf_counter()
        # The base policy (adapter off): the same function as the bare model below.
        result = worker.sample(SampleRequest(BASE_POLICY, batch, 1, sampling, seed=repeat))
        seconds = time.perf_counter() - started
        generated = sum(len(s.tokens) for group in result.sequences for s in group)
        ours.append({"seconds": seconds, "tokens": generated, "tokens_per_s": generated / seconds})

    bare_model = AutoModelForCausalLM.from_pretrained(resolve_model(args.model), dtype=torch.float32).eval()
    pad = worker.tokenizer.pad_token_id
    width = max(len(p) for p in batch)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    eos = set(worker.chat.eos_token_ids)
    bare = []
    for repeat in range(args.repeats):
        torch.manual_seed(repeat)
        started = time.perf_counter()
        with torch.no_grad():
            generated_ids = bare_model.generate(
                input_ids=ids, attention_mask=attention, do_sample=True, temperature=TEMPERATURE, top_k=0, top_p=1.0,
                max_new_tokens=NEW_TOKENS, pad_token_id=pad, eos_token_id=list(eos),
            )  # fmt: skip
        seconds = time.perf_counter() - started
        generated = 0
        for row in generated_ids[:, width:].tolist():
            n = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            generated += n
        bare.append({"seconds": seconds, "tokens": generated, "tokens_per_s": generated / seconds})
    out["generation"] = {
        "tinkerless": ours, "bare_generate": bare,
        "tinkerless_tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in ours),
        "bare_tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in bare),
    }  # fmt: skip
    out["generation"]["ratio"] = out["generation"]["tinkerless_tokens_per_s_median"] / out["generation"]["bare_tokens_per_s_median"]
    out["load_average"] = os.getloadavg()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
