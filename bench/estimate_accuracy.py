"""How close `tinkerless estimate` (its CPU calibration) comes to the run it estimates: the estimate, then the run.

    PYTHONPATH=$PWD .venv/bin/python bench/estimate_accuracy.py examples/arithmetic.py --storage /tmp/est

Prints the estimate table, the run's report and one line: the estimate beside the actual device-seconds (and
the wall time of each). BENCHMARKS.md keeps the result for the main job (examples/arithmetic.py).
"""

from __future__ import annotations

import argparse
import json
import time

from tinkerless.sdk.cli.commands import load_config
from tinkerless.sdk.run.estimate import estimate
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
    started = time.perf_counter()
    result = train(config.replace(storage=args.storage, progress=False))
    run_wall = time.perf_counter() - started
    line = found.beside(result.usage)
    print(line)
    cpu = found.for_device("cpu")
    print(json.dumps({"config": args.config, "estimate_s": cpu.run_seconds, "actual_s": result.usage["compute_seconds_total"],
                      "estimate_wall_s": estimate_wall, "run_wall_s": run_wall, "calibration": found.calibration,
                      "date": time.strftime("%Y-%m-%d")}))


if __name__ == "__main__":
    main()
