"""Running the app: `serve` (`tinkerless serve`: load a model, serve it with uvicorn until interrupted)
and `serve_in_thread` (an app on a background thread, for tests, benchmarks and notebooks)."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from typing import Any, Iterator

from fastapi import FastAPI

from tinkerless.server.app import DEFAULT_MAX_PENDING_PER_TENANT, DEFAULT_MAX_REQUEST_BYTES, create_app
from tinkerless.server.keys import KeyStore
from tinkerless.server.limits import ServingLimits

logger = logging.getLogger(__name__)


def serve(
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    model: str,
    storage: str | None = None,
    auth: bool = True,
    extra_keys: dict[str, str] | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    max_pending: int = 1024,
    max_pending_per_tenant: int | None = DEFAULT_MAX_PENDING_PER_TENANT,
    limits: ServingLimits | None = None,
    slice_seconds: float = 0.05,
    log_level: str = "info",
    single_user: bool = False,
    price_per_hour: float | None = None,
    also_models: list[str] | tuple[str, ...] = (),
    **worker_options: Any,
) -> None:
    """Load `model` into a Worker and serve it until interrupted (binds to localhost unless told otherwise).

    `also_models`: extra base models, each loaded into a Worker of its own beside the main one, answering forward
    (log-probs) and sample for a teacher of another base (`served_models`, docs/serving.md); tenants train on `model`.
    `gpus` > 1 (a worker option) trains over that many GPUs as FSDP2 ranks (`functions/sharding`).
    With `auth` (the default), calls need an API key issued into `storage` by `tinkerless keys create`.
    Clients' env/reward/agent code runs in a sandboxed process per tenant (`user_code.py`), never in
    this one, unless `single_user` (one's own server, e.g. `sky launch` of one's own cluster).
    """
    import uvicorn

    from tinkerless.functions.worker import Worker
    from tinkerless.storage import ObjectStore

    also_models = _distinct(model, also_models)
    keys = KeyStore(ObjectStore(storage or "."), extra_keys=extra_keys) if auth else None
    if not single_user:
        from tinkerless.functions.hosting.user_code import UserCodeHosts

        local_storage = storage or "."
        hidden = (local_storage,) if "://" not in local_storage else ()  # tenants' code must not see it
        hosts = UserCodeHosts(hide=hidden)
        hosts.check()  # no sandbox here: refuse to serve tenants now, naming the fix, rather than fail their rollouts
        worker_options.setdefault("user_code_hosts", hosts)
    gpus = worker_options.pop("gpus", 1)
    if gpus > 1:  # training over the machine's GPUs as ranks, sampling on one (functions/sharding/split.py)
        from tinkerless.functions.sharding.split import SplitWorker

        worker: Worker = SplitWorker(model, ranks=gpus, **worker_options)
    else:
        worker = Worker(model, **worker_options)
    # The extra models share the device and the CPU threads: the scheduler runs one call at a time on any of them.
    extra_options = {k: v for k, v in worker_options.items() if k in ("threads", "dtype", "device", "engine")}
    if getattr(worker, "threads", None) is not None:
        extra_options["threads"] = worker.threads.threads
    models = {spec: Worker(spec, **extra_options) for spec in also_models}
    app = create_app(
        worker,
        max_request_bytes=max_request_bytes,
        max_pending=max_pending,
        max_pending_per_tenant=max_pending_per_tenant,
        limits=limits,
        slice_seconds=slice_seconds,
        keys=keys,
        storage=storage or ".",
        price_per_hour=price_per_hour,
        models=models,
    )

    class Server(uvicorn.Server):
        """uvicorn's graceful shutdown waits for every open request, and an abandoned generation would hold it
        for its whole job: SIGINT/SIGTERM first cancel the generations queued and running for the OpenAI routes."""

        def handle_exit(self, sig, frame) -> None:
            cancelled = app.state.cancel_jobs()
            if cancelled:
                logger.info("shutting down: cancelled %d generation job(s)", cancelled)
            super().handle_exit(sig, frame)

    try:
        Server(uvicorn.Config(app, host=host, port=port, log_level=log_level)).run()
    finally:  # a graceful stop writes what keys and runs spent since the last timed write (a crash loses <= 1 s)
        app.state.flush_spending()


def _distinct(model: str, also_models: Any) -> list[str]:
    """The extra model ids, each once and none the main model (checked before any loads: loading takes minutes)."""
    from tinkerless.errors import ConfigError
    from tinkerless.functions.models import model_aliases

    seen, out = set(model_aliases(model)), []
    for spec in also_models:
        if not isinstance(spec, str) or not spec.strip():
            raise ConfigError(f"--also-model {spec!r} is not a model id or directory", hint="e.g. --also-model smollm2")
        if model_aliases(spec.strip()) & seen:
            raise ConfigError(f"--also-model {spec!r} is served already (the main --model, or an earlier --also-model)",
                              hint="name each model once")
        seen |= model_aliases(spec.strip())
        out.append(spec.strip())
    return out


@contextlib.contextmanager
def serve_in_thread(app: FastAPI, *, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0) -> Iterator[str]:
    """Serve `app` from a background thread (tests, benchmarks, notebooks); yields its base URL and stops it on exit."""
    import uvicorn

    if port == 0:  # a free port, picked by the OS
        with socket.socket() as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            raise RuntimeError(f"the server did not start on {host}:{port}")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        flush = getattr(app.state, "flush_spending", None)
        if flush is not None:
            flush()
