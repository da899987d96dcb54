"""Per-call overhead of the python tool's sandbox: a `print(1)` tool call, per sandbox kind.

    PYTHONPATH=. .venv/bin/python bench/sandbox_overhead.py [--calls 40] [--kinds bwrap,process-unsafe]

Each round runs, back to back (so a busy machine slows all alike): a bare interpreter
start (`python -I -S -c "print(1)"`, the floor any separate process pays), then one
`print(1)` call of the `python` tool per sandbox kind. Prints medians and p90 in ms,
and each kind's cost above the bare interpreter, as markdown rows for BENCHMARKS.md.
"process-unsafe" is the pre-#12 process sandbox, kept by name: it is the "before".
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from tinkerless.envs.python_tool import python_tool
from tinkerless.envs.sandbox import SandboxLimits

LIMITS = SandboxLimits(cpu_seconds=2, wall_seconds=5)


def timed(call) -> float:
    started = time.perf_counter()
    call()
    return (time.perf_counter() - started) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--kinds", default="bwrap,process-unsafe")
    args = parser.parse_args()
    interpreter = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    calls = {"bare interpreter": lambda: subprocess.run([interpreter, "-I", "-S", "-c", "print(1)"], capture_output=True, check=True)}
    for kind in args.kinds.split(","):
        tool = python_tool(sandbox=kind, limits=LIMITS)

        def call(tool=tool, kind=kind) -> None:
            observation = tool(code="print(1)")
            assert observation.ok and observation.text == "1", (kind, observation)

        calls[kind] = call
    for call in calls.values():  # warm up: the sandbox builds its layout and seccomp filter once per process
        call()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(args.calls):
        for name, call in calls.items():
            samples[name].append(timed(call))
    floor = statistics.median(samples["bare interpreter"])
    load = os.getloadavg()[0]
    print(f"{args.calls} calls each, {os.cpu_count()} CPUs, load average {load:.1f}")
    print("| what | median ms | p90 ms | above bare interpreter ms |")
    print("|---|---|---|---|")
    for name, values in samples.items():
        ordered = sorted(values)
        median = statistics.median(ordered)
        p90 = ordered[int(0.9 * (len(ordered) - 1))]
        extra = "" if name == "bare interpreter" else f"{median - floor:.1f}"
        print(f"| {name} | {median:.1f} | {p90:.1f} | {extra} |")


if __name__ == "__main__":
    main()
