"""Verified checkpoints on an ObjectStore.

Layout under a prefix such as ``runs/<run_id>/checkpoints``::

    step-<n>/<files...>        the checkpoint's files (names may contain '/')
    step-<n>/manifest.json     written LAST: sha256 and size of every file
    latest                     {"step": n}, written atomically AFTER the manifest

A step without a manifest is half-written and never loaded. A crash at any
point therefore leaves either the previous checkpoint or the new one usable.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
import warnings
from dataclasses import dataclass, field

from tinkerless.errors import ConfigError, CorruptCheckpoint, StorageNotFound, UserError
from tinkerless.storage.store import ObjectStore, validate_key

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass
class Checkpoint:
    step: int
    files: dict[str, bytes]
    metadata: dict = field(default_factory=dict)


class CheckpointStore:
    """Save, verify, load and prune numbered checkpoints under one prefix."""

    def __init__(self, store: ObjectStore, prefix: str, keep_last: int | None = None):
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ConfigError(
                f"keep_last must be a positive integer or None, got {keep_last!r}",
                hint="use None to keep every checkpoint, or e.g. keep_last=3",
            )
        self.store = store
        self.prefix = validate_key(prefix.rstrip("/"))
        self.keep_last = keep_last

    # -- keys ----------------------------------------------------------------

    def step_prefix(self, step: int) -> str:
        return f"{self.prefix}/step-{step}"

    def _latest_key(self) -> str:
        return f"{self.prefix}/{LATEST}"

    # -- writing -------------------------------------------------------------

    def save(self, step: int, files: dict[str, bytes], metadata: dict | None = None) -> str:
        """Write a checkpoint; return its prefix (``<prefix>/step-<n>``)."""
        step = _check_step(step)
        if not files:
            raise UserError(
                f"checkpoint for step {step} has no files",
                hint="pass at least one file, e.g. {'adapter/adapter_model.safetensors': data}",
            )
        for name, data in files.items():
            _check_file_name(name)
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise UserError(
                    f"checkpoint file {name!r} (step {step}) is {type(data).__name__}, not bytes",
                    hint="serialize it first (e.g. safetensors.torch.save(...) or json.dumps(...).encode())",
                )
        manifest = {
            "step": step,
            "created_at": time.time(),
            "files": {
                name: {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
                for name, data in files.items()
            },
            "metadata": dict(metadata or {}),
        }
        try:
            manifest_bytes = json.dumps(manifest, indent=1, sort_keys=True).encode()
        except (TypeError, ValueError) as e:
            raise UserError(
                f"checkpoint metadata for step {step} is not JSON-serializable: {e}",
                hint="keep metadata to str/int/float/bool/None, lists and dicts",
            ) from e

        base = self.step_prefix(step)
        # Drop anything left by an earlier save of this step (e.g. after a
        # crash) so stale files can't mix with the new ones.
        self.store.delete(base)
        for name, data in files.items():
            self.store.put(f"{base}/{name}", bytes(data))
        self.store.put(f"{base}/{MANIFEST}", manifest_bytes)
        self.store.put(self._latest_key(), json.dumps({"step": step}).encode())
        self._prune(step)
        return base

    def _prune(self, just_written: int) -> None:
        by_step = self._step_dirs()
        older = sorted(s for s in by_step if s < just_written)
        complete = [s for s in older if by_step[s]]
        doomed = [s for s in older if not by_step[s]]  # half-written leftovers
        if self.keep_last is not None:
            # The step just written counts toward keep_last.
            doomed += complete[: max(0, len(complete) - (self.keep_last - 1))]
        for s in sorted(set(doomed)):
            logger.info("pruning checkpoint %s", self.step_prefix(s))
            self.store.delete(self.step_prefix(s))

    # -- reading -------------------------------------------------------------

    def _step_dirs(self) -> dict[int, bool]:
        """Every step directory under the prefix -> whether it has a manifest."""
        found: dict[int, bool] = {}
        for key in self.store.list(self.prefix):
            parts = key[len(self.prefix) + 1:].split("/")
            m = _STEP_DIR.match(parts[0])
            if not m or len(parts) < 2:
                continue
            step = int(m.group(1))
            found[step] = found.get(step, False) or parts[1:] == [MANIFEST]
        return found

    def steps(self) -> list[int]:
        """Steps that have a manifest, ascending (their files are not verified here)."""
        return sorted(s for s, complete in self._step_dirs().items() if complete)

    def load(self, step: int) -> Checkpoint:
        """Load and verify one checkpoint; CorruptCheckpoint if anything is off."""
        step = _check_step(step)
        base = self.step_prefix(step)
        where = f"{self.store.full_url(base)}"
        try:
            raw = self.store.get(f"{base}/{MANIFEST}")
        except StorageNotFound:
            if self.store.list(base):
                raise CorruptCheckpoint(
                    f"checkpoint step {step} at {where} has no {MANIFEST}; it was only partly written",
                    hint="load an earlier step (see CheckpointStore.steps()) or use load_latest(), "
                    "which skips half-written checkpoints",
                ) from None
            raise StorageNotFound(
                f"no checkpoint for step {step} at {where}; available steps: {self.steps()}",
                hint="pick one of the available steps, or use load_latest()",
            ) from None
        manifest = _parse_manifest(raw, step, where)
        files: dict[str, bytes] = {}
        for name, entry in manifest["files"].items():
            try:
                data = self.store.get(f"{base}/{name}")
            except StorageNotFound:
                raise CorruptCheckpoint(
                    f"checkpoint step {step}: file {name!r} listed in the manifest is missing at {where}",
                    hint="this checkpoint is damaged; load an earlier step or use load_latest()",
                ) from None
            if len(data) != entry["size"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
                raise CorruptCheckpoint(
                    f"checkpoint step {step}: file {name!r} does not match its manifest "
                    f"(size {len(data)} vs {entry['size']}, or sha256 differs) at {where}",
                    hint="the file was modified or truncated; load an earlier step or use load_latest()",
                )
            files[name] = data
        return Checkpoint(step=step, files=files, metadata=manifest["metadata"])

    def _pointer_step(self) -> int | None:
        """Step named by the `latest` pointer; None if missing or unreadable."""
        try:
            raw = self.store.get(self._latest_key())
        except StorageNotFound:
            return None
        try:
            step = json.loads(raw)["step"]
            return _check_step(step)
        except (ValueError, KeyError, TypeError, UserError):
            _warn(
                f"checkpoint pointer {self.store.full_url(self._latest_key())} is unreadable; "
                "skipped it and searching for the newest complete checkpoint instead"
            )
            return None

    def _candidates(self) -> list[int]:
        """Steps to try, best first: the pointer's step, then older complete steps."""
        pointer = self._pointer_step()
        complete = self.steps()
        if pointer is None:
            return sorted(complete, reverse=True)
        # Steps above the pointer belong to an abandoned timeline (e.g. after
        # a reset to an earlier checkpoint); never prefer them.
        return [pointer] + sorted((s for s in complete if s < pointer), reverse=True)

    def load_latest(self) -> Checkpoint | None:
        """The newest valid checkpoint, skipping (with a warning) corrupt or half-written ones."""
        for step in self._candidates():
            try:
                return self.load(step)
            except (CorruptCheckpoint, StorageNotFound) as e:
                _warn(f"skipped checkpoint step {step}: {e.message}; falling back to an older checkpoint")
        return None

    def latest_step(self) -> int | None:
        """Step load_latest() would try first among those with a manifest (hashes not verified)."""
        complete = set(self.steps())
        for step in self._candidates():
            if step in complete:
                return step
        return None

    def materialize(self, step: int, dest_dir: str) -> str:
        """Write a verified checkpoint's files into local `dest_dir`; return dest_dir."""
        ckpt = self.load(step)
        os.makedirs(dest_dir, exist_ok=True)
        for name, data in ckpt.files.items():
            path = os.path.join(dest_dir, *name.split("/"))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
        return dest_dir


def _check_step(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise UserError(
            f"checkpoint step must be a non-negative integer, got {step!r}",
            hint="use the training step number, e.g. save(3, files)",
        )
    return step


def _check_file_name(name: str) -> None:
    validate_key(name)
    if name == MANIFEST:
        raise UserError(
            f"checkpoint file name {MANIFEST!r} is reserved for the checkpoint's own manifest",
            hint="rename the file or put it in a subdirectory, e.g. 'meta/manifest.json'",
        )


def _parse_manifest(raw: bytes, step: int, where: str) -> dict:
    def corrupt(why: str) -> CorruptCheckpoint:
        return CorruptCheckpoint(
            f"checkpoint step {step}: {MANIFEST} at {where} is unreadable ({why})",
            hint="this checkpoint is damaged; load an earlier step or use load_latest()",
        )

    try:
        manifest = json.loads(raw)
    except ValueError as e:
        raise corrupt(f"not valid JSON: {e}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise corrupt("missing the 'files' table")
    if manifest.get("step") != step:
        raise corrupt(f"it records step {manifest.get('step')!r}")
    for name, entry in manifest["files"].items():
        try:
            _check_file_name(name)
        except UserError:
            raise corrupt(f"unsafe file name {name!r}") from None
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("sha256"), str)
            or not isinstance(entry.get("size"), int)
        ):
            raise corrupt(f"bad entry for file {name!r}")
    if not isinstance(manifest.get("metadata", {}), dict):
        raise corrupt("'metadata' is not an object")
    manifest.setdefault("metadata", {})
    return manifest


def _warn(message: str) -> None:
    logger.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)
