"""HTTP transport for the worker: the same msgpack envelopes the local backend uses, over HTTP.

    POST /v1/call/{method}   body: encoded request envelope (application/msgpack); header X-Tinkerless-Model:
                             one of the server's extra models (forward, sample) instead of its main one
                             200: encoded reply; 400/500: encoded `ErrorReply` (user/server);
                             413: encoded `ErrorReply` (ProtocolError) when the body is too large;
                             429 + Retry-After: the queue is full
                             402: encoded `ErrorReply` (BudgetExceeded): the key's budget would be exceeded
    POST /v1/runs/...        server-hosted runs: coordinator calls and checkpoints (see `runs`)
    GET  /v1/usage           what the caller's key spent, holds and may still spend (see `budgets`)
    GET  /healthz            {"status": "ok", "model": ..., "models": [main, extra...], "policies": {name: version}}
    GET  /v1/served-models   the models this server holds, and each one's tokenizer (see `served_models`)
    GET  /metrics            Prometheus text: queue depth, calls in flight, requests, CPU/GPU
    /api/v1/...              the Tinker API, for the official `tinker` SDK (see `tinker_api`)
    /v1/models, /v1/chat/completions, /v1/completions
                             the OpenAI API: base model and trained adapters (see `openai_api`)

Error bodies are still msgpack envelopes so `tinkerless.sdk.backends.base.call` raises the
same typed error over HTTP as in-process. One model lives in the process, so calls run
one at a time on the `Scheduler`'s thread: in each client's sequence order
(`X-Tinkerless-Stream` / `X-Tinkerless-Seq` headers), tenants taking turns, long
generations paused between slices so that other tenants' calls run (see `scheduler`).
`info` reads no model and answers at once, without queueing. Requests that generate are
checked against the server's `ServingLimits` first (docs/serving-limits.md).

This module builds the app (`create_app`); `stats` holds the `/metrics` counters and `serving`
runs the app (`serve`, `serve_in_thread`; `tinkerless.server` exports all three).
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from typing import Any, Callable, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tinkerless.errors import BudgetExceeded, ProtocolError, SequenceReused, ServerBusy, TinkerlessError, UserError
from tinkerless.wire.http import RequestTooLarge, read_body
from tinkerless.server.budgets import KeyBudgets, calling_key, served_model
from tinkerless.server.run_budgets import Charges, RunBudgets
from tinkerless.storage import ObjectStore
from tinkerless.server.keys import KeyStore
from tinkerless.server.limits import LimitExceeded, ServingLimits
from tinkerless.server.replies import error_response, status_of, stream_of, unauthorized
from tinkerless.server.scheduler import QueueFull, Scheduler
from tinkerless.server.served_models import ModelRefusal, ServedModels, served_models_router
from tinkerless.server.stats import ServerStats
from tinkerless.functions.hosting.user_code import tenant_scope
from tinkerless.server.tenancy import policy_quota, scope, tenant_prefix, unscope
from tinkerless.wire import decode_message, encode_message
from tinkerless.wire.http import COMPUTE_SECONDS_HEADER, MSGPACK, QUEUE_SECONDS_HEADER
from tinkerless.wire.messages import ErrorReply
from tinkerless.wire.validate import validate

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_PENDING_PER_TENANT = 256
_GENERATING = ("sample", "rollout", "rollout_multi")  # the /v1/call methods checked against ServingLimits
# The /v1/call methods that change (or read out) one policy's training state: fenced by the run that owns it.
_POLICY_STATE = (
    "create_policy", "reset_policy", "forward_backward", "optim_step", "update", "save_state", "load_state",
)
# Replies that carry an ErrorReply contain its type tag; only those are decoded to pick a status.
_ERROR_TAG = f"{ErrorReply.__module__}:{ErrorReply.__qualname__}".encode()


class Handler(Protocol):
    """What the app needs from a worker (tinkerless.functions.worker.Worker fits)."""

    def handle(self, method: str, payload: bytes) -> bytes: ...

    def info(self, _request: Any = None) -> dict: ...


def create_app(
    worker_factory_or_worker: Handler | Callable[[], Handler],
    *,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    keys: KeyStore | None = None,
    storage: str | None = None,
    max_pending: int = 1024,
    max_pending_per_tenant: int | None = DEFAULT_MAX_PENDING_PER_TENANT,
    limits: ServingLimits | None = None,
    slice_seconds: float = 0.05,
    tinker_api: bool = True,
    price_per_hour: float | None = None,
    models: dict[str, Handler] | None = None,
) -> FastAPI:
    """A FastAPI app serving one worker (or the worker a zero-argument factory builds, built now).

    With `keys`, every call needs `Authorization: Bearer <key>`; `/healthz` then answers
    only `{"status": "ok"}` to callers without a key (enough for a readiness probe).
    `storage` (an fsspec URL, default: a temporary directory) holds the runs clients drive
    through this server (coordinator state and checkpoints) and Tinker checkpoints, all
    tenant-prefixed. Past `max_pending` queued calls in all, or `max_pending_per_tenant` unfinished
    calls of one tenant, the server answers 429. `limits` (default: `ServingLimits()`) bound what one
    request may generate; `slice_seconds` is how long a generation runs before yielding to others.
    `price_per_hour` prices the server's device-seconds for the keys' budgets (default: the list price of the
    worker's device, `functions/prices.py`; the CPU is free, so budgets on a CPU server need a price).
    `models`: extra base models beside the main one, {id: its Worker}, answering forward and sample (`served_models`).
    """
    worker: Handler = (
        worker_factory_or_worker
        if hasattr(worker_factory_or_worker, "handle")
        else worker_factory_or_worker()  # type: ignore[operator]
    )
    app = FastAPI(title="tinkerless", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker = worker
    served = app.state.served = ServedModels(worker, models)
    app.state.max_request_bytes = max_request_bytes
    limits = limits or ServingLimits()
    app.state.limits = limits
    if hasattr(worker, "policy_guard"):  # a tenant's policies count against its quota
        worker.policy_guard = policy_quota(worker, limits)
    model_free = frozenset(getattr(worker, "MODEL_FREE_METHODS", ()))  # answered at once, off the scheduler
    budgets = None
    price = _server_price(worker, price_per_hour)
    if keys is not None:  # keys' spending, against their budgets (server/budgets.py)
        budgets = KeyBudgets(keys, keys.store, price)
    app.state.budgets = budgets
    hosts_runs = hasattr(worker, "model_name")  # a real Worker (test doubles speak only /v1/call)
    store = ObjectStore(storage or tempfile.mkdtemp(prefix="tinkerless-serve-")) if hosts_runs else None
    # Hosted runs' spending, against their own limits (server/run_budgets.py); the run service fills it in.
    run_budgets = RunBudgets(lambda tenant: store.child(f"tenants/{tenant or '_'}"), lambda tenant, run: None,
                             price) if hosts_runs else None
    scheduler = Scheduler(max_pending=max_pending, max_pending_per_tenant=max_pending_per_tenant,
                          slice_seconds=slice_seconds, budgets=Charges(budgets, run_budgets))
    app.state.scheduler = scheduler
    app.state.flush_spending = lambda: [b.flush() for b in (budgets, run_budgets) if b is not None]
    # Shutdown cancels the generations this app queued for callers that wait on nothing else (the OpenAI routes);
    # training calls run to the end, so a policy is never left half-updated.
    app.state.cancel_jobs = lambda: 0
    stats = ServerStats(scheduler)
    app.state.stats = stats

    def tenant_of(request: Request) -> str | None:
        """The caller's tenant; "" when the server runs without keys, None when the key is bad."""
        if keys is None:
            return ""
        header = request.headers.get("authorization", "")
        key = header[7:].strip() if header.lower().startswith("bearer ") else request.headers.get("x-api-key")
        found = keys.lookup(key)
        # The key the scheduler charges this request's work to (its budget): this request's context only.
        calling_key.set(found[1].key_id if found is not None and found[1] is not None else None)
        return found[0] if found is not None else None

    known_methods = set(getattr(worker, "METHODS", ()))

    @app.post("/v1/call/{method}")
    async def call(method: str, request: Request) -> Response:
        # The path is the caller's: /metrics must not grow a label per made-up name.
        label = method if not known_methods or method in known_methods else "unknown"
        tenant = tenant_of(request)
        if tenant is None:
            return unauthorized()
        try:
            stream, seq = stream_of(request)
        except ProtocolError as exc:
            return error_response(400, exc)
        policies: frozenset[str] = frozenset()
        try:
            target, model_id = served.pick(request, method)  # the main worker, or an extra model's
            body = await read_body(request, max_request_bytes)
            # Every value is checked before anything reads it (the limits below included). `info` ignores its
            # request and unknown methods are refused by the worker: their bodies are never walked.
            decoded = None
            # (A handler that names no methods, a test double, gets its bodies checked only when they are scoped.)
            if method != "info" and (method in known_methods if known_methods else bool(tenant)):
                decoded = validate(decode_message(body))  # the worker validates again, token ids included
            if model_id is not None:
                served.check_request(model_id, decoded)
            if method in _GENERATING and hasattr(target, "chat"):
                await asyncio.to_thread(_check_limits, limits, target, method, decoded)
            if tenant and decoded is not None:  # multi-tenant: every policy name scoped to the caller
                decoded = scope(decoded, tenant_prefix(tenant))
                body = encode_message(decoded)
            if method in _POLICY_STATE:
                policies = _policy_named(method, decoded, body)
        except (LimitExceeded, ModelRefusal) as exc:
            if stream is not None:
                scheduler.skip(tenant, stream, seq)
            stats.count(label, 400)
            return error_response(400, exc)
        except (RequestTooLarge, ProtocolError) as exc:
            if stream is not None:
                scheduler.skip(tenant, stream, seq)  # refused before running: later calls must not wait for it
            stats.count(label, 400 if isinstance(exc, ProtocolError) else 413)  # refusals show in /metrics too
            if isinstance(exc, ProtocolError):
                return error_response(400, exc)
            return error_response(
                413,
                ProtocolError(
                    f"request body of {exc.size} bytes is over this server's limit of {exc.limit} bytes "
                    f"(max_request_bytes)",
                    hint="send smaller batches (fewer tasks or data per call) or start the server with a larger limit",
                ),
            )

        submitted = time.perf_counter()

        def run() -> tuple[bytes, float, float]:
            started = time.perf_counter()  # the scheduler starts the job: what came before was queueing
            with tenant_scope(tenant):  # a tenant's env/reward code runs in that tenant's sandbox (user_code.py)
                return target.handle(method, body), time.perf_counter() - started, started - submitted

        if method in model_free:  # reads no model: never waits behind the queue
            if stream is not None:
                try:
                    scheduler.skip(tenant, stream, seq, refuse_reused=True)
                except SequenceReused as exc:
                    stats.count(label, status_of(exc))
                    return error_response(status_of(exc), exc)
            return _reply(label, tenant, *run())

        served_model.set(model_id)  # the key's usage counts an extra model's seconds under its id
        try:
            future = scheduler.submit(run, tenant=tenant, stream=stream, seq=seq, policies=policies,
                                      charge=label if model_id is None else f"{label} on {model_id}")
        except BudgetExceeded as exc:  # refused before its work: its sequence number must not hold later calls
            if stream is not None:
                scheduler.skip(tenant, stream, seq)
            stats.count(label, 402)
            return error_response(402, exc)
        except QueueFull as full:
            stats.count(label, 429)
            return error_response(
                429,
                ServerBusy(str(full), hint=f"retry after {full.retry_after:.0f}s; HTTPBackend does this by itself"),
                headers={"Retry-After": str(int(round(full.retry_after)))},
            )
        # Shielded: a dropped client must not cancel a call that may be mid-update on the model.
        try:
            reply, compute_seconds, queue_seconds = await asyncio.shield(asyncio.wrap_future(future))
        except TinkerlessError as exc:  # refused by the scheduler (a reused sequence number, a replaced driver)
            stats.count(label, status_of(exc))
            return error_response(status_of(exc), exc)
        return _reply(label, tenant, reply, compute_seconds, queue_seconds)

    def _reply(label: str, tenant: str, reply: bytes, compute_seconds: float, queue_seconds: float = 0.0) -> Response:
        if tenant:
            reply = encode_message(unscope(decode_message(reply), tenant_prefix(tenant)))
        status = _status_for(reply)
        stats.count(label, status)
        # The server's own timing of the function body: what pay-per-use accounting bills.
        headers = {COMPUTE_SECONDS_HEADER: f"{compute_seconds:.6f}", QUEUE_SECONDS_HEADER: f"{queue_seconds:.6f}"}
        return Response(content=reply, status_code=status, media_type=MSGPACK, headers=headers)

    if hosts_runs:
        from tinkerless.server.runs import RunService, make_router

        app.state.runs = RunService(store, worker, fence=scheduler, budgets=run_budgets)
        app.include_router(make_router(app.state.runs, scheduler, tenant_of, max_request_bytes))

        from tinkerless.functions.apis import api_routers
        from tinkerless.server.openai_api import openai_router
        from tinkerless.server.openai_api.serve_backend import ServeBackend

        # The OpenAI API (docs/openai.md): the same keys, tenants, scheduler and limits as the routes above.
        app.state.openai = ServeBackend(worker, scheduler, store, limits=limits, extra_models=list(served.extras))
        app.state.cancel_jobs = app.state.openai.cancel_all
        app.include_router(openai_router(app.state.openai, caller=tenant_of, max_body_bytes=max_request_bytes))
        # Anthropic Messages and OpenAI Responses: the same backend, keys and limits (docs/anthropic-messages.md,
        # docs/responses.md).
        for more in api_routers(app.state.openai, caller=tenant_of, max_body_bytes=max_request_bytes):
            app.include_router(more)

    if tinker_api and hasattr(worker, "model_name"):
        from tinkerless.functions.models import resolve_model
        from tinkerless.server import tinker_api as tinker

        aliases = {resolve_model(worker.model_name)}
        app.state.tinker = tinker.mount(app, worker, scheduler, store, tenant_of, max_request_bytes=max_request_bytes,
                                        aliases=aliases, stats=stats, limits=limits, extras=models)

    app.include_router(served_models_router(served, tenant_of))

    @app.exception_handler(StarletteHTTPException)
    async def no_such_route(request: Request, exc: StarletteHTTPException) -> Response:
        """A path or method no route serves: a typed 4xx in the format of the API the path belongs to."""
        path = request.url.path
        message = f"{request.method} {path[:200]} is not served here ({exc.detail})"
        if path.startswith(("/v1/call/", "/v1/runs/")):  # the msgpack routes answer an ErrorReply envelope
            return error_response(exc.status_code, UserError(message, hint="see docs/serving.md for the routes"))
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        if path.startswith("/v1/"):  # the OpenAI routes' error body
            return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                           "code": code}}, status_code=exc.status_code, headers=exc.headers)
        return JSONResponse({"error": message, "category": "user", "code": code}, status_code=exc.status_code,
                            headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        """The last resort: a bug answers a typed 500 in the route's own format, never a bare one."""
        logger.error("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
        error = TinkerlessError(f"internal error ({type(exc).__name__})", hint="this is a server bug; see the server's log")
        if request.url.path.startswith("/v1/"):  # the msgpack routes answer an ErrorReply envelope
            return error_response(500, error)
        return JSONResponse({"error": f"{error.message} ({error.hint})", "category": "server"}, status_code=500)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if tenant_of(request) is None:
            return JSONResponse({"error": "missing or invalid API key", "category": "user"}, status_code=401)
        return Response(content=stats.prometheus(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/usage")
    async def usage(request: Request) -> Response:
        """What the caller's key spent on this server, what its running calls hold, and its budget."""
        tenant, key_id = tenant_of(request), calling_key.get()
        if tenant is None:
            return unauthorized()
        if budgets is None or key_id is None:
            return JSONResponse({"error": "this server's calls are not metered per key (it runs without API keys, "
                                 "or the key came from its environment)", "category": "user"}, status_code=404)
        return JSONResponse(budgets.usage(key_id))

    @app.get("/healthz")
    async def healthz(request: Request) -> JSONResponse:
        tenant = tenant_of(request)
        if tenant is None:
            return JSONResponse({"status": "ok"})
        info = worker.info()
        if tenant:  # a tenant sees only its own policies
            info = unscope(info, tenant_prefix(tenant))
        return JSONResponse({"status": "ok", "model": info.get("model"), "models": served.ids(),
                             "policies": dict(info.get("policies", {}))})

    return app



def _server_price(worker: Any, price_per_hour: float | None) -> float:
    """The $/hour the keys' budgets are charged at: the one given, else the list price of the worker's device."""
    from tinkerless.functions.prices import PriceTable, check_price

    if price_per_hour is not None:
        return check_price("price_per_hour", price_per_hour)
    try:
        info = worker.info()
        device = str(info.get("device_name") or info.get("device") or "unknown")
    except Exception:  # noqa: BLE001 - a worker that cannot say: its seconds are priced at 0
        return 0.0
    return PriceTable().per_hour(device) or 0.0


def _check_limits(limits: ServingLimits, worker, method: str, request: Any) -> None:
    """Refuse a generating call over the server's limits (string prompts counted as the worker templates them).
    `request` has been validated: a request of another type than the method's is the worker's to refuse."""
    limits.check_call(method, request, lambda text: len(worker.chat.prompt_tokens([{"role": "user", "content": text}])))


def _policy_named(method: str, decoded: Any, body: bytes) -> frozenset[str]:
    """The (tenant-scoped) policy whose state a `_POLICY_STATE` call changes; none for a body the worker
    will refuse anyway (it answers malformed requests with their own typed error)."""
    if decoded is None:
        try:
            decoded = decode_message(body)
        except ProtocolError:
            return frozenset()
    if method == "load_state":
        decoded = getattr(decoded, "state", None)
    name = getattr(decoded, "policy", None)
    return frozenset([name]) if isinstance(name, str) else frozenset()


def _status_for(reply: bytes) -> int:
    if _ERROR_TAG not in reply:
        return 200
    try:
        body = decode_message(reply)
    except Exception:
        return 500  # the worker always encodes valid envelopes; anything else is the server's fault
    if isinstance(body, ErrorReply):
        if body.cause:  # an infrastructure failure (a judge, env server or sandbox the call needed): retry it
            return 503
        return 400 if body.category == "user" else 500
    return 200
