"""Wire codec throughput: msgpack encode + decode of realistic training batches.

    .venv/bin/python bench/wire_throughput.py [--data 64] [--tokens 2048] [--repeats 101]

Measures `tinkerless.wire.encode_message` followed by `decode_message` on
  * an `UpdateRequest` of 64 `Datum`s × 2048 tokens (int32 tokens; float32 mask,
    advantages, sampler_logprobs), and
  * a `RolloutResult` of 64 `Episode`s × 2048 tokens (int32 tokens; float32 mask,
    sampler_logprobs; a short transcript and info dict each).
Throughput = encoded payload bytes / (encode + decode seconds), median of the repeats.
Prints one markdown row per payload.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from tinkerless.functions.losses import LossConfig
from tinkerless.wire import decode_message, encode_message
from tinkerless.wire.messages import AdamParams, Datum, Episode, RolloutResult, UpdateRequest


def update_request(n: int, tokens: int, rng: np.random.Generator) -> UpdateRequest:
    data = [
        Datum(
            tokens=rng.integers(0, 50_000, tokens, dtype=np.int32),
            mask=(rng.random(tokens) > 0.3).astype(np.float32),
            advantages=rng.standard_normal(tokens).astype(np.float32),
            sampler_logprobs=-rng.random(tokens).astype(np.float32),
        )
        for _ in range(n)
    ]
    return UpdateRequest("default", data, LossConfig(), AdamParams())


def rollout_result(n: int, tokens: int, rng: np.random.Generator) -> RolloutResult:
    episodes = [
        Episode(
            task_index=i // 4,
            tokens=rng.integers(0, 50_000, tokens, dtype=np.int32),
            mask=(rng.random(tokens) > 0.3).astype(np.float32),
            sampler_logprobs=-rng.random(tokens).astype(np.float32),
            prompt_length=128,
            reward=1.0,
            turn_rewards=[1.0],
            num_turns=1,
            transcript=[{"role": "user", "content": "What is 3 + 4?"}, {"role": "assistant", "content": "7"}],
            info={"answer": 7},
        )
        for i in range(n)
    ]
    return RolloutResult(episodes, {"reward_mean": 0.5})


def measure(obj, repeats: int) -> tuple[int, float, float]:
    """Payload bytes and the median encode and decode seconds."""
    payload = encode_message(obj)
    decode_message(payload)  # warm-up (imports, allocator)
    enc, dec = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        payload = encode_message(obj)
        t1 = time.perf_counter()
        decode_message(payload)
        t2 = time.perf_counter()
        enc.append(t1 - t0)
        dec.append(t2 - t1)
    return len(payload), statistics.median(enc), statistics.median(dec)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=101)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    payloads = {
        f"UpdateRequest {args.data}×{args.tokens}": update_request(args.data, args.tokens, rng),
        f"RolloutResult {args.data}×{args.tokens}": rollout_result(args.data, args.tokens, rng),
    }
    print("| payload | bytes | encode | decode | MB/s (enc+dec) |")
    print("|---|---|---|---|---|")
    for name, obj in payloads.items():
        size, enc, dec = measure(obj, args.repeats)
        print(f"| {name} | {size / 1e6:.2f} MB | {enc * 1e3:.2f} ms | {dec * 1e3:.2f} ms | {size / (enc + dec) / 1e6:,.0f} |")


if __name__ == "__main__":
    main()
