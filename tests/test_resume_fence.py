"""The resume fence: once a second client takes a run over, no call the first one sent can change the run.

A killed client can leave calls behind on the server: queued behind other work, held
behind a gap in its sequence numbers (a number reserved and never sent), or still on
their way. The server gives a run's worker policies to its current driver's call stream
(on open, save and restore); every call of another stream that would change them is
refused with a 409 `StaleDriver`, at once, gaps or not. These tests drive the run at the
wire level (`HTTPBackend`, `ServerRunHost`), as `train()` does, to hold calls exactly
where a kill leaves them.
"""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import pytest

from tinkerless.errors import CommitConflict, StaleDriver
from tinkerless.sdk.backends.base import call
from tinkerless.sdk.backends.http import HTTPBackend
from tinkerless.server import create_app
from tinkerless.server import serve_in_thread as running
from tinkerless.server.scheduler import Scheduler
from tinkerless.wire import decode_message, encode_message
from tinkerless.wire.http import MSGPACK, SEQ_HEADER, STREAM_HEADER
from tinkerless.wire.messages import (
    BASE_POLICY, AdamParams, CreatePolicyRequest, Datum, ErrorReply, LoraConfig, SampleRequest,
    SamplingParams, SaveStateRequest, UpdateRequest,
)
from tinkerless.wire.runs import CheckpointPolicy
from tinkerless.functions.losses import LossConfig

CLIENT_FILE = "client.json"
GAP_TIMEOUT = 600.0  # far past every wait here: a refusal that comes quickly is the fence, not the gap timeout


def _datum(k: int) -> Datum:
    """Step k's batch: different per step, so updates applied twice or out of order change the result."""
    return Datum(
        tokens=np.arange(1 + k, 9 + k, dtype=np.int32), mask=np.array([0, 0, 1, 1, 1, 1, 1, 1], dtype=np.float32),
        advantages=np.full(8, 1.0 - 0.5 * k, dtype=np.float32), sampler_logprobs=np.zeros(8, dtype=np.float32),
    )


def _update(backend, policy: str, k: int):
    return call(backend, "update", UpdateRequest(policy, [_datum(k)], LossConfig(), AdamParams(learning_rate=0.05)))


class Driver:
    """What a training client does on the server: its run's coordinator, one policy, checkpoints."""

    def __init__(self, url: str, run_id: str, *, api_key: str | None = None, resume: bool = False):
        self.backend = HTTPBackend(url, api_key=api_key)
        host = self.backend.run_host()
        self.coordinator = host.open(run_id) if resume else host.create(run_id, {"name": run_id})
        self.checkpoints = host.checkpoints(run_id, None, self.coordinator)
        self.policy = f"{run_id}-pol"  # the worker's name for it, as train() namespaces it per run
        call(self.backend, "create_policy", CreatePolicyRequest(self.policy, LoraConfig(rank=4, seed=3)))

    def checkpoint_policies(self) -> list[CheckpointPolicy]:
        return [CheckpointPolicy("default", "", self.policy)]

    def save(self, updates: int) -> None:
        """A checkpoint after `updates` updates (as the run's step 0: this driver does not walk the coordinator's
        phases, and the checkpoint's step number plays no part here)."""
        self.checkpoints.save(0, self.checkpoint_policies(), {CLIENT_FILE: str(updates).encode()}, {})

    def restore(self) -> int | None:
        """The number of updates the restored checkpoint holds; None when there was no checkpoint."""
        restored = self.checkpoints.restore(self.checkpoint_policies(), [CLIENT_FILE])
        return None if restored.step is None else int(restored.files[CLIENT_FILE])

    def state(self) -> dict[str, bytes]:
        files = call(self.backend, "save_state", SaveStateRequest(self.policy, True)).files
        return {k: files[k] for k in ("adapter/adapter_model.safetensors", "optimizer.pt")}

    def held_update(self, k: int) -> dict:
        """Send step k's update behind a gap (a sequence number reserved and never sent, as a client killed
        between reserving and sending leaves), from a thread; the returned dict gets its outcome."""
        with self.backend._seq_lock:
            next(self.backend._seq)
        outcome: dict = {}

        def send() -> None:
            started = time.monotonic()
            try:
                outcome["result"] = _update(self.backend, self.policy, k)
            except Exception as exc:  # noqa: BLE001 - the test inspects it
                outcome["error"] = exc
            outcome["seconds"] = time.monotonic() - started

        outcome["thread"] = threading.Thread(target=send, daemon=True)
        outcome["thread"].start()
        return outcome


def _uninterrupted(url: str, steps: int, *, checkpoint_at: int | None, api_key: str | None = None) -> dict[str, bytes]:
    driver = Driver(url, "straight", api_key=api_key)
    for k in range(steps):
        if k == checkpoint_at:
            driver.save(k)
        _update(driver.backend, driver.policy, k)
    return driver.state()


def _wait_until(condition, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _assert_refused_as_stale(outcome: dict, within: float) -> None:
    outcome["thread"].join(within)
    assert not outcome["thread"].is_alive(), f"the stale call was not answered within {within}s"
    assert isinstance(outcome.get("error"), StaleDriver), outcome
    assert outcome["seconds"] < within


def test_calls_held_behind_a_gap_are_refused_at_the_takeover_and_the_resume_matches_the_straight_run(tiny_model):
    from tinkerless.functions.worker import Worker

    app = create_app(Worker(tiny_model))
    app.state.scheduler.gap_timeout = GAP_TIMEOUT
    with running(app) as url:
        expected = _uninterrupted(url, 3, checkpoint_at=1)

        first = Driver(url, "x")
        _update(first.backend, first.policy, 0)
        first.save(1)
        _update(first.backend, first.policy, 1)  # ran, after the checkpoint: the resume must undo it
        held = first.held_update(2)  # waits in the server's queue for the number before it
        time.sleep(0.5)
        assert "thread" in held and held["thread"].is_alive(), "the held call should still wait for its gap"

        # The first client is gone (killed); a second one takes the run over. The open alone fences it off.
        second = Driver(url, "x", resume=True)
        _assert_refused_as_stale(held, within=10.0)
        assert second.restore() == 1
        for k in (1, 2):
            _update(second.backend, second.policy, k)
        assert second.state() == expected

        # Late calls of the replaced client: refused at once, on every policy-changing function, with a typed
        # 409; its coordinator calls are refused too (the lease), and none of it changed the run.
        for method, request in (
            ("update", None),
            ("save_state", SaveStateRequest(first.policy, True)),
            ("create_policy", CreatePolicyRequest(first.policy, LoraConfig(rank=4, seed=3))),
        ):
            with pytest.raises(StaleDriver, match="another client"):
                if request is None:
                    _update(first.backend, first.policy, 3)
                else:
                    call(first.backend, method, request)
        raw = httpx.post(
            f"{url}/v1/call/update",
            content=encode_message(UpdateRequest(first.policy, [_datum(3)], LossConfig(), AdamParams())),
            headers={"Content-Type": MSGPACK, STREAM_HEADER: first.backend._stream, SEQ_HEADER: "1000"},
        )
        reply = decode_message(raw.content)
        assert raw.status_code == 409 and isinstance(reply, ErrorReply)
        assert reply.category == "user" and reply.type == "StaleDriver" and reply.hint
        with pytest.raises(CommitConflict):
            first.coordinator.begin_rollout(2)
        assert second.state() == expected
        # The driver itself, and other policies of the same tenant, are not fenced.
        other = HTTPBackend(url)
        call(other, "create_policy", CreatePolicyRequest("unrelated", LoraConfig(rank=4, seed=1)))
        _update(other, "unrelated", 0)


def test_a_client_killed_before_its_first_checkpoint_is_fenced_by_the_restore_under_another_tenants_load(
    tiny_model, tmp_path
):
    """No checkpoint: the server learns the run's policies only from the resume's restore, which resets
    them and refuses the killed client's held call, while another tenant's long generation is sliced."""
    from tinkerless.functions.worker import Worker
    from tinkerless.server.keys import KeyStore
    from tinkerless.storage import ObjectStore

    keys = KeyStore(ObjectStore(str(tmp_path / "keys")))
    ours, theirs = keys.create("ours"), keys.create("theirs")
    app = create_app(Worker(tiny_model), keys=keys, storage=str(tmp_path / "server"), slice_seconds=0.02)
    scheduler = app.state.scheduler
    scheduler.gap_timeout = GAP_TIMEOUT
    with running(app) as url:
        expected = _uninterrupted(url, 3, checkpoint_at=None, api_key=ours)

        # Another tenant's long generation occupies the model, in slices, for the rest of the test.
        generating: dict = {}
        flood = HTTPBackend(url, api_key=theirs)
        long_sample = SampleRequest(BASE_POLICY, [[1, 2, 3]], 1, SamplingParams(max_tokens=1500, stop_token_ids=[]))
        generator = threading.Thread(
            target=lambda: generating.update(r=call(flood, "sample", long_sample)), daemon=True
        )
        generator.start()
        _wait_until(lambda: scheduler.in_flight > 0)

        first = Driver(url, "y", api_key=ours)
        _update(first.backend, first.policy, 0)
        _update(first.backend, first.policy, 1)
        held = first.held_update(2)
        time.sleep(0.3)

        second = Driver(url, "y", api_key=ours, resume=True)
        assert held["thread"].is_alive(), "no checkpoint yet: the open cannot know the run's policies"
        assert second.restore() is None  # no checkpoint: back to the fresh init, and the policies are fenced
        _assert_refused_as_stale(held, within=10.0)
        for k in range(3):
            _update(second.backend, second.policy, k)
        assert second.state() == expected

        generator.join(120)
        assert len(generating["r"].sequences[0][0].tokens) == 1500
        assert scheduler.slices > 0  # the restore and the updates ran between the generation's slices


# -- the scheduler's fence, without a model ---------------------------------------------------------


def _gated() -> tuple[Scheduler, threading.Event]:
    scheduler = Scheduler(gap_timeout=GAP_TIMEOUT, max_pending_per_tenant=8)
    release, started = threading.Event(), threading.Event()
    scheduler.submit(lambda: (started.set(), release.wait(10)), tenant="gate")
    assert started.wait(5)
    return scheduler, release


def test_bind_refuses_the_other_streams_queued_calls_on_those_policies_and_nothing_else():
    scheduler, release = _gated()
    ran: list[str] = []

    def job(name: str):
        return lambda: ran.append(name) or name

    P = frozenset({"P"})
    old_ready = scheduler.submit(job("old-ready"), tenant="t", stream="old", seq=1, policies=P)
    old_gap = scheduler.submit(job("old-gap"), tenant="t", stream="old", seq=3, policies=P)  # #2 never comes
    old_read = scheduler.submit(job("old-read"), tenant="t", stream="old", seq=4)  # changes no policy
    old_other = scheduler.submit(job("old-other"), tenant="t", stream="old2", seq=1, policies=frozenset({"Q"}))
    tenant_twin = scheduler.submit(job("twin"), tenant="u", stream="old", seq=1, policies=P)  # another tenant's P
    no_stream = scheduler.submit(job("tinker"), tenant="t")  # a Tinker API call: no stream, no run policy
    assert scheduler._unfinished["t"] == 5

    scheduler.bind("t", "new", ["P"])
    for refused in (old_ready, old_gap):  # at once, even the one held behind its gap
        with pytest.raises(StaleDriver):
            refused.result(1)
    assert scheduler._unfinished["t"] == 3  # their quota is free again at once
    newer = scheduler.submit(job("new"), tenant="t", stream="new", seq=1, policies=P)
    with pytest.raises(StaleDriver):  # a late call of the replaced stream
        scheduler.submit(job("late"), tenant="t", stream="old", seq=5, policies=P).result(1)
    with pytest.raises(StaleDriver):  # a call with no stream cannot be the driver's
        scheduler.submit(job("anon"), tenant="t", policies=P).result(1)

    release.set()
    assert [f.result(5) for f in (old_other, tenant_twin, no_stream, newer)] == ["old-other", "twin", "tinker", "new"]
    assert not old_read.done()  # a call that changes no policy still waits for the gap, as before
    # The missing #2 arrives late: refused, and the read behind it runs at once.
    with pytest.raises(StaleDriver):
        scheduler.submit(job("old-2"), tenant="t", stream="old", seq=2, policies=P).result(1)
    assert old_read.result(5) == "old-read"
    assert "old-ready" not in ran and "old-gap" not in ran and "old-2" not in ran
    scheduler.close()


def test_a_job_running_when_its_run_is_taken_over_finishes_and_the_new_drivers_job_runs_after_it():
    scheduler = Scheduler(gap_timeout=GAP_TIMEOUT)
    order: list[str] = []
    inside, release = threading.Event(), threading.Event()

    def old_update():
        inside.set()
        release.wait(10)
        order.append("old")
        return "old"

    running_job = scheduler.submit(old_update, tenant="t", stream="old", seq=1, policies=frozenset({"P"}))
    assert inside.wait(5)
    scheduler.bind("t", "new", ["P"])  # e.g. the open of a takeover, from another thread
    restore = scheduler.submit(lambda: order.append("restore") or "restore", tenant="t", stream="new", seq=1,
                               policies=frozenset({"P"}))
    release.set()
    assert running_job.result(5) == "old" and restore.result(5) == "restore"
    assert order == ["old", "restore"]
    scheduler.close()
