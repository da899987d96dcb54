"""SFT tokens/s: tinkerless's update (cross_entropy through the local backend) vs a plain transformers+peft loop.

Both train the same LoRA (rank 16, alpha 32, all-linear) on the same batch of chat examples (the
calculator agent's generated demonstrations, rendered by tinkerless.sdk.sft.data) with AdamW:

- tinkerless: `TrainingClient(LocalBackend(model)).update(data, cross_entropy)`: every request
  and reply goes through the wire codec, as on a remote backend;
- plain: `get_peft_model` + `model(input_ids, attention_mask, labels=...)` (labels -100 where
  the weight is 0), `loss.backward()`, clip, `optimizer.step()`, as a user would write it.

The two alternate, so load from other processes hits both alike; the median step time gives
tokens/s over all tokens of the batch (prompt and reply: the forward pass reads them all).

    PYTHONPATH=$PWD python bench/sft_speed.py                      # SmolLM2-135M, batch 8, 5 rounds
    PYTHONPATH=$PWD python bench/sft_speed.py --model tiny --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def batch_of_examples(tokenizer, end_of_turn: int, size: int):
    from tinkerless.envs.calculator import make_demonstrations
    from tinkerless.sdk.sft.data import ChatRenderer, render_examples

    demos = [(i + 1, {"messages": d["messages"]}) for i, d in enumerate(make_demonstrations(size, seed=1))]
    return render_examples(demos, ChatRenderer(tokenizer, end_of_turn), max_length=4096, source="demos")


def plain_loop(model_spec: str, examples, lr: float):
    """A step function of the plain transformers+peft loop on `examples` (right-padded, one batch)."""
    from peft import LoraConfig, get_peft_model

    from tinkerless.functions.models import load_model

    base, tokenizer = load_model(model_spec)
    torch.manual_seed(0)
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"))
    model.eval()  # no dropout, as the worker
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr)
    width = max(len(e.tokens) for e in examples)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.full((len(examples), width), pad, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for row, e in enumerate(examples):
        n = len(e.tokens)
        input_ids[row, :n] = torch.as_tensor(e.tokens, dtype=torch.long)
        attention[row, :n] = 1
        labels[row, :n] = torch.where(torch.as_tensor(e.weights) > 0, input_ids[row, :n], torch.tensor(-100))

    def step() -> float:
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def tinkerless_loop(model_spec: str, examples, lr: float):
    from tinkerless.sdk.backends.base import LocalBackend
    from tinkerless.sdk.backends.client import TrainingClient
    from tinkerless.sdk.sft.loop import SFT_LOSS, datum
    from tinkerless.wire.messages import AdamParams

    backend = LocalBackend(model_spec, threads=torch.get_num_threads())
    client = TrainingClient(backend, "default")
    data = [datum(e) for e in examples]
    adam = AdamParams(learning_rate=lr, grad_clip_norm=1.0)
    return (lambda: float(client.update(data, SFT_LOSS, adam).metrics["loss"])), backend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5, help="timed steps of each loop (after one warm-up step each)")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from tinkerless.functions.rollout.chat import ChatFormat
    from tinkerless.functions.models import build_tiny_model, cache_dir, load_model

    spec = build_tiny_model(cache_dir() / "models" / "tiny-qwen2-h64-l2-s0") if args.model == "tiny" else args.model
    _, tokenizer = load_model(spec)
    examples = batch_of_examples(tokenizer, ChatFormat(tokenizer).end_of_turn_id, args.batch)
    tokens = sum(len(e.tokens) for e in examples)
    ours, backend = tinkerless_loop(spec, examples, 1e-4)
    plain = plain_loop(spec, examples, 1e-4)
    ours(), plain()  # warm-up
    times: dict[str, list[float]] = {"tinkerless": [], "plain": []}
    losses: dict[str, list[float]] = {"tinkerless": [], "plain": []}
    for _ in range(args.rounds):
        for name, step in (("tinkerless", ours), ("plain", plain)):
            started = time.perf_counter()
            losses[name].append(step())
            times[name].append(time.perf_counter() - started)
    print(f"model {args.model}, batch {args.batch} examples, {tokens} tokens "
          f"({sum(int(e.weights.sum()) for e in examples)} trained), {args.threads} threads, {args.rounds} rounds")
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name in times:
        print(f"  {name:<11} median {medians[name]:.2f} s/step = {tokens / medians[name]:.0f} tokens/s  "
              f"(steps: {' '.join(f'{t:.2f}' for t in times[name])}; loss {losses[name][0]:.3f} -> {losses[name][-1]:.3f})")
    print(f"  tinkerless / plain tokens/s: {medians['plain'] / medians['tinkerless']:.2f}")
    print(f"  load average during the run: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
