"""The main job and guess_number through a shared `tinkerless serve`, tenant code sandboxed vs in-process.

    PYTHONPATH=. .venv/bin/python bench/tenant_code_overhead.py [--steps 3] [--model smollm2] [--rounds 2]

Two servers on 127.0.0.1 with the same model: one multi-tenant (each tenant's env and
reward run in its bubblewrap-sandboxed host, `tinkerless/functions/hosting/user_code.py`), one
`--single-user` (user code in the server process). Each example runs `--steps` steps as
a tenant with an API key on each server, alternating, `--rounds` times after one warm-up
round (model load, the tenant host's start); the script prints the median and minimum
seconds per step, their ratios sandboxed/in-process and the rewards (the
same seeds give the same rewards either way: the sandbox changes where code runs, not
what it computes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import tinkerless  # noqa: E402
from tinkerless.functions.hosting.user_code import UserCodeHost, UserCodeHosts  # noqa: E402
from tinkerless.functions.worker import Worker  # noqa: E402
from tinkerless.sdk.cli.commands import load_config  # noqa: E402
from tinkerless.sdk.backends.http import HTTPBackend  # noqa: E402
from tinkerless.server import create_app, serve_in_thread  # noqa: E402
from tinkerless.server.keys import KeyStore  # noqa: E402
from tinkerless.storage import ObjectStore  # noqa: E402

EXAMPLES = {"main job (arithmetic)": REPO / "examples/arithmetic.py", "guess_number": REPO / "examples/guess_number.py"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default="smollm2")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tinkerless-tenant-bench-"))
    configs = {name: load_config(str(path)).replace(model=args.model, steps=args.steps, progress=False) for name, path in EXAMPLES.items()}
    hosts = UserCodeHosts(hide=(str(work),))
    # The time the server spends waiting on the tenants' sandboxes, apart from the model's: the part of the
    # ratio that a busy machine's noise cannot hide.
    hosted = {"calls": 0, "seconds": 0.0}
    real_request = UserCodeHost.request

    def timed_request(self, request):
        started = time.perf_counter()
        try:
            return real_request(self, request)
        finally:
            hosted["calls"] += 1
            hosted["seconds"] += time.perf_counter() - started

    UserCodeHost.request = timed_request
    servers = {}
    for kind, worker in (("sandboxed", Worker(args.model, user_code_hosts=hosts)), ("in-process", Worker(args.model))):
        storage = work / kind
        key = KeyStore(ObjectStore(str(storage))).create("bench")
        servers[kind] = (create_app(worker, keys=KeyStore(ObjectStore(str(storage))), storage=str(storage)), key)
    seconds: dict[tuple[str, str], list[float]] = {}
    rewards: dict[tuple[str, str], list[float]] = {}
    hostwait: dict[str, list] = {}
    with serve_in_thread(servers["sandboxed"][0]) as sandboxed_url, serve_in_thread(servers["in-process"][0]) as local_url:
        urls = {"sandboxed": sandboxed_url, "in-process": local_url}
        for round_index in range(-1, args.rounds):  # round -1 warms up (loads, first host start), not counted
            for name, config in configs.items():
                for kind in ("sandboxed", "in-process"):
                    started = time.perf_counter()
                    result = tinkerless.train(
                        config, backend=HTTPBackend(urls[kind], api_key=servers[kind][1]),
                        storage=str(work / f"client-{kind}-{round_index + 1}"), run_id=f"{name.split()[0]}-{round_index + 1}",
                    )
                    elapsed = time.perf_counter() - started
                    if round_index >= 0:
                        seconds.setdefault((name, kind), []).append(elapsed / args.steps)
                        if kind == "sandboxed":
                            waits = hostwait.setdefault(name, [0, 0.0, 0.0])
                            waits[0] += hosted["calls"]
                            waits[1] += hosted["seconds"]
                            waits[2] += sum(r["rollout_s"] for r in result.metrics)
                    hosted["calls"], hosted["seconds"] = 0, 0.0
                    rewards[(name, kind)] = [round(r["reward_mean"], 3) for r in result.metrics]
    hosts.close()
    import os

    print(f"{args.steps} steps × {args.rounds} rounds per cell after a warm-up round, model {args.model}, load {os.getloadavg()[0]:.1f}")
    print("| example | in-process s/step (median, min) | sandboxed s/step (median, min) | ratio of medians | ratio of minima | rewards equal |")
    print("|---|---|---|---|---|---|")
    for name in configs:
        local, boxed = seconds[(name, "in-process")], seconds[(name, "sandboxed")]
        same = rewards[(name, "in-process")] == rewards[(name, "sandboxed")]
        print(
            f"| {name} | {statistics.median(local):.2f}, {min(local):.2f} | {statistics.median(boxed):.2f}, {min(boxed):.2f} | "
            f"{statistics.median(boxed) / statistics.median(local):.3f} | {min(boxed) / min(local):.3f} | {same} {rewards[(name, 'sandboxed')]} |"
        )
    for name, (calls, waited, rollout) in hostwait.items():
        print(f"{name}: {calls} round trips to the sandbox, {waited:.3f} s in them, {100 * waited / rollout:.1f}% of {rollout:.1f} s of rollout")


if __name__ == "__main__":
    main()
