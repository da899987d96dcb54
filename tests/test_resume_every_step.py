"""A run through a server, its client SIGKILLed at every step, resumes to the uninterrupted run's exact result.

The server keeps every run's adapters and optimizer in memory. A resume must therefore
first put each policy into exactly its checkpoint's state, or into the fresh init when
there is none (killed before the first checkpoint, or every checkpoint corrupt), and
never go on from what the killed attempt left on the worker.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from conftest import write_resumable_example
from safetensors.torch import load as load_safetensors

from tinkerless.sdk.cli.commands import main
from tinkerless.server import create_app
from tinkerless.server import serve_in_thread as running

STEPS = 4
CHECKPOINT_EVERY = 2  # kills at steps 0 and 1 land before the first checkpoint
CLI = [sys.executable, "-m", "tinkerless.sdk.cli.commands"]


def _args(example: Path, url: str, client: Path, run_id: str, *extra: str) -> list[str]:
    return [
        "train", str(example), "--backend", url, "--storage", str(client), "--run-id", run_id, "--no-progress",
        "--checkpoint-every", str(CHECKPOINT_EVERY), *extra,
    ]


def _state(server: Path, run_id: str) -> dict | None:
    try:
        return json.loads((server / f"tenants/_/runs/{run_id}/state.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _adapter(server: Path, run_id: str) -> dict:
    path = server / f"tenants/_/runs/{run_id}/checkpoints/step-{STEPS}/adapter/adapter_model.safetensors"
    return load_safetensors(path.read_bytes())


def _optimizer(server: Path, run_id: str) -> bytes:
    return (server / f"tenants/_/runs/{run_id}/checkpoints/step-{STEPS}/optimizer.pt").read_bytes()


def _rewards(client: Path, run_id: str) -> list[float]:
    lines = (client / f"runs/{run_id}/metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["reward_mean"] for line in lines]


def _assert_same_run(server: Path, client: Path, run_id: str, reference: str) -> None:
    expected, actual = _adapter(server, reference), _adapter(server, run_id)
    assert expected.keys() == actual.keys() and expected
    for name in expected:
        assert (expected[name] == actual[name]).all(), f"{run_id}: {name} differs from the uninterrupted run"
    assert _rewards(client, run_id) == _rewards(client, reference), f"{run_id}: rewards differ"


def test_a_client_killed_at_every_step_resumes_bit_identically(tiny_model, tmp_path):
    from tinkerless.functions.worker import Worker

    example = write_resumable_example(tmp_path / "resumable.py", tiny_model, STEPS)
    server, client = tmp_path / "server", tmp_path / "client"
    with running(create_app(Worker(tiny_model), storage=str(server))) as url:
        assert main(_args(example, url, client, "straight")) == 0

        # One client per step, all at once (a busy shared server is the realistic case): each is killed
        # as soon as the server's run reaches its step, plus a random part of that step.
        procs = {
            k: subprocess.Popen(CLI + _args(example, url, client, f"kill{k}"), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
            for k in range(STEPS)
        }
        killed_at: dict[int, int] = {}
        deadline = time.monotonic() + 300
        while len(killed_at) < STEPS and time.monotonic() < deadline:
            for k, proc in procs.items():
                state = _state(server, f"kill{k}")
                if k in killed_at or state is None or state["step"] < k:
                    assert proc.poll() is None or k in killed_at, proc.communicate()[0]
                    continue
                time.sleep(random.uniform(0.0, 0.1))
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                killed_at[k] = _state(server, f"kill{k}")["step"]
            time.sleep(0.02)
        assert sorted(killed_at) == list(range(STEPS)), "a client was not killed in time"
        assert all(step < STEPS for step in killed_at.values()), f"a run finished before its kill: {killed_at}"
        # The kills before the first checkpoint left trained adapters on the worker and nothing to resume from.
        assert any(step < CHECKPOINT_EVERY for step in killed_at.values())

        for k in range(STEPS):
            assert main(_args(example, url, client, f"kill{k}", "--resume")) == 0

    for k in range(STEPS):
        _assert_same_run(server, client, f"kill{k}", "straight")
        assert _optimizer(server, f"kill{k}") == _optimizer(server, "straight"), f"kill{k}: optimizer state differs"


def test_a_run_whose_checkpoints_are_all_corrupt_restarts_from_the_fresh_init(tiny_model, tmp_path):
    from tinkerless.functions.worker import Worker

    example = write_resumable_example(tmp_path / "resumable.py", tiny_model, STEPS)
    server, client = tmp_path / "server", tmp_path / "client"
    with running(create_app(Worker(tiny_model), storage=str(server))) as url:
        assert main(_args(example, url, client, "straight")) == 0
        # Stop after 3 steps (checkpoint at step 2), then damage every checkpoint the server holds.
        assert main(_args(example, url, client, "corrupt", "--steps", "3")) == 0
        damaged = sorted((server / "tenants/_/runs/corrupt/checkpoints").glob("step-*/adapter/adapter_model.safetensors"))
        assert damaged
        for path in damaged:
            path.write_bytes(path.read_bytes()[:-8] + b"garbage!")

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert main(_args(example, url, client, "corrupt", "--resume", "--steps", str(STEPS))) == 0
    # The client is told which checkpoints the server skipped (the server, in this same process, also warns
    # in its own log with its paths), without the server's own paths.
    told = [str(w.message) for w in caught if str(w.message).startswith(url)]
    assert len(told) == 2 and all("skipped checkpoint" in m and str(server) not in m for m in told), told
    _assert_same_run(server, client, "corrupt", "straight")


def test_reset_policy_rebuilds_the_seeded_init_and_a_fresh_optimizer(tiny_model):
    """The worker-side primitive: after training, reset gives back the bytes create_policy made."""
    import numpy as np

    from tinkerless.functions.losses import LossConfig
    from tinkerless.functions.worker import Worker
    from tinkerless.wire.messages import (
        AdamParams, CreatePolicyRequest, Datum, LoraConfig, ResetPolicyRequest, SaveStateRequest, UpdateRequest,
    )

    worker = Worker(tiny_model)
    worker.create_policy(CreatePolicyRequest("other", LoraConfig(rank=4, seed=1)))
    worker.create_policy(CreatePolicyRequest("pol", LoraConfig(rank=4, seed=3)))
    fresh = worker.save_state(SaveStateRequest("pol")).files
    other = worker.save_state(SaveStateRequest("other")).files
    datum = Datum(
        tokens=np.arange(1, 7, dtype=np.int32), mask=np.array([0, 1, 1, 1, 1, 1], dtype=np.float32),
        advantages=np.ones(6, dtype=np.float32), sampler_logprobs=np.zeros(6, dtype=np.float32),
    )
    for _ in range(2):
        worker.update(UpdateRequest("pol", [datum], LossConfig(), AdamParams(learning_rate=0.1)))
    trained = worker.save_state(SaveStateRequest("pol")).files
    assert trained["adapter/adapter_model.safetensors"] != fresh["adapter/adapter_model.safetensors"]

    assert worker.reset_policy(ResetPolicyRequest("pol")) == {"policy": "pol", "policy_version": 0}
    reset = worker.save_state(SaveStateRequest("pol")).files
    assert reset["adapter/adapter_model.safetensors"] == fresh["adapter/adapter_model.safetensors"]
    assert reset["optimizer.pt"] == fresh["optimizer.pt"]
    # The other policy, and the set of policies, are untouched (the scratch adapter is gone).
    assert worker.save_state(SaveStateRequest("other")).files["adapter/adapter_model.safetensors"] == other[
        "adapter/adapter_model.safetensors"
    ]
    assert sorted(worker.info()["policies"]) == ["other", "pol"]
    # A policy the worker does not hold: an error, unless the caller says it may be missing (a read-only eval).
    from tinkerless.errors import UserError

    with pytest.raises(UserError, match="does not exist"):
        worker.reset_policy(ResetPolicyRequest("absent"))
    worker.reset_policy(ResetPolicyRequest("absent", missing_ok=True))
    assert "absent" not in worker.policies
    # A second server (a restart) builds the same init from the same seed.
    again = Worker(tiny_model)
    again.create_policy(CreatePolicyRequest("pol", LoraConfig(rank=4, seed=3)))
    assert again.save_state(SaveStateRequest("pol")).files["adapter/adapter_model.safetensors"] == fresh[
        "adapter/adapter_model.safetensors"
    ]
