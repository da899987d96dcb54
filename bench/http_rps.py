"""Requests per second of small calls against a tinkerless HTTP server on 127.0.0.1.

    .venv/bin/python bench/http_rps.py [--method info|forward] [--clients 8] [--requests 400]

A uvicorn server (a thread in this process) hosts a `Worker` on the tiny random model.
`--clients` threads, each with its own `HTTPBackend`, share a fixed total of `--requests`
calls (`info`, or `forward` of one 16-token datum). Warm-up calls are not counted.
Prints RPS (requests / wall seconds) and p50/p95 latency per call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tinkerless.functions.models import build_tiny_model  # noqa: E402
from tinkerless.functions.worker import Worker  # noqa: E402
from tinkerless.sdk.backends.base import call  # noqa: E402
from tinkerless.sdk.backends.http import HTTPBackend  # noqa: E402
from tinkerless.server import create_app  # noqa: E402
from tinkerless.server import serve_in_thread as running  # noqa: E402
from tinkerless.wire.messages import CreatePolicyRequest, Datum, ForwardRequest  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", choices=("info", "forward"), default="info")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=400)
    args = parser.parse_args()
    tokens = np.arange(16, dtype=np.int32) + 40
    request = ForwardRequest("pi", [Datum(tokens=tokens, mask=np.ones(16, np.float32))]) if args.method == "forward" else None
    per_client = [args.requests // args.clients + (i < args.requests % args.clients) for i in range(args.clients)]
    latencies: list[list[float]] = [[] for _ in range(args.clients)]
    errors: list[BaseException] = []

    with tempfile.TemporaryDirectory() as tmp:
        worker = Worker(build_tiny_model(f"{tmp}/tiny", hidden_size=64, num_layers=2, seed=0))
        with running(create_app(worker)) as url:
            backends = [HTTPBackend(url) for _ in range(args.clients)]
            try:
                call(backends[0], "create_policy", CreatePolicyRequest("pi"))
                for b in backends:  # warm-up: open each client's connection
                    call(b, args.method, request)
                barrier = threading.Barrier(args.clients + 1)

                def client(i: int) -> None:
                    try:
                        barrier.wait(timeout=30)
                        for _ in range(per_client[i]):
                            started = time.perf_counter()
                            call(backends[i], args.method, request)
                            latencies[i].append(time.perf_counter() - started)
                    except BaseException as exc:  # reported after the run
                        errors.append(exc)

                threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
                for t in threads:
                    t.start()
                barrier.wait(timeout=30)
                started = time.perf_counter()
                for t in threads:
                    t.join(timeout=300)
                wall = time.perf_counter() - started
            finally:
                for b in backends:
                    b.close()
    if errors:
        raise errors[0]
    flat = sorted(x for xs in latencies for x in xs)
    p50 = statistics.median(flat)
    p95 = flat[min(len(flat) - 1, int(0.95 * len(flat)))]
    print(f"{len(flat)} calls of {args.method} from {args.clients} clients in {wall:.2f} s")
    print(f"| {args.method} | {args.clients} | {len(flat)} | {len(flat) / wall:.0f} | {p50 * 1e3:.1f} ms | {p95 * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()
