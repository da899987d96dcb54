"""API keys: hashed at rest, required on every call, revocable; the CLI manages them."""

from __future__ import annotations

import httpx
import pytest

from tinkerless.errors import UserError
from tinkerless.sdk.backends.base import call
from tinkerless.sdk.cli.commands import main
from tinkerless.sdk.backends.http import HTTPBackend
from tinkerless.server import create_app
from tinkerless.server import serve_in_thread as running
from tinkerless.server.keys import KEYS_FILE, KeyStore
from tinkerless.storage import ObjectStore


@pytest.fixture()
def keys(tmp_path) -> KeyStore:
    return KeyStore(ObjectStore(str(tmp_path)))


def test_keys_are_stored_only_as_hashes(keys, tmp_path):
    key = keys.create("alice")
    assert key.startswith("tml-") and keys.tenant_for(key) == "alice"
    stored = (tmp_path / KEYS_FILE).read_text()
    assert key not in stored and key.split("-", 2)[2] not in stored
    assert keys.tenant_for(key + "x") is None and keys.tenant_for(None) is None
    with pytest.raises(UserError, match="invalid tenant"):
        keys.create("../bob")


def test_every_call_needs_a_valid_unrevoked_key(keys, worker):
    alice, bob = keys.create("alice"), keys.create("bob")
    with running(create_app(worker, keys=keys)) as url:
        assert call(HTTPBackend(url, api_key=alice), "info", {})["model"]
        for bad in (None, "tml-0000-nope"):
            backend = HTTPBackend(url, api_key=bad)
            with pytest.raises(UserError, match="missing or invalid API key") as error:
                call(backend, "info", {})
            assert "tinkerless keys create" in error.value.hint
        raw = httpx.post(f"{url}/v1/call/info", content=b"", headers={"Content-Type": "application/msgpack"})
        assert raw.status_code == 401
        # Health answers a probe without a key, but reveals nothing about the model or its tenants.
        assert httpx.get(f"{url}/healthz").json() == {"status": "ok"}
        assert "policies" in httpx.get(f"{url}/healthz", headers={"Authorization": f"Bearer {bob}"}).json()
        keys.revoke(next(r.key_id for r in keys.list() if r.tenant == "bob"))
        with pytest.raises(UserError, match="invalid API key"):
            call(HTTPBackend(url, api_key=bob), "info", {})
        assert call(HTTPBackend(url, api_key=alice), "info", {})["model"]


def test_keys_cli(tmp_path, capsys):
    assert main(["keys", "create", "--tenant", "carol", "--storage", str(tmp_path)]) == 0
    key = capsys.readouterr().out.strip()
    assert KeyStore(ObjectStore(str(tmp_path))).tenant_for(key) == "carol"
    assert main(["keys", "list", "--storage", str(tmp_path)]) == 0
    listing = capsys.readouterr().out
    assert "carol" in listing and "active" in listing and key not in listing
    key_id = listing.split()[0]
    assert main(["keys", "revoke", key_id, "--storage", str(tmp_path)]) == 0
    assert KeyStore(ObjectStore(str(tmp_path))).tenant_for(key) is None
    assert main(["keys", "revoke", "nope", "--storage", str(tmp_path)]) == 2


def test_tenants_cannot_name_or_read_each_others_policies(keys, tiny_model, tmp_path):
    import numpy as np

    import tinkerless
    from tinkerless.functions.worker import Worker
    from tinkerless.sdk.backends.client import TrainingClient
    from tinkerless.wire.messages import Datum

    alice, bob = keys.create("alice"), keys.create("bob")
    worker = Worker(tiny_model)
    with running(create_app(worker, keys=keys)) as url:
        a = TrainingClient(HTTPBackend(url, api_key=alice), "shared-name")
        TrainingClient(HTTPBackend(url, api_key=bob), "shared-name")  # same name, a different adapter
        assert len(worker.policies) == 2  # the worker holds two separate adapters
        datum = Datum(tokens=np.arange(1, 9, dtype=np.int32), mask=np.ones(8, dtype=np.float32))
        a.update([datum], "cross_entropy")
        states = {k: v.version for k, v in worker.policies.items()}
        assert sorted(states.values()) == [0, 1]  # only alice's adapter moved
        # Each tenant lists only its own policies, under the name it chose.
        assert call(HTTPBackend(url, api_key=alice), "info", {})["policies"] == {"shared-name": 1}
        assert call(HTTPBackend(url, api_key=bob), "info", {})["policies"] == {"shared-name": 0}
        # Naming alice's worker-side policy from bob's key lands inside bob's own scope: not found.
        alice_internal = next(k for k, v in states.items() if v == 1)
        with pytest.raises(UserError, match="does not exist"):
            TrainingClient(HTTPBackend(url, api_key=bob), alice_internal, create=False).save_state()
        saved = a.save_state()
        assert saved.policy == "shared-name" and "adapter/adapter_model.safetensors" in saved.files
        # A whole run through the service works with a key, and stays in its tenant's scope.
        run = tinkerless.train(
            model=tiny_model, reward=lambda c, t: float(len(c) % 2), tasks=[{"prompt": "hi"}], steps=1,
            batch_size=1, group_size=2, max_tokens=4, storage=str(tmp_path / "runs"), progress=False,
            backend=HTTPBackend(url, api_key=bob),
        )
        assert run.metrics[0]["episodes"] == 2
        assert all(not p.endswith("default") for p in call(HTTPBackend(url, api_key=alice), "info", {})["policies"])


def test_prometheus_metrics_report_requests_queue_and_cpu(keys, worker):
    key = keys.create("ops")
    with running(create_app(worker, keys=keys)) as url:
        backend = HTTPBackend(url, api_key=key)
        for _ in range(3):
            call(backend, "info", {})
        with pytest.raises(UserError):
            call(backend, "forward", {"not": "a request"})
        assert httpx.get(f"{url}/metrics").status_code == 401  # scrapes need a key too
        text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"}).text
    assert 'tinkerless_requests_total{method="info",status="200"} 3' in text
    assert 'tinkerless_requests_total{method="forward",status="' in text
    assert "tinkerless_queue_depth 0" in text and "tinkerless_in_flight 0" in text
    cpu = float(next(line for line in text.splitlines() if line.startswith("process_cpu_seconds_total")).split()[1])
    assert cpu > 0


def test_a_key_from_the_environment_is_accepted_without_touching_storage(tmp_path):
    store = ObjectStore(str(tmp_path))
    keys = KeyStore(store, extra_keys={"tml-env-secret": "default"})
    assert keys.tenant_for("tml-env-secret") == "default"
    assert keys.tenant_for("tml-env-other") is None
    assert not store.exists("server/api_keys.json")  # nothing written: the env key lives only in memory
