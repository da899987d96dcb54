"""Trained adapters named by OpenAI `model` strings: `<run_id>@<step>`, `<run_id>@latest`, `<run_id>/<agent>@...`,
and the Tinker API's checkpoint paths `tinker://<run>/sampler_weights/<name>` (or `/weights/<name>`).

`AdapterNames` turns a name into the adapter's files, read from the caller's own runs on the server
(`tenants/<tenant>/runs/<run_id>/checkpoints`, the layout `server/runs.py` writes; `tenants/<tenant>/tinker/...`
for Tinker checkpoints), so a tenant can only ever name its own: another tenant's run resolves exactly like
one that does not exist.

`AdapterCache` keeps the loaded adapters as LoRA slots on the one shared base model, least recently
used first out. A slot in use by a generation (which may pause between time slices) is never evicted;
an evicted slot's adapter is reloaded in place for the next checkpoint of the same shape, which costs
a state-dict copy instead of building a new peft adapter (the hand-off in BENCHMARKS.md).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

from tinkerless.coordinator.state import checkpoint_prefix, validate_run_id
from tinkerless.errors import StorageError, StorageNotFound, UserError
from tinkerless.functions.openai_api.backend import OpenAIError
from tinkerless.storage import CheckpointStore, ObjectStore
from tinkerless.wire.messages import LoadStateRequest, PolicyState

_NAME = re.compile(r"(?P<run>[^/@]+)(?:/(?P<agent>[A-Za-z0-9_-]{1,64}))?@(?P<step>latest|[0-9]{1,12})")
_ADAPTER_FILES = ("adapter/adapter_config.json", "adapter/adapter_model.safetensors")
SLOT_PREFIX = "openai_slot"


class NotFound(Exception):
    """The name does not resolve to one of the caller's adapters (answered as an unknown model)."""


@dataclass(frozen=True)
class AdapterRef:
    """One checkpointed adapter: whose, which run, step and agent, and the committed content's identity."""

    tenant: str
    run_id: str
    agent: str | None
    step: int
    identity: str  # hash of the step's manifest: a step re-written by a resumed run is another adapter
    source: str = "run"  # "run": a run's checkpoint; "tinker": a Tinker checkpoint path (in run_id)

    @property
    def key(self) -> tuple:
        return (self.source, self.tenant, self.run_id, self.agent, self.step, self.identity)


class AdapterNames:
    """Resolves `model` names to the caller's checkpointed adapters (storage reads: call off the event loop)."""

    def __init__(self, store: ObjectStore):
        from tinkerless.server.tinker_api.checkpoints import CheckpointRegistry

        self.store = store  # the server's storage root; runs live under tenants/<tenant>/ (RunService.tenant_store)
        self.tinker = CheckpointRegistry(store)  # the Tinker API's checkpoints, in the same storage

    @staticmethod
    def looks_like_adapter(model: str) -> bool:
        return "@" in model or model.startswith("tinker://")

    def _resolve_tinker(self, tenant: str, model: str) -> AdapterRef:
        from tinkerless.server.tinker_api.checkpoints import TinkerPath

        try:
            path = TinkerPath.parse(model)
            info = self.tinker.info(tenant, path)
        except (UserError, StorageError):  # malformed, missing, expired: all read as "no such model"
            raise NotFound(model) from None
        info = {k: v for k, v in info.items() if k != "expires_at"}
        identity = hashlib.sha256(json.dumps(info, sort_keys=True, default=str).encode()).hexdigest()[:16]
        return AdapterRef(tenant, str(path), None, 0, identity, source="tinker")

    def _load_tinker(self, ref: AdapterRef) -> tuple[dict[str, bytes], int]:
        from tinkerless.server.tinker_api.checkpoints import TinkerPath

        try:
            meta, files = self.tinker.load(ref.tenant, TinkerPath.parse(ref.run_id))
        except (UserError, StorageError):
            raise NotFound(ref.run_id) from None
        adapter = {name: files[name] for name in _ADAPTER_FILES if name in files}
        if len(adapter) != len(_ADAPTER_FILES):
            raise NotFound(ref.run_id)
        return adapter, int(meta.get("policy_version", 0) or 0)

    def tenant_store(self, tenant: str) -> ObjectStore:
        return self.store.child(f"tenants/{tenant or '_'}")

    def checkpoints(self, tenant: str, run_id: str) -> CheckpointStore:
        return CheckpointStore(self.tenant_store(tenant), checkpoint_prefix(run_id))

    def resolve(self, tenant: str, model: str) -> AdapterRef:
        if model.startswith("tinker://"):
            return self._resolve_tinker(tenant, model)
        match = _NAME.fullmatch(model)
        if match is None:
            raise NotFound(model)
        try:
            run_id = validate_run_id(match["run"])
        except UserError:
            raise NotFound(model) from None
        checkpoints = self.checkpoints(tenant, run_id)
        try:
            if match["step"] == "latest":
                step = checkpoints.latest_step()
                if step is None:
                    raise NotFound(model)
            else:
                step = int(match["step"])
            manifest = checkpoints.manifest(step)
        except StorageNotFound:
            raise NotFound(model) from None
        except StorageError:  # written but never committed, half-written: not a servable step
            raise NotFound(model) from None
        identity = hashlib.sha256(json.dumps(manifest, sort_keys=True, default=str).encode()).hexdigest()[:16]
        return AdapterRef(tenant, run_id, match["agent"], step, identity)

    def load_files(self, ref: AdapterRef) -> tuple[dict[str, bytes], int]:
        """The adapter's PEFT files (as `Worker.load_state` takes them) and its policy version."""
        if ref.source == "tinker":
            return self._load_tinker(ref)
        try:
            checkpoint = self.checkpoints(ref.tenant, ref.run_id).load(ref.step)
        except StorageNotFound:
            raise NotFound(ref.run_id) from None
        except StorageError:
            raise OpenAIError(
                f"checkpoint step {ref.step} of run {ref.run_id!r} failed verification and cannot be served",
                status=409, param="model", code="corrupt_checkpoint",
                hint="serve another step (GET /v1/models lists them), or re-save this run's checkpoint",
            ) from None
        prefix = "" if ref.agent is None else f"policies/{ref.agent}/"
        files = {name: checkpoint.files.get(prefix + name) for name in _ADAPTER_FILES}
        if any(blob is None for blob in files.values()):
            agents = sorted({k.split("/")[1] for k in checkpoint.files if k.startswith("policies/") and k.count("/") >= 3})
            if ref.agent is None and agents:
                raise OpenAIError(
                    f"run {ref.run_id!r} trains several agents ({', '.join(agents)}): name one",
                    status=404, param="model", code="model_not_found",
                    hint=f"use model='{ref.run_id}/{agents[0]}@{ref.step}'",
                )
            raise NotFound(ref.run_id)
        versions = checkpoint.metadata.get("policy_versions", {})
        version = versions.get(ref.agent or "default", ref.step)
        return files, int(version) if isinstance(version, int) else ref.step

    def list(self, tenant: str, limit: int = 256) -> list[str]:
        """The caller's servable adapter names: `<run>@latest` and every committed step, newest runs first."""
        from tinkerless.coordinator import list_runs

        names: list[str] = []
        for run in list_runs(self.tenant_store(tenant)):
            try:
                steps = self.checkpoints(tenant, run.run_id).steps()
            except StorageError:
                continue
            if steps:
                names += [f"{run.run_id}@latest"] + [f"{run.run_id}@{s}" for s in reversed(steps)]
            if len(names) >= limit:
                break
        for run in self.tinker.list_runs(tenant) if len(names) < limit else []:
            try:
                names += [c["tinker_path"] for c in self.tinker.list(tenant, run["training_run_id"])
                          if c.get("tinker_path")]
            except (UserError, StorageError, KeyError):
                continue
        return names[:limit]


class AdapterCache:
    """Loaded adapters as LoRA slots on the worker, LRU-evicted past `capacity` (call on the scheduler thread,
    which is the only one that changes the worker's adapters)."""

    def __init__(self, worker, capacity: int = 8):
        if capacity < 1:
            raise ValueError("the adapter cache needs room for at least one adapter")
        self.worker = worker
        self.capacity = capacity
        self._slots: OrderedDict[tuple, str] = OrderedDict()  # adapter key -> worker policy, LRU first
        self._in_use: dict[str, int] = {}
        self._free: list[str] = []  # evicted slots kept as peft adapters, reloaded in place
        self._count = 0
        self._lock = threading.Lock()
        self.loads = 0  # adapters read into a slot (a statistic for tests and benchmarks)

    def cached(self, ref: AdapterRef) -> bool:
        return ref.key in self._slots

    def acquire(self, ref: AdapterRef, load_files) -> str:
        """The slot holding `ref`'s adapter, loading it (`load_files(ref)` -> (files, version)) on a miss; pinned
        until `release`."""
        with self._lock:
            slot = self._slots.get(ref.key)
            if slot is not None:
                self._slots.move_to_end(ref.key)
                self._in_use[slot] = self._in_use.get(slot, 0) + 1
                return slot
        files, version = load_files(ref)
        slot = self._load(files, version)
        with self._lock:
            self._slots[ref.key] = slot
            self._in_use[slot] = self._in_use.get(slot, 0) + 1
            self._evict()
        self.loads += 1
        return slot

    def release(self, slot: str) -> None:
        with self._lock:
            self._in_use[slot] -= 1
            if not self._in_use[slot]:
                del self._in_use[slot]
            self._evict()

    def _load(self, files: dict[str, bytes], version: int) -> str:
        """Load into a free slot whose adapter has the same shape, else into a new slot."""
        while self._free:
            slot = self._free.pop()
            try:
                self.worker.load_state(LoadStateRequest(PolicyState(slot, files, version), include_optimizer=False))
                return slot
            except UserError:  # another rank or target modules: that slot's adapter cannot hold this one
                self.worker.drop_policy(slot)
        self._count += 1
        slot = f"{SLOT_PREFIX}{self._count}"
        try:
            self.worker.load_state(LoadStateRequest(PolicyState(slot, files, version), include_optimizer=False))
        except UserError as exc:
            raise OpenAIError(f"the adapter cannot be loaded onto this server's base model: {exc.message}",
                              status=400, param="model", code="incompatible_adapter", hint=exc.hint) from None
        return slot

    def _evict(self) -> None:
        """Drop least recently used slots not in use, past the capacity (evicted slots stay loadable in place;
        at most one spare is kept, so memory stays within capacity + 1 adapters)."""
        for key in list(self._slots):
            if len(self._slots) <= self.capacity:
                break
            slot = self._slots[key]
            if slot in self._in_use:
                continue
            del self._slots[key]
            if self._free:
                self.worker.drop_policy(slot)
            else:
                self._free.append(slot)
