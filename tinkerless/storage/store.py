"""Key/value object storage over fsspec.

A store is rooted at a local directory (the default) or any fsspec URL
(s3://bucket/prefix, gs://..., memory://...). Keys are '/'-separated paths
relative to that root. Every key goes through `validate_key` so a caller can
never read or write outside the root; a multi-tenant server relies on this.

Besides plain put/get, a store offers versioned reads and conditional writes
(`get_with_version`, `put_if`), the compare-and-swap that checkpoint commits
are built on: the ETag on S3, a content hash under a file lock locally.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import threading
import unicodedata
from collections.abc import Iterator
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from tinkerless.errors import StorageError, StorageNotFound, TinkerlessError, UserError
from tinkerless.storage import local as _local
from tinkerless.storage.errors import PreconditionFailed
from tinkerless.storage.names import MAX_NAME_BYTES

logger = logging.getLogger(__name__)

# Local writes go to a temp file next to the target first; a crash can leave
# one behind, so listings skip names that carry this marker (lock files too).
_TMP_MARK = _local.TMP_MARK

# memory:// lives in this process, so a process-wide lock makes its
# conditional writes exact.
_MEMORY_LOCK = threading.Lock()

_NOT_FOUND_HINT = "check the key and the storage URL; list what exists with ObjectStore.list(prefix)"


def validate_key(key: str) -> str:
    """Return `key` unchanged if it is a safe relative key, else raise UserError.

    Rejected: empty keys, absolute paths, backslashes, NUL and other control characters, empty parts
    ('a//b', trailing '/'), '.' or '..' parts (path traversal), and parts over 255 bytes (a file name's
    limit). The second wall behind `names.check_name`, which refuses such names where a client sends them.
    """
    if not isinstance(key, str):
        raise UserError(
            f"storage key must be a string, got {type(key).__name__}",
            hint="pass a '/'-separated relative key such as 'runs/my-run/state.json'",
        )
    hint = "use a '/'-separated relative key such as 'runs/my-run/state.json'"
    if not key:
        raise UserError("storage key is empty", hint=hint)
    if "\x00" in key:
        raise UserError(f"storage key {key!r} contains a NUL character", hint=hint)
    if "\\" in key:
        raise UserError(
            f"storage key {key!r} contains a backslash",
            hint="separate key parts with '/', not '\\'",
        )
    if key.startswith("/"):
        raise UserError(f"storage key {key!r} is an absolute path", hint=hint)
    parts = key.split("/")
    if any(p == "" for p in parts):
        raise UserError(f"storage key {key!r} has an empty part ('//' or a leading/trailing '/')", hint=hint)
    if any(p in (".", "..") for p in parts):
        raise UserError(
            f"storage key {key!r} contains a '.' or '..' part; keys may not leave or alias the store root",
            hint=hint,
        )
    if any(unicodedata.category(c) in ("Cc", "Cf") for c in key):
        raise UserError(f"storage key {key[:80]!r} contains a control character", hint=hint)
    if any(len(p.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES for p in parts):
        raise UserError(f"storage key {key[:80]!r}... has a part over {MAX_NAME_BYTES} bytes", hint=hint)
    if len(parts[0]) == 2 and parts[0][1] == ":" and parts[0][0].isalpha():
        raise UserError(f"storage key {key!r} looks like a Windows drive path", hint=hint)
    return key


def _validate_prefix(prefix: str) -> str:
    """A listing/deletion prefix: like a key, but '' (the root) and a trailing '/' are allowed."""
    prefix = prefix.rstrip("/") if prefix else ""
    return validate_key(prefix) if prefix else ""


class ObjectStore:
    """Bytes stored under string keys, rooted at a local directory or fsspec URL.

    For s3:// URLs, `storage_options` go to s3fs (e.g. ``key=``, ``secret=``,
    ``profile=``, ``client_kwargs={"endpoint_url": ...}``); credentials and
    endpoints otherwise come from the standard AWS environment and ~/.aws.
    """

    def __init__(self, url: str = ".", **storage_options: Any):
        if url.split("://", 1)[0] in ("s3", "s3a"):
            # Listings must show other processes' writes (checkpoints from
            # another writer, a crashed save), so don't serve them from a cache.
            storage_options.setdefault("use_listings_cache", False)
            # fsspec reuses filesystem instances with equal arguments, but s3fs reads the endpoint
            # and credentials from the environment when the instance is made: a cached one could
            # still talk to an endpoint the environment has since moved away from.
            storage_options.setdefault("skip_instance_cache", True)
        try:
            fs, root = fsspec.core.url_to_fs(url, **storage_options)
        except (ImportError, ValueError) as e:
            raise StorageError(
                f"cannot open object storage at {url!r}: {e}",
                hint="install the fsspec backend for this URL scheme (e.g. `pip install s3fs` for s3://) "
                "or pass a local directory",
            ) from e
        self.fs = fs
        self.is_local = isinstance(fs, LocalFileSystem)
        self._s3: Any = None
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        self._is_memory = "memory" in protocols
        if self.is_local:
            root = os.path.abspath(root)
            try:
                os.makedirs(root, exist_ok=True)
            except OSError as e:
                raise StorageError(
                    f"cannot create local storage directory {root}: {e}",
                    hint="choose a directory you can write to, or fix its permissions",
                ) from e
            self.url = root
        else:
            root = root.rstrip("/")
            self.url = fs.unstrip_protocol(root)
            if "s3" in protocols:
                from tinkerless.storage.s3 import S3Access

                self._s3 = S3Access(fs)
        self._root = root.rstrip("/") if root != "/" else ""

    def __repr__(self) -> str:
        return f"ObjectStore({self.url!r})"

    def child(self, prefix: str) -> "ObjectStore":
        """A store rooted at `prefix` inside this one (same filesystem and credentials).

        Keys of the child can only name objects under `prefix`: a multi-tenant server gives
        each tenant its own child, so no key a tenant sends reaches another tenant's objects."""
        validate_key(prefix)
        clone = copy.copy(self)
        clone._root = self._path(prefix)
        clone.url = self.full_url(prefix)
        return clone

    @property
    def supports_conditional_writes(self) -> bool:
        """Whether `put_if` is a real compare-and-swap here (local, s3://, memory://)."""
        return self.is_local or self._s3 is not None or self._is_memory

    # -- paths ---------------------------------------------------------------

    def _path(self, key: str) -> str:
        return f"{self._root}/{key}" if key else (self._root or "/")

    def full_url(self, key: str) -> str:
        """The URL (or local path) a key lives at; used in error messages."""
        key = _validate_prefix(key)
        return f"{self.url.rstrip('/')}/{key}" if key else self.url

    def local_path(self, key: str) -> str | None:
        """Filesystem path of `key` when the store is local, else None."""
        validate_key(key)
        if not self.is_local:
            return None
        return os.path.join(self._root or "/", *key.split("/"))

    @contextlib.contextmanager
    def _io(self, action: str, key: str, hint: str) -> Iterator[None]:
        """Turn backend failures into typed errors that name the URL."""
        try:
            if self._s3 is not None:
                self._s3.ensure_bucket(self._path(key))
            yield
        except TinkerlessError:
            raise
        except Exception as e:
            url = self.full_url(key)
            translated = self._s3.translate(e, url) if self._s3 is not None else None
            if translated is not None:
                raise translated from e
            if isinstance(e, OSError):
                raise StorageError(f"could not {action} {url}: {e}", hint=hint) from e
            raise

    def _not_found(self, key: str, e: BaseException) -> StorageNotFound:
        if self._s3 is not None and self._s3.translate(e, self.full_url(key)) is not None:
            raise e  # e.g. the bucket itself is gone; _io reports that instead
        return StorageNotFound(f"no object at {self.full_url(key)}", hint=_NOT_FOUND_HINT)

    # -- operations ----------------------------------------------------------

    def put(self, key: str, data: bytes) -> None:
        """Store `data` under `key`. Local writes are atomic (temp file, fsync, rename)."""
        validate_key(key)
        data = _require_bytes(key, data)
        with self._io("write", key, "check that the storage location is writable and has free space"):
            if self.is_local:
                _local.atomic_write(self.local_path(key), data)  # type: ignore[arg-type]
            else:
                # Object stores replace a whole object per PUT, so this is atomic there.
                self.fs.pipe_file(self._path(key), data)

    def get(self, key: str) -> bytes:
        """Bytes stored under `key`; StorageNotFound if there are none."""
        validate_key(key)
        with self._io("read", key, "check that the storage location is reachable and readable"):
            try:
                if self.is_local:
                    with open(self.local_path(key), "rb") as f:  # type: ignore[arg-type]
                        return f.read()
                return self.fs.cat_file(self._path(key))
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
                raise self._not_found(key, e) from e
        raise AssertionError("unreachable")  # _io re-raises every failure

    def exists(self, key: str) -> bool:
        """True if an object (a file, not a prefix) is stored under `key`."""
        validate_key(key)
        with self._io("check", key, "check that the storage location is reachable"):
            return bool(self.fs.isfile(self._path(key)))
        raise AssertionError("unreachable")

    def list(self, prefix: str = "") -> list[str]:
        """Keys of all objects under `prefix` (a key or a directory-style prefix), sorted."""
        prefix = _validate_prefix(prefix)
        with self._io("list", prefix, "check that the storage location is reachable"):
            try:
                paths = self.fs.find(self._path(prefix))
            except FileNotFoundError as e:
                if self._s3 is not None and self._s3.translate(e, self.full_url(prefix)) is not None:
                    raise
                return []
        keys = []
        for p in paths:
            key = self._key_of(p)
            # Skip temp and lock files, also inside a hidden temp directory.
            if key is None or any(part.startswith(_TMP_MARK) for part in key.split("/")):
                continue
            keys.append(key)
        return sorted(keys)

    def _key_of(self, path: str) -> str | None:
        path = path.replace(os.sep, "/") if self.is_local else path
        base = self._root + "/"
        if not path.startswith(base):
            # Some backends return paths without a leading '/'; compare stripped.
            stripped_base, stripped = base.lstrip("/"), path.lstrip("/")
            if not stripped.startswith(stripped_base):
                logger.debug("skipping %s: not under store root %s", path, self._root)
                return None
            return stripped[len(stripped_base):]
        return path[len(base):]

    def delete(self, key_or_prefix: str) -> None:
        """Delete one object or everything under a prefix. Missing keys are fine."""
        key = validate_key(key_or_prefix.rstrip("/") if key_or_prefix else key_or_prefix)
        path = self._path(key)
        with self._io("delete", key, "check that the storage location is writable"):
            try:
                if self.fs.isfile(path):
                    self.fs.rm_file(path)
                elif self.fs.isdir(path):
                    self.fs.rm(path, recursive=True)
            except FileNotFoundError:
                pass

    # -- versioned reads and conditional writes -----------------------------

    def get_with_version(self, key: str) -> tuple[bytes, str]:
        """Bytes under `key` and an opaque version for `put_if(match=...)`; StorageNotFound if absent.

        The version is the ETag on S3 and a sha256 of the content elsewhere;
        both come from the same read, so they always belong together."""
        validate_key(key)
        with self._io("read", key, "check that the storage location is reachable and readable"):
            if self._s3 is not None:
                return self._s3.get_with_version(self._path(key), self.full_url(key))
            if self.is_local:
                found = _local.read_version(self.local_path(key))  # type: ignore[arg-type]
                if found is None:
                    raise StorageNotFound(f"no object at {self.full_url(key)}", hint=_NOT_FOUND_HINT)
                return found
            with _MEMORY_LOCK if self._is_memory else contextlib.nullcontext():
                try:
                    data = self.fs.cat_file(self._path(key))
                except FileNotFoundError as e:
                    raise self._not_found(key, e) from e
            return data, _local.content_version(data)
        raise AssertionError("unreachable")

    def put_if(self, key: str, data: bytes, *, match: str | None) -> str:
        """Write `data` only if `key` is still at version `match` (None: only if `key` does not exist).

        Returns the new version; raises PreconditionFailed, and writes nothing,
        if another writer got there first. S3 checks the condition server-side
        (If-Match / If-None-Match); locally it is checked under an exclusive lock."""
        validate_key(key)
        data = _require_bytes(key, data)
        self._require_conditional(key)
        with self._io("write", key, "check that the storage location is writable and has free space"):
            if self._s3 is not None:
                return self._s3.put_if(self._path(key), data, match, self.full_url(key))
            if self.is_local:
                target = self.local_path(key)
                assert target is not None
                with _local.exclusive(target):
                    current = _local.read_version(target)
                    self._check_precondition(key, None if current is None else current[1], match)
                    _local.atomic_write(target, data)
                return _local.content_version(data)
            with _MEMORY_LOCK:
                try:
                    current_version: str | None = _local.content_version(self.fs.cat_file(self._path(key)))
                except FileNotFoundError:
                    current_version = None
                self._check_precondition(key, current_version, match)
                self.fs.pipe_file(self._path(key), data)
            return _local.content_version(data)
        raise AssertionError("unreachable")

    def _check_precondition(self, key: str, current: str | None, match: str | None) -> None:
        if current == match:
            return
        expected = "not to exist" if match is None else f"to have version {match}"
        found = "it does not exist" if current is None else f"it has version {current}"
        raise PreconditionFailed(
            f"conditional write to {self.full_url(key)} refused: it was expected {expected}, but {found}",
            hint="read it again (get_with_version) and retry, or stop the other writer",
        )

    def _require_conditional(self, key: str) -> None:
        if not self.supports_conditional_writes:
            raise StorageError(
                f"conditional writes are not supported for {self.full_url(key)} "
                f"(protocol {self.fs.protocol!r})",
                hint="use a local directory, s3:// (including S3-compatible stores) or memory://",
            )


def _require_bytes(key: str, data: object) -> bytes:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise UserError(
            f"ObjectStore write of {key!r} needs bytes, got {type(data).__name__}",
            hint="encode text first, e.g. json.dumps(obj).encode()",
        )
    return bytes(data)
