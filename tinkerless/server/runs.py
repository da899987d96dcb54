"""Runs hosted by the server: the coordinator and the checkpoints of every tenant's runs.

    POST /v1/runs/call/{method}      a coordinator call (`RunCall` -> `RunReply`)
    POST /v1/runs/list               the caller's runs (`RunListRequest` -> `RunList`)
    POST /v1/runs/checkpoint/save    save a step (`SaveCheckpointRequest` -> `RunReply`)
    POST /v1/runs/checkpoint/restore load the latest step (`RestoreCheckpointRequest` -> `RestoredCheckpoint`)

Each tenant's runs live under ``tenants/<tenant>/runs/<run_id>/`` in the server's
storage (`ObjectStore.child`), so a run id names a run only within its tenant. Open
coordinators stay in memory, which is what lets a barrier wait here; after a restart
they are reopened from ``state.json`` on first use. Checkpoint calls read and load the
worker's adapters, so they run on the model's scheduler, in the client's call order.

The fence: the worker policies a run checkpoints belong to its driver's call stream
(`Scheduler.bind`), from its saves and restores on, and pass to the next client as soon as
it opens the run (takeover). So after a takeover, or a restore, no call the earlier
driver sent (queued, held behind a gap, or sent late) can change them: it gets a 409.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tinkerless.coordinator import Coordinator, checkpoint_prefix, list_runs
from tinkerless.coordinator.policy_checkpoints import restore_policies, save_policies
from tinkerless.coordinator.state import state_key, validate_run_id
from tinkerless.errors import (
    BarrierTimeout, CommitConflict, PhaseError, ProtocolError, ServerBusy, TinkerlessError, UserError,
)
from tinkerless.wire.http import RequestTooLarge, read_body
from tinkerless.server.run_budgets import LIMITS, RunBudgets, check_run_limits
from tinkerless.server.replies import Redactor, error_response, status_of, stream_of, unauthorized
from tinkerless.server.scheduler import QueueFull, Scheduler
from tinkerless.server.tenancy import tenant_prefix
from tinkerless.storage import CheckpointStore, ObjectStore
from tinkerless.wire import decode_message, encode_message
from tinkerless.wire.http import COMPUTE_SECONDS_HEADER, MSGPACK, STREAM_HEADER
from tinkerless.wire.run_calls import run_call_args
from tinkerless.wire.validate import validate
from tinkerless.wire.messages import LoadStateRequest, PolicyState, ResetPolicyRequest, SaveStateRequest
from tinkerless.wire.runs import (
    CheckpointPolicy,
    RestoreCheckpointRequest,
    RunCall,
    RunList,
    RunListRequest,
    RunReply,
    SaveCheckpointRequest,
)

logger = logging.getLogger(__name__)

LONG_POLL_SECONDS = 20.0  # a barrier wait answers within this; the client asks again until its own timeout

@dataclass
class _Hosted:
    coordinator: Coordinator
    lease: str
    limits: dict | None = None  # the budget its driver opened it with, until its config (on resume) restates it


class RunService:
    """The coordinators and checkpoints of the runs that clients drive through this server."""

    def __init__(
        self, store: ObjectStore, worker: Any, *, long_poll: float = LONG_POLL_SECONDS, fence: Scheduler | None = None,
        budgets: RunBudgets | None = None,
    ):
        self.store = store
        self.worker = worker
        self.fence = fence  # the scheduler whose `bind` gives a run's policies to its current driver
        self.budgets = budgets  # each run's own limits, charged with its driver's calls (server/run_budgets.py)
        if budgets is not None:
            budgets.limits_of = self.limits
        self.long_poll = long_poll
        self._hosted: dict[tuple[str, str], _Hosted] = {}
        # Each run's worker policies (tenant-scoped), learned from its saves and restores; kept past
        # `finish`, since a finished run can be resumed to train on.
        self._policies: dict[tuple[str, str], set[str]] = {}
        self._lock = threading.Lock()
        self.redact = Redactor(store.url)

    def tenant_store(self, tenant: str) -> ObjectStore:
        return self.store.child(f"tenants/{tenant or '_'}")

    # -- coordinator calls ---------------------------------------------------------------

    def call(self, tenant: str, method: str, request: RunCall, stream: str | None = None) -> RunReply:
        """Coordinator call `method`; `stream` is the caller's call stream (its worker calls' X-Tinkerless-Stream)."""
        run_id = validate_run_id(request.run_id)
        run_call_args(method, request.args)
        store = self.tenant_store(tenant)
        if method in ("create", "reset_to_checkpoint"):  # the run's own budget, held here: checked at the boundary
            check_run_limits(request.args.get("config"))
        if method == "open":
            check_run_limits(request.args.get("limits"), where="limits")
        if method in ("create", "open"):
            if method == "create":
                coordinator = Coordinator.create(store, run_id, request.args.get("config") or {})
            else:
                coordinator = Coordinator.open(store, run_id)
            lease = uuid.uuid4().hex  # whoever opened last drives the run
            with self._lock:
                self._hosted[(tenant, run_id)] = _Hosted(coordinator, lease, request.args.get("limits"))
            # A takeover: the earlier driver's calls that are still queued or on their way can no longer
            # change the run's policies (its restore comes next, and resets them).
            self._bind(tenant, run_id, stream, ())
            if self.budgets is not None:  # the driver's calls on the model are charged to this run from now on
                self.budgets.drive(tenant, stream, run_id)
            return RunReply(coordinator.state.to_dict(), lease)
        if method == "state":
            with self._lock:
                hosted = self._hosted.get((tenant, run_id))
            state = hosted.coordinator.state if hosted else Coordinator.open(store, run_id).state
            return RunReply(state.to_dict())
        hosted = self._driver(tenant, run_id, request.lease)
        coordinator = hosted.coordinator
        try:
            if method == "wait_rollouts":
                return self._wait(coordinator, hosted.lease, **request.args)
            getattr(coordinator, method)(**request.args)
            if method == "reset_to_checkpoint" and request.args.get("config") is not None:
                hosted.limits = None  # the resumed config's budget is the run's now
        except TypeError as exc:  # a missing argument, or a value of the wrong kind, from a hand-made request
            raise UserError(f"bad arguments for {method}: {exc}") from exc
        if method == "finish":  # a finished run needs no barrier any more; reopened on demand
            with self._lock:
                self._hosted.pop((tenant, run_id), None)
        return RunReply(coordinator.state.to_dict(), hosted.lease)

    def limits(self, tenant: str, run_id: str) -> dict | None:
        """The run's own budget as its config (the latest create or resume) set it, or None when it is not open."""
        with self._lock:
            hosted = self._hosted.get((tenant, run_id))
        if hosted is None:
            return None
        given = hosted.limits if hosted.limits is not None else hosted.coordinator.state.config
        return {name: given.get(name) for name in LIMITS}

    def _wait(self, coordinator: Coordinator, lease: str, step: int, timeout: float | None = None) -> RunReply:
        """One poll of the barrier: `done=False` when it is still open after the poll; the client,
        which knows its own deadline, decides whether to poll again or give up."""
        poll = self.long_poll if timeout is None else min(float(timeout), self.long_poll)
        try:
            coordinator.wait_rollouts(step, timeout=poll)
        except BarrierTimeout:
            return RunReply(coordinator.state.to_dict(), lease, done=False)
        return RunReply(coordinator.state.to_dict(), lease)

    def _driver(self, tenant: str, run_id: str, lease: str | None) -> _Hosted:
        """The open run that `lease` drives; a stale lease means another client took the run over."""
        if not lease:
            raise ProtocolError("this run call needs the lease from create or open", hint="open the run first")
        with self._lock:
            hosted = self._hosted.get((tenant, run_id))
            if hosted is None:  # the server restarted (or the run finished): reopen from storage
                hosted = _Hosted(Coordinator.open(self.tenant_store(tenant), run_id), lease)
                self._hosted[(tenant, run_id)] = hosted
        if hosted.lease != lease:
            raise CommitConflict(
                f"run {run_id!r} was opened by another client, which now drives it",
                hint="two clients are running the same run id; stop one, then resume the run from its checkpoint",
            )
        return hosted

    def _bind(self, tenant: str, run_id: str, stream: str | None, policies: list[CheckpointPolicy]) -> None:
        """Give the run's policies (those known, and `policies`) to the driver's `stream`. A driver that
        sends no stream id (a hand-made client) cannot be told from another one, so it gets no fence."""
        with self._lock:
            known = self._policies.setdefault((tenant, run_id), set())
            known.update(_on_worker(tenant, p) for p in policies)
            known = set(known)
        if self.fence is not None and stream is not None:
            self.fence.bind(tenant, stream, known)

    def list(self, tenant: str, request: RunListRequest) -> RunList:
        runs = list_runs(self.tenant_store(tenant))
        return RunList([r.to_dict() for r in runs if request.name is None or r.config.get("name") == request.name])

    # -- checkpoints (on the scheduler's thread: they touch the worker) ------------------

    def save_checkpoint(self, tenant: str, request: SaveCheckpointRequest, stream: str | None = None) -> RunReply:
        hosted = self._driver(tenant, validate_run_id(request.run_id), request.lease)
        self._bind(tenant, request.run_id, stream, request.policies)

        def read(policy: CheckpointPolicy) -> dict[str, bytes]:
            return self.worker.save_state(SaveStateRequest(_on_worker(tenant, policy), True)).files

        at = hosted.coordinator.state.step
        if request.step > at:  # refused before anything is written: a checkpoint the run could not name
            raise PhaseError(f"cannot save a checkpoint for step {request.step}: run {request.run_id!r} is at step {at}",
                             hint="save the step whose update was committed (0 <= step <= current step)")
        checkpoints = self._checkpoints(tenant, request.run_id, request.keep_last)
        save_policies(checkpoints, request.step, request.policies, read, request.files, request.metadata)
        hosted.coordinator.record_checkpoint(request.step)  # the run's state names its checkpoint at once
        return RunReply(hosted.coordinator.state.to_dict(), hosted.lease)

    def restore_checkpoint(self, tenant: str, request: RestoreCheckpointRequest, stream: str | None = None):
        validate_run_id(request.run_id)
        if request.lease is not None:  # the run's driver resuming it; without a lease, a read (eval)
            # Bound before the reset: the earlier driver's calls still queued are refused, not run after it.
            self._driver(tenant, request.run_id, request.lease)
            self._bind(tenant, request.run_id, stream, request.policies)
        elif not self.tenant_store(tenant).exists(state_key(request.run_id)):
            raise UserError(f"run {request.run_id!r} does not exist on this server", hint="see `tinkerless runs --server URL`")

        def load(policy: CheckpointPolicy, files: dict[str, bytes], version: int) -> None:
            self.worker.load_state(LoadStateRequest(PolicyState(_on_worker(tenant, policy), files, version), True))

        def reset(policy: CheckpointPolicy) -> None:
            self.worker.reset_policy(ResetPolicyRequest(_on_worker(tenant, policy), missing_ok=True))

        checkpoints = self._checkpoints(tenant, request.run_id, request.keep_last)
        reader = request.lease is None  # eval: nothing to reset when the run has no checkpoint
        restored = restore_policies(checkpoints, request.policies, request.client_files, load,
                                    None if reader else reset, request.step)
        restored.warnings = [self.redact(message) for message in restored.warnings]
        return restored

    def _checkpoints(self, tenant: str, run_id: str, keep_last: int | None) -> CheckpointStore:
        return CheckpointStore(self.tenant_store(tenant), checkpoint_prefix(run_id), keep_last=keep_last)


def _on_worker(tenant: str, policy: CheckpointPolicy) -> str:
    """The worker's name for a tenant's policy, as /v1/call scopes it."""
    return tenant_prefix(tenant) + policy.worker_policy if tenant else policy.worker_policy


def make_router(
    service: RunService,
    scheduler: Scheduler,
    tenant_of: Callable[[Request], str | None],
    max_request_bytes: int,
) -> APIRouter:
    router = APIRouter()
    # Coordinator calls never touch the model, and a barrier wait may block: their own threads.
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="tinkerless-runs")

    async def answer(
        request: Request, expected: type, run: Callable[[str, Any, str | None], Any], ordered: bool
    ) -> Response:
        tenant = tenant_of(request)
        if tenant is None:
            return unauthorized()
        stream = seq = None
        try:
            if ordered:
                stream, seq = stream_of(request)
            else:  # coordinator calls carry the caller's stream id too (no number: they skip the queue)
                stream = request.headers.get(STREAM_HEADER)
                if stream is not None and not 0 < len(stream) <= 128:
                    raise ProtocolError(f"invalid {STREAM_HEADER} (of {len(stream)} characters)",
                                        hint="a stream id is 1-128 characters")
            body = decode_message(await read_body(request, max_request_bytes))
            if not isinstance(body, expected):
                raise ProtocolError(
                    f"expected a {expected.__name__}, got {type(body).__name__}", hint="use the matching client version"
                )
            validate(body)
        except RequestTooLarge as exc:
            if ordered and stream is not None:
                scheduler.skip(tenant, stream, seq)
            return error_response(413, ProtocolError(f"request body of {exc.size} bytes is over the limit of {exc.limit}"))
        except ProtocolError as exc:
            if ordered and stream is not None and seq is not None:
                scheduler.skip(tenant, stream, seq)
            return error_response(400, exc, redact=service.redact)
        def timed() -> tuple[Any, float]:
            started = time.perf_counter()
            return run(tenant, body, stream), time.perf_counter() - started

        try:
            if ordered:
                future = scheduler.submit(timed, tenant=tenant, stream=stream, seq=seq)
            else:
                future = pool.submit(timed)
            # Shielded: a dropped client must not cancel a checkpoint half-written.
            reply, seconds = await asyncio.shield(asyncio.wrap_future(future))
        except QueueFull as full:
            return error_response(
                429, ServerBusy(str(full)), headers={"Retry-After": str(int(round(full.retry_after)))}
            )
        except TinkerlessError as exc:
            return error_response(status_of(exc), exc, redact=service.redact)
        except Exception as exc:  # a bug here, not the caller's: say so (without the server's paths), keep the server up
            logger.exception("run call failed")
            error = TinkerlessError(f"internal error ({type(exc).__name__})", hint="this is a server bug; see the server's log")
            return error_response(500, error)
        headers = {COMPUTE_SECONDS_HEADER: f"{seconds:.6f}"} if ordered else None  # checkpoints are billed work
        return Response(content=encode_message(reply), media_type=MSGPACK, headers=headers)

    @router.post("/v1/runs/call/{method}")
    async def run_call(method: str, request: Request) -> Response:
        return await answer(request, RunCall, lambda tenant, body, stream: service.call(tenant, method, body, stream),
                            ordered=False)

    @router.post("/v1/runs/list")
    async def run_list(request: Request) -> Response:
        return await answer(request, RunListRequest, lambda tenant, body, _: service.list(tenant, body), ordered=False)

    @router.post("/v1/runs/checkpoint/save")
    async def save(request: Request) -> Response:
        return await answer(request, SaveCheckpointRequest, service.save_checkpoint, ordered=True)

    @router.post("/v1/runs/checkpoint/restore")
    async def restore(request: Request) -> Response:
        return await answer(request, RestoreCheckpointRequest, service.restore_checkpoint, ordered=True)

    return router
