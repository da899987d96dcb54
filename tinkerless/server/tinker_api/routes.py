"""FastAPI routes of the Tinker API (`/api/v1/...`), as the official `tinker` SDK 0.38 calls them.

Auth is the SDK's `X-API-Key` header, checked against the server's key store
(keys start with `tml-`, which the SDK insists on). Submissions answer with a
future (`{request_id, ...}`); `retrieve_future` long-polls up to `POLL_SECONDS`
and then answers 408, which the SDK re-polls quietly. Results the SDK expects as
protobuf (forward_backward, sample) go out as `application/x-protobuf`; failures
go out as `{error, category}`, which the SDK raises as `RequestFailedError`.
"""

from __future__ import annotations

import asyncio
import json
import math
import logging
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from tinkerless.errors import BudgetExceeded, TinkerlessError
from tinkerless.wire.http import RequestTooLarge, read_body
from tinkerless.server.replies import Redactor
from tinkerless.server.scheduler import QueueFull
from tinkerless.server.tinker_api.service import Proto, TinkerService

logger = logging.getLogger(__name__)
POLL_SECONDS = 25.0  # under the SDK's 45 s poll timeout
PROTOBUF = "application/x-protobuf"


class NotFound(Exception):
    """A run, sampler or checkpoint that does not exist for this tenant (404; never says whose it is)."""


def _error(status: int, message: str, category: str = "user", hint: str | None = None) -> JSONResponse:
    text = f"{message} ({hint})" if hint else message
    return JSONResponse({"error": text, "category": category}, status_code=status)


def _failure(exc: BaseException) -> dict:
    if isinstance(exc, TinkerlessError):
        text = f"{exc.message} ({exc.hint})" if getattr(exc, "hint", None) else exc.message
        return {"error": text, "category": exc.category}
    logger.exception("tinker request failed", exc_info=exc)
    return {"error": f"{type(exc).__name__}: {exc}", "category": "server"}


def make_router(service: TinkerService, tenant_of, max_request_bytes: int, stats=None) -> APIRouter:
    """`tenant_of(request)` gives the caller's tenant ("" without auth) or None for a bad key.
    With `stats` (the server's `ServerStats`), every answer is counted in `/metrics`."""
    router = APIRouter(prefix="/api/v1")
    redact = Redactor(service.registry.store.url)  # errors name checkpoints by key, never by the server's path

    async def call(request: Request, handler, *, raw: bool = False) -> Response:
        response = await _answer(request, handler, raw=raw)
        if stats is not None:
            stats.count("tinker:" + request.url.path.rsplit("/api/v1/", 1)[-1].split("/")[0], response.status_code)
        return response

    async def _answer(request: Request, handler, *, raw: bool = False) -> Response:
        tenant = tenant_of(request)
        if tenant is None:
            return _error(401, "missing or invalid API key",
                          hint="set TINKER_API_KEY to a key from `tinkerless keys create --tenant NAME`")
        try:
            body = await read_body(request, max_request_bytes)
        except RequestTooLarge as too_large:
            return _error(413, f"request body of {too_large.size} bytes is over this server's limit of {too_large.limit}",
                          hint="send smaller batches, or start the server with a larger --max-request-bytes")
        except TinkerlessError as exc:
            return _error(400, exc.message, hint=exc.hint)
        try:
            payload: Any = body if raw else parse_json_object(body)
            result = handler(tenant, payload)
        except NotFound as missing:
            return _error(404, f"not found: {missing}")
        except QueueFull as full:
            return JSONResponse({"error": str(full), "category": "server"}, status_code=429,
                                headers={"Retry-After": str(int(round(full.retry_after)))})
        except BudgetExceeded as exc:  # the key's budget: refused before any work; the SDK is told not to retry
            response = _error(402, exc.message, "user", exc.hint)
            response.headers["x-should-retry"] = "false"
            return response
        except (KeyError, TypeError, ValueError, OverflowError) as exc:  # a field missing or of the wrong kind
            return _error(400, f"malformed request: {type(exc).__name__}: {str(exc)[:300]}")
        except TinkerlessError as exc:
            return _error(400 if exc.category == "user" else 500, redact(exc.message), exc.category,
                          redact(getattr(exc, "hint", None)))
        return JSONResponse(result)

    def route(path: str, handler, *, raw: bool = False, method: str = "post"):
        async def endpoint(request: Request) -> Response:
            return await call(request, handler, raw=raw)

        getattr(router, method)(path)(endpoint)

    # -- client and session --------------------------------------------------------
    route("/client/config", lambda t, b: {"pjwt_auth_enabled": False, "use_pyqwest_transport": False,
                                          "parallel_fwdbwd_chunks": True, "proto_compress_fwdbwd": False})
    route("/client/dynamic_config", lambda t, b: {"refresh_interval_sec": 300, "sample_cancel_enabled": False})
    route("/create_session", service.create_session)
    route("/session_heartbeat", lambda t, b: (service.session(t, b["session_id"]), {"type": "session_heartbeat"})[1])
    route("/telemetry", lambda t, b: {"status": "accepted"})

    @router.post("/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request) -> Response:
        return await call(request, lambda t, b: (service.session(t, session_id).update(alive=False), {})[1])

    @router.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @router.get("/get_server_capabilities")
    async def capabilities(request: Request) -> Response:
        extras = sorted({model_id for model_id, _ in service.extra_workers.values()})  # sampled, never trained
        return await call(request, lambda t, b: {"supported_models": [
            {"model_name": service.base_model, "trainable": True, "sampleable": True},
            *({"model_name": name, "trainable": False, "sampleable": True} for name in extras)]})

    # -- training -----------------------------------------------------------------------
    route("/create_model", service.create_model)
    route("/get_info", service.get_info)
    route("/forward_backward", service.forward_backward, raw=True)
    route("/optim_step", service.optim_step)
    route("/save_weights", service.save_weights)
    route("/save_weights_for_sampler", service.save_weights_for_sampler)
    route("/load_weights", service.load_weights)

    # -- sampling --------------------------------------------------------------------------
    route("/create_sampling_session", service.create_sampling_session)
    route("/asample", service.sample)

    @router.get("/samplers/{sampler_id}")
    async def sampler(sampler_id: str, request: Request) -> Response:
        return await call(request, lambda t, b: _found(lambda: service.get_sampler(t, sampler_id)))

    # -- futures -----------------------------------------------------------------------------
    @router.post("/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        tenant = tenant_of(request)
        if tenant is None:
            return _error(401, "missing or invalid API key")
        try:
            body = parse_json_object(await read_body(request, max_request_bytes))
            request_id = body["request_id"]
            if not isinstance(request_id, str):
                raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
        except RequestTooLarge as too_large:
            return _error(413, f"request body of {too_large.size} bytes is over this server's limit of {too_large.limit}")
        except (TinkerlessError, KeyError, TypeError, ValueError) as exc:
            return _error(400, f"malformed retrieve_future request: {getattr(exc, 'message', None) or exc!r}"[:400],
                          hint='send {"request_id": "<id from the call>"}')
        try:
            future = service.future(tenant, request_id)
        except KeyError:
            return _error(404, f"unknown request id {request_id[:128]!r}")
        try:
            result = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), POLL_SECONDS)
        except asyncio.TimeoutError:
            return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"},
                                status_code=408)
        except Exception as exc:  # noqa: BLE001 - the call failed: the SDK gets a typed failure
            failure = _failure(exc)
            return JSONResponse({**failure, "error": redact(failure["error"])})
        if isinstance(result, Proto):
            return Response(result.data, media_type=PROTOBUF)
        return JSONResponse(result)

    # -- training runs and checkpoints -----------------------------------------------------------
    @router.get("/training_runs")
    async def training_runs(request: Request) -> Response:
        def listing(t, b):
            runs = service.training_runs(t)
            limit = int(request.query_params.get("limit", 20))
            offset = int(request.query_params.get("offset", 0))
            return {"training_runs": runs[offset: offset + limit],
                    "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)}}

        return await call(request, listing)

    @router.get("/training_runs/{run_id}")
    async def training_run(run_id: str, request: Request) -> Response:
        return await call(request, lambda t, b: _found(lambda: service.training_run(t, run_id)))

    @router.get("/training_runs/{run_id}/checkpoints")
    async def checkpoints(run_id: str, request: Request) -> Response:
        return await call(request, lambda t, b: {"checkpoints": _found(lambda: service.checkpoints(t, run_id))})

    @router.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}")
    async def delete_checkpoint(run_id: str, kind: str, name: str, request: Request) -> Response:
        def delete(t, b):
            if not service.delete_checkpoint(t, run_id, kind, name):
                raise NotFound(f"tinker://{run_id}/{kind}/{name}")
            return {}

        return await call(request, delete)

    from tinkerless.server.tinker_api.rest import RestSurface, add_catch_all, add_routes

    add_routes(router, call, RestSurface(service), _found)
    add_catch_all(router)  # last: it matches every path
    return router


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses to inf, which no field accepts
        raise ValueError(f"number {text[:32]} is out of range")
    return value


def parse_json_object(body: bytes) -> dict:
    """A request body as a JSON object: empty is {}, anything but an object (a list, null, a number),
    non-finite numbers or a nesting too deep to parse are a ValueError (HTTP 400)."""
    if not body:
        return {}
    try:
        value = json.loads(body, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise ValueError("the JSON body is nested too deeply") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"the body is not UTF-8 JSON ({exc.reason})") from None
    if not isinstance(value, dict):
        raise ValueError(f"the body must be a JSON object, got {type(value).__name__}")
    return value


def _found(fn):
    try:
        return fn()
    except KeyError as exc:
        raise NotFound(exc.args[0]) from None
