"""Runs hosted by `tinkerless serve`: coordinator and checkpoints in the server's storage, per tenant."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import write_resumable_example
from safetensors.torch import load as load_safetensors

import tinkerless
from tinkerless.coordinator.policy_checkpoints import restore_policies, save_policies
from tinkerless.errors import BarrierTimeout, CheckpointMismatch, CommitConflict, CorruptCheckpoint, PhaseError, StorageNotFound, UserError
from tinkerless.sdk.cli.commands import main
from tinkerless.sdk.evaluation.evaluate import evaluate
from tinkerless.sdk.backends.http import HTTPBackend
from tinkerless.sdk.backends.server_runs import ServerRunHost
from tinkerless.server import create_app
from tinkerless.server import serve_in_thread as running
from tinkerless.server.keys import KeyStore
from tinkerless.storage import CheckpointStore, ObjectStore
from tinkerless.wire import decode_message, encode_message
from tinkerless.wire.messages import ErrorReply
from tinkerless.wire.runs import CheckpointPolicy, RunCall

CLI = [sys.executable, "-m", "tinkerless.sdk.cli.commands"]


def _short_run(model: str, storage: Path, backend, run_id: str, **extra):
    return tinkerless.train(
        model=model, name="short", reward=lambda c, t: float(len(c) % 3), tasks=[{"prompt": "hi"}], steps=1,
        batch_size=1, group_size=2, max_tokens=4, storage=str(storage), progress=False, run_id=run_id,
        backend=backend, **extra,
    )


def test_tenants_keep_their_own_runs(tiny_model, worker, tmp_path, capsys, monkeypatch):
    server = tmp_path / "server"
    keys = KeyStore(ObjectStore(str(server)))
    alice, bob = keys.create("alice"), keys.create("bob")
    with running(create_app(worker, keys=keys, storage=str(server))) as url:
        _short_run(tiny_model, tmp_path / "alice", HTTPBackend(url, api_key=alice), "shared")  # train() closes it
        alice_runs, bob_runs = ServerRunHost(HTTPBackend(url, api_key=alice)), ServerRunHost(HTTPBackend(url, api_key=bob))

        # Bob can neither see nor open nor resume alice's run: the id names nothing in his tenant.
        assert bob_runs.list() == []
        with pytest.raises(UserError, match="does not exist"):
            bob_runs.open("shared")
        with pytest.raises(UserError, match="does not exist"):
            _short_run(tiny_model, tmp_path / "bob", HTTPBackend(url, api_key=bob), "shared", resume=True)
        # Names that would leave his prefix are refused before they reach storage.
        for name in ("../alice/runs/shared", "..", "a/b", "%2e%2e"):
            with pytest.raises(UserError, match="invalid run id"):
                bob_runs.open(name)
        raw = httpx.post(
            f"{url}/v1/runs/call/open", content=encode_message(RunCall("../../alice")),
            headers={"Authorization": f"Bearer {bob}", "Content-Type": "application/msgpack"},
        )
        assert raw.status_code == 400 and "invalid run id" in decode_message(raw.content).error

        # The same run id in bob's tenant is a run of its own.
        _short_run(tiny_model, tmp_path / "bob", HTTPBackend(url, api_key=bob), "shared")
        for tenant in ("alice", "bob"):
            state = json.loads((server / f"tenants/{tenant}/runs/shared/state.json").read_text())
            assert state["status"] == "finished" and state["last_checkpoint_step"] == 1
            assert (server / f"tenants/{tenant}/runs/shared/checkpoints/step-1/manifest.json").exists()
        assert [r.run_id for r in alice_runs.list()] == ["shared"] == [r.run_id for r in bob_runs.list()]
        assert not (tmp_path / "alice/runs/shared/state.json").exists()  # nothing of the run on the client

        # A wrong key reaches no run at all.
        with pytest.raises(UserError, match="API key"):
            ServerRunHost(HTTPBackend(url, api_key="tml-not-a-key")).list()

        # `tinkerless runs --server` lists the caller's runs.
        monkeypatch.setenv("TINKERLESS_API_KEY", alice)
        assert main(["runs", "--server", url]) == 0
        out = capsys.readouterr().out
        assert "shared" in out and "finished" in out

        # `tinkerless eval` of a server-hosted run: the server loads the checkpoint from its own storage.
        config = tinkerless.TrainConfig(
            model=tiny_model, reward=lambda c, t: float(len(c) % 3), tasks=[{"prompt": "hi"}], max_tokens=4,
            backend=url, storage=str(tmp_path / "nothing-here"),
        )
        report = evaluate(config, run_id="shared", step=1, episodes=2)
        assert report.source == "run shared step 1" and len(report.rewards) == 2
        with pytest.raises(StorageNotFound, match="step 5"):
            evaluate(config, run_id="shared", step=5, episodes=2)
        example = tmp_path / "short.py"
        example.write_text(
            f"import tinkerless\nconfig = tinkerless.TrainConfig(model={tiny_model!r}, "
            "reward=lambda c, t: 1.0, tasks=[{'prompt': 'hi'}], max_tokens=4)\n"
        )
        assert main(["eval", str(example), "--backend", url, "--run-id", "shared", "--episodes", "2"]) == 0
        assert "run shared: mean reward 1.000 over 2 episodes" in capsys.readouterr().out
        monkeypatch.setenv("TINKERLESS_API_KEY", keys.create("carol"))
        with pytest.raises(UserError, match="does not exist"):
            evaluate(config, run_id="shared", episodes=2)


def test_the_barrier_lives_on_the_server(worker, tmp_path):
    storage = str(tmp_path / "server")
    app = create_app(worker, storage=storage)
    app.state.runs.long_poll = 0.2  # several polls per wait below
    with running(app) as url:
        host = ServerRunHost(HTTPBackend(url))
        run = host.create("barrier", {"name": "b"})
        run.begin_rollout(0, ["a", "b"])
        run.submit_rollout(0, "a")
        with pytest.raises(BarrierTimeout, match=r"within 0.5s; still missing: \['b'\]"):
            run.wait_rollouts(0, timeout=0.5)

        def submit_b_later():
            time.sleep(0.5)
            run.submit_rollout(0, "b")

        later = threading.Thread(target=submit_b_later)
        later.start()
        run.wait_rollouts(0, timeout=30)  # returns once b is in, across long-polls
        later.join()
        assert run.state.missing_rollouts() == [] and run.state.rollouts_submitted == ["a", "b"]

        with pytest.raises(PhaseError, match="cannot commit the update of step 0"):
            run.commit_update(0)
        run.begin_update(0)
        run.commit_update(0, {"reward_mean": 0.5})
        assert (run.state.step, run.state.policy_version, run.state.phase.value) == (1, 1, "idle")

        # A second client opening the run takes it over; the first one is told so, not silently overwritten.
        second = host.open("barrier")
        with pytest.raises(CommitConflict, match="opened by another client"):
            run.begin_rollout(1, ["default"])
        second.begin_rollout(1, ["default"])

    # The state is in the server's storage: a restarted server picks the run up where it was.
    with running(create_app(worker, storage=storage)) as url:
        second.host = ServerRunHost(HTTPBackend(url))
        second.submit_rollout(1, "default")
        assert second.refresh().rollouts_submitted == ["default"]
        state = json.loads((tmp_path / "server/tenants/_/runs/barrier/state.json").read_text())
        assert state["step"] == 1 and state["rollouts_submitted"] == ["default"]


def test_run_calls_answer_typed_errors(worker, tmp_path):
    with running(create_app(worker, storage=str(tmp_path))) as url:
        headers = {"Content-Type": "application/msgpack"}
        unknown = httpx.post(f"{url}/v1/runs/call/explode", content=encode_message(RunCall("x", {}, "lease")), headers=headers)
        reply = decode_message(unknown.content)
        assert unknown.status_code == 400 and reply.type == "InvalidRequest" and reply.category == "user"
        wrong_type = httpx.post(f"{url}/v1/runs/call/open", content=encode_message({"run_id": "x"}), headers=headers)
        assert wrong_type.status_code == 400 and "expected a RunCall" in decode_message(wrong_type.content).error
        host = ServerRunHost(HTTPBackend(url))
        run = host.create("typed", {})
        with pytest.raises(UserError, match="already exists"):
            host.create("typed", {})
        phase = httpx.post(
            f"{url}/v1/runs/call/begin_update", content=encode_message(RunCall("typed", {"step": 0}, run.lease)),
            headers=headers,
        )
        reply = decode_message(phase.content)
        assert phase.status_code == 409 and isinstance(reply, ErrorReply) and reply.type == "PhaseError"
        missing = httpx.post(
            f"{url}/v1/runs/call/wait_rollouts", content=encode_message(RunCall("typed", {}, run.lease)), headers=headers
        )
        assert missing.status_code == 400 and "wait_rollouts needs the arguments ['step']" in decode_message(missing.content).error


def test_policy_checkpoint_layout_round_trips(tmp_path):
    store = CheckpointStore(ObjectStore(str(tmp_path)), "runs/x/checkpoints")
    policies = [CheckpointPolicy("alice", "policies/alice/", "w-alice", 3), CheckpointPolicy("bob", "policies/bob/", "w-bob", 5)]
    save_policies(store, 2, policies, lambda p: {"adapter/w": p.name.encode()}, {"client.json": b"{}"}, {"run_id": "x"})
    loaded = {}
    never_reset = lambda p: pytest.fail(f"{p.name} was reset although a checkpoint exists")  # noqa: E731
    restored = restore_policies(
        store, policies, ["client.json"], lambda p, files, v: loaded.update({p.name: (files, v)}), never_reset
    )
    assert restored.step == 2 and restored.files == {"client.json": b"{}"}
    assert loaded == {"alice": ({"adapter/w": b"alice"}, 3), "bob": ({"adapter/w": b"bob"}, 5)}
    assert restored.policy_versions == {"alice": 3, "bob": 5}
    # The single-agent layout keeps the adapter at the top level, beside the client's own files.
    single_store = CheckpointStore(ObjectStore(str(tmp_path)), "runs/y/checkpoints")
    single = [CheckpointPolicy("default", "", "w", 1)]
    save_policies(single_store, 3, single, lambda p: {"adapter/w": b"d"}, {"client.json": b"{}"}, {})
    restored = restore_policies(
        single_store, single, ["client.json"], lambda p, files, v: loaded.update({p.name: (files, v)}), never_reset
    )
    assert loaded["default"] == ({"adapter/w": b"d"}, 1) and restored.files == {"client.json": b"{}"}
    with pytest.raises(CheckpointMismatch, match="no files for policy .carol."):
        restore_policies(
            store, [*policies[:1], CheckpointPolicy("carol", "policies/carol/", "w-c")], [], lambda *a: None, never_reset
        )
    # No checkpoint at all: every policy goes back to its fresh init, none is left as the worker holds it.
    reset = []
    empty = CheckpointStore(ObjectStore(str(tmp_path)), "runs/z/checkpoints")
    assert restore_policies(empty, policies, [], lambda *a: None, lambda p: reset.append(p.name)).step is None
    assert reset == ["alice", "bob"]


# ---- a client killed mid-run resumes from the server's checkpoint -----------------------------------

STEPS = 6


def _client(example: Path, url: str, storage: Path, run_id: str, *extra: str, wait: bool = True) -> subprocess.Popen:
    cmd = [*CLI, "train", str(example), "--backend", url, "--storage", str(storage), "--run-id", run_id, "--no-progress", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if wait:
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out
    return proc


def _latest(server: Path, run_id: str) -> int:
    try:
        return json.loads((server / f"tenants/_/runs/{run_id}/checkpoints/latest").read_text())["step"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return 0


def _adapter(server: Path, run_id: str) -> dict:
    path = server / f"tenants/_/runs/{run_id}/checkpoints/step-{STEPS}/adapter/adapter_model.safetensors"
    return load_safetensors(path.read_bytes())


def _rewards(client: Path, run_id: str) -> list[float]:
    lines = (client / f"runs/{run_id}/metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["reward_mean"] for line in lines]


def test_a_killed_http_client_resumes_from_the_servers_checkpoint(tiny_model, tmp_path):
    from tinkerless.functions.worker import Worker

    example = write_resumable_example(tmp_path / "resumable.py", tiny_model, STEPS)
    server, client = tmp_path / "server", tmp_path / "client"
    with running(create_app(Worker(tiny_model), storage=str(server))) as url:
        _client(example, url, client, "straight")

        proc = _client(example, url, client, "killed", wait=False)
        deadline = time.monotonic() + 300
        while _latest(server, "killed") < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(random.uniform(0.0, 0.25))  # land anywhere inside the following step(s)
        assert proc.poll() is None, "the run finished before it could be killed; make it longer"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert 2 <= _latest(server, "killed") < STEPS

        _client(example, url, client, "killed", "--resume")

    expected, actual = _adapter(server, "straight"), _adapter(server, "killed")
    assert expected.keys() == actual.keys() and expected
    for name in expected:
        assert (expected[name] == actual[name]).all(), f"{name} differs after resume"
    assert _rewards(client, "killed") == _rewards(client, "straight")
    assert not (client / "runs/killed/checkpoints").exists() and not os.path.exists(client / "runs/killed/state.json")


def test_a_multi_agent_run_through_the_server_resumes_like_a_local_one(tiny_model, tmp_path):
    """Three policies, their barrier on the server, checkpoints with one adapter per policy, a resume."""
    from tinkerless.envs.gomoku import GomokuEnv
    from tinkerless.functions.worker import Worker
    from tinkerless.sdk.backends.base import LocalBackend

    def run(storage: Path, backend, steps: int, **extra):
        return tinkerless.train(
            model=tiny_model, env=GomokuEnv, tasks=[{"size": 4, "win_length": 3, "max_invalid": 1}],
            agents=tinkerless.round_robin(["p", "q", "s"], roles=("black", "white")), steps=steps, batch_size=1,
            group_size=2, max_turns=8, max_tokens=4, temperature=1.0, storage=str(storage), progress=False,
            checkpoint_every=1, run_id="ma", seed=3, backend=backend, **extra,
        )

    local = run(tmp_path / "local", LocalBackend(tiny_model), steps=3)
    server = tmp_path / "server"
    with running(create_app(Worker(tiny_model), storage=str(server))) as url:
        run(tmp_path / "client", HTTPBackend(url), steps=2)
        resumed = run(tmp_path / "client", HTTPBackend(url), steps=3, resume=True)

    assert [r["reward_mean"] for r in resumed.metrics] == [r["reward_mean"] for r in local.metrics]
    for step in range(3):
        events = [(e, p) for s, e, p in resumed.events if s == step]
        if events:  # the resumed process saw step 2 only
            assert max(i for i, (e, _) in enumerate(events) if e == "rollouts_in") < min(
                i for i, (e, _) in enumerate(events) if e == "update_start"
            )
    ours = CheckpointStore(ObjectStore(str(server / "tenants/_")), "runs/ma/checkpoints").load(3).files
    theirs = CheckpointStore(ObjectStore(str(tmp_path / "local")), "runs/ma/checkpoints").load(3).files
    adapters = sorted(k for k in theirs if k.endswith("adapter_model.safetensors"))
    assert adapters == [f"policies/{p}/adapter/adapter_model.safetensors" for p in "pqs"]
    assert all(ours[k] == theirs[k] for k in adapters)
