"""The OpenAI API of `tinkerless serve`: adapter hand-off and the cost of serving a LoRA adapter.

Against a live server (loopback HTTP, the official `openai` client), one rank-16 LoRA policy:

1. **Hand-off**: the time from an `update` reply (`/v1/call/update` on the policy) to the first sampled
   token that uses the new weights (a chat completion with max_tokens=1; its log-prob is checked to have
   changed, so the reply really came from the updated adapter). Two ways to name the adapter:
   * live: `model="<policy>"`, the caller's policy on the worker (no copy);
   * checkpoint: the new weights saved as a checkpoint of a run (`model="<run>@latest"`), so the time
     also counts reading it from storage and loading it into the adapter cache (update -> save -> token).
2. **Adapter cost**: chat-completion latency and tokens/s, base model against the same prompt on a LoRA
   adapter (live policy and a cached checkpoint), greedy, requests interleaved round-robin.

    PYTHONPATH=$PWD python bench/openai_serving.py                  # SmolLM2-135M-Instruct (model="smollm2")
    PYTHONPATH=$PWD python bench/openai_serving.py --model tiny     # the tiny random model (a smoke run)
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import tempfile
import time

import numpy as np
import openai

from tinkerless.coordinator.state import checkpoint_prefix
from tinkerless.functions.losses import LossConfig
from tinkerless.functions.models import build_tiny_model
from tinkerless.functions.worker import Worker
from tinkerless.sdk.backends.base import call
from tinkerless.sdk.backends.http import HTTPBackend
from tinkerless.server import create_app, serve_in_thread
from tinkerless.server.openai_api import render_chat
from tinkerless.storage import CheckpointStore, ObjectStore
from tinkerless.wire.messages import (
    AdamParams, CreatePolicyRequest, Datum, LoraConfig, SampleRequest, SamplingParams, SaveStateRequest, UpdateRequest,
)

MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]
POLICY, RUN = "bench", "bench-run"
ONE_TOKEN = 104  # a one-token prompt (any id of the vocabulary does)


def update(backend, prompt: list[int], step: int) -> None:
    """One RL update of the policy on one of its own samples (a real gradient step that moves the weights)."""
    sample = call(backend, "sample", SampleRequest(POLICY, [prompt], 1, SamplingParams(max_tokens=12), seed=step))
    sequence = sample.sequences[0][0]
    tokens = np.array(prompt + sequence.tokens, dtype=np.int32)
    mask = np.array([0] * len(prompt) + [1] * len(sequence.tokens), dtype=np.float32)
    logprobs = np.array([0.0] * len(prompt) + list(sequence.logprobs), dtype=np.float32)
    datum = Datum(tokens, mask, advantages=mask * (1.0 if step % 2 else -1.0), sampler_logprobs=logprobs)
    call(backend, "update", UpdateRequest(POLICY, [datum], LossConfig(), AdamParams(learning_rate=5e-3)))


def first_token(client: openai.OpenAI, model: str, chat: bool) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds of this process, log-prob of the first greedy token) of a one-token completion:
    of the chat prompt (its prefill included), or of a one-token prompt (the hand-off alone: one forward).
    The server runs in this process, so the CPU time is the request's own work on both sides, which a busy
    shared machine does not inflate the way it inflates wall time."""
    started, cpu = time.perf_counter(), time.process_time()
    if chat:
        answer = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1, temperature=0,
                                                logprobs=True)
        logprob = answer.choices[0].logprobs.content[0].logprob
    else:
        answer = client.completions.create(model=model, prompt=[ONE_TOKEN], max_tokens=1, temperature=0, logprobs=0)
        logprob = answer.choices[0].logprobs.token_logprobs[0]
    return time.perf_counter() - started, time.process_time() - cpu, logprob


def summary(values: list[float]) -> str:
    ms = sorted(v * 1000 for v in values)
    p90 = ms[min(len(ms) - 1, math.ceil(0.9 * len(ms)) - 1)]
    return f"median {statistics.median(ms):6.1f} ms  p90 {p90:6.1f} ms  (n={len(ms)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--handoffs", type=int, default=12)
    parser.add_argument("--requests", type=int, default=6, help="chat completions per model for the adapter cost")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    model = args.model
    if model == "tiny":
        model = build_tiny_model(tempfile.mkdtemp() + "/tiny")
    storage = tempfile.mkdtemp(prefix="openai-bench-")
    worker = Worker(model)
    app = create_app(worker, storage=storage)
    checkpoints = CheckpointStore(ObjectStore(storage).child("tenants/_"), checkpoint_prefix(RUN))
    try:
        with serve_in_thread(app) as url:
            backend = HTTPBackend(url)
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
            base = app.state.openai.base_model
            call(backend, "create_policy", CreatePolicyRequest(POLICY, LoraConfig(rank=16, alpha=32, seed=0)))
            prompt = render_chat(worker.tokenizer, MESSAGES)
            print(f"model {base}, engine {worker.engine.name}, {worker.threads.threads} threads, LoRA rank 16 (all-linear)")

            for model_name in (base, POLICY):  # warm-up: first requests build caches
                first_token(client, model_name, True)
                first_token(client, model_name, False)
            # Live policy: the first token right after an update against the same request with no update before it.
            after_update, steady, changed = ([], []), ([], []), 0
            _, _, before = first_token(client, POLICY, False)
            step = 0
            for i in range(args.handoffs):
                wall, cpu, same = first_token(client, POLICY, False)
                steady[0].append(wall), steady[1].append(cpu)
                step += 1
                update(backend, prompt, step)
                wall, cpu, after = first_token(client, POLICY, False)  # measured from the update's reply
                after_update[0].append(wall), after_update[1].append(cpu)
                changed += (after != same) and (same == before)
                before = after
            print(f"hand-off, live policy (1-token prompt, max_tokens=1; CPU = this process's CPU time):")
            print(f"  update reply -> first token        wall {summary(after_update[0])}  CPU {summary(after_update[1])}")
            print(f"  same request, no update before it  wall {summary(steady[0])}  CPU {summary(steady[1])}")
            print(f"  the first token's log-prob moved with {changed} of {args.handoffs} updates (and only then)")

            # Checkpoint: update -> save -> `run@latest`, the cache reloading its one slot in place (capacity 1),
            # then the first use of a step that needs a new slot (an empty cache).
            cache = app.state.openai.adapters
            saves, loads, cached = [], ([], []), ([], [])
            for i in range(args.handoffs):
                cache.capacity = 1
                step += 1
                update(backend, prompt, step)
                started = time.perf_counter()
                files = call(backend, "save_state", SaveStateRequest(POLICY, include_optimizer=False)).files
                checkpoints.save(step, files, {"policy_versions": {"default": step}})
                saves.append(time.perf_counter() - started)
                wall, cpu, _ = first_token(client, f"{RUN}@latest", False)
                loads[0].append(wall), loads[1].append(cpu)
                wall, cpu, _ = first_token(client, f"{RUN}@latest", False)
                cached[0].append(wall), cached[1].append(cpu)
            print(f"hand-off, checkpoint of a run (`{RUN}@latest`, 1-token prompt):")
            print(f"  update reply -> checkpoint committed (save_state + CheckpointStore.save)  wall {summary(saves)}")
            print(f"  committed -> first token (read, verify, reload the slot in place)  wall {summary(loads[0])}"
                  f"  CPU {summary(loads[1])}")
            print(f"  the same step again (cached)                                       wall {summary(cached[0])}"
                  f"  CPU {summary(cached[1])}")
            print(f"  adapters loaded into the cache: {cache.loads}")
            cache.capacity = 8

            # Adapter cost: the same greedy request, interleaved, on the base model and on LoRA adapters.
            models = {"base": base, "LoRA (live policy)": POLICY, "LoRA (checkpoint)": f"{RUN}@latest"}
            times = {k: [] for k in models}
            cpu_times = {k: [] for k in models}
            tokens = {k: 0 for k in models}
            for _ in range(args.requests + 1):
                for label, name in models.items():
                    started, cpu = time.perf_counter(), time.process_time()
                    answer = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=args.max_tokens,
                                                            temperature=0)
                    elapsed = time.perf_counter() - started
                    if _ > 0:  # the first round warms up
                        times[label].append(elapsed)
                        cpu_times[label].append(time.process_time() - cpu)
                        tokens[label] += answer.usage.completion_tokens
            base_rate = tokens["base"] / sum(times["base"])
            base_cpu_rate = tokens["base"] / sum(cpu_times["base"])
            for label in models:
                rate, cpu_rate = tokens[label] / sum(times[label]), tokens[label] / sum(cpu_times[label])
                print(f"{label:20s} latency {summary(times[label])}  {rate:6.1f} tokens/s ({rate / base_rate:5.2f}x base)"
                      f"  per CPU second {cpu_rate:6.1f} tokens ({cpu_rate / base_cpu_rate:5.2f}x base)"
                      f"  {tokens[label] / len(times[label]):.0f} tokens per reply")

    finally:  # the checkpoints written (tens of MB per step on SmolLM2)
        shutil.rmtree(storage, ignore_errors=True)

if __name__ == "__main__":
    main()
