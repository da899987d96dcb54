"""Checkpoint writes off the critical path: the next step runs while the checkpoint is written,
the write is still verified and atomic, and a process killed mid-write keeps the previous checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading

import pytest

import tinkerless
from tinkerless.coordinator import Coordinator
from tinkerless.sdk.backends.base import LocalBackend
from tinkerless.storage import CheckpointStore, ObjectStore
from tinkerless.storage.checkpoint import BackgroundSaves


class GatedStore:
    """An ObjectStore whose puts under `gate_prefix` wait until the test opens the gate."""

    def __init__(self, inner: ObjectStore, gate_prefix: str):
        self.inner, self.gate_prefix = inner, gate_prefix
        self.gate, self.reached = threading.Event(), threading.Event()

    def put(self, key: str, data: bytes) -> None:
        if key.startswith(self.gate_prefix):
            self.reached.set()
            assert self.gate.wait(60), "the test never opened the gate"
        self.inner.put(key, data)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_background_save_commits_later_and_in_order(tmp_path):
    inner = ObjectStore(str(tmp_path))
    store = GatedStore(inner, "ckpt/step-2/a.bin")
    checkpoints = CheckpointStore(store, "ckpt")
    writer = BackgroundSaves()
    writer.submit(lambda: checkpoints.save(1, {"a.bin": b"one"}))
    writer.wait()
    writer.submit(lambda: checkpoints.save(2, {"a.bin": b"two"}))
    assert store.reached.wait(30)
    # Written but not committed: readers still get step 1, verified.
    assert writer.busy
    assert checkpoints.load_latest().files == {"a.bin": b"one"}
    store.gate.set()
    committed, _ = writer.wait()
    assert committed.endswith("step-2") and not writer.busy
    assert checkpoints.load_latest().step == 2 and checkpoints.load(2).files == {"a.bin": b"two"}


def test_a_failed_background_write_raises_at_wait_and_keeps_the_previous_checkpoint(tmp_path):
    checkpoints = CheckpointStore(ObjectStore(str(tmp_path)), "ckpt")
    checkpoints.save(1, {"a.bin": b"one"})
    writer = BackgroundSaves()

    def broken():
        checkpoints.save(2, {"a.bin": b"two", "../escape": b"x"})  # an invalid key: the save raises

    writer.submit(broken)
    with pytest.raises(Exception, match="escape|key"):
        writer.wait()
    writer.wait()  # the error is reported once
    assert checkpoints.load_latest().step == 1


KILLED_WRITER = textwrap.dedent(
    """
    import os, signal, sys, threading
    from tinkerless.storage import CheckpointStore, ObjectStore
    from tinkerless.storage.checkpoint import BackgroundSaves

    inner = ObjectStore(sys.argv[1])
    CheckpointStore(inner, "ckpt").save(1, {"adapter.bin": b"A" * 1000, "client.json": b"{}"})
    half_written = threading.Event()

    class Slow:
        def put(self, key, data):
            inner.put(key, data)
            if "step-2/" in key:
                half_written.set()
                threading.Event().wait(60)  # the kill lands while this write is in flight
        def __getattr__(self, name):
            return getattr(inner, name)

    writer = BackgroundSaves()
    checkpoints = CheckpointStore(Slow(), "ckpt")
    writer.submit(lambda: checkpoints.save(2, {"adapter.bin": b"B" * 1000, "client.json": b"{}"}))
    half_written.wait(30)
    os.kill(os.getpid(), signal.SIGKILL)  # this process only
    """
)


def test_a_kill_during_a_background_write_leaves_the_previous_checkpoint_valid(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(KILLED_WRITER)
    storage = tmp_path / "store"
    proc = subprocess.run([sys.executable, str(script), str(storage)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    checkpoints = CheckpointStore(ObjectStore(str(storage)), "ckpt")
    latest = checkpoints.load_latest()
    assert latest.step == 1 and latest.files["adapter.bin"] == b"A" * 1000
    assert checkpoints.steps() == [1]
    # The run goes on from there: the next save of step 2 commits over the half-written one.
    checkpoints.save(2, {"adapter.bin": b"C" * 10})
    assert checkpoints.load_latest().files == {"adapter.bin": b"C" * 10}


@tinkerless.reward
def letters(completion, task):
    return float(sum(ord(c) for c in completion) % 97) / 97


def test_the_next_step_runs_while_the_checkpoint_is_written(tiny_model, tmp_path, monkeypatch):
    """Step 1's rollout happens while step 0's checkpoint write is held back: were the write on the
    critical path, the write would wait for the rollout and the rollout for the write."""
    rollouts = []
    second_rollout = threading.Event()
    original_save = CheckpointStore.save

    def held_save(self, step, files, metadata=None):
        if step == 1:  # the checkpoint after step 0
            assert second_rollout.wait(60), "the next step did not start while the checkpoint was being written"
        return original_save(self, step, files, metadata)

    class Counting(LocalBackend):
        def call_bytes(self, method, payload):
            if method == "rollout":
                rollouts.append(method)
                if len(rollouts) == 2:
                    second_rollout.set()
            return super().call_bytes(method, payload)

    monkeypatch.setattr(CheckpointStore, "save", held_save)
    result = tinkerless.train(
        model=tiny_model, reward=letters, tasks=[{"prompt": "a"}, {"prompt": "b"}], steps=3, batch_size=2,
        group_size=2, max_tokens=4, checkpoint_every=1, keep_checkpoints=None, seed=1, progress=False,
        storage=str(tmp_path), run_id="overlap", backend=Counting(tiny_model),
    )  # fmt: skip
    assert len(rollouts) == 3
    assert result.last_checkpoint_step == 3
    store = CheckpointStore(ObjectStore(str(tmp_path)), "runs/overlap/checkpoints")
    assert store.steps() == [1, 2, 3]
    state = json.loads(store.load(3).files["client.json"])
    assert state["step"] == 3
    assert Coordinator.open(ObjectStore(str(tmp_path)), "overlap").state.last_checkpoint_step == 3
