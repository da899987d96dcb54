"""A CPU step and sampling time of the tinkerless checkout on PYTHONPATH, for before/after comparisons of a change.

    PYTHONPATH=/path/to/before .venv/bin/python bench/cpu_step_ab.py --what step      # then the same with after
    PYTHONPATH=/path/to/after  .venv/bin/python bench/cpu_step_ab.py --what sample

`step`: bench/overhead.py's tinkerless side (SmolLM2, 8 x 4 rows, 12 new tokens, LoRA r16, a checkpoint a step):
the local `tinkerless.train` step times after the first. `sample`: `engine.generate` of 32 rows x 16 sampled tokens
on SmolLM2 with a LoRA policy, four timed calls after a warm-up, wall and process CPU seconds (the CPU seconds
move less with other jobs' load). Alternate the two checkouts (A B A B) on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def step_times(model: str, steps: int) -> list[float]:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import overhead

    args = argparse.Namespace(model=model, steps=steps, batch_size=8, group_size=4, max_tokens=12)
    times, _tokens = overhead.tinkerless_steps(args)
    return times


def sample_times(model: str, calls: int) -> list[float]:
    from tinkerless.functions.worker import Worker
    from tinkerless.wire.messages import CreatePolicyRequest, LoraConfig, SamplingParams

    worker = Worker(model)
    worker.create_policy(CreatePolicyRequest("p", LoraConfig(rank=16, seed=1)))
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10 + i] for i in range(32)]
    sampling = SamplingParams(max_tokens=16, temperature=0.7, stop_token_ids=[])
    worker.engine.generate(prompts[:4], sampling, policy="p", seed=0)
    times = []
    for k in range(calls):
        started, cpu = time.perf_counter(), time.process_time()
        worker.engine.generate(prompts, sampling, policy="p", seed=k)
        times.append((time.perf_counter() - started, time.process_time() - cpu))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--what", choices=("step", "sample"), default="step")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    import tinkerless

    print(f"code: {os.path.dirname(tinkerless.__file__)}")
    if args.what == "step":
        times = step_times(args.model, args.repeats)
        print(f"step seconds: {[round(t, 3) for t in times]} median {statistics.median(times):.3f}")
        return
    times = sample_times(args.model, args.repeats)
    wall, cpu = [t for t, _ in times], [c for _, c in times]
    print(f"sample wall seconds: {[round(t, 3) for t in wall]} median {statistics.median(wall):.3f}")
    print(f"sample process CPU seconds: {[round(c, 3) for c in cpu]} median {statistics.median(cpu):.3f}")


if __name__ == "__main__":
    main()
