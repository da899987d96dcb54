"""The base models one `tinkerless serve` holds: its main one, and extra ones beside it (`--also-model ID`).

The main model is the one tenants train on (their adapters, hosted runs, the Tinker and OpenAI APIs). Each extra
model is a `Worker` of its own, loaded at start, that answers `forward` (log-probs) and `sample` on its base
weights (and a Tinker sampling client's `sample` / `compute_logprobs`, `tinker_api.sampling_calls`): a teacher for on-policy distillation of another base (docs/distillation.md), or a second sampler. A
`/v1/call/{method}` names one with the `X-Tinkerless-Model` header; that call then goes through everything a call
on the main model does (the key, validation, the serving limits, the one scheduler: the device runs one call at a
time, tenants taking turns, and the key's and the run's budgets), and its seconds are also counted under the
model's id in the key's usage (`budgets.served_model`, set by the app for the call).

    GET /v1/served-models[?model=NAME]          {"main": ID, "models": [{"id", "main", "vocab_size", "methods"}]}
                                                (with NAME: also "model", the id it names; 404 if none)
    GET /v1/served-models/tokenizer?model=ID    msgpack {"model": ID, "files": {name: bytes}}

The tokenizer route sends the tokenizer files the server loaded for that model, so a client aligns a teacher of
another vocabulary with exactly the tokenizer that scores it: no model download on the client (which may have
no hub access, or a path that exists only on the server), and no version skew between two copies.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tinkerless.errors import UserError
from tinkerless.functions.companions.tokenizer_files import tokenizer_files
from tinkerless.functions.models import model_aliases, public_model_id
from tinkerless.server.replies import error_response, unauthorized
from tinkerless.wire import encode_message
from tinkerless.wire.http import MODEL_HEADER, MSGPACK
from tinkerless.wire.messages import BASE_POLICY

EXTRA_METHODS = ("info", "forward", "sample")  # what an extra model answers: log-probs and sampling on its base
MAX_NAME_CHARS = 1000


class ModelRefusal(UserError):
    """A call this server's models cannot answer as addressed (HTTP 400 on /v1/call)."""


class UnknownModel(ModelRefusal):
    """A call named a model this server does not hold (HTTP 404 on the tokenizer route, 400 on /v1/call)."""


@dataclass
class ServedModel:
    id: str  # as the server was started with it (a Hub id, an alias, a directory)
    worker: Any
    main: bool
    names: frozenset[str]  # every name a client may use for it (`functions.models.model_aliases`)
    _tokenizer_files: dict[str, bytes] | None = field(default=None, repr=False)


class ServedModels:
    """The main worker and the extra ones, by the names clients use for them."""

    def __init__(self, main: Any, extras: dict[str, Any] | None = None):
        main_id = getattr(main, "model_name", None)
        self.main = ServedModel(public_model_id(main_id) if main_id else "main", main, True,
                                frozenset(model_aliases(main_id)) if main_id else frozenset())
        self.extras: dict[str, ServedModel] = {}
        for spec, worker in (extras or {}).items():
            names = frozenset(model_aliases(spec))
            clash = [m.id for m in (self.main, *self.extras.values()) if m.names & names]
            if clash:
                raise UserError(f"model {spec!r} is served twice (it is also {clash[0]!r})",
                                hint="name each model once: the main one with --model, the others with --also-model")
            self.extras[spec] = ServedModel(public_model_id(spec), worker, False, names)
        self._lock = threading.Lock()

    def ids(self) -> list[str]:
        return [self.main.id, *(m.id for m in self.extras.values())]

    def find(self, name: Any) -> ServedModel:
        """The model a client named; `UnknownModel` naming the ones served."""
        if isinstance(name, str) and 0 < len(name) <= MAX_NAME_CHARS:
            for model in (self.main, *self.extras.values()):
                if name.strip() in model.names:
                    return model
        shown = repr(name[:200]) if isinstance(name, str) else repr(type(name).__name__)
        raise UnknownModel(f"this server does not hold model {shown}; it serves {', '.join(map(repr, self.ids()))}",
                           hint="name one of those (GET /healthz lists them), or start the server with "
                           "`tinkerless serve --also-model ID` to hold another")

    def pick(self, request: Request, method: str) -> tuple[Any, str | None]:
        """(the worker a /v1/call runs on, the extra model's id or None for the main one), from its header."""
        name = request.headers.get(MODEL_HEADER)
        if name is None:
            return self.main.worker, None
        model = self.find(name)
        if model.main:
            return model.worker, None
        if method not in EXTRA_METHODS:
            raise ModelRefusal(f"model {model.id!r} on this server answers {', '.join(EXTRA_METHODS)} only, not {method[:64]!r}",
                            hint=f"training, rollouts and adapters run on its main model {self.main.id!r} "
                            f"(send no {MODEL_HEADER} header)")
        return model.worker, model.id

    @staticmethod
    def check_request(model_id: str, request: Any) -> None:
        """An extra model holds no adapters: its calls read the base weights (policy 'base')."""
        policy = getattr(request, "policy", BASE_POLICY)
        if policy not in (None, BASE_POLICY):
            raise ModelRefusal(f"model {model_id!r} holds no adapters, so it has no policy {str(policy)[:64]!r}",
                            hint=f"name policy {BASE_POLICY!r} (its base weights) on that model")

    def listing(self) -> dict:
        return {"main": self.main.id, "models": [
            {"id": m.id, "main": m.main, "vocab_size": _vocab_size(m.worker),
             "methods": None if m.main else list(EXTRA_METHODS)} for m in (self.main, *self.extras.values())]}

    def tokenizer_files(self, name: Any) -> dict:
        """{"model": id, "files": {name: bytes}}: the model's tokenizer as `save_pretrained` writes it (cached)."""
        model = self.find(name)
        with self._lock:
            if model._tokenizer_files is None:
                model._tokenizer_files = tokenizer_files(model.worker.tokenizer)
        return {"model": model.id, "files": dict(model._tokenizer_files)}


def _vocab_size(worker: Any) -> int | None:
    tokenizer = getattr(worker, "tokenizer", None)
    return len(tokenizer) if tokenizer is not None else None


def served_models_router(served: ServedModels, tenant_of: Callable[[Request], str | None]) -> APIRouter:
    """GET /v1/served-models and its tokenizer route: for callers with a key (or any, without keys)."""
    import asyncio

    router = APIRouter()

    @router.get("/v1/served-models")
    async def listing(request: Request, model: str | None = None) -> Response:
        if tenant_of(request) is None:
            return unauthorized()
        try:
            named = {} if model is None else {"model": served.find(model).id}
        except UnknownModel as exc:
            return error_response(404, exc)
        return JSONResponse({**served.listing(), **named})

    @router.get("/v1/served-models/tokenizer")
    async def tokenizer(request: Request, model: str = "") -> Response:
        if tenant_of(request) is None:
            return unauthorized()
        try:
            files = await asyncio.to_thread(served.tokenizer_files, model)
        except UnknownModel as exc:
            return error_response(404, exc)
        return Response(content=encode_message(files), media_type=MSGPACK)

    return router
