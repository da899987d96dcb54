"""Framework overhead: one GRPO step through tinkerless's local backend vs a bare loop.

    .venv/bin/python bench/overhead.py [--model smollm2] [--steps 3]

Both sides use the same model, the same LoRA init, the same batch and the
same sampling seeds, so they generate the same tokens and do the same
forward/backward work. The tinkerless step includes everything a run does:
wire encoding, the coordinator's barrier, metrics and a checkpoint to storage.
Prints a markdown row for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time

import torch


def make_task(rng):
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return {"prompt": f"What is {a} + {b}? Answer with a number.", "answer": a + b}


def reward(completion: str, task: dict) -> float:
    numbers = re.findall(r"-?\d+", completion)
    return float(bool(numbers) and int(numbers[0]) == task["answer"])


def tinkerless_steps(args) -> list[float]:
    import tinkerless

    with tempfile.TemporaryDirectory() as storage:
        result = tinkerless.train(
            model=args.model, reward=reward, tasks=make_task, steps=args.steps + 1, batch_size=args.batch_size,
            group_size=args.group_size, max_tokens=args.max_tokens, temperature=0.7, learning_rate=5e-4,
            storage=storage, checkpoint_every=1, progress=False, seed=0,
        )
    # Step 0 pays one-time warm-up; every step includes its checkpoint (checkpoint_every=1).
    tokens = [int(r["sampled_tokens"]) for r in result.metrics[1:]]
    return [r["step_s"] + r["storage_s"] for r in result.metrics[1:]], tokens


def bare_steps(args) -> list[float]:
    """The same work written directly against transformers + peft: no wire, no coordinator, no storage."""
    from peft import LoraConfig, get_peft_model

    from tinkerless.functions.models import load_model
    from tinkerless.sdk.run.tasks import TaskSource
    from tinkerless.sdk.run.trainer import _step_seed

    model, tokenizer = load_model(args.model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"), adapter_name="default")
    model.eval()
    params = [p for n, p in model.named_parameters() if "lora_" in n]
    optimizer = torch.optim.AdamW(params, lr=5e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id]
    source = TaskSource(make_task, seed=0)
    times, token_counts = [], []
    for step in range(args.steps + 1):
        started = time.perf_counter()
        tasks, _ = source.batch(step * args.batch_size, args.batch_size)
        prompts = [
            tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t["prompt"]}], add_generation_prompt=True, tokenize=False), add_special_tokens=False)
            for t in tasks for _ in range(args.group_size)
        ]
        width = max(map(len, prompts))
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
        attention = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(_step_seed(0, step) * 1_000_003)
            out = model.generate(input_ids=ids, attention_mask=attention, do_sample=True, temperature=0.7, top_p=1.0, top_k=None,
                                 max_new_tokens=args.max_tokens, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
                                 output_logits=True, return_dict_in_generate=True)
        new = out.sequences[:, width:]
        logits = torch.stack(out.logits, 1).float()
        sampler_lp = logits.gather(2, new[..., None]).squeeze(-1) - torch.logsumexp(logits, -1)
        sequences, masks, old = [], [], []
        rewards = []
        for row, prompt in enumerate(prompts):
            tokens = new[row].tolist()
            stop = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
            rewards.append(reward(tokenizer.decode(tokens[:stop], skip_special_tokens=True), tasks[row // args.group_size]))
            sequences.append(prompt + tokens[:stop])
            masks.append([0.0] * len(prompt) + [1.0] * stop)
            old.append([0.0] * len(prompt) + sampler_lp[row, :stop].tolist())
        r = torch.tensor(rewards).view(args.batch_size, args.group_size)
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, unbiased=False, keepdim=True) + 1e-6)).flatten()
        keep = [i for i in range(len(sequences)) if adv[i] != 0]
        if keep:
            width = max(len(sequences[i]) for i in keep)
            pad = lambda xs, v: [x + [v] * (width - len(x)) for x in xs]  # noqa: E731
            ids = torch.tensor(pad([sequences[i] for i in keep], 0))
            mask = torch.tensor(pad([masks[i] for i in keep], 0.0))
            old_lp = torch.tensor(pad([old[i] for i in keep], 0.0))
            attention = torch.tensor(pad([[1] * len(sequences[i]) for i in keep], 0))
            logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
            lp = logits.gather(2, ids[:, 1:, None]).squeeze(-1) - torch.logsumexp(logits, -1)
            lp = torch.nn.functional.pad(lp, (1, 0))
            ratio = torch.exp((lp - old_lp) * mask)
            per_token = -ratio * adv[keep][:, None] * mask
            loss = (per_token.sum(1) / mask.sum(1)).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
        token_counts.append(int(sum(sum(m) for m in masks)))
    return times[1:], token_counts[1:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=12)
    args = parser.parse_args()
    bare, bare_tokens = bare_steps(args)
    ours, our_tokens = tinkerless_steps(args)
    # Same seeds on both sides: the sampled token counts must match, or the comparison is not like for like.
    print(f"sampled tokens per step: bare {bare_tokens}, tinkerless {our_tokens}")
    ratio = statistics.median(ours) / statistics.median(bare)
    print(f"bare loop step times (s):   {[round(t, 2) for t in bare]}")
    print(f"tinkerless step times (s):  {[round(t, 2) for t in ours]}")
    print(f"| {args.model} | {args.batch_size}x{args.group_size}, {args.max_tokens} new tokens | "
          f"{statistics.median(bare):.2f} s | {statistics.median(ours):.2f} s | {ratio:.3f} |")


if __name__ == "__main__":
    main()
