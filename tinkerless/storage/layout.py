"""What a checkpoint prefix holds, and how its two small JSON records are read and written.

Layout under a prefix such as ``runs/<run_id>/checkpoints``::

    step-<n>/claim.json          who owns this directory (created only if absent)
    step-<n>/<files...>          the checkpoint's files (names may contain '/')
    step-<n>/manifest.json       written LAST: sha256 and size of every file
    step-<n>.<token>/...         the same, for a later save of step n that found
                                 step-<n> taken (a resave, a retry after a crash,
                                 a second writer); the pointer says which one counts
    latest                       the pointer: the committed step, its directory,
                                 the writer, and the committed history (newest first)
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass, field

from tinkerless.errors import CorruptCheckpoint, UserError
from tinkerless.storage.store import validate_key

MANIFEST = "manifest.json"
CLAIM = "claim.json"
LATEST = "latest"
RESERVED = (MANIFEST, CLAIM)
# How many committed (step, directory) pairs the pointer remembers when
# keep_last is None; older checkpoints are still found by listing.
HISTORY_LIMIT = 256

_DIR = re.compile(r"^step-(\d+)(?:\.[0-9a-f]{12})?$")


def dir_step(name: str) -> int | None:
    """The step a checkpoint directory name belongs to, or None if it is not one."""
    m = _DIR.match(name)
    return int(m.group(1)) if m else None


def canonical_dir(step: int) -> str:
    return f"step-{step}"


@dataclass
class Pointer:
    """The content of `latest`: what is committed. Moved only by compare-and-swap."""

    step: int
    dir: str
    writer: str | None = None
    # Committed (step, directory) pairs, newest first; history[0] == (step, dir).
    history: list[tuple[int, str]] = field(default_factory=list)

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "step": self.step,
                "dir": self.dir,
                "writer": self.writer,
                "committed_at": time.time(),
                "history": [[s, d] for s, d in self.history],
            },
            indent=1,
        ).encode()

    @classmethod
    def parse(cls, raw: bytes) -> Pointer:
        """Parse `latest`; ValueError or TypeError if it is unreadable. A bare {"step": n} (older layout) means step-<n>."""
        d = json.loads(raw)
        if not isinstance(d, dict):
            raise TypeError("not a JSON object")
        step = check_step(d.get("step"), error=ValueError)
        name = d.get("dir", canonical_dir(step))
        if not isinstance(name, str) or dir_step(name) != step:
            raise ValueError(f"directory {name!r} is not one of step {step}")
        entries = d.get("history", [[step, name]])
        if not isinstance(entries, list) or not entries or entries[0] != [step, name]:
            raise ValueError("the history does not start with the committed step")
        history = [(step, name)]
        for entry in entries[1:]:
            if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], str)):
                raise ValueError(f"bad history entry {entry!r}")
            s = check_step(entry[0], error=ValueError)
            if dir_step(entry[1]) != s or s >= history[-1][0]:
                raise ValueError(f"bad history entry {entry!r}")
            history.append((s, entry[1]))
        writer = d.get("writer")
        return cls(step, name, writer if isinstance(writer, str) else None, history)


def check_step(step: object, error: type[Exception] = UserError) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        message = f"checkpoint step must be a non-negative integer, got {step!r}"
        if error is UserError:
            raise UserError(message, hint="use the training step number, e.g. save(3, files)")
        raise error(message)
    return step


def check_file_name(name: str) -> None:
    validate_key(name)
    if name in RESERVED:
        raise UserError(
            f"checkpoint file name {name!r} is reserved for the checkpoint's own bookkeeping",
            hint="rename the file or put it in a subdirectory, e.g. 'meta/manifest.json'",
        )


def build_manifest(step: int, files: dict[str, bytes], metadata: dict | None, writer: str) -> bytes:
    """Validate a checkpoint's inputs and return its manifest, before anything is written."""
    if not files:
        raise UserError(
            f"checkpoint for step {step} has no files",
            hint="pass at least one file, e.g. {'adapter/adapter_model.safetensors': data}",
        )
    for name, data in files.items():
        check_file_name(name)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise UserError(
                f"checkpoint file {name!r} (step {step}) is {type(data).__name__}, not bytes",
                hint="serialize it first (e.g. safetensors.torch.save(...) or json.dumps(...).encode())",
            )
    manifest = {
        "step": step,
        "created_at": time.time(),
        "writer": writer,
        "files": {
            name: {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)} for name, data in files.items()
        },
        "metadata": dict(metadata or {}),
    }
    try:
        return json.dumps(manifest, indent=1, sort_keys=True).encode()
    except (TypeError, ValueError) as e:
        raise UserError(
            f"checkpoint metadata for step {step} is not JSON-serializable: {e}",
            hint="keep metadata to str/int/float/bool/None, lists and dicts",
        ) from e


def parse_manifest(raw: bytes, step: int, where: str) -> dict:
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
            check_file_name(name)
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
