"""One tenant floods the server with maximal requests; how long do another tenant's small calls take?

    .venv/bin/python bench/flood.py [--seconds 60] [--flooders 4] [--slice-seconds 0.05] [--torch-threads N]

Starts `tinkerless serve` (a subprocess, auth on, two tenants, the tiny random model) on
127.0.0.1 with its default per-request limits. Tenant "flood" runs `--flooders` threads,
each sending maximal Tinker `asample` requests back to back through the official SDK:
`num_samples` = --max-samples, `max_tokens` = --max-tokens, `stop=[]` (so no sample ends
early). Once the first one is running, tenant "small" makes small calls in a loop for
`--seconds`: `/v1/call/info`, a 4-token `/v1/call/sample`, and a 4-token Tinker `asample`.
Prints each kind's count and p50/p99/max latency (a call still unanswered when the time is
up counts as lasting until then, marked "+"). The server is stopped at the end: bounded in
time whatever the flood's backlog. `--slice-seconds 1e9` shows the server without slicing.
`--torch-threads N` sets the server's OMP_NUM_THREADS (torch's intra-op threads): on a CPU
shared with other busy processes, 1 avoids threads waiting on each other at every op.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TINKER_TELEMETRY", "0")
from tinkerless.functions.models import build_tiny_model  # noqa: E402
from tinkerless.sdk.backends.base import call  # noqa: E402
from tinkerless.sdk.backends.http import HTTPBackend  # noqa: E402
from tinkerless.server.keys import KeyStore  # noqa: E402
from tinkerless.server.limits import ServingLimits  # noqa: E402
from tinkerless.storage import ObjectStore  # noqa: E402
from tinkerless.wire.messages import SampleRequest, SamplingParams  # noqa: E402


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(model: str, storage: str, port: int, slice_seconds: float, threads: int | None) -> subprocess.Popen:
    command = [sys.executable, "-c", "from tinkerless.sdk.cli.commands import main; raise SystemExit(main())", "serve",
               "--model", model, "--storage", storage, "--port", str(port), "--slice-seconds", str(slice_seconds)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            time.sleep(0.2)
    server.kill()
    raise RuntimeError("the server did not start within 120 s")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="how long the small tenant measures")
    parser.add_argument("--flooders", type=int, default=4, help="the flooding tenant's concurrent requests")
    parser.add_argument("--slice-seconds", type=float, default=0.05)
    parser.add_argument("--torch-threads", type=int, default=None, help="the server's OMP_NUM_THREADS (default: torch's)")
    args = parser.parse_args()
    import tinker
    from tinker import types

    limits = ServingLimits()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(f"{tmp}/tiny", hidden_size=64, num_layers=2, seed=0)
        keys = KeyStore(ObjectStore(f"{tmp}/storage"))
        flood_key, small_key = keys.create("flood"), keys.create("small")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = start_server(model, f"{tmp}/storage", port, args.slice_seconds, args.torch_threads)
        stop = threading.Event()
        flood_counts = {"sent": 0, "done": 0}
        try:
            flood_client = tinker.ServiceClient(base_url=url, api_key=flood_key)
            flood_sampler = flood_client.create_sampling_client(base_model=model).result()
            maximal = types.SamplingParams(max_tokens=limits.max_tokens, stop=[], temperature=1.0)

            def flood() -> None:
                while not stop.is_set():
                    future = flood_sampler.sample(types.ModelInput.from_ints([3, 4, 5]), limits.max_samples, maximal)
                    flood_counts["sent"] += 1
                    while not stop.is_set():
                        try:
                            future.result(timeout=1.0)
                            flood_counts["done"] += 1
                            break
                        except TimeoutError:
                            continue
                        except Exception:  # noqa: BLE001 - the server goes away at the end
                            return

            flooders = [threading.Thread(target=flood, daemon=True) for _ in range(args.flooders)]
            for thread in flooders:
                thread.start()
            time.sleep(2.0)  # the flood is queued and the first maximal request is generating

            small = HTTPBackend(url, api_key=small_key)
            small_client = tinker.ServiceClient(base_url=url, api_key=small_key)
            small_sampler = small_client.create_sampling_client(base_model=model).result()
            calls = {
                "info (/v1/call/info)": lambda: call(small, "info", None),
                "sample 4 tokens (/v1/call/sample)": lambda: call(
                    small, "sample", SampleRequest("base", [[3, 4]], sampling=SamplingParams(max_tokens=4))),
                "Tinker asample 4 tokens": lambda: small_sampler.sample(
                    types.ModelInput.from_ints([3, 4]), 1, types.SamplingParams(max_tokens=4)).result(),
            }
            latencies: dict[str, list[float]] = {name: [] for name in calls}
            unfinished: dict[str, float] = {}
            deadline = time.monotonic() + args.seconds

            def measure() -> None:
                while time.monotonic() < deadline:
                    for name, fn in calls.items():
                        started = time.perf_counter()
                        fn()
                        latencies[name].append(time.perf_counter() - started)

            measurer = threading.Thread(target=measure, daemon=True)
            measurer.start()
            measurer.join(args.seconds + 30)  # the call under way at the deadline may finish
            if measurer.is_alive():  # a small call is stuck behind the flood
                unfinished["(a call)"] = args.seconds
            stop.set()
        finally:
            server.kill()
            server.wait()

    print(f"flood: {args.flooders} concurrent Tinker asample requests of num_samples={limits.max_samples}, "
          f"max_tokens={limits.max_tokens}, stop=[] ({flood_counts['sent']} sent, {flood_counts['done']} finished); "
          f"slice_seconds={args.slice_seconds}, torch threads={args.torch_threads or 'default'}; "
          f"measured {args.seconds:.0f} s")
    print(f"{'small call':<36} {'n':>5} {'p50 s':>8} {'p99 s':>8} {'max s':>8}")
    for name, values in latencies.items():
        if values:
            print(f"{name:<36} {len(values):>5} {statistics.median(values):>8.3f} {percentile(values, 99):>8.3f} "
                  f"{max(values):>8.3f}")
        else:
            print(f"{name:<36} {0:>5} {'-':>8} {'-':>8} {'>' + format(args.seconds, '.0f'):>8}")
    if unfinished:
        print(f"+ a small call was still unanswered after {args.seconds:.0f} s")


if __name__ == "__main__":
    main()
