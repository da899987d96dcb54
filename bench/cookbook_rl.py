"""One iteration of the cookbook's own RL trainer, before and after batching sampling across calls.

Runs `examples/tinker_cookbook/rl_arithmetic.py` (the cookbook's `rl.train.main`, unmodified, on
its in-code arithmetic env: GROUPS groups x GROUP_SIZE rollouts, one `sample` call per rollout)
in the cookbook's own environment (`.venv-cookbook`, made by scripts/cookbook_check.sh) against
`tinkerless serve` in a separate process on 127.0.0.1, twice:

* before: `TINKERLESS_JOIN_QUEUED_CALLS=0`, a generation never pauses for queued calls to join
  its batch, so the sample calls decode one after another;
* after: the default, concurrent sample calls decode in one batch.

It prints the trainer's own per-iteration timings from its metrics.jsonl: `time/total`,
`time/sampling` and the training half (`time/do_train_step_and_get_sampling_client`:
forward_backward, optim_step and the next sampler snapshot). Iteration 0 includes the first sampler snapshot and warm-up, so the
table reports each iteration and the summary uses the last one.

    PYTHONPATH=$PWD .venv/bin/python bench/cookbook_rl.py                # SmolLM2-135M-Instruct
    PYTHONPATH=$PWD .venv/bin/python bench/cookbook_rl.py --model tiny   # the tiny random model
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from server_process import serve_process

REPO = Path(__file__).resolve().parent.parent
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def run_cookbook(python: str, url: str, key: str, model: str, log_dir: Path, args) -> list[dict]:
    env = {**os.environ, "TINKER_BASE_URL": url, "TINKER_API_KEY": key, "TINKER_TELEMETRY": "0",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)  # the cookbook's venv has its own packages; tinkerless is not one of them
    command = [python, str(REPO / "examples/tinker_cookbook/rl_arithmetic.py"), model, str(log_dir),
               "--iterations", str(args.iterations), "--groups", str(args.groups),
               "--group-size", str(args.group_size), "--max-tokens", str(args.max_tokens)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the cookbook run failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _training(row: dict) -> float:
    """The trainer's training half: forward_backward + optim_step, and the next sampler snapshot."""
    return row.get("time/do_train_step_and_get_sampling_client", row.get("time/train_step", float("nan")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="'smollm2' or 'tiny' (a random ~0.1M model)")
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    parser.add_argument("--cookbook-python", default=str(REPO / ".venv-cookbook/bin/python"))
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    if not Path(args.cookbook_python).exists():
        raise SystemExit(f"{args.cookbook_python} is missing: run scripts/cookbook_check.sh once to build the cookbook's venv")
    root = Path(tempfile.mkdtemp(prefix="tinkerless-bench-cookbook-rl-"))
    if args.model == "tiny":
        from tinkerless.functions.models import build_tiny_model

        served_model = client_model = build_tiny_model(root / "model", hidden_size=64, num_layers=2, seed=0)
    else:
        served_model, client_model = args.model, SMOLLM2_HUB_ID if args.model == "smollm2" else args.model
    print(f"model={args.model} {args.groups} groups x {args.group_size}, max_tokens={args.max_tokens}, "
          f"server threads={args.threads}, load average {os.getloadavg()[0]:.1f}")
    results = {}
    for label, join in (("before", "0"), ("after", "1")):
        started = time.perf_counter()
        with serve_process(served_model, root / label, env={"TINKERLESS_JOIN_QUEUED_CALLS": join},
                           threads=args.threads) as served:
            rows = run_cookbook(args.cookbook_python, served.url, served.api_key, client_model, root / label / "run", args)
        results[label] = rows
        for row in rows:
            print(f"  {label:6s} iteration {row['progress/batch']}: total {row['time/total']:7.2f} s  "
                  f"sampling {row['time/sampling']:7.2f} s  training {_training(row):6.2f} s  "
                  f"({row['env/all/total_ac_tokens']} sampled tokens, mean reward {row['env/all/reward/total']:+.3f})")
        print(f"  ({label}: {time.perf_counter() - started:.0f} s in all, server start and cookbook start-up included)")
    before, after = results["before"][-1], results["after"][-1]
    print(f"last iteration: {before['time/total']:.2f} s -> {after['time/total']:.2f} s "
          f"({before['time/total'] / after['time/total']:.1f}x); sampling {before['time/sampling']:.2f} s -> "
          f"{after['time/sampling']:.2f} s ({before['time/sampling'] / after['time/sampling']:.1f}x)")
    print(f"logs under {root}")


if __name__ == "__main__":
    main()
