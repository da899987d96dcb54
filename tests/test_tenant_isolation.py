"""On a shared server, a tenant's env/reward code runs in a sandbox of its own, never in the server process.

The reward below tries what issue #12 found a tenant could do: list `tenants/`, read
another tenant's run state, read the API-key store, read the server's environment. In
the sandbox it gets nothing, the episodes it ran in fail with the error recorded, and
the run completes. The same reward in a single-user (in-process) server does get
the secrets: that is what makes the first half of the test mean something.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

import pytest

import tinkerless
from tinkerless.functions.user_code import UserCodeHosts
from tinkerless.functions.worker import Worker
from tinkerless.sdk.http_backend import HTTPBackend
from tinkerless.server import create_app
from tinkerless.server import serve_in_thread as running
from tinkerless.server.keys import KEYS_FILE, KeyStore
from tinkerless.storage import ObjectStore
from tinkerless.wire import pack_code

pytestmark = pytest.mark.timeout(300)


def prying_reward_for(server: str, server_pid: int):
    """A reward that, on tasks marked "pry", reads everything it should not and raises with what it found."""

    def reward(completion, task) -> float:
        if not task.get("pry"):
            return float(len(completion) % 3)
        import os as _os

        attempts = {
            "tenants": lambda: _os.listdir(f"{server}/tenants"),
            "alice state": lambda: open(f"{server}/tenants/alice/runs/secret-run/state.json").read(),
            "key store": lambda: open(f"{server}/server/api_keys.json").read(),
            "server env var": lambda: _os.environ["TINKERLESS_TEST_SERVER_SECRET"],
            "server environ": lambda: open(f"/proc/{server_pid}/environ", "rb").read().decode("latin-1"),
            "pid 1 environ": lambda: open("/proc/1/environ", "rb").read().decode("latin-1"),
        }
        found = {}
        for label, attempt in attempts.items():
            try:
                found[label] = "GOT " + str(attempt())
            except Exception as exc:
                found[label] = f"refused {type(exc).__name__}"
        raise RuntimeError(f"pried: {found}")

    return reward


def run_as(tiny_model, url: str, key: str, storage: Path, reward, run_id: str):
    return tinkerless.train(
        model=tiny_model, name="pry", reward=reward, tasks=[{"prompt": "hi"}, {"prompt": "hi", "pry": True}], steps=1,
        batch_size=2, group_size=2, max_tokens=4, storage=str(storage), progress=False, run_id=run_id,
        backend=HTTPBackend(url, api_key=key), on_env_error="skip",
    )


def recorded_errors(result) -> str:
    return json.dumps([e for record in result.metrics for e in record.get("errors", [])])


@pytest.fixture
def shared_server(tmp_path, monkeypatch):
    server = tmp_path / "server"
    keys = KeyStore(ObjectStore(str(server)))
    alice, bob = keys.create("alice"), keys.create("bob")
    token = secrets.token_hex(16)
    monkeypatch.setenv("TINKERLESS_TEST_SERVER_SECRET", token)
    return server, keys, alice, bob, token


def test_a_tenants_reward_reads_nothing_and_its_run_completes(tiny_model, tmp_path, shared_server):
    server, keys, alice, bob, token = shared_server
    hosts = UserCodeHosts(hide=(str(server),))
    worker = Worker(tiny_model, user_code_hosts=hosts)
    try:
        with running(create_app(worker, keys=keys, storage=str(server))) as url:
            run_as(tiny_model, url, alice, tmp_path / "alice", lambda c, t: 1.0, "secret-run")
            alice_state = (server / "tenants/alice/runs/secret-run/state.json").read_text()
            key_digest = json.loads((server / KEYS_FILE).read_text())[0]["sha256"]
            result = run_as(tiny_model, url, bob, tmp_path / "bob", prying_reward_for(str(server), os.getpid()), "pry-run")
        assert json.loads((server / "tenants/bob/runs/pry-run/state.json").read_text())["status"] == "finished"
        errors = recorded_errors(result)
        assert "pried:" in errors and "refused" in errors, errors
        assert "GOT" not in errors, f"the sandboxed reward read something: {errors}"
        for secret in (token, key_digest, alice_state[:40]):
            assert secret not in errors
        assert worker._code_cache == {}, "the server process never unpickled the tenants' code"
    finally:
        hosts.close()


def test_the_server_process_never_unpickles_tenant_code(tiny_model, tmp_path, shared_server):
    server, keys, alice, bob, token = shared_server
    marker = tmp_path / "unpickled-in-the-server"

    class Planted:  # unpickling it runs os.makedirs(marker): a side effect the server must never see
        def __reduce__(self):
            return (os.makedirs, (str(marker),))

    hosts = UserCodeHosts(hide=(str(server),))
    worker = Worker(tiny_model, user_code_hosts=hosts)
    try:
        from tinkerless.functions.user_code import HostedCodeError, tenant_scope

        with tenant_scope("bob"):
            loaded = worker._load_code(pack_code(Planted()))
            with pytest.raises(HostedCodeError, match="NoneType"):
                loaded("completion", {})  # what unpickling produced (None) is in the host, not here
        assert not marker.exists()
    finally:
        hosts.close()


def test_single_user_server_keeps_user_code_in_process(tiny_model, tmp_path, shared_server):
    """The positive control: in-process, the very same reward reads the secrets (hence --single-user is opt-in)."""
    server, keys, alice, bob, token = shared_server
    with running(create_app(Worker(tiny_model), keys=keys, storage=str(server))) as url:
        run_as(tiny_model, url, alice, tmp_path / "alice", lambda c, t: 1.0, "secret-run")
        result = run_as(tiny_model, url, bob, tmp_path / "bob", prying_reward_for(str(server), os.getpid()), "pry-run")
    errors = recorded_errors(result)
    assert token in errors and "GOT" in errors
