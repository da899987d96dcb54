"""Per-call overhead of the HTTP path vs the in-process path for the same training step.

    .venv/bin/python bench/http_overhead.py [--model tiny|smollm2] [--steps 8] [--data 32] [--tokens 64]

Two workers on the same model live in this process: one is called in-process through
`LocalBackend`'s bytes path (encode -> Worker.handle -> decode), the other sits behind
`create_app` on a uvicorn server (a thread, 127.0.0.1) and is called through `HTTPBackend`.
Each side creates its policy fresh with the same LoRA seed and runs the same sequence of
`update` calls (same batch), alternating local/HTTP step by step so both see the same
machine load. Step 0 is warm-up and not counted. Prints median seconds and HTTP/local.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np

from tinkerless.functions.losses import LossConfig
from tinkerless.functions.worker import Worker
from tinkerless.sdk.backends.base import LocalBackend, call
from tinkerless.sdk.backends.http import HTTPBackend
from tinkerless.server import create_app
from tinkerless.server import serve_in_thread as running
from tinkerless.wire.messages import AdamParams, CreatePolicyRequest, Datum, LoraConfig, UpdateRequest




def batch(n: int, tokens: int, vocab: int) -> list[Datum]:
    rng = np.random.default_rng(0)
    data = []
    for _ in range(n):
        mask = np.zeros(tokens, np.float32)
        mask[tokens // 2 :] = 1.0  # second half is the "completion"
        data.append(
            Datum(
                tokens=rng.integers(0, vocab, tokens, dtype=np.int32),
                mask=mask,
                advantages=(rng.standard_normal() * mask).astype(np.float32),
                sampler_logprobs=(-rng.random(tokens) * mask).astype(np.float32),
            )
        )
    return data


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny", help="'tiny' (built in a temp dir) or a model name, e.g. smollm2")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--data", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model == "tiny":
            from tinkerless.functions.models import build_tiny_model

            model = build_tiny_model(f"{tmp}/tiny", hidden_size=64, num_layers=2, seed=0)
        local = LocalBackend(model)
        remote_worker = Worker(model)
        data = batch(args.data, args.tokens, min(len(local.worker.tokenizer), 32_000))
        request = UpdateRequest("pi", data, LossConfig(), AdamParams(learning_rate=1e-4))
        with running(create_app(remote_worker)) as url:
            http = HTTPBackend(url)
            try:
                for backend in (local, http):
                    call(backend, "create_policy", CreatePolicyRequest("pi", LoraConfig(rank=16, alpha=32, seed=0)))
                local_s, http_s, versions = [], [], []
                for _ in range(args.steps + 1):
                    for backend, times in ((local, local_s), (http, http_s)):
                        started = time.perf_counter()
                        result = call(backend, "update", request)
                        times.append(time.perf_counter() - started)
                        versions.append((backend.name, result.policy_version, round(result.metrics.get("loss", 0.0), 6)))
            finally:
                http.close()
    # Same state on both sides: step k has the same version and loss locally and over HTTP.
    same = all(a[1:] == b[1:] for a, b in zip(versions[::2], versions[1::2]))
    local_med, http_med = statistics.median(local_s[1:]), statistics.median(http_s[1:])
    print(f"identical versions/losses on both sides: {same}")
    print(f"local step times (s): {[round(t, 4) for t in local_s[1:]]}")
    print(f"http  step times (s): {[round(t, 4) for t in http_s[1:]]}")
    print(f"| {args.model} | update {args.data}×{args.tokens} | {local_med:.4f} s | {http_med:.4f} s | "
          f"{http_med / local_med:.3f}× | +{(http_med - local_med) * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()
