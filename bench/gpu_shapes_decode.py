"""bench/gpu_shapes.py's measurements of issue #36 (imported by it; not run alone).

On the `--extras` shape (1.7B by default), in the same process and device as the rest of gpu_shapes:
- `decode_exactness`: the multi-step device decode (`device_decode`, graphs where there are some) against the
  eager one-step loop, in fp32, on `--exact-rows` rows (128) with a stop set of 1/7 of the vocabulary, so
  rows stop at their own times: identical tokens, or each differing row shown to be a near-tie at its first
  difference (the eager top-two log-probs within 1e-4); log-probs of identical rows within 1e-5.
- `decode_speed`: sampling at `--batch` with the device decode (`--decode-steps` per host read) against the
  one-step loop on the same worker, and the device decode with one adapter through the grouped (stacked) LoRA
  path (`TINKERLESS_GROUPED_LORA_SINGLE=1`); the same at `--large-batch` rows (256): first call (captures
  included) and steady call, each.
- `mixed_adapters`: `--batch` rows split over 4 policies in one block, against the same rows of one policy.
- `rl_step`: the whole local RL step at the worker level (sample `--batch` x `--new-tokens`, forward_backward,
  optim_step), three steps: the first and the steady ones;
- `local_train_step`: the same through `tinkerless.train` (the SDK's rollout, update and metrics), three steps.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import torch

STOP_EVERY = 7  # a stop set of every 7th token id: rows stop at their own times


def _worker(model_dir: str, args, dtype: str, policies: int = 1, rows: int | None = None):
    from tinkerless.functions.worker import Worker
    from tinkerless.wire.messages import CreatePolicyRequest, LoraConfig

    worker = Worker(model_dir, device=args.device, dtype=dtype, max_batch_size=max(rows or args.batch, args.batch))
    for k in range(policies):
        worker.create_policy(CreatePolicyRequest(f"p{k}", LoraConfig(rank=16, seed=k)))
        with torch.no_grad():  # off the zero init, so the policies differ from each other and the base
            for p in worker.policies[f"p{k}"].params:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(k + 1)) * 0.02)
    return worker


def _prompts(rows: int, args, seed: int = 0) -> list[list[int]]:
    from gpu_shapes import VOCAB

    return np.random.default_rng(seed).integers(10, VOCAB - 10, size=(rows, args.prompt_tokens)).tolist()


def _sampled(worker, prompts, sampling, policy="p0", seed=1, **kwargs):
    return worker.engine.generate(prompts, sampling, policy=policy, seed=seed, **kwargs)


def decode_exactness(model_dir: str, shape: str, args, update_batch: int) -> list[dict]:
    from gpu_shapes import VOCAB, _free

    from tinkerless.wire.messages import SamplingParams

    worker = _worker(model_dir, args, "fp32", rows=args.exact_rows)
    prompts = _prompts(args.exact_rows, args, seed=5)
    batcher, decoder, rows = worker.engine.batcher, worker.engine.graphs, []
    for name, sampling in (("greedy", SamplingParams(max_tokens=48, temperature=0.0,
                                                     stop_token_ids=list(range(0, VOCAB, STOP_EVERY)))),
                           ("sampled, top-p", SamplingParams(max_tokens=48, temperature=1.0, top_p=0.95,
                                                             stop_token_ids=list(range(0, VOCAB, STOP_EVERY))))):
        worker.engine.graphs, batcher.decode_steps = None, 1
        eager = _sampled(worker, prompts, sampling, seed=4, top_logprobs=2)
        worker.engine.graphs, batcher.decode_steps = decoder, args.decode_steps
        chunks = batcher.chunks
        new = _sampled(worker, prompts, sampling, seed=4)
        rows.append({"shape": shape, "dtype": "fp32", "what": f"device decode vs eager one-step, {name}",
                     "tokens_per_s": 0.0, "decode_steps": args.decode_steps, "chunks": batcher.chunks - chunks,
                     "graphs": decoder is not None and decoder.capture, "rows": len(prompts),
                     "lengths": sorted(len(g.tokens) for g in new)[:: max(1, len(new) // 8)],
                     **exact_agreement(eager, new)})
    worker = None
    _free(args.device)
    return rows


def exact_agreement(eager: list, new: list, tie: float = 1e-4, tolerance: float = 1e-5) -> dict:
    """Identical rows, differing rows each a near-tie at its first difference (eager's top two log-probs there
    within `tie`), and the largest log-prob difference over identical rows (within `tolerance` to pass)."""
    identical, ties, not_ties, gaps = 0, 0, 0, [0.0]
    for e, g in zip(eager, new):
        if e.tokens == g.tokens and e.stop_reason == g.stop_reason:
            identical += 1
            gaps.extend(abs(a - b) for a, b in zip(e.logprobs, g.logprobs))
            continue
        at = next((i for i, (a, b) in enumerate(zip(e.tokens, g.tokens)) if a != b), min(len(e.tokens), len(g.tokens)))
        top = e.top_logprobs[at] if e.top_logprobs and at < len(e.top_logprobs) else None
        if top is not None and len(top) > 1 and abs(top[0][1] - top[1][1]) <= tie:
            ties += 1
        else:
            not_ties += 1
    return {"rows_identical": identical / max(1, len(eager)), "differing_near_ties": ties,
            "differing_not_ties": not_ties, "max_logprob_diff_identical": max(gaps),
            "passes": not_ties == 0 and max(gaps) <= tolerance}


def decode_speed(model_dir: str, shape: str, args, update_batch: int) -> list[dict]:
    from gpu_shapes import _free, _timed

    from tinkerless.wire.messages import SamplingParams

    rows = []
    sampling = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, stop_token_ids=[])
    for batch in (args.batch, args.large_batch):
        worker = _worker(model_dir, args, args.dtype, rows=batch)
        prompts = _prompts(batch, args)
        batcher = worker.engine.batcher
        base = {"shape": shape, "dtype": worker.info()["dtype"], "rows": batch}
        modes = [(args.decode_steps, "0"), (1, "0"), (args.decode_steps, "1")]  # (steps, grouped single LoRA)
        for steps, grouped in modes:
            batcher.decode_steps = steps
            os.environ["TINKERLESS_GROUPED_LORA_SINGLE"] = grouped
            label = f"device decode, {steps} steps per host read" if steps > 1 else "one-step loop"
            label += ", grouped LoRA" if grouped == "1" else ""
            first, first_s, _ = _timed(lambda: _sampled(worker, prompts, sampling), args.device)
            steady, steady_s, peak = _timed(lambda: _sampled(worker, prompts, sampling), args.device)
            tokens = sum(len(g.tokens) for g in steady)
            rows.append({**base, "what": f"sampling at batch {batch}, {label}", "tokens_per_s": tokens / steady_s,
                         "seconds": steady_s, "peak_gib": peak, "first_call_s": first_s,
                         "first_call_tokens_per_s": sum(len(g.tokens) for g in first) / first_s,
                         "first_over_steady": steady_s / first_s})
        os.environ["TINKERLESS_GROUPED_LORA_SINGLE"] = "0"
        worker = None
        _free(args.device)
        if args.large_batch == args.batch:
            break
    return rows


def mixed_adapters(model_dir: str, shape: str, args, update_batch: int, policies: int = 4) -> list[dict]:
    """`--batch` rows of one policy, then the same rows split over `policies` policies decoding in one block
    (concurrent calls batch together): mixed-adapter tokens/s over one-adapter tokens/s."""
    from gpu_shapes import _free, _timed

    from tinkerless.wire.messages import SamplingParams

    worker = _worker(model_dir, args, args.dtype, policies=policies)
    prompts = _prompts(args.batch, args)
    sampling = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, stop_token_ids=[])
    share = -(-len(prompts) // policies)

    def mixed():
        results: list = [None] * policies
        barrier = threading.Barrier(policies)

        def run(k):
            barrier.wait()
            results[k] = _sampled(worker, prompts[k * share : (k + 1) * share], sampling, policy=f"p{k}")

        threads = [threading.Thread(target=run, args=(k,)) for k in range(policies)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return [g for part in results for g in part]

    _sampled(worker, prompts, sampling)  # warm-up (captures) of one policy
    one, one_s, _ = _timed(lambda: _sampled(worker, prompts, sampling), args.device)
    mixed()  # warm-up of the mixed block
    eager_before = worker.engine.graphs.eager_steps if worker.engine.graphs is not None else 0
    together, mixed_s, peak = _timed(mixed, args.device)
    eager_steps = (worker.engine.graphs.eager_steps if worker.engine.graphs is not None else 0) - eager_before
    widest = worker.engine.batcher.widest
    worker = None
    _free(args.device)
    one_rate = sum(len(g.tokens) for g in one) / one_s
    rate = sum(len(g.tokens) for g in together) / mixed_s
    return [{"shape": shape, "dtype": args.dtype, "what": f"sampling, {policies} adapters mixed in one batch",
             "tokens_per_s": rate, "seconds": mixed_s, "peak_gib": peak, "one_adapter_tokens_per_s": one_rate,
             "mixed_over_one": rate / one_rate, "eager_steps": eager_steps, "widest": widest}]


def rl_step(model_dir: str, shape: str, args, update_batch: int, steps: int = 3) -> list[dict]:
    """The local RL step at the worker level: sample, forward_backward, optim_step; each step's seconds."""
    from gpu_shapes import _free, _sync

    from tinkerless.functions.losses import LossConfig
    from tinkerless.wire.messages import AdamParams, Datum, ForwardBackwardRequest, OptimStepRequest, SamplingParams

    worker = _worker(model_dir, args, args.dtype)
    prompts = _prompts(args.batch, args)
    sampling = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, stop_token_ids=[])
    times, parts, gaps = [], [], []
    for step in range(steps):
        _sync(args.device)
        started = time.perf_counter()
        generations = _sampled(worker, prompts, sampling, seed=step)
        _sync(args.device)
        sampled = time.perf_counter()
        data = []
        for prompt, g in zip(prompts, generations):
            tokens = np.array(prompt + list(g.tokens), np.int32)
            mask = np.r_[np.zeros(len(prompt)), np.ones(len(g.tokens))].astype(np.float32)
            advantage = np.float32(np.random.default_rng(step).normal())
            data.append(Datum(tokens, mask, advantages=mask * advantage,
                              sampler_logprobs=np.r_[np.zeros(len(prompt)), g.logprobs].astype(np.float32)))
        fb = worker.forward_backward(ForwardBackwardRequest("p0", data, LossConfig()))
        worker.optim_step(OptimStepRequest("p0", AdamParams(learning_rate=1e-5)))
        _sync(args.device)
        done = time.perf_counter()
        times.append(done - started)
        parts.append((sampled - started, done - sampled))
        gaps.append(fb.metrics.get("logprob_gap"))
    dtype = worker.info()["dtype"]
    worker = None
    _free(args.device)
    return [{"shape": shape, "dtype": dtype, "what": f"whole RL step, {args.batch} x {args.new_tokens} tokens",
             "tokens_per_s": args.batch * args.new_tokens / min(times[1:] or times), "first_step_s": times[0],
             "steady_step_s": min(times[1:] or times), "sample_update_s": parts, "logprob_gap": gaps}]


def local_train_step(model_dir: str, shape: str, args, update_batch: int, steps: int = 3) -> list[dict]:
    """The whole local `tinkerless.train` step (rollout through the SDK, update, metrics: `step_s`, without the one
    checkpoint at the end): `--batch` episodes of up to `--new-tokens` tokens (groups of 4, random rewards), the
    first step and the steady ones."""
    import random
    import tempfile

    import tinkerless

    def make_task(rng):
        return {"prompt": f"Say something about the number {rng.randint(0, 999)}."}

    def reward(completion: str, task: dict) -> float:
        return random.Random(completion).random()  # random weights: any reward, as long as groups differ

    with tempfile.TemporaryDirectory() as storage:
        result = tinkerless.train(model=model_dir, reward=reward, tasks=make_task, steps=steps,
                                  batch_size=max(1, args.batch // 4), group_size=4, max_tokens=args.new_tokens,
                                  temperature=1.0, learning_rate=1e-5, storage=storage, checkpoint_every=1000,
                                  progress=False, seed=0)
    times = [r["step_s"] for r in result.metrics]
    tokens = [int(r.get("sampled_tokens", 0)) for r in result.metrics]
    return [{"shape": shape, "dtype": args.dtype, "what": f"local train() step, {args.batch} episodes",
             "tokens_per_s": tokens[-1] / times[-1] if times[-1] else 0.0, "first_step_s": times[0],
             "steady_step_s": min(times[1:] or times), "step_s": times, "sampled_tokens": tokens}]


MEASURES = (decode_exactness, decode_speed, mixed_adapters, rl_step, local_train_step)
