"""A busy or restarting server (429, or 503 with Retry-After) is waited out, the waits shown; one that stays so
past `busy_timeout` is a `ServerBusy`, and a 503 without Retry-After (a failed service) is not retried."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tinkerless.errors import ServerBusy
from tinkerless.sdk.backends import http
from tinkerless.sdk.backends.http import HTTPBackend
from tinkerless.wire import encode_message
from tinkerless.wire.http import MSGPACK


@contextmanager
def _server(answers: list[tuple[int, dict]]):
    """Answers each POST with the next (status, headers) of `answers` (the last one repeats), a msgpack body."""
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers["content-length"]))
            seen.append(self.headers.get("X-Tinkerless-Seq"))
            status, headers = answers[min(len(seen) - 1, len(answers) - 1)]
            body = encode_message({"ok": len(seen)})
            self.send_response(status)
            for name, value in {"content-type": MSGPACK, "content-length": str(len(body)), **headers}.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def test_429_and_503_with_retry_after_are_waited_out_and_shown():
    waits: list[tuple[float, str]] = []
    http.wait_listeners.append(lambda seconds, why: waits.append((seconds, why)))
    try:
        answers = [(429, {"Retry-After": "0"}), (503, {"Retry-After": "0"}), (200, {})]
        with _server(answers) as (url, seen):
            backend = HTTPBackend(url, busy_timeout=10)
            reply = backend.call_bytes("sample", b"x")
            backend.close()
    finally:
        http.wait_listeners.clear()
    assert len(seen) == 3 and len(set(seen)) == 1  # the same call, resent with its sequence number
    assert reply == encode_message({"ok": 3})
    assert [why for _, why in waits] == ["sample: HTTP 429, retrying after 0s", "sample: HTTP 503, retrying after 0s"]


def test_a_503_without_retry_after_is_answered_not_retried():
    with _server([(503, {}), (200, {})]) as (url, seen):
        backend = HTTPBackend(url, busy_timeout=10)
        assert backend.call_bytes("rollout", b"x") == encode_message({"ok": 1})  # the envelope, for `call` to raise
        backend.close()
    assert len(seen) == 1


@pytest.mark.parametrize("status", [429, 503])
def test_a_server_busy_past_busy_timeout_is_server_busy(status):
    with _server([(status, {"Retry-After": "1"})]) as (url, seen):
        backend = HTTPBackend(url, busy_timeout=0.5)
        with pytest.raises(ServerBusy, match=f"HTTP {status}") as caught:
            backend.call_bytes("update", b"x")
        backend.close()
    assert "busy_timeout" in caught.value.hint and len(seen) == 1
