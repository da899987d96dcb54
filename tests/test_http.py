"""The HTTP transport: a real uvicorn server on 127.0.0.1 hosting a worker, driven by `HTTPBackend`."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

import tinkerless
from tinkerless.coordinator import checkpoint_prefix
from tinkerless.errors import ProtocolError, RemoteError, ServerBusy, UserError
from tinkerless.sdk.backends.base import LocalBackend, call, raise_error_reply
from tinkerless.sdk.backends.http import HTTPBackend
from tinkerless.server import create_app
from tinkerless.server import serve_in_thread as running
from tinkerless.storage import CheckpointStore, ObjectStore
from tinkerless.wire import decode_message, encode_message
from tinkerless.wire.codec import PYTHON_VERSION, encode
from tinkerless.wire.messages import Datum, ErrorReply, ForwardRequest

MSGPACK = {"Content-Type": "application/msgpack"}




@pytest.fixture(scope="module")
def server_storage(tmp_path_factory):
    return tmp_path_factory.mktemp("server-storage")


@pytest.fixture(scope="module")
def server_url(tiny_model, server_storage) -> Iterator[str]:
    from tinkerless.functions.worker import Worker

    with running(create_app(lambda: Worker(tiny_model), storage=str(server_storage))) as url:
        yield url


class EchoWorker:
    """A model-free worker: enough to test limits and status codes without loading weights."""

    def handle(self, method: str, payload: bytes) -> bytes:
        if method == "boom":
            return encode_message(ErrorReply(error="disk on fire", category="server", type="RuntimeError"))
        return encode_message({"method": method, "size": len(payload)})

    def info(self, _request=None) -> dict:
        return {"model": "echo", "policies": {}}


@pytest.fixture(scope="module")
def small_server_url() -> Iterator[str]:
    with running(create_app(EchoWorker(), max_request_bytes=1024)) as url:
        yield url


@tinkerless.reward
def length_reward(completion, task):
    return float(len(completion) % 3)


def _train(tiny_model, storage, backend, run_id="same-run"):
    return tinkerless.train(
        model=tiny_model,
        reward=length_reward,
        tasks=[{"prompt": "2+3?"}, {"prompt": "1+1?"}],
        steps=2,
        batch_size=2,
        group_size=2,
        max_tokens=4,
        seed=0,
        storage=str(storage),
        progress=False,
        run_id=run_id,
        backend=backend,
    )


def _adapter_files(storage, result) -> dict[str, bytes]:
    """The adapter of the run's last checkpoint in `storage` (a server keeps its runs under tenants/<tenant>)."""
    checkpoint = CheckpointStore(ObjectStore(str(storage)), checkpoint_prefix(result.run_id)).load(
        result.last_checkpoint_step
    )
    return {name: blob for name, blob in checkpoint.files.items() if name.endswith("adapter_model.safetensors")}


# ---- (a) the same run locally and over HTTP ------------------------------------------------------


def test_training_over_http_matches_local(tiny_model, server_url, server_storage, tmp_path):
    local = _train(tiny_model, tmp_path / "local", LocalBackend(tiny_model))
    remote = _train(tiny_model, tmp_path / "http", HTTPBackend(server_url, timeout=120))

    local_rewards = [r["reward_mean"] for r in local.metrics]
    assert len(local_rewards) == 2 and all(np.isfinite(local_rewards))
    assert [r["reward_mean"] for r in remote.metrics] == local_rewards
    assert local.last_checkpoint_step == remote.last_checkpoint_step == 2
    local_adapter = _adapter_files(tmp_path / "local", local)
    assert local_adapter, "the checkpoint holds no adapter weights"
    # The server hosts the run: its state and checkpoints are in the server's storage, not the client's.
    assert _adapter_files(server_storage / "tenants/_", remote) == local_adapter
    state = json.loads((server_storage / "tenants/_/runs/same-run/state.json").read_text())
    assert state["status"] == "finished" and state["step"] == 2 and state["last_checkpoint_step"] == 2
    assert not (tmp_path / "http/runs/same-run/state.json").exists()
    assert not (tmp_path / "http/runs/same-run/checkpoints").exists()
    assert (tmp_path / "http/runs/same-run/metrics.jsonl").exists()  # metrics and plot stay with the client


# ---- (b) typed user errors -----------------------------------------------------------------------


def _unknown_policy_request() -> ForwardRequest:
    datum = Datum(tokens=np.array([1, 2, 3], dtype=np.int32), mask=np.ones(3, dtype=np.float32))
    return ForwardRequest("nope", [datum])


def test_user_error_is_typed_and_status_400(tiny_model, server_url, worker):
    with pytest.raises(UserError) as local_error:
        call(_LocalOn(worker), "forward", _unknown_policy_request())

    backend = HTTPBackend(server_url, timeout=30)
    try:
        with pytest.raises(UserError) as remote_error:
            call(backend, "forward", _unknown_policy_request())
    finally:
        backend.close()
    assert type(remote_error.value) is type(local_error.value)
    assert remote_error.value.message == local_error.value.message
    assert "does not exist" in remote_error.value.message

    response = httpx.post(
        f"{server_url}/v1/call/forward", content=encode_message(_unknown_policy_request()), headers=MSGPACK, timeout=30
    )
    assert response.status_code == 400
    assert response.headers["content-type"].startswith("application/msgpack")


class _LocalOn:
    """A LocalBackend around an existing worker (the session fixture), without loading another model."""

    name = "local"

    def __init__(self, worker):
        self.worker = worker

    def call_bytes(self, method: str, payload: bytes) -> bytes:
        return self.worker.handle(method, payload)

    def close(self) -> None:
        pass


def test_server_error_is_status_500(small_server_url):
    response = httpx.post(f"{small_server_url}/v1/call/boom", content=encode_message({}), headers=MSGPACK, timeout=10)
    assert response.status_code == 500
    with pytest.raises(RemoteError, match="disk on fire"):
        call(HTTPBackend(small_server_url, timeout=10), "boom", {})


# ---- (c) size limit ------------------------------------------------------------------------------


def test_oversized_request_gets_413_and_protocol_error(small_server_url):
    big = {"blob": b"x" * 4096}
    response = httpx.post(f"{small_server_url}/v1/call/echo", content=encode_message(big), headers=MSGPACK, timeout=10)
    assert response.status_code == 413

    backend = HTTPBackend(small_server_url, timeout=10)
    with pytest.raises(ProtocolError, match="limit of 1024 bytes"):
        call(backend, "echo", big)
    assert call(backend, "echo", {"blob": b"x" * 10})["method"] == "echo"  # small ones still pass
    backend.close()


def test_oversized_chunked_upload_without_content_length_gets_413(small_server_url):
    body = encode_message({"blob": b"x" * 4096})

    def chunks():
        for i in range(0, len(body), 512):
            yield body[i : i + 512]

    response = httpx.post(f"{small_server_url}/v1/call/echo", content=chunks(), headers=MSGPACK, timeout=10)
    assert "content-length" not in response.request.headers
    assert response.status_code == 413


# ---- (d) protocol version ------------------------------------------------------------------------


def test_other_protocol_version_is_a_protocol_error(server_url):
    future = encode({"v": 999, "py": PYTHON_VERSION, "body": {}})
    response = httpx.post(f"{server_url}/v1/call/info", content=future, headers=MSGPACK, timeout=30)
    assert response.status_code == 400

    backend = HTTPBackend(server_url, timeout=30)
    try:
        reply = decode_message(backend.call_bytes("info", future))  # call() would encode a current envelope
    finally:
        backend.close()
    assert isinstance(reply, ErrorReply)
    with pytest.raises(ProtocolError, match="protocol version 999"):
        raise_error_reply(reply, where="http info")


# ---- (e) health ----------------------------------------------------------------------------------


def test_healthz_reports_model_and_policies(server_url, tiny_model):
    response = httpx.get(f"{server_url}/healthz", timeout=10)
    assert response.status_code == 200
    health = response.json()
    assert health["status"] == "ok"
    assert health["model"] == tiny_model
    assert isinstance(health["policies"], dict)


# ---- (f) unreachable server ----------------------------------------------------------------------


def test_unreachable_url_is_a_remote_error_with_a_hint():
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    backend = HTTPBackend(f"http://127.0.0.1:{port}", timeout=5)
    with pytest.raises(RemoteError) as error:
        call(backend, "info", None)
    backend.close()
    assert "cannot reach the tinkerless server" in str(error.value)
    assert "tinkerless serve" in (error.value.hint or "")


# ---- one call at a time --------------------------------------------------------------------------


class SlowWorker(EchoWorker):
    """Records how many calls overlap; the model is single-tenant, so it must never be more than one."""

    def __init__(self):
        self.active = 0
        self.max_active = 0
        self._count = threading.Lock()

    def handle(self, method: str, payload: bytes) -> bytes:
        with self._count:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        time.sleep(0.1)
        with self._count:
            self.active -= 1
        return super().handle(method, payload)


def test_calls_run_one_at_a_time_and_health_stays_responsive():
    worker = SlowWorker()
    with running(create_app(worker)) as url:
        backend = HTTPBackend(url, timeout=10)
        threads = [threading.Thread(target=call, args=(backend, "echo", {"i": i})) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.05)
        started = time.monotonic()
        assert httpx.get(f"{url}/healthz", timeout=10).json()["model"] == "echo"
        assert time.monotonic() - started < 0.3  # not queued behind the four 0.1 s calls
        for t in threads:
            t.join(timeout=10)
        backend.close()
    assert worker.max_active == 1


def test_backend_url_string_selects_the_http_backend(tiny_model, server_url, tmp_path):
    from tinkerless.sdk.backends.base import make_backend

    assert isinstance(make_backend(server_url, tiny_model), HTTPBackend)
    result = tinkerless.train(
        model=tiny_model, reward=length_reward, tasks=[{"prompt": "hi"}], steps=1, batch_size=1, group_size=2,
        max_tokens=4, storage=str(tmp_path), progress=False, backend=server_url,
    )
    assert result.metrics[0]["episodes"] == 2


def test_runs_sharing_a_server_start_from_their_own_fresh_adapters(tiny_model, server_url, server_storage, tmp_path):
    """Runs on one server get their own adapters: a second run does not continue the first one's."""
    import httpx

    first = _train(tiny_model, tmp_path / "one", HTTPBackend(server_url, timeout=120), run_id="sharing-one")
    second = _train(tiny_model, tmp_path / "two", HTTPBackend(server_url, timeout=120), run_id="sharing-two")
    assert [r["reward_mean"] for r in second.metrics] == [r["reward_mean"] for r in first.metrics]
    assert _adapter_files(server_storage / "tenants/_", second) == _adapter_files(server_storage / "tenants/_", first)
    # Finished runs free their policies on the server (peft keeps a model's last adapter: at most one stays).
    policies = httpx.get(server_url + "/healthz").json()["policies"]
    assert len([p for p in policies if p.endswith("-default")]) <= 1


class RecordingWorker:
    """Records the order calls reach it; "slow" calls hold the model until released."""

    def __init__(self):
        self.calls: list[str] = []
        self.release = threading.Event()

    def handle(self, method: str, payload: bytes) -> bytes:
        if method == "slow":
            self.release.wait(10)
        self.calls.append(decode_message(payload)["tag"])
        return encode_message({"ok": True})

    def info(self, _request=None) -> dict:
        return {"model": "recording", "policies": {}}


def test_http_calls_run_in_the_order_the_client_made_them():
    worker = RecordingWorker()
    worker.release.set()
    with running(create_app(worker)) as url:
        backend = HTTPBackend(url)
        stream = {"X-Tinkerless-Stream": "fixed", "Content-Type": "application/msgpack"}
        # Sent out of order on one stream: #3, then #2, then #1. The server runs #1, #2, #3.
        with ThreadPoolExecutor(3) as pool:
            futures = []
            for seq in (3, 2, 1):
                body = encode_message({"tag": f"call-{seq}"})
                futures.append(pool.submit(httpx.post, f"{url}/v1/call/info", content=body, headers={**stream, "X-Tinkerless-Seq": str(seq)}))
                time.sleep(0.2)  # make the arrival order certain
            assert [f.result().status_code for f in futures] == [200, 200, 200]
        assert worker.calls == ["call-1", "call-2", "call-3"]
        backend.close()


def test_a_full_queue_answers_429_and_the_backend_retries_after_the_delay():
    worker = RecordingWorker()
    with running(create_app(worker, max_pending=1)) as url:
        with ThreadPoolExecutor(2) as pool:
            slow = pool.submit(HTTPBackend(url).call_bytes, "slow", encode_message({"tag": "slow"}))
            time.sleep(0.3)  # the slow call is running; the next one fills the one queue slot
            queued = pool.submit(HTTPBackend(url).call_bytes, "info", encode_message({"tag": "queued"}))
            time.sleep(0.3)
            refused = httpx.post(f"{url}/v1/call/info", content=encode_message({"tag": "refused"}))
            assert refused.status_code == 429 and float(refused.headers["retry-after"]) >= 1
            assert decode_message(refused.content).type == "ServerBusy"
            # A backend call made now is refused too, and retried by HTTPBackend until there is room.
            retried = pool.submit(HTTPBackend(url).call_bytes, "info", encode_message({"tag": "retried"}))
            time.sleep(0.5)
            worker.release.set()
            for future in (slow, queued, retried):
                assert decode_message(future.result(30)) == {"ok": True}
        assert worker.calls == ["slow", "queued", "retried"]


def test_a_queue_that_stays_full_is_a_clear_error():
    worker = RecordingWorker()
    with running(create_app(worker, max_pending=1)) as url:
        with ThreadPoolExecutor(2) as pool:
            pool.submit(HTTPBackend(url).call_bytes, "slow", encode_message({"tag": "slow"}))
            time.sleep(0.3)
            pool.submit(HTTPBackend(url).call_bytes, "info", encode_message({"tag": "queued"}))
            time.sleep(0.3)
            with pytest.raises(ServerBusy, match="stayed busy"):
                HTTPBackend(url, busy_timeout=0.5).call_bytes("info", encode_message({"tag": "late"}))
            worker.release.set()
