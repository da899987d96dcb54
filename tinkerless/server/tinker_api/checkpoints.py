"""Tinker checkpoints and training-run records in the server's storage, tenant-prefixed.

Layout (every key under the tenant's own prefix, so no name a tenant sends can
reach another tenant's files; `validate_key` rejects traversal on top of that):

    tenants/<tenant>/tinker/runs/<run>/run.json
    tenants/<tenant>/tinker/runs/<run>/<kind>/<name>/<files...>
    tenants/<tenant>/tinker/runs/<run>/<kind>/<name>/meta.json   written last: sha256 of every file

`<run>` is the run id with its ':' made path-safe; `<kind>` is `weights`
(adapter + optimizer) or `sampler_weights` (adapter only).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
import urllib.parse
from dataclasses import dataclass

from tinkerless.errors import CorruptCheckpoint, StorageNotFound, UserError
from tinkerless.storage import ObjectStore

KINDS = {"weights": "training", "sampler_weights": "sampler"}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
META = "meta.json"


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
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise UserError(
            f"invalid checkpoint name {name!r}",
            hint="1-128 letters, digits, '.', '_' or '-', starting with a letter or digit",
        )
    return name


class CheckpointRegistry:
    """Reads and writes one server's Tinker runs and checkpoints."""

    def __init__(self, store: ObjectStore):
        self.store = store

    def _run_prefix(self, tenant: str, run_id: str) -> str:
        return f"tenants/{tenant or '_'}/tinker/runs/{urllib.parse.quote(run_id, safe='')}"

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

    def save(self, tenant: str, path: TinkerPath, files: dict[str, bytes], info: dict) -> dict:
        prefix = f"{self._run_prefix(tenant, path.run_id)}/{path.kind}/{path.name}"
        if self.store.exists(f"{prefix}/{META}"):
            self.store.delete(prefix)  # overwriting a name replaces the whole checkpoint
        for name, data in files.items():
            self.store.put(f"{prefix}/{name}", data)
        meta = {
            **info,
            "tinker_path": str(path),
            "checkpoint_id": f"{path.kind}/{path.name}",
            "checkpoint_type": KINDS[path.kind],
            "time": now_iso(),
            "size_bytes": sum(len(d) for d in files.values()),
            "files": {name: hashlib.sha256(data).hexdigest() for name, data in files.items()},
        }
        self.store.put(f"{prefix}/{META}", json.dumps(meta).encode())  # last: the checkpoint now exists
        return meta

    def load(self, tenant: str, path: TinkerPath) -> tuple[dict, dict[str, bytes]]:
        prefix = f"{self._run_prefix(tenant, path.run_id)}/{path.kind}/{path.name}"
        try:
            meta = json.loads(self.store.get(f"{prefix}/{META}"))
        except StorageNotFound:
            raise UserError(
                f"no checkpoint at {path}",
                hint="list this run's checkpoints with `tinker checkpoint list` or RestClient.list_checkpoints",
            ) from None
        files = {}
        for name, digest in meta["files"].items():
            data = self.store.get(f"{prefix}/{name}")
            if hashlib.sha256(data).hexdigest() != digest:
                raise CorruptCheckpoint(
                    f"checkpoint {path} is corrupt: {name} does not match its checksum",
                    hint="load an earlier checkpoint of this run",
                )
            files[name] = data
        return meta, files

    def list(self, tenant: str, run_id: str) -> list[dict]:
        out = []
        prefix = self._run_prefix(tenant, run_id)
        for key in self.store.list(prefix):
            if key.endswith(f"/{META}"):
                meta = json.loads(self.store.get(key))
                out.append({k: v for k, v in meta.items() if k != "files"})
        return sorted(out, key=lambda m: m["time"])

    def delete(self, tenant: str, path: TinkerPath) -> bool:
        prefix = f"{self._run_prefix(tenant, path.run_id)}/{path.kind}/{path.name}"
        if not self.store.exists(f"{prefix}/{META}"):
            return False
        self.store.delete(f"{prefix}/{META}")  # first: a half-deleted checkpoint is never loadable
        self.store.delete(prefix)
        return True
