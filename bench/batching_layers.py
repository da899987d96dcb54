"""Where the per-call cost of 16 single-sample calls goes, layer by layer (tiny model, no HTTP first).

Times 16 concurrent single-row generations against one 16-row generation at three depths:

1. engine: 16 threads calling `engine.generate` (the batcher's lock batches them) vs one call;
2. scheduler: 16 jobs on the server's `Scheduler` (thread per job, pauses to let calls join) vs one job;
3. HTTP: the official `tinker` SDK against `tinkerless serve` in its own process (bench/batching.py's
   figure), so the client's cost is on another interpreter, as for a client on another machine.

    PYTHONPATH=$PWD python bench/batching_layers.py [--max-tokens 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("TINKER_TELEMETRY", "0")

from tinkerless.functions.models import build_tiny_model  # noqa: E402
from tinkerless.functions.worker import Worker  # noqa: E402
from tinkerless.server.scheduler import Scheduler  # noqa: E402
from tinkerless.wire.messages import SamplingParams  # noqa: E402

PROMPT = [5, 6, 7, 8, 9, 10]


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def engine_layer(engine, sampling) -> tuple[float, float]:
    def many():
        threads = [threading.Thread(target=engine.generate, args=([PROMPT], sampling), kwargs={"policy": None, "seed": i})
                   for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    return timed(lambda: engine.generate([PROMPT] * 16, sampling, policy=None, seed=0)), timed(many)


def scheduler_layer(engine, scheduler, sampling) -> tuple[float, float]:
    def one():
        scheduler.submit(lambda: engine.generate([PROMPT] * 16, sampling, policy=None, seed=0)).result()

    def many():
        futures = [scheduler.submit(lambda i=i: engine.generate([PROMPT], sampling, policy=None, seed=i))
                   for i in range(16)]
        for f in futures:
            f.result()

    return timed(one), timed(many)


def http_layer(model: str, root: Path, max_tokens: int, repeats: int) -> tuple[float, float]:
    import tinker
    from tinker import types

    from server_process import serve_process

    with serve_process(model, root / "served", threads=1) as served:
        service = tinker.ServiceClient(base_url=served.url, api_key=served.api_key)
        sampler = service.create_sampling_client(base_model=model).result()
        prompt = types.ModelInput.from_ints(PROMPT)
        params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, stop=[], seed=1)

        def one():
            sampler.sample(prompt, num_samples=16, sampling_params=params).result()

        def many():
            futures = [sampler.sample(prompt, num_samples=1, sampling_params=params) for _ in range(16)]
            for f in futures:
                f.result()

        many()  # warm-up
        ones = [timed(one) for _ in range(repeats)]
        manys = [timed(many) for _ in range(repeats)]
        service.close(status="success")
    return statistics.median(ones), statistics.median(manys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tinkerless-bench-layers-"))
    model = build_tiny_model(root / "model", hidden_size=64, num_layers=2, seed=0)
    worker = Worker(model, threads=1)
    engine = worker.engine
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop_token_ids=[])
    scheduler = Scheduler()
    print(f"tiny model, max_tokens={args.max_tokens}, median of {args.repeats}, load average {os.getloadavg()[0]:.1f}")
    layers = {
        "engine (16 threads, no server)": lambda: engine_layer(engine, sampling),
        "scheduler (16 jobs, no HTTP)": lambda: scheduler_layer(engine, scheduler, sampling),
    }
    for name, measure in layers.items():
        measure()  # warm-up
        runs = [measure() for _ in range(args.repeats)]
        one, many = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        print(f"  {name:34s} 1 x 16: {one * 1000:6.0f} ms   16 x 1: {many * 1000:6.0f} ms   ({one / many:.0%})")
    scheduler.close()
    one, many = http_layer(model, root, args.max_tokens, args.repeats)
    print(f"  {'HTTP (tinker SDK, server process)':34s} 1 x 16: {one * 1000:6.0f} ms   16 x 1: {many * 1000:6.0f} ms   ({one / many:.0%})")


if __name__ == "__main__":
    main()
