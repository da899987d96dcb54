"""How close `tinkerless estimate` (its CPU calibration) comes to the run it estimates: the estimate, then the run.

    PYTHONPATH=$PWD .venv/bin/python bench/estimate_accuracy.py examples/arithmetic.py --storage /tmp/est

Prints the estimate table, the run's report and one line: the estimate beside the actual device-seconds, its
error (estimate over actual), the calibration's model, the share of its cores the run had, the machine's load
(1-minute average before and after the run) and the wall time of each. BENCHMARKS.md keeps the result for the main job (examples/arithmetic.py).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from tinkerless.sdk.cli.commands import load_config
from tinkerless.sdk.run.estimate import cpu_share, estimate
from tinkerless.sdk.run.trainer import train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("config", help="a Python file that defines `config = tinkerless.TrainConfig(...)`")
    parser.add_argument("--storage", default=".", help="where the measured run goes")
    args = parser.parse_args()
    config = load_config(args.config)
    started = time.perf_counter()
    found = estimate(config)
    estimate_wall = time.perf_counter() - started
    print(found.table(), flush=True)
    load_before = os.getloadavg()[0]
    started, cpu = time.perf_counter(), time.process_time()
    result = train(config.replace(storage=args.storage, progress=False))
    run_wall = time.perf_counter() - started
    run_share = cpu_share(time.process_time() - cpu, run_wall)
    line = found.beside(result.usage)
    print(line)
    cpu = found.for_device("cpu")
    actual = result.usage["compute_seconds_total"]
    print(json.dumps({"config": args.config, "estimate_s": [round(s, 1) for s in cpu.run_seconds], "actual_s": round(actual, 1),
                      "error": f"{100 * (cpu.run_seconds[1] - actual) / actual:+.0f}%",
                      "calibration": {k: round(v, 4) if isinstance(v, float) else v for k, v in found.calibration.items()},
                      "run_cpu_share": round(run_share, 2),
                      # Not an estimate (it needs the run's load, known only after it): the model's error apart from
                      # the machine's load changing between the calibration and the run.
                      "estimate_at_run_load_s": round(cpu.run_seconds[1] * found.calibration["cpu_share"] / max(run_share, 0.01), 1), "load_1min": [round(load_before, 1), round(os.getloadavg()[0], 1)],
                      "estimate_wall_s": round(estimate_wall, 1), "run_wall_s": round(run_wall, 1),
                      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}))


if __name__ == "__main__":
    main()
