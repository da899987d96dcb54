"""A whole `train()` step over HTTP vs in-process: rollout, update, the coordinator's barrier
calls and a checkpoint, with the run hosted by the server on the HTTP side.

    .venv/bin/python bench/http_train_step.py [--model tiny|smollm2] [--steps 12] [--repeats 3]

Each repeat trains the same run (same seed) once through `LocalBackend` (coordinator and
checkpoints in this process, in a temp dir) and once through `HTTPBackend` against a
uvicorn server in a thread on 127.0.0.1 (coordinator and checkpoints on the server),
alternating so both see the same machine load. Step 0 is warm-up. Prints the median
per-step wall time (the metrics' `step_s` plus checkpoint `storage_s`) and HTTP/local.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import tinkerless
from tinkerless.functions.worker import Worker
from tinkerless.sdk.backends.base import LocalBackend
from tinkerless.sdk.backends.http import HTTPBackend
from tinkerless.server import create_app
from tinkerless.server import serve_in_thread as running


@tinkerless.reward
def vowels(completion: str, task: dict) -> float:
    return sum(c in "aeiou" for c in completion) / max(len(completion), 1)


def run(model: str, backend, storage: str, run_id: str, steps: int) -> list[float]:
    result = tinkerless.train(
        model=model, reward=vowels, tasks=lambda rng: {"prompt": f"say {rng.randint(0, 99)}"}, steps=steps,
        batch_size=4, group_size=4, max_tokens=16, learning_rate=1e-3, checkpoint_every=1, seed=0,
        storage=storage, run_id=run_id, progress=False, backend=backend,
    )
    # The checkpoint after step n is reported in step n+1's storage_s: one whole step each.
    return [r["step_s"] + r["storage_s"] for r in result.metrics[1:]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = args.model
    if model == "tiny":
        from tinkerless.functions.models import build_tiny_model

        model = build_tiny_model(tempfile.mkdtemp() + "/tiny", hidden_size=64, num_layers=2, seed=0)
    local_worker = LocalBackend(model)
    local_times: list[float] = []
    http_times: list[float] = []
    with running(create_app(Worker(model), storage=tempfile.mkdtemp())) as url:
        for repeat in range(args.repeats):
            local_times += run(model, local_worker, tempfile.mkdtemp(), f"local-{repeat}", args.steps)
            http_times += run(model, HTTPBackend(url), tempfile.mkdtemp(), f"http-{repeat}", args.steps)
    local, http = statistics.median(local_times), statistics.median(http_times)
    print(f"model {args.model}: {len(local_times)} steps each (batch 4 x group 4, 16 tokens, a checkpoint every step)")
    print(f"median step: local {local:.4f} s, HTTP {http:.4f} s, HTTP/local {http / local:.3f}x")


if __name__ == "__main__":
    main()
