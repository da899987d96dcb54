"""The Tinker REST surface beyond training and sampling: sessions, checkpoint listings, weights
info, external-weights export and download, checkpoint TTLs, and a typed answer for the rest.

These are what `RestClient` and the SDK's own CLI (`tinker checkpoint list|download|delete`,
`tinker run list`) call. Paths and shapes are the SDK 0.38's:

    GET    /sessions?limit&offset                      {sessions: [id]}
    GET    /sessions/{id}                              {training_run_ids, sampler_ids, user_metadata, display_name}
    GET    /checkpoints?limit&offset                   {checkpoints: [...], cursor}   every run of the caller
    POST   /weights_info {tinker_path}                 {base_model, is_lora, lora_rank, train_*}
    POST   /save_weights_external {model_id, path}     future -> {path: tinker://<run>/external_weights/<name>}
    GET    /training_runs/{run}/checkpoints/external_weights/{name}/external_weights_urls   {urls, expires}
    PUT    /training_runs/{run}/checkpoints/{kind}/{name}/ttl {ttl_seconds}
    GET    /external_weights/{token}/{file}            the file (a signed URL: urllib sends no API key)

An external-weights checkpoint is the adapter in PEFT's file layout (adapter_config.json naming
the base model's Hub id, adapter_model.safetensors): `PeftModel.from_pretrained` loads it.
Any other /api/v1 path answers 404 with a typed error that names the route.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import json
import secrets

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from tinkerless.errors import UserError
from tinkerless.server.tinker_api.checkpoints import TinkerPath, check_name, check_ttl
from tinkerless.wire.messages import SaveStateRequest

URL_LIFETIME = dt.timedelta(hours=1)  # how long a signed download URL stays valid
_ADAPTER_FILES = ("adapter/adapter_config.json", "adapter/adapter_model.safetensors")


class RestSurface:
    """The listing and export calls, over a `TinkerService` (framework-free)."""

    def __init__(self, service):
        self.service = service
        self._url_key = secrets.token_bytes(32)  # signs download URLs; a restart invalidates old ones

    # -- sessions ----------------------------------------------------------------------

    def _session_ids(self, tenant: str) -> list[str]:
        """This tenant's sessions: live ones and those whose runs survive in storage, oldest first."""
        ids = [sid for sid, record in list(self.service.sessions.items()) if record["tenant"] == tenant]
        for run in self.service.training_runs(tenant):
            session = run["training_run_id"].split(":train:")[0]
            if session not in ids:
                ids.append(session)
        return ids

    def list_sessions(self, tenant: str, limit: int, offset: int) -> dict:
        return {"sessions": self._session_ids(tenant)[offset: offset + limit]}

    def get_session(self, tenant: str, session_id: str) -> dict:
        if session_id not in self._session_ids(tenant):
            raise KeyError(session_id)
        runs = [r["training_run_id"] for r in self.service.training_runs(tenant)
                if r["training_run_id"].startswith(session_id + ":train:")]
        samplers = [s.sampler_id for s in list(self.service.samplers.values())
                    if s.tenant == tenant and s.sampler_id.startswith(session_id + ":sample:")]
        record = self.service.sessions.get(session_id) or {}
        return {"training_run_ids": runs, "sampler_ids": samplers,
                "user_metadata": record.get("user_metadata"), "display_name": record.get("display_name")}

    # -- checkpoints ---------------------------------------------------------------------

    def list_user_checkpoints(self, tenant: str, limit: int, offset: int) -> dict:
        checkpoints = []
        for run in self.service.training_runs(tenant):
            checkpoints.extend(self.service.checkpoints(tenant, run["training_run_id"]))
        checkpoints.sort(key=lambda c: c["time"], reverse=True)  # newest first, as the SDK documents
        return {"checkpoints": checkpoints[offset: offset + limit],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(checkpoints)}}

    def weights_info(self, tenant: str, body: dict) -> dict:
        path = TinkerPath.parse(body["tinker_path"])
        meta = self.service.registry.info(tenant, path)
        return {
            "base_model": meta.get("base_model", self.service.base_model),
            "is_lora": True,
            "lora_rank": meta.get("lora_rank"),
            "optimizer_config": {"type": "adamw"},
            **{k: meta[k] for k in ("train_unembed", "train_mlp", "train_attn") if k in meta},
        }

    def set_ttl(self, tenant: str, path: TinkerPath, body: dict) -> dict:
        if "ttl_seconds" not in body:
            raise UserError("set_checkpoint_ttl needs ttl_seconds", hint='send {"ttl_seconds": 86400} or null for no expiry')
        self.service.registry.set_ttl(tenant, path, body["ttl_seconds"])
        return {}

    # -- external weights ----------------------------------------------------------------

    def save_weights_external(self, tenant: str, body: dict) -> dict:
        service = self.service
        model = service.model(tenant, body["model_id"])
        path = TinkerPath(model.model_id, "external_weights", check_name(body["path"]))
        ttl = body.get("ttl_seconds")
        if ttl is not None:
            check_ttl(ttl)  # before queueing: a refused export must not be half-made
        if body.get("age_encryption_recipients"):
            raise UserError("age-encrypted exports are not supported by this server", hint="leave age_encryption_recipients unset")

        def run() -> dict:
            state = service.worker.save_state(SaveStateRequest(model.policy, include_optimizer=False))
            files = external_files(state.files, model.base_model)
            info = {"base_model": model.base_model, "lora_rank": model.lora_rank, "policy_version": state.policy_version,
                    "user_metadata": None, **model.lora_flags}
            meta = service.registry.save(tenant, path, files, info)
            if ttl is not None:
                service.registry.set_ttl(tenant, path, ttl)
            return {"path": str(path), "size_bytes": meta["size_bytes"], "type": "save_weights_external"}

        return service.submit(tenant, run, stream=model.model_id, seq=body.get("seq_id"), model_id=model.model_id)

    def external_urls(self, tenant: str, path: TinkerPath, base_url: str) -> dict:
        if path.kind != "external_weights":
            raise UserError(f"{path} is not an external weights checkpoint",
                            hint="export one with TrainingClient.save_weights_external, or `tinker checkpoint download`")
        meta = self.service.registry.info(tenant, path)
        expires = dt.datetime.now(dt.timezone.utc) + URL_LIFETIME
        names = meta.get("files") or [name.split("/", 1)[1] for name in _ADAPTER_FILES]
        return {"urls": {name: f"{base_url}api/v1/external_weights/{self._token(tenant, path, name, expires)}/{name}"
                         for name in names},
                "expires": expires.isoformat()}

    def _token(self, tenant: str, path: TinkerPath, name: str, expires: dt.datetime) -> str:
        claim = json.dumps([tenant, str(path), name, int(expires.timestamp())]).encode()
        signature = hmac.new(self._url_key, claim, hashlib.sha256).digest()
        return _b64(claim) + "." + _b64(signature)

    def download(self, token: str, name: str) -> bytes:
        """The file a signed URL names; UserError for a forged, altered or expired one."""
        try:
            claim_text, signature_text = token.split(".")
            claim, signature = _unb64(claim_text), _unb64(signature_text)
        except ValueError:
            raise UserError("malformed download link", hint="ask for fresh links with get_external_weights_urls") from None
        if not hmac.compare_digest(hmac.new(self._url_key, claim, hashlib.sha256).digest(), signature):
            raise UserError("invalid download link", hint="ask for fresh links with get_external_weights_urls")
        tenant, path, signed_name, expires = json.loads(claim)
        if signed_name != name:
            raise UserError("this download link is for another file")
        if expires < dt.datetime.now(dt.timezone.utc).timestamp():
            raise UserError("this download link has expired", hint="ask for fresh links with get_external_weights_urls")
        _, files = self.service.registry.load(tenant, TinkerPath.parse(path))
        if name not in files:
            raise UserError(f"{path} has no file {name!r}")
        return files[name]


def external_files(state_files: dict[str, bytes], base_model: str) -> dict[str, bytes]:
    """The adapter files of a saved policy, at the root and naming the base model by its Hub id."""
    config = json.loads(state_files["adapter/adapter_config.json"])
    config["base_model_name_or_path"] = base_model
    return {
        "adapter_config.json": json.dumps(config, indent=2).encode(),
        "adapter_model.safetensors": state_files["adapter/adapter_model.safetensors"],
    }


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (ValueError, TypeError):
        raise ValueError("not base64") from None


def _page(request: Request, default_limit: int) -> tuple[int, int]:
    try:
        limit = int(request.query_params.get("limit", default_limit))
        offset = int(request.query_params.get("offset", 0))
    except ValueError:
        raise UserError("limit and offset must be integers") from None
    if not (0 <= limit <= 10_000 and offset >= 0):
        raise UserError(f"limit={limit} / offset={offset} out of range", hint="use 0 <= limit <= 10000 and offset >= 0")
    return limit, offset


def add_routes(router: APIRouter, call, surface: RestSurface, not_found) -> None:
    """Adds the REST routes to the Tinker router; `call(request, handler)` authenticates and types errors,
    `not_found(fn)` turns a KeyError into the router's 404."""

    @router.get("/sessions")
    async def list_sessions(request: Request) -> Response:
        return await call(request, lambda t, b: surface.list_sessions(t, *_page(request, 20)))

    @router.get("/sessions/{session_id}")
    async def get_session(session_id: str, request: Request) -> Response:
        return await call(request, lambda t, b: not_found(lambda: surface.get_session(t, session_id)))

    @router.get("/checkpoints")
    async def list_user_checkpoints(request: Request) -> Response:
        return await call(request, lambda t, b: surface.list_user_checkpoints(t, *_page(request, 100)))

    @router.post("/weights_info")
    async def weights_info(request: Request) -> Response:
        return await call(request, surface.weights_info)

    @router.post("/save_weights_external")
    async def save_weights_external(request: Request) -> Response:
        return await call(request, surface.save_weights_external)

    @router.get("/training_runs/{run_id}/checkpoints/{kind}/{name}/external_weights_urls")
    async def external_weights_urls(run_id: str, kind: str, name: str, request: Request) -> Response:
        path = f"tinker://{run_id}/{kind}/{name}"
        base = str(request.base_url)
        return await call(request, lambda t, b: surface.external_urls(t, TinkerPath.parse(path), base))

    @router.put("/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl")
    async def checkpoint_ttl(run_id: str, kind: str, name: str, request: Request) -> Response:
        path = f"tinker://{run_id}/{kind}/{name}"
        return await call(request, lambda t, b: surface.set_ttl(t, TinkerPath.parse(path), b))

    @router.get("/external_weights/{token}/{name}")
    async def download(token: str, name: str) -> Response:
        try:
            data = surface.download(token, name)
        except UserError as exc:
            text = f"{exc.message} ({exc.hint})" if exc.hint else exc.message
            return JSONResponse({"error": text, "category": "user"}, status_code=403)
        return Response(data, media_type="application/octet-stream")


def add_catch_all(router: APIRouter) -> None:
    """Last: any other /api/v1 path or method answers a typed 404 that names it (never a bare one)."""

    @router.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"], include_in_schema=False)
    async def unsupported(rest: str, request: Request) -> Response:
        route = f"{request.method} /api/v1/{rest}"[:200]
        return JSONResponse(
            {"error": f"{route} is not supported by this tinkerless server "
                      "(see docs/tinker.md for the Tinker routes it implements)",
             "category": "user"},
            status_code=404,
        )
