"""Verified checkpoints on an ObjectStore, committed atomically even on S3.

A save (1) reads the `latest` pointer and its version, (2) claims a directory
of its own for the step, (3) uploads the files, then the manifest (sha256 per
file), and (4) moves `latest` with a compare-and-swap against the version read
in (1). Until (4) nothing points at the new files, so a crash anywhere leaves
the previous checkpoint in force; of two writers racing from the same pointer,
exactly one swap succeeds and the other gets CommitConflict and removes its
own files. Because every save writes into a directory no other live save
uses, a losing writer can never overwrite the winner's files.

Readers follow `latest` (its history lists the committed steps), verify every
file against the manifest, and fall back to the previous committed step, with
a warning naming the bad file, when a checkpoint is corrupt or incomplete.
The directory layout is described in `tinkerless.storage.layout`.
`BackgroundSaves` (defined in `tinkerless.storage.background`, importable from here)
runs such saves off the training loop's critical path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import time
import uuid
import warnings
from dataclasses import dataclass, field

from tinkerless.errors import (
    ConfigError,
    CorruptCheckpoint,
    StorageError,
    StorageNotFound,
)
# Re-exported (see __all__): the run host and tests import BackgroundSaves from here.
from tinkerless.storage.background import BackgroundSaves
from tinkerless.storage.errors import CommitConflict, PreconditionFailed
from tinkerless.storage.layout import (
    CLAIM,
    HISTORY_LIMIT,
    LATEST,
    MANIFEST,
    Pointer,
    build_manifest,
    canonical_dir,
    check_step,
    dir_step,
    parse_manifest,
)
from tinkerless.storage.store import ObjectStore, validate_key

__all__ = ["BackgroundSaves", "Checkpoint", "CheckpointStore", "default_writer_id"]

logger = logging.getLogger(__name__)

# A reader restarts this many times when `latest` moves (and a writer may have
# pruned the step it was reading) before it reports failures as corruption.
_READ_ATTEMPTS = 3


@dataclass
class Checkpoint:
    step: int
    files: dict[str, bytes]
    metadata: dict = field(default_factory=dict)


def default_writer_id() -> str:
    """Names this process in claims, manifests and conflict errors."""
    return f"{socket.gethostname()}/pid-{os.getpid()}/{uuid.uuid4().hex[:6]}"


class CheckpointStore:
    """Save, verify, load and prune numbered checkpoints under one prefix."""

    def __init__(self, store: ObjectStore, prefix: str, keep_last: int | None = None, *, writer: str | None = None):
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ConfigError(
                f"keep_last must be a positive integer or None, got {keep_last!r}",
                hint="use None to keep every checkpoint, or e.g. keep_last=3",
            )
        self.store = store
        self.prefix = validate_key(prefix.rstrip("/"))
        self.keep_last = keep_last
        self.writer = writer or default_writer_id()
        self._warned_no_cas = False

    # -- keys ----------------------------------------------------------------

    def step_prefix(self, step: int) -> str:
        """Where the first save of `step` puts its files (see `location` for the committed one)."""
        return f"{self.prefix}/{canonical_dir(step)}"

    def location(self, step: int) -> str:
        """Prefix of the files `load(step)` reads: the committed directory of `step`."""
        return f"{self.prefix}/{self._resolve(check_step(step), self._read_pointer(quiet=True)[0])}"

    def _latest_key(self) -> str:
        return f"{self.prefix}/{LATEST}"

    # -- writing -------------------------------------------------------------

    def save(self, step: int, files: dict[str, bytes], metadata: dict | None = None) -> str:
        """Write and commit a checkpoint; return the prefix its files live under.

        Raises CommitConflict if another writer moved `latest` during the save."""
        step = check_step(step)
        manifest = build_manifest(step, files, metadata, self.writer)
        base, base_version = self._read_pointer(quiet=True)  # the state this save builds on
        where = f"{self.prefix}/{self._claim(step)}"
        try:
            for name, data in files.items():
                self.store.put(f"{where}/{name}", bytes(data))
            self.store.put(f"{where}/{MANIFEST}", manifest)
        except BaseException:
            self._discard(where)  # never referenced; don't leave it for a listing to find
            raise
        try:
            pointer = self._commit(step, where.rsplit("/", 1)[1], base, base_version)
        except CommitConflict:
            self._discard(where)
            raise
        # Any other failure of the commit leaves the files alone: the swap may have happened.
        try:
            self._prune(pointer)
        except StorageError as e:  # the checkpoint is committed; leftovers go at the next save
            logger.warning("checkpoint step %d is committed, but pruning old checkpoints failed: %s", step, e)
        return where

    def _claim(self, step: int) -> str:
        """A directory for this save that no other live save writes into."""
        name = canonical_dir(step)
        key = f"{self.prefix}/{name}/{CLAIM}"
        claim = json.dumps({"writer": self.writer, "step": step, "claimed_at": time.time()}).encode()
        try:
            self._put_if(key, claim, match=None)
        except PreconditionFailed:
            pass  # an earlier or concurrent save of this step has it
        else:
            if self.store.list(f"{self.prefix}/{name}") == [key]:
                return name
            # Unclaimed files from an older tinkerless: leave them to pruning, write elsewhere.
        return f"{name}.{uuid.uuid4().hex[:12]}"

    def _commit(self, step: int, name: str, base: Pointer | None, base_version: str | None) -> Pointer:
        """Move `latest` to (step, name) if it is still at `base_version`: the commit point."""
        older = [(s, d) for s, d in (base.history if base else []) if s < step]
        history = ([(step, name)] + older)[: self.keep_last or HISTORY_LIMIT]
        pointer = Pointer(step, name, self.writer, history)
        try:
            self._put_if(self._latest_key(), pointer.to_bytes(), match=base_version)
        except PreconditionFailed as e:
            raise self._conflict(step) from e
        return pointer

    def _conflict(self, step: int) -> CommitConflict:
        other, _ = self._read_pointer(quiet=True)
        who = f"writer {other.writer!r}" if other and other.writer else "another writer"
        now = f"`latest` now names step {other.step}" if other else "`latest` changed"
        return CommitConflict(
            f"checkpoint step {step} was not committed to {self.store.full_url(self.prefix)}: {who} committed "
            f"there while this save was running ({now}). This writer is {self.writer!r}; its files for "
            f"step {step} were discarded",
            hint="two processes are writing the same run's checkpoints: stop one of them (or give each its own "
            "run_id / storage prefix), then resume from the latest checkpoint",
        )

    def _put_if(self, key: str, data: bytes, *, match: str | None) -> None:
        if self.store.supports_conditional_writes:
            self.store.put_if(key, data, match=match)
            return
        if not self._warned_no_cas:
            self._warned_no_cas = True
            _warn(
                f"{self.store.url} has no conditional writes in tinkerless, so two writers on "
                f"{self.prefix} are only detected on a best-effort basis; use a local directory or s3://"
            )
        try:
            current: str | None = self.store.get_with_version(key)[1]
        except StorageNotFound:
            current = None
        if current != match:
            raise PreconditionFailed(f"{self.store.full_url(key)} was changed by another writer")
        self.store.put(key, data)

    def _discard(self, where: str) -> None:
        try:
            self.store.delete(where)
        except StorageError as e:  # best effort; the directory is unreferenced either way
            logger.warning("could not remove uncommitted checkpoint files at %s: %s", where, e)

    def _prune(self, pointer: Pointer) -> None:
        """Delete what no committed checkpoint in the keep window needs.

        Never touches the directories `latest` names (re-read now, as another
        writer may have committed since), nor anything at or above the step
        just committed, where a save may still be running."""
        current, _ = self._read_pointer(quiet=True)
        protected = {d for _, d in pointer.history} | {d for _, d in (current.history if current else [])}
        floor = pointer.history[-1][0]  # the oldest step the pointer still lists
        for name, (step, complete) in sorted(self._scan().items()):
            if name in protected or step >= pointer.step:
                continue
            if step < floor and complete and self.keep_last is None:
                continue  # committed before the pointer's history began: keep everything
            logger.info("pruning checkpoint directory %s/%s", self.prefix, name)
            self.store.delete(f"{self.prefix}/{name}")

    # -- reading -------------------------------------------------------------

    def _read_pointer(self, quiet: bool = False) -> tuple[Pointer | None, str | None]:
        """The parsed pointer (None if missing or unreadable) and the version it was read at."""
        try:
            raw, version = self.store.get_with_version(self._latest_key())
        except StorageNotFound:
            return None, None
        try:
            return Pointer.parse(raw), version
        except (ValueError, TypeError) as e:  # UnicodeDecodeError is a ValueError
            if not quiet:
                _warn(
                    f"checkpoint pointer {self.store.full_url(self._latest_key())} is unreadable ({e}); "
                    "skipped it and searching for the newest complete checkpoint instead"
                )
            return None, version

    def _scan(self) -> dict[str, tuple[int, bool]]:
        """Every checkpoint directory under the prefix -> (its step, whether it has a manifest)."""
        found: dict[str, tuple[int, bool]] = {}
        for key in self.store.list(self.prefix):
            parts = key[len(self.prefix) + 1:].split("/")
            step = dir_step(parts[0])
            if step is None or len(parts) < 2:
                continue
            complete = found.get(parts[0], (step, False))[1] or parts[1:] == [MANIFEST]
            found[parts[0]] = (step, complete)
        return found

    @staticmethod
    def _candidates(pointer: Pointer | None, scan: dict[str, tuple[int, bool]]) -> list[tuple[int, str]]:
        """(step, directory) pairs to try, best first: the committed history, then older complete ones.

        Directories above the pointer's step, or beside its history, belong to
        abandoned timelines, crashed saves or losing writers: never chosen."""
        complete = sorted(
            ((s, name) for name, (s, ok) in scan.items() if ok),
            key=lambda sd: (-sd[0], sd[1] != canonical_dir(sd[0]), sd[1]),
        )
        if pointer is None:
            return complete
        floor = pointer.history[-1][0]
        return list(pointer.history) + [(s, d) for s, d in complete if s < floor]

    def steps(self) -> list[int]:
        """Committed steps that have a manifest, ascending (their files are not verified here)."""
        scan = self._scan()
        pointer, _ = self._read_pointer(quiet=True)
        return sorted({s for s, d in self._candidates(pointer, scan) if scan.get(d, (s, False))[1]})

    def latest_step(self) -> int | None:
        """Step load_latest() would try first among those with a manifest (hashes not verified)."""
        scan = self._scan()
        pointer, _ = self._read_pointer(quiet=True)
        for s, d in self._candidates(pointer, scan):
            if scan.get(d, (s, False))[1]:
                return s
        return None

    def load(self, step: int) -> Checkpoint:
        """Load and verify one checkpoint; CorruptCheckpoint if anything is off."""
        step = check_step(step)
        return self._load_dir(step, self._resolve(step, self._read_pointer(quiet=True)[0]))

    def load_latest(self, skipped: list[str] | None = None) -> Checkpoint | None:
        """The newest valid committed checkpoint, skipping (with a warning) corrupt or half-written ones.

        Each skip's warning is also appended to `skipped`, for a caller that reports it further (a server
        tells its client)."""
        for attempt in range(_READ_ATTEMPTS):
            pointer, version = self._read_pointer(quiet=attempt > 0)
            for step, name in self._candidates(pointer, self._scan()):
                try:
                    return self._load_dir(step, name)
                except (CorruptCheckpoint, StorageNotFound) as e:
                    if attempt + 1 < _READ_ATTEMPTS and self._pointer_version() != version:
                        break  # a writer committed (and may have pruned this step): start over
                    message = f"skipped checkpoint step {step}: {e.message}; falling back to an older checkpoint"
                    _warn(message)
                    if skipped is not None:
                        skipped.append(message)
            else:
                return None
        return None

    def _pointer_version(self) -> str | None:
        try:
            return self.store.get_with_version(self._latest_key())[1]
        except StorageNotFound:
            return None

    def _resolve(self, step: int, pointer: Pointer | None) -> str:
        """The committed directory of `step`. A directory `latest` does not account for
        (a crashed or losing save, an abandoned timeline) is never returned."""
        for s, name in pointer.history if pointer else []:
            if s == step:
                return name
        scan = self._scan()
        for s, name in self._candidates(pointer, scan):
            if s == step:
                return name
        names = [n for n, (s, _) in scan.items() if s == step]
        where = self.store.full_url(self.step_prefix(step))
        hint = "load a committed step (see CheckpointStore.steps()) or use load_latest()"
        if any(scan[n][1] for n in names):
            raise CorruptCheckpoint(
                f"checkpoint step {step} at {where} was written but never committed (`latest` does not "
                "account for it): it is from a save that crashed, lost to another writer, or was abandoned",
                hint=hint,
            )
        if names:
            raise CorruptCheckpoint(
                f"checkpoint step {step} at {where} has no {MANIFEST}; it was only partly written",
                hint=hint + ", which skips half-written checkpoints",
            )
        raise StorageNotFound(
            f"no checkpoint for step {step} at {where}; available steps: {self.steps()}",
            hint="pick one of the available steps, or use load_latest()",
        )

    def manifest(self, step: int) -> dict:
        """The committed manifest of `step` (files with sizes and hashes, metadata), without reading the files."""
        step = check_step(step)
        return self._read_manifest(step, self._resolve(step, self._read_pointer(quiet=True)[0]))

    def _read_manifest(self, step: int, name: str) -> dict:
        base = f"{self.prefix}/{name}"
        where = self.store.full_url(base)
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
        return parse_manifest(raw, step, where)

    def _load_dir(self, step: int, name: str) -> Checkpoint:
        base = f"{self.prefix}/{name}"
        where = self.store.full_url(base)
        manifest = self._read_manifest(step, name)
        files: dict[str, bytes] = {}
        for file_name, entry in manifest["files"].items():
            try:
                data = self.store.get(f"{base}/{file_name}")
            except StorageNotFound:
                raise CorruptCheckpoint(
                    f"checkpoint step {step}: file {file_name!r} listed in the manifest is missing at {where}",
                    hint="this checkpoint is damaged; load an earlier step or use load_latest()",
                ) from None
            if len(data) != entry["size"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
                raise CorruptCheckpoint(
                    f"checkpoint step {step}: file {file_name!r} does not match its manifest "
                    f"(size {len(data)} vs {entry['size']}, or sha256 differs) at {where}",
                    hint="the file was modified or truncated; load an earlier step or use load_latest()",
                )
            files[file_name] = data
        return Checkpoint(step=step, files=files, metadata=manifest["metadata"])

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


def _warn(message: str) -> None:
    logger.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)
