"""The Tinker service: sessions, training models, samplers and futures over one tinkerless Worker.

Framework-free (the FastAPI routes in `routes.py` are thin glue). Every call that
touches the model is a job on the shared `Scheduler`: a training model's calls
form one stream ordered by the SDK's `seq_id`; tenants take turns.

Ids follow the hosted service: sessions `sess-<hex>`, training models (= training
runs) `<session>:train:<n>`, samplers `<session>:sample:<n>`, checkpoints
`tinker://<run>/weights/<name>` and `tinker://<run>/sampler_weights/<name>`.

The calls themselves live by responsibility: `training_calls` (training models), `sampling_calls`
(samplers and `asample`); this module holds what they share (sessions, futures, the model
registry) and the run and checkpoint listings.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import secrets
import threading
import time
from collections import OrderedDict
from typing import Any, Callable

from tinkerless.errors import BudgetExceeded, UserError
from tinkerless.server.limits import ServingLimits
from tinkerless.server.scheduler import Scheduler
from tinkerless.server.tinker_api.checkpoints import CheckpointRegistry, TinkerPath, now_iso
from tinkerless.server.tinker_api.records import Proto, Sampler, TrainingModel, public_checkpoint
from tinkerless.server.tinker_api.sampling_calls import SamplingCalls
from tinkerless.server.tinker_api.training_calls import STALE_SESSION_SECONDS, TrainingCalls

FUTURE_TTL = 3600.0  # seconds a finished result stays retrievable

__all__ = ["FUTURE_TTL", "Proto", "Sampler", "TinkerService", "TrainingModel"]


class TinkerService(TrainingCalls, SamplingCalls):
    """The Tinker API over one worker: each method takes the caller's tenant and the request body and answers
    the SDK's reply, or a future id whose result `retrieve_future` collects."""

    def __init__(
        self, worker, scheduler: Scheduler, registry: CheckpointRegistry, *, aliases: set[str],
        limits: ServingLimits | None = None, extras: dict | None = None,
    ):
        self.worker = worker
        self.scheduler = scheduler
        self.registry = registry
        from tinkerless.functions.models import model_aliases, public_model_id

        # Clients see the Hub id (their tokenizer loads from it); the short aliases are accepted too.
        self.base_model = public_model_id(worker.model_name)
        self.aliases = aliases | model_aliases(worker.model_name)
        # The server's extra base models (`served_models`): a sampling client's base model, never a training one.
        self.extra_workers = {name: (public_model_id(spec), extra) for spec, extra in (extras or {}).items()
                              for name in model_aliases(spec)}
        self.limits = limits or ServingLimits()
        self._lock = threading.Lock()
        self.sessions: dict[str, dict] = {}
        self.models: dict[str, TrainingModel] = {}
        self.freed_models: dict[str, str] = {}  # model id -> tenant, for models of stale sessions freed for room
        self.samplers: dict[str, Sampler] = {}
        self._ephemeral: dict[str, list[str]] = {}  # model id -> its ephemeral sampler ids, oldest first
        self._slots: OrderedDict[str, str] = OrderedDict()  # snapshot key -> worker policy, LRU order
        self._slots_in_use: dict[str, int] = {}  # slot -> samples using it (paused between slices, too)
        self.futures: dict[str, tuple[str, concurrent.futures.Future, float]] = {}
        self._ids = itertools.count(1)
        self._sequence_ids = itertools.count()

    # -- sessions -------------------------------------------------------------------

    def create_session(self, tenant: str, body: dict) -> dict:
        session_id = f"sess-{secrets.token_hex(8)}"
        with self._lock:
            self.sessions[session_id] = {"tenant": tenant, "tags": body.get("tags") or [], "alive": True,
                                         "user_metadata": body.get("user_metadata"), "display_name": body.get("display_name"),
                                         "seen": time.monotonic()}
        return {"session_id": session_id, "type": "create_session"}

    def session(self, tenant: str, session_id: str) -> dict:
        record = self.sessions.get(session_id)
        if record is None or record["tenant"] != tenant:
            raise UserError(f"unknown session {session_id!r}", hint="create a new ServiceClient")
        record["seen"] = time.monotonic()  # the SDK heartbeats every 10 s: a silent session's client is gone
        return record

    # -- futures --------------------------------------------------------------------

    def submit(
        self, tenant: str, fn: Callable[[], Any], *, stream: str | None = None, seq: int | None = None, **extra
    ) -> dict:
        try:
            future = self.scheduler.submit(fn, tenant=tenant, stream=stream, seq=seq, charge="tinker")
        except BudgetExceeded:  # refused before its work: a later call of the stream must not wait for its number
            if stream is not None and isinstance(seq, int):
                self.scheduler.skip(tenant, stream, seq)
            raise
        request_id = f"req-{next(self._ids)}-{secrets.token_hex(6)}"
        with self._lock:
            self._expire_futures()
            self.futures[request_id] = (tenant, future, time.monotonic())
        return {"request_id": request_id, **extra}

    def future(self, tenant: str, request_id: str) -> concurrent.futures.Future:
        entry = self.futures.get(request_id)
        if entry is None or entry[0] != tenant:
            raise KeyError(request_id)
        return entry[1]

    def _expire_futures(self) -> None:
        cutoff = time.monotonic() - FUTURE_TTL
        for rid in [r for r, (_, f, t) in self.futures.items() if f.done() and t < cutoff]:
            del self.futures[rid]

    # -- training models ------------------------------------------------------------------

    def _check_base_model(self, base_model: str | None) -> None:
        if base_model in self.extra_workers:
            raise UserError(f"model {base_model!r} is served here for sampling and log-probs only, not training",
                            hint=f"create a sampling client on it; train on {self.base_model!r} (the server's --model)")
        if base_model is not None and base_model not in self.aliases:
            raise UserError(
                f"this server serves {self.base_model!r}, not {base_model!r}",
                hint=f"pass base_model={self.base_model!r} (the server's --model), or start a server for that model",
            )

    def model(self, tenant: str, model_id: str) -> TrainingModel:
        model = self.models.get(model_id)
        if model is None or model.tenant != tenant:
            if self.freed_models.get(model_id) == tenant:
                raise UserError(
                    f"model {model_id!r} was freed: its session sent no heartbeat for {STALE_SESSION_SECONDS:.0f} s "
                    "while its tenant needed room for a new model",
                    hint="load its last saved checkpoint into a new training client (create_training_client_from_state)",
                )
            raise UserError(f"unknown model {model_id!r}", hint="create it with create_lora_training_client first")
        model.last_request_time = now_iso()
        return model

    # -- runs and checkpoints ------------------------------------------------------------------

    def training_run(self, tenant: str, run_id: str) -> dict:
        model = self.models.get(run_id)
        if model is not None and model.tenant == tenant:
            return model.record()
        record = self.registry.load_run(tenant, run_id)
        if record is None:
            raise KeyError(run_id)
        return record

    def training_runs(self, tenant: str) -> list[dict]:
        stored = {r["training_run_id"]: r for r in self.registry.list_runs(tenant)}
        for model in list(self.models.values()):  # a copy: other threads register models
            if model.tenant == tenant:
                stored[model.model_id] = model.record()
        return sorted(stored.values(), key=lambda r: r.get("created_at", ""))

    def checkpoints(self, tenant: str, run_id: str) -> list[dict]:
        self.training_run(tenant, run_id)  # KeyError for someone else's or an unknown run
        return [public_checkpoint(m) for m in self.registry.list(tenant, run_id)]

    def delete_checkpoint(self, tenant: str, run_id: str, kind: str, name: str) -> bool:
        return self.registry.delete(tenant, TinkerPath.parse(f"tinker://{run_id}/{kind}/{name}"))
