"""What a client is told when things go wrong on a server: the failing call, never the server's paths."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

import tinkerless
from tinkerless.errors import RemoteError, ServerUnreachable, UserError
from tinkerless.sdk.backends.http import HTTPBackend
from tinkerless.sdk.backends.server_runs import ServerRunHost
from tinkerless.server import create_app
from tinkerless.server import serve_in_thread as running


def _train(model: str, storage: Path, backend=None, **extra):
    return tinkerless.train(
        model=model, name="errs", reward=lambda c, t: 1.0, tasks=[{"prompt": "hi"}], steps=2, batch_size=1,
        group_size=2, max_tokens=2, storage=str(storage), progress=False, backend=backend, **extra,
    )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _started_server(model: str, tmp_path, *flags: str) -> tuple[subprocess.Popen, str]:
    """`tinkerless serve` as its own process (no auth, single user, storage in tmp_path), once it answers."""
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tinkerless.sdk.cli", "serve", "--model", model, "--port", str(port), "--no-auth",
         "--single-user", "--storage", str(tmp_path / "server"), *flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/healthz").status_code == 200:
                return server, url
        except httpx.TransportError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise AssertionError("the server did not start")
        time.sleep(0.2)


def test_a_server_dying_mid_call_names_that_call_not_finish(tiny_model, tmp_path):
    # --single-user: the reward below touches a marker file in tmp_path, from the server
    server, url = _started_server(tiny_model, tmp_path)
    try:
        marker = tmp_path / "rolling-out"

        def slow_reward(completion, task):  # runs on the server, inside the rollout call
            marker.touch()
            time.sleep(30)
            return 1.0

        def kill_when_rolling_out():
            while not marker.exists() and server.poll() is None:
                time.sleep(0.05)
            server.send_signal(signal.SIGKILL)

        killer = threading.Thread(target=kill_when_rolling_out, daemon=True)
        killer.start()
        with pytest.raises(ServerUnreachable) as info:  # reconnect_timeout=0: no waiting for it to come back
            tinkerless.train(
                model=tiny_model, name="dies", reward=slow_reward, tasks=[{"prompt": "hi"}], steps=1, batch_size=1,
                group_size=2, max_tokens=2, storage=str(tmp_path / "client"), progress=False, backend=HTTPBackend(url),
                reconnect_timeout=0,
            )
        killer.join(timeout=10)
    finally:
        server.kill()
        server.wait()
    message = str(info.value)
    assert "during rollout" in message and "finish" not in message, message


def test_resuming_a_run_that_was_never_created_says_to_run_without_resume(tiny_model, worker, tmp_path):
    with pytest.raises(UserError, match="nothing to resume") as local:
        _train(tiny_model, tmp_path / "local", resume=True, run_id="never-made")
    assert "without --resume" in local.value.hint
    with running(create_app(worker, storage=str(tmp_path / "server"))) as url:
        with pytest.raises(UserError, match="nothing to resume") as remote:
            _train(tiny_model, tmp_path / "client", backend=HTTPBackend(url), resume=True, run_id="never-made")
    assert "without --resume" in remote.value.hint


def test_server_errors_never_show_the_servers_storage_paths(worker, tmp_path):
    storage = tmp_path / "secret-server-dir"
    with running(create_app(worker, storage=str(storage))) as url:
        host = ServerRunHost(HTTPBackend(url))
        host.create("taken", {})
        errors = []
        for attempt in (lambda: host.create("taken", {}), lambda: host.open("missing")):
            with pytest.raises(UserError) as info:
                attempt()
            errors.append(f"{info.value.message} {info.value.hint}")
    for error in errors:
        assert "secret-server-dir" not in error and os.fspath(tmp_path) not in error, error
        assert "<server storage>" in error


def test_an_unexpected_bug_is_a_typed_500_in_the_routes_format():
    from tinkerless.wire import decode_message, encode_message
    from tinkerless.wire.messages import ErrorReply

    class Buggy:  # a worker whose every entry point has a bug
        def handle(self, method: str, payload: bytes) -> bytes:
            raise RuntimeError("/secret/path/to/storage exploded")

        def info(self, _request=None) -> dict:
            raise RuntimeError("/secret/path/to/storage exploded")

    with running(create_app(Buggy())) as url:
        health = httpx.get(f"{url}/healthz")
        called = httpx.post(f"{url}/v1/call/info", content=encode_message({}), headers={"Content-Type": "application/msgpack"})
    assert health.status_code == 500 and health.json()["category"] == "server"
    assert "internal error (RuntimeError)" in health.json()["error"] and "secret" not in health.text
    reply = decode_message(called.content)
    assert called.status_code == 500 and isinstance(reply, ErrorReply) and reply.category == "server"
    assert "secret" not in reply.error


def test_sigterm_cancels_a_running_generation_instead_of_waiting_for_it(tiny_model, tmp_path):
    """A generation for a caller that is waiting (or gone) must not hold `tinkerless serve`'s shutdown."""
    import threading

    server, url = _started_server(tiny_model, tmp_path, "--max-tokens", "2000")
    deadline = time.monotonic() + 120
    try:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 2000,
                "temperature": 0.0, "n": 4}
        answered: dict = {}

        def ask() -> None:
            try:
                answered["status"] = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).status_code
            except httpx.HTTPError as exc:
                answered["error"] = exc

        caller = threading.Thread(target=ask)
        caller.start()
        while "in_flight 1" not in httpx.get(f"{url}/metrics").text:  # the generation is running
            assert caller.is_alive() and time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.3)
        sent = time.monotonic()
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
        took = time.monotonic() - sent
        caller.join(timeout=10)
        # 4 x 2000 greedy tokens take the tiny model well over the 3 s; the job's rows end at their next step.
        assert took < 3.0, f"SIGTERM waited {took:.1f} s"
        assert server.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it caught
    finally:
        if server.poll() is None:
            server.kill()
