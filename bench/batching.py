"""Continuous batching through the official `tinker` SDK against a live tinkerless server.

The server runs in a process of its own (`tinkerless serve` on 127.0.0.1, auth on), as for a
client on another machine: the client's HTTP and the SDK's polling share no interpreter with it.
Two measurements, each with batching across calls on ("after") and off ("before",
`TINKERLESS_JOIN_QUEUED_CALLS=0`: a generation does not pause for queued calls to join it, so
calls decode one after another):

1. sampled tokens/s of 16 concurrent single-sample `sample` calls against one call of
   num_samples=16 (same prompt, max_tokens, stop=[] so every row draws max_tokens);
2. one cookbook-style RL iteration: a fresh sampling client, 8 groups x 4 samples as 8
   concurrent `sample` calls with num_samples=4, then forward_backward (importance_sampling)
   and optim_step on the 32 samples.

    PYTHONPATH=$PWD python bench/batching.py                 # the tiny random model
    PYTHONPATH=$PWD python bench/batching.py --model smollm2 # SmolLM2-135M-Instruct

bench/batching_layers.py splits the 16-call figure by layer (engine, scheduler, HTTP);
bench/cookbook_rl.py runs the cookbook's own RL trainer instead of this request pattern.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TINKER_TELEMETRY", "0")

import tinker  # noqa: E402
from tinker import types  # noqa: E402
from server_process import serve_process  # noqa: E402

from tinkerless.functions.models import build_tiny_model  # noqa: E402


def sampled_tokens_per_second(sampler, prompt, max_tokens: int, *, concurrent: bool) -> float:
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, stop=[], seed=1)
    started = time.perf_counter()
    if concurrent:
        futures = [sampler.sample(prompt, num_samples=1, sampling_params=params) for _ in range(16)]
        sequences = [s for f in futures for s in f.result().sequences]
    else:
        sequences = sampler.sample(prompt, num_samples=16, sampling_params=params).result().sequences
    seconds = time.perf_counter() - started
    return sum(len(s.tokens) for s in sequences) / seconds


def rl_iteration(training, prompts, max_tokens: int) -> tuple[float, float]:
    """Seconds of (the whole iteration, its sampling: from the sampling client to the last sample)."""
    started = time.perf_counter()
    sampler = training.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, stop=[])
    futures = [sampler.sample(types.ModelInput.from_ints(p), num_samples=4, sampling_params=params) for p in prompts]
    data = []
    for prompt, future in zip(prompts, futures):
        samples = future.result().sequences
        rewards = [sum(t % 2 == 0 for t in s.tokens) / max(len(s.tokens), 1) for s in samples]
        mean = sum(rewards) / len(rewards)
        for s, r in zip(samples, rewards):
            tokens = prompt + list(s.tokens)
            n = len(prompt) - 1
            data.append(types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": tokens[1:],
                    "logprobs": [0.0] * n + list(s.logprobs),
                    "advantages": [0.0] * n + [r - mean] * len(s.tokens),
                },
            ))
    sampled = time.perf_counter()
    fwd_bwd = training.forward_backward(data, "importance_sampling")
    optim = training.optim_step(types.AdamParams(learning_rate=1e-4))
    fwd_bwd.result()
    optim.result()
    return time.perf_counter() - started, sampled - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="'tiny' (a random ~0.1M model) or a model name, e.g. smollm2")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tinkerless-bench-batching-"))
    model = (build_tiny_model(root / "model", hidden_size=64, num_layers=2, seed=0)
             if args.model == "tiny" else args.model)
    vocab = 250  # the tiny tokenizer's byte range; SmolLM2's ids below 250 are ordinary tokens too
    prompt_ids = [[(7 * g + i) % vocab + 3 for i in range(6)] for g in range(8)]
    print(f"model={args.model} max_tokens={args.max_tokens} server threads={args.threads} repeats={args.repeats} "
          f"(median), load average {os.getloadavg()[0]:.1f}")
    for batching in (False, True):
        env = {"TINKERLESS_JOIN_QUEUED_CALLS": "1" if batching else "0"}
        with serve_process(model, root / ("after" if batching else "before"), env=env, threads=args.threads) as served:
            service = tinker.ServiceClient(base_url=served.url, api_key=served.api_key)
            sampler = service.create_sampling_client(base_model=model).result()
            training = service.create_lora_training_client(base_model=model, rank=8).result()
            prompt = types.ModelInput.from_ints(prompt_ids[0])
            sampled_tokens_per_second(sampler, prompt, 4, concurrent=True)  # warm-up
            one = statistics.median(sampled_tokens_per_second(sampler, prompt, args.max_tokens, concurrent=False)
                                    for _ in range(args.repeats))
            many = statistics.median(sampled_tokens_per_second(sampler, prompt, args.max_tokens, concurrent=True)
                                     for _ in range(args.repeats))
            runs = [rl_iteration(training, prompt_ids, args.max_tokens) for _ in range(args.repeats)]
            rl, rl_sampling = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
            service.close(status="success")
        label = "after (batching across calls)" if batching else "before (calls one at a time)"
        print(f"{label}:")
        print(f"  1 call x 16 samples:      {one:8.0f} sampled tokens/s")
        print(f"  16 calls x 1 sample:      {many:8.0f} sampled tokens/s  ({many / one:.0%} of one call)")
        print(f"  RL iteration 8 x 4:       {rl:8.2f} s  (sampling {rl_sampling:.2f} s, training {rl - rl_sampling:.2f} s)")


if __name__ == "__main__":
    main()
