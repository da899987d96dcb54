"""Tinker checkpoints and training-run records in the server's storage, tenant-prefixed.

Layout (every key under the tenant's own prefix, so no name a tenant sends can
reach another tenant's files; `validate_key` rejects traversal on top of that):

    tenants/<tenant>/tinker/runs/<run>/run.json
    tenants/<tenant>/tinker/runs/<run>/<kind>/<name>/...   a `CheckpointStore` holding one checkpoint

`<run>` is the run id with its ':' made path-safe; `<kind>` is `weights`
(adapter + optimizer), `sampler_weights` (adapter only) or `external_weights` (the adapter
in PEFT's own file layout, for download). A checkpoint with a TTL has an `expires.json`
next to its steps; once past it, the checkpoint reads as missing and is deleted. Each named checkpoint is
the storage layer's verified checkpoint (files, then a sha256 manifest, then `latest`
by compare-and-swap), so saving over a name replaces it atomically.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import urllib.parse
from dataclasses import dataclass

from tinkerless.errors import StorageNotFound, UserError
from tinkerless.storage import CheckpointStore, ObjectStore, names
from tinkerless.storage.layout import LATEST

KINDS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
EXPIRES = "expires.json"
MIN_TTL_SECONDS, MAX_TTL_SECONDS = 3600, 10 * 366 * 86400  # the SDK's documented range: 1 hour to 10 years
_STEP = 1  # a named checkpoint is a one-step CheckpointStore; saving again replaces that step

MAX_RUN_ID = 200


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat()


@dataclass(frozen=True)
class TinkerPath:
    run_id: str
    kind: str
    name: str

    @classmethod
    def parse(cls, path: str) -> "TinkerPath":
        hint = "use a path returned by save_state / save_weights_for_sampler: tinker://<run>/weights/<name>"
        if not isinstance(path, str) or not path.startswith("tinker://"):
            raise UserError(f"not a tinker:// path: {path!r}", hint=hint)
        parts = path[len("tinker://"):].split("/")
        if len(parts) != 3 or parts[1] not in KINDS:
            raise UserError(f"malformed tinker path {path!r}", hint=hint)
        check_name(parts[2])
        return cls(parts[0], parts[1], parts[2])

    def __str__(self) -> str:
        return f"tinker://{self.run_id}/{self.kind}/{self.name}"


def check_name(name: str) -> str:
    return names.check_name(name, names.CHECKPOINT_NAME)


class CheckpointRegistry:
    """Reads and writes one server's Tinker runs and checkpoints."""

    def __init__(self, store: ObjectStore):
        self.store = store

    def _run_prefix(self, tenant: str, run_id: str) -> str:
        quoted = urllib.parse.quote(run_id, safe="") if isinstance(run_id, str) else ""
        if not quoted or len(quoted) > MAX_RUN_ID:  # it becomes one file name in storage
            raise UserError(
                f"training run id of {len(quoted)} characters (URL-quoted) is not valid",
                hint=f"use the id a training client was given (1-{MAX_RUN_ID} characters)",
            )
        return f"tenants/{tenant or '_'}/tinker/runs/{quoted}"

    # -- runs ----------------------------------------------------------------------

    def save_run(self, tenant: str, record: dict) -> None:
        self.store.put(f"{self._run_prefix(tenant, record['training_run_id'])}/run.json", json.dumps(record).encode())

    def load_run(self, tenant: str, run_id: str) -> dict | None:
        try:
            return json.loads(self.store.get(f"{self._run_prefix(tenant, run_id)}/run.json"))
        except StorageNotFound:
            return None

    def list_runs(self, tenant: str) -> list[dict]:
        prefix = f"tenants/{tenant or '_'}/tinker/runs"
        runs = []
        for key in self.store.list(prefix):
            if key.endswith("/run.json") and key.count("/") == prefix.count("/") + 2:
                runs.append(json.loads(self.store.get(key)))
        return sorted(runs, key=lambda r: r.get("created_at", ""))

    # -- checkpoints ------------------------------------------------------------------

    def _checkpoint(self, tenant: str, path: TinkerPath) -> CheckpointStore:
        return CheckpointStore(self.store, f"{self._run_prefix(tenant, path.run_id)}/{path.kind}/{path.name}", keep_last=1)

    def save(self, tenant: str, path: TinkerPath, files: dict[str, bytes], info: dict) -> dict:
        meta = {
            **info,
            "tinker_path": str(path),
            "checkpoint_id": f"{path.kind}/{path.name}",
            "checkpoint_type": KINDS[path.kind],
            "time": now_iso(),
            "size_bytes": sum(len(d) for d in files.values()),
        }
        self._checkpoint(tenant, path).save(_STEP, files, meta)
        return meta

    def load(self, tenant: str, path: TinkerPath) -> tuple[dict, dict[str, bytes]]:
        """The checkpoint's metadata and verified files; CorruptCheckpoint if a file fails its checksum."""
        self._drop_if_expired(tenant, path)
        with _missing(path):
            checkpoint = self._checkpoint(tenant, path).load(_STEP)
        return checkpoint.metadata, checkpoint.files

    def info(self, tenant: str, path: TinkerPath) -> dict:
        """The checkpoint's metadata, without reading its files."""
        expires_at = self._drop_if_expired(tenant, path)
        with _missing(path):
            return {**self._checkpoint(tenant, path).manifest(_STEP)["metadata"], "expires_at": expires_at}

    # -- expiry -------------------------------------------------------------------------

    def set_ttl(self, tenant: str, path: TinkerPath, ttl_seconds: int | None) -> None:
        """Expire the checkpoint `ttl_seconds` from now; None keeps it for good."""
        self.info(tenant, path)  # a clear error for a missing one
        key = f"{self._checkpoint(tenant, path).prefix}/{EXPIRES}"
        if ttl_seconds is None:
            with contextlib.suppress(StorageNotFound):
                self.store.delete(key)
            return
        check_ttl(ttl_seconds)
        when = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=ttl_seconds)
        self.store.put(key, json.dumps({"expires_at": when.isoformat()}).encode())

    def _drop_if_expired(self, tenant: str, path: TinkerPath) -> str | None:
        """The checkpoint's expiry time (None = never); an expired checkpoint is deleted first."""
        try:
            expires_at = json.loads(self.store.get(f"{self._checkpoint(tenant, path).prefix}/{EXPIRES}"))["expires_at"]
        except StorageNotFound:
            return None
        if dt.datetime.fromisoformat(expires_at) <= dt.datetime.now(dt.timezone.utc):
            self.delete(tenant, path)
        return expires_at

    def list(self, tenant: str, run_id: str) -> list[dict]:
        out = []
        prefix = self._run_prefix(tenant, run_id)
        for key in self.store.list(prefix):
            parts = key[len(prefix) + 1 :].split("/")
            if len(parts) == 3 and parts[0] in KINDS and parts[2] == LATEST:  # <kind>/<name>/latest
                with contextlib.suppress(UserError):  # expired (and deleted) while listing
                    out.append(self.info(tenant, TinkerPath(run_id, parts[0], parts[1])))
        return sorted(out, key=lambda m: m["time"])

    def delete(self, tenant: str, path: TinkerPath) -> bool:
        checkpoint = self._checkpoint(tenant, path)
        if checkpoint.latest_step() is None:
            return False
        self.store.delete(f"{checkpoint.prefix}/{LATEST}")  # first: a half-deleted checkpoint is never loadable
        self.store.delete(checkpoint.prefix)
        return True


def check_ttl(ttl_seconds) -> None:
    if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int) or not MIN_TTL_SECONDS <= ttl_seconds <= MAX_TTL_SECONDS:
        raise UserError(f"ttl_seconds={ttl_seconds!r} is out of range",
                        hint=f"use {MIN_TTL_SECONDS} (1 hour) to {MAX_TTL_SECONDS} (10 years), or null for no expiry")


@contextlib.contextmanager
def _missing(path: TinkerPath):
    try:
        yield
    except StorageNotFound:
        raise UserError(
            f"no checkpoint at {path}",
            hint="list this run's checkpoints with `tinker checkpoint list` or RestClient.list_checkpoints",
        ) from None
