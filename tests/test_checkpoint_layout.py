"""A run checkpoint whose layout could not be restored is refused when it is saved (HTTP 400 naming the clash),
and a restore that asks a checkpoint for what it does not hold is the caller's error, never a 500."""

from __future__ import annotations

import httpx
import pytest

from tinkerless.errors import CheckpointMismatch, InvalidRequest, PhaseError, UserError
from tinkerless.sdk.backends.client import TrainingClient
from tinkerless.sdk.backends.http import HTTPBackend
from tinkerless.sdk.backends.server_runs import ServerRunHost
from tinkerless.server import create_app
from tinkerless.server import serve_in_thread as running
from tinkerless.wire import decode_message, encode_message
from tinkerless.wire.messages import LoraConfig
from tinkerless.wire.runs import CheckpointPolicy, SaveCheckpointRequest

# Layouts a restore could not read back as written, and what the refusal names.
CLASHES = {
    "same prefix": ([("a", "p/"), ("b", "p/")], {}, "file_prefix 'p/' is also policy 0's"),
    "same name": ([("a", "p/"), ("a", "q/")], {}, "name 'a' is also policy 0's"),
    "same top-level prefix": ([("a", ""), ("b", "")], {}, "file_prefix '' is also policy 0's"),
    # b's prefix is inside a's files ('adapter/...'): a restore would hand a's adapter to b.
    "prefix inside another's files": ([("a", ""), ("b", "adapter/")], {}, "would be restored into policy 'b'"),
    # The client's own file has the name of a policy's file.
    "client file over a policy's": ([("a", "")], {"adapter/adapter_config.json": b"{}"}, "would be written by both"),
}


@pytest.fixture
def served(worker, tmp_path):
    with running(create_app(worker, storage=str(tmp_path / "server"))) as url:
        backend = HTTPBackend(url)
        clients = [TrainingClient(backend, name, LoraConfig(rank=2, seed=i), namespace="layout")
                   for i, name in enumerate(("a", "b"))]
        host = ServerRunHost(backend)
        try:
            yield url, host, {c.policy: c.remote(c.policy) for c in clients}
        finally:
            for client in clients:
                client.delete()
            backend.close()


@pytest.mark.parametrize("case", sorted(CLASHES))
def test_a_save_that_could_not_be_restored_is_refused_and_writes_nothing(served, case):
    url, host, remote = served
    layout, files, named = CLASHES[case]
    run = host.create(f"clash-{abs(hash(case)) % 10**6}", {})
    checkpoints = host.checkpoints(run.run_id, None, run)
    policies = [CheckpointPolicy(name, prefix, remote["a" if i == 0 else "b"], 1) for i, (name, prefix) in enumerate(layout)]
    with pytest.raises(UserError) as caught:  # InvalidRequest at the boundary, CheckpointMismatch once files are known
        checkpoints.save(0, policies, files, {})
    assert isinstance(caught.value, (InvalidRequest, CheckpointMismatch)) and named in caught.value.message
    assert run.refresh().last_checkpoint_step is None  # nothing was written: the run names no checkpoint
    assert checkpoints.restore(policies[:1], list(files), driver=False).step is None
    # The raw answer: a 400 in the msgpack envelope, category "user".
    raw = httpx.post(f"{url}/v1/runs/checkpoint/save", headers={"Content-Type": "application/msgpack"},
                     content=encode_message(SaveCheckpointRequest(run.run_id, run.lease, 0, policies, files, {})))
    assert raw.status_code == 400 and decode_message(raw.content).category == "user"


def test_a_restore_asking_for_what_the_checkpoint_does_not_hold_is_the_callers_error(served):
    url, host, remote = served
    run = host.create("mismatch", {})
    checkpoints = host.checkpoints(run.run_id, None, run)
    saved = [CheckpointPolicy("a", "policies/a/", remote["a"], 1), CheckpointPolicy("b", "policies/b/", remote["b"], 2)]
    with pytest.raises(PhaseError, match="cannot save a checkpoint for step 1: run 'mismatch' is at step 0"):
        checkpoints.save(1, saved, {"client.json": b"{}"}, {})  # a step the run has not reached: refused unwritten
    assert checkpoints.restore(saved, ["client.json"], driver=False).step is None
    checkpoints.save(0, saved, {"client.json": b"{}"}, {})
    restored = checkpoints.restore(saved, ["client.json"])  # the layout as saved round-trips
    assert restored.step == 0 and restored.policy_versions == {"a": 1, "b": 2} and restored.files == {"client.json": b"{}"}
    for asked in ([CheckpointPolicy("c", "policies/c/", remote["b"])],  # a policy it does not hold
                  [CheckpointPolicy("b", "elsewhere/", remote["b"])]):  # one it holds, under another prefix
        with pytest.raises(CheckpointMismatch, match="has no files for policy") as caught:
            checkpoints.restore(asked, [])
        assert caught.value.category == "user" and "policies ['a', 'b']" in caught.value.message
