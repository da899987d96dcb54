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

from tinkerless.errors import ConfigError, TinkerlessError
from tinkerless.sdk.backends.reader_processes import (CHANGING_METHODS, READ_METHODS, changed_policy, policies_of, publish,
                                                      start_readers, stop_readers)
from tinkerless.sdk.run.accounting import UsageMeter
from tinkerless.wire import decode_message, encode_message
from tinkerless.wire.messages import ErrorReply
from tinkerless.wire.replies import raise_error_reply


class Backend(Protocol):
    name: str
    usage: UsageMeter  # compute seconds per function, measured where the body ran (see accounting.py)

    def call_bytes(self, method: str, payload: bytes) -> bytes: ...

    def close(self) -> None: ...


class LocalBackend:
    """Runs the functions on this machine's CPU (or GPU if present): in this process, or with
    `rollout_workers=N` the sampling calls in N processes of their own (`reader_processes`). With `gpus=N` (N > 1)
    the update trains over N GPUs as FSDP2 ranks and this process samples on the first (`sharding.split`); on a
    machine without GPUs the ranks are CPU processes (gloo)."""

    name = "local"

    def __init__(self, model: str, *, rollout_workers: int = 0, gpus: int = 1, **worker_options: Any):
        from tinkerless.functions.worker import Worker  # torch/transformers load only when used

        if not isinstance(rollout_workers, int) or isinstance(rollout_workers, bool) or not 0 <= rollout_workers <= 64:
            raise ConfigError(f"rollout_workers={rollout_workers!r} is not a number of processes from 0 to 64",
                              hint="0 samples in this process; 1 or more run the rollouts in worker processes")
        self.readers: list = []
        if rollout_workers:
            from tinkerless.functions.threads import choose_threads

            # The CPU threads split between the writer and the readers, so the processes do not fight for cores.
            total = choose_threads(worker_options.pop("threads", None)).threads
            share = max(1, total // (rollout_workers + 1))
            self.readers = start_readers(model, rollout_workers, {**worker_options, "threads": share})
            worker_options["threads"] = max(1, total - share * rollout_workers)
        if gpus > 1:
            from tinkerless.functions.sharding.split import SplitWorker

            self.worker = SplitWorker(model, ranks=gpus, **worker_options)
        else:
            self.worker = Worker(model, **worker_options)
        self._lock = threading.Lock()  # one model in this process: calls from several threads take turns
        self.usage = UsageMeter(source="the in-process worker", device=self.worker.device_name)
        self._changes: dict[str, int] = {}  # per policy: writer calls that may have changed it
        self._published: dict[str, tuple[int, Any]] = {}  # per policy: (its change count, the state readers take)
        self._next_reader = 0

    def call_bytes(self, method: str, payload: bytes) -> bytes:
        if self.readers and method in READ_METHODS:
            return self._read(method, payload)
        with self._lock:
            # Timed inside the lock: waiting for another thread's call is not compute.
            started = time.perf_counter()
            try:
                reply = self.worker.handle(method, payload)
            finally:
                self.usage.record(method, time.perf_counter() - started)
            if self.readers and method in CHANGING_METHODS:
                self._changed(method, decode_message(payload), reply)
            return reply

    def close(self) -> None:
        if self.readers:
            stop_readers(self.readers)
            self.readers = []
        getattr(self.worker, "close", lambda: None)()  # a SplitWorker's ranks

    # -- readers in processes of their own ------------------------------------------------

    def _changed(self, method: str, request: Any, reply: bytes) -> None:
        """A writer call that may have changed a policy (under the writer's lock): readers' copies are stale. A
        state handed over by `load_state` is published at once, with its proof, for readers to take later."""
        name = changed_policy(request)
        if name is None:
            return
        change = self._changes[name] = self._changes.get(name, 0) + 1
        self._published.pop(name, None)
        if method == "delete_policy":
            for reader in self.readers:
                if reader.held.pop(name, None) is not None:
                    reader.doomed.add(name)  # freed before that reader's next call, not waiting for its current one
        elif method == "load_state" and name in self.worker.policies and not isinstance(decode_message(reply), ErrorReply):
            self._published[name] = (change, publish(self.worker, name, self.worker.policies[name].version,
                                                     request.state.files))

    def _read(self, method: str, payload: bytes) -> bytes:
        request = decode_message(payload)
        reader = self._acquire_reader()
        try:
            for name in sorted(reader.doomed):
                reader.request(("drop", name))
            reader.doomed.clear()
            for name in policies_of(request):
                self._sync(reader, name)
            started = time.perf_counter()
            try:
                return reader.request(("call", method, payload))
            finally:
                self.usage.record(method, time.perf_counter() - started)
        finally:
            reader.lock.release()

    def _acquire_reader(self):
        """A reader not busy, else the next in turn (waiting for it)."""
        for reader in self.readers:
            if reader.lock.acquire(blocking=False):
                return reader
        reader = self.readers[self._next_reader % len(self.readers)]
        self._next_reader += 1
        reader.lock.acquire()
        return reader

    def _sync(self, reader: Any, name: str) -> None:
        """Bring `reader`'s copy of policy `name` to the writer's current state of it, proven (`handoff`)."""
        from tinkerless.wire.messages import SaveStateRequest

        change = self._changes.get(name)
        if change is None or reader.held.get(name) == change:
            return  # unknown to the writer (the reader's own error says so), or already in step
        published = self._published.get(name)
        if published is None or published[0] != change:
            with self._lock:  # the writer's state now: waits for the writer's call in progress
                change = self._changes.get(name)
                state = self.worker.save_state(SaveStateRequest(name, include_optimizer=False))
                published = self._published[name] = (change, publish(self.worker, name, state.policy_version,
                                                                      state.files))
        change, state = published
        reply = decode_message(reader.request(("sync", name, state.version, state.files, state.proof)))
        if isinstance(reply, ErrorReply):
            raise_error_reply(reply, where=f"rollout worker {reader.process.pid} loading policy {name!r}")
        reader.held[name] = change


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


# Backends that live on a higher floor (`tinkerless.cloud`, which itself runs the client's trainer in the cloud),
# registered by name: "module:factory", the factory called as factory(model, **options).
CLOUD_BACKENDS = {
    "modal": "tinkerless.cloud.modal_backend:make_modal_backend",
    "sky": "tinkerless.cloud.sky_backend:make_sky_backend",  # "sky" or "sky:<cluster>"
}


def make_backend(backend: str | Backend, model: str, *, run_config: Any = None, **options: Any) -> Backend:
    """The backend `backend` names; `run_config` (the run's TrainConfig) lets a SkyPilot launch print its estimate."""
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
        sky = {"cluster": argument or None, "run_config": run_config} if name == "sky" else {}
        return make(model, **sky, **options)
    raise ConfigError(
        f"unknown backend {backend!r}", hint="backend='local', 'modal', 'sky', 'sky:<cluster>' or 'http://host:port'"
    )
