"""Backends: where the functions run. All speak bytes produced by the wire codec.

`LocalBackend` hosts a `Worker` in this process but still encodes every
request and decodes every reply, exactly as a remote call would, so local
runs exercise the remote payloads. Remote backends (HTTP server, Modal,
SkyPilot) implement the same `call_bytes`.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from tinkerless.errors import ConfigError, RemoteError, error_class_for
from tinkerless.wire import decode_message, encode_message
from tinkerless.wire.messages import ErrorReply


class Backend(Protocol):
    name: str

    def call_bytes(self, method: str, payload: bytes) -> bytes: ...

    def close(self) -> None: ...


class LocalBackend:
    """Runs the functions in-process on this machine's CPU (or GPU if present)."""

    name = "local"

    def __init__(self, model: str, **worker_options: Any):
        from tinkerless.functions.worker import Worker  # torch/transformers load only when used

        self.worker = Worker(model, **worker_options)
        self._lock = threading.Lock()  # one model in this process: calls from several threads take turns

    def call_bytes(self, method: str, payload: bytes) -> bytes:
        with self._lock:
            return self.worker.handle(method, payload)

    def close(self) -> None:
        pass


def call(backend: Backend, method: str, request: Any) -> Any:
    """Encode a request, run it on the backend, decode the reply; errors come back typed."""
    reply = decode_message(backend.call_bytes(method, encode_message(request)))
    if isinstance(reply, ErrorReply):
        raise_error_reply(reply, where=f"{backend.name} {method}")
    return reply


def raise_error_reply(reply: ErrorReply, *, where: str) -> None:
    cls = error_class_for(reply.type)
    if cls is not None and cls is not RemoteError:
        error = cls(reply.error, hint=reply.hint)
    else:
        error = RemoteError(
            f"{where} failed: {reply.type}: {reply.error}",
            category=reply.category,
            remote_type=reply.type,
            traceback=reply.traceback,
        )
    error.remote_traceback = reply.traceback  # type: ignore[attr-defined]
    raise error


def make_backend(backend: str | Backend, model: str, **options: Any) -> Backend:
    if not isinstance(backend, str):
        return backend
    if backend == "local":
        return LocalBackend(model, **options)
    if backend.startswith(("http://", "https://")):
        from tinkerless.sdk.http_backend import HTTPBackend  # httpx loads only for remote runs

        return HTTPBackend(backend)  # engine and micro-batch size are the server's to set
    if backend in ("modal", "sky"):
        raise ConfigError(
            f"backend {backend!r} is not available in this version of tinkerless",
            hint="use backend='local' or a `tinkerless serve` URL ('http://host:port'); Modal and SkyPilot arrive later",
        )
    raise ConfigError(f"unknown backend {backend!r}", hint="backend='local', 'modal', 'sky' or 'http://host:port'")
