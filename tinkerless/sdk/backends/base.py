"""Backends: where the functions run. All speak bytes produced by the wire codec.

`LocalBackend` hosts a `Worker` in this process but still encodes every
request and decodes every reply, exactly as a remote call would, so local
runs exercise the remote payloads. Remote backends (HTTP server, Modal,
SkyPilot) implement the same `call_bytes`.
"""

from __future__ import annotations

import importlib
import threading
import time
from typing import Any, Protocol

from tinkerless.errors import ConfigError, RemoteError, TinkerlessError, error_class_for
from tinkerless.sdk.run.accounting import UsageMeter
from tinkerless.wire import decode_message, encode_message
from tinkerless.wire.messages import ErrorReply


class Backend(Protocol):
    name: str
    usage: UsageMeter  # compute seconds per function, measured where the body ran (see accounting.py)

    def call_bytes(self, method: str, payload: bytes) -> bytes: ...

    def close(self) -> None: ...


class LocalBackend:
    """Runs the functions in-process on this machine's CPU (or GPU if present)."""

    name = "local"

    def __init__(self, model: str, **worker_options: Any):
        from tinkerless.functions.worker import Worker  # torch/transformers load only when used

        self.worker = Worker(model, **worker_options)
        self._lock = threading.Lock()  # one model in this process: calls from several threads take turns
        self.usage = UsageMeter(source="the in-process worker", device=self.worker.device_name)

    def call_bytes(self, method: str, payload: bytes) -> bytes:
        with self._lock:
            # Timed inside the lock: waiting for another thread's call is not compute.
            started = time.perf_counter()
            try:
                return self.worker.handle(method, payload)
            finally:
                self.usage.record(method, time.perf_counter() - started)

    def close(self) -> None:
        pass


class ClientTimed:
    """Wraps a backend that keeps no `usage` meter: bills each call's client-side wall time.

    That includes network and queueing, so it overstates compute; `usage.source` says so.
    """

    def __init__(self, inner: Any):
        self.inner = inner
        self.name = getattr(inner, "name", type(inner).__name__)
        self.usage = UsageMeter(source="client wall time (the backend reports no compute seconds)")

    def call_bytes(self, method: str, payload: bytes) -> bytes:
        started = time.perf_counter()
        try:
            return self.inner.call_bytes(method, payload)
        finally:
            self.usage.record(method, time.perf_counter() - started, client_timed=True)

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:  # anything else the user's backend offers
        if name == "inner":  # not set yet (e.g. while unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


def with_usage(backend: Any) -> Backend:
    """`backend` itself when it meters its calls, else wrapped so its calls are at least wall-timed."""
    return backend if isinstance(getattr(backend, "usage", None), UsageMeter) else ClientTimed(backend)


def device_of(backend: Backend) -> str:
    """What the backend's functions run on: the meter's device, else the worker's `info` reply."""
    if backend.usage.device:
        return backend.usage.device
    try:
        info = call(backend, "info", {})
    except TinkerlessError:
        return "unknown"  # a backend without `info`: its cost is n/a, with a warning saying how to price it
    device = str(info.get("device_name") or info.get("device") or "unknown") if isinstance(info, dict) else "unknown"
    backend.usage.device = device
    return device


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
            hint=reply.hint,  # what to do about it: a server-side error class the client does not know keeps it too
        )
    error.remote_traceback = reply.traceback  # type: ignore[attr-defined]
    raise error


# Backends that live on a higher floor (`tinkerless.cloud`, which itself runs the client's trainer in the cloud),
# registered by name: "module:factory", the factory called as factory(model, **options).
CLOUD_BACKENDS = {
    "modal": "tinkerless.cloud.modal_backend:make_modal_backend",
    "sky": "tinkerless.cloud.sky_backend:make_sky_backend",  # "sky" or "sky:<cluster>"
}


def make_backend(backend: str | Backend, model: str, **options: Any) -> Backend:
    if not isinstance(backend, str):
        return backend
    if backend == "local":
        return LocalBackend(model, **options)
    if backend.startswith(("http://", "https://")):
        from tinkerless.sdk.backends.http import HTTPBackend  # httpx loads only for remote runs

        return HTTPBackend(backend)  # engine and micro-batch size are the server's to set
    name, _, argument = backend.partition(":")
    if name in CLOUD_BACKENDS and (not argument or name == "sky"):  # the cloud package (and modal or skypilot) loads only for a run that names it
        module, factory = CLOUD_BACKENDS[name].split(":")
        make = getattr(importlib.import_module(module), factory)
        return make(model, **({"cluster": argument or None} if name == "sky" else {}), **options)
    raise ConfigError(
        f"unknown backend {backend!r}", hint="backend='local', 'modal', 'sky', 'sky:<cluster>' or 'http://host:port'"
    )
