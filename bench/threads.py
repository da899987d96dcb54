"""Tokens/s of guess_number rollouts against the worker's CPU thread count, with and without a second busy process.

    .venv/bin/python bench/threads.py                       # smollm2; threads 1, 2 and auto; load 0 and 1
    .venv/bin/python bench/threads.py --threads 1,torch --load 1 --seconds 30

Each measurement runs in a fresh process: the Worker (SmolLM2 by default), then
rollouts of examples/guess_number.py's env (2 tasks x 4 episodes, up to 4 turns of 8 tokens) until
`--seconds` have passed (at least one rollout). "torch" is torch's own default thread count (what the worker used before it chose one);
"auto" is the worker's choice (tinkerless/functions/threads.py). `--load N` first starts N other
processes that each multiply matrices with torch's default threads, like a second training run
on the same machine. Every process is bounded: a child that overruns `--seconds` by far is killed
and its partial numbers are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child(args: argparse.Namespace) -> None:
    import importlib.util

    import torch

    torch_default = torch.get_num_threads()
    from tinkerless.functions.worker import Worker
    from tinkerless.wire import pack_code
    from tinkerless.wire.messages import CreatePolicyRequest, EpisodeLimits, RolloutRequest, SamplingParams

    spec = importlib.util.spec_from_file_location("guess_number", ROOT / "examples" / "guess_number.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    setting = args.threads
    threads = torch_default if setting == "torch" else None if setting == "auto" else int(setting)
    worker = Worker(args.model, threads=threads)
    worker.create_policy(CreatePolicyRequest("bench"))

    def rollout(seed: int) -> float:
        request = RolloutRequest(
            policy="bench", tasks=[{"secret": 3 + seed % 11}, {"secret": 12}], group_size=4,
            sampling=SamplingParams(max_tokens=8, temperature=0.8), limits=EpisodeLimits(max_turns=4, max_episode_tokens=256),
            seed=seed, env=pack_code(example.GuessNumber), reward=pack_code(example.closeness),
        )
        return worker.rollout(request).stats["sampled_tokens"]

    # No warm-up: on a CPU the first rollout costs what the others do, and a loaded machine may finish only one.
    tokens, started, seed = 0.0, time.perf_counter(), 0
    while time.perf_counter() - started < args.seconds:
        tokens += rollout(seed)
        seed += 1
        elapsed = time.perf_counter() - started
        print(json.dumps({"threads": worker.threads.threads, "why": worker.threads.reason, "torch_default": torch_default,
                          "tokens": tokens, "seconds": elapsed, "rollouts": seed}), flush=True)


def loader() -> None:
    import torch

    a = torch.randn(512, 512)
    while True:
        a = torch.tanh(a @ a)


def measure(args: argparse.Namespace, setting: str, load: int) -> dict:
    loaders = [subprocess.Popen([sys.executable, __file__, "--loader"]) for _ in range(load)]
    try:
        time.sleep(3 if load else 0)  # let the load start
        load_before = os.getloadavg()[0]
        command = [sys.executable, __file__, "--child", "--threads", setting, "--model", args.model, "--seconds", str(args.seconds)]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("OMP_NUM_THREADS", None)
        limit = args.seconds * 3 + 90  # model load + one rollout that overran --seconds
        started = time.perf_counter()
        try:
            out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=limit).stdout
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        child_s = time.perf_counter() - started
        lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    finally:
        for process in loaders:
            process.kill()
            process.wait()
    if not lines:  # not one rollout finished in time: say so instead of a number
        return {"setting": setting, "load_procs": load, "loadavg_1m": round(load_before, 2),
                "no_rollout_finished_within_s": round(child_s, 1), "tokens_per_s": None}
    last = lines[-1]
    return {"setting": setting, "load_procs": load, "loadavg_1m": round(load_before, 2), **last,
            "tokens_per_s": round(last["tokens"] / last["seconds"], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", default="1,2,torch,auto", help="comma list of N, 'torch' (torch's default), 'auto'")
    parser.add_argument("--load", default="0,1", help="comma list: how many busy processes run beside the worker")
    parser.add_argument("--seconds", type=float, default=40.0, help="measured seconds per setting (at least one rollout)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--loader", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.loader:
        return loader()
    if args.child:
        return child(args)
    print(f"machine: {os.cpu_count()} cores, {len(os.sched_getaffinity(0))} usable; load average {os.getloadavg()}", flush=True)
    for load in [int(x) for x in args.load.split(",")]:
        for setting in args.threads.split(","):
            print(json.dumps(measure(args, setting, load)), flush=True)


if __name__ == "__main__":
    main()
