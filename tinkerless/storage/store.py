"""Key/value object storage over fsspec.

A store is rooted at a local directory (the default) or any fsspec URL
(s3://bucket/prefix, gs://..., memory://...). Keys are '/'-separated paths
relative to that root. Every key goes through `validate_key` so a caller can
never read or write outside the root; a multi-tenant server relies on this.
"""

from __future__ import annotations

import logging
import os
import tempfile

import fsspec
from fsspec.implementations.local import LocalFileSystem

from tinkerless.errors import StorageError, StorageNotFound, UserError

logger = logging.getLogger(__name__)

# Local writes go to a temp file next to the target first; a crash can leave
# one behind, so listings skip names that carry this marker.
_TMP_MARK = ".tinkerless-tmp-"


def validate_key(key: str) -> str:
    """Return `key` unchanged if it is a safe relative key, else raise UserError.

    Rejected: empty keys, absolute paths, backslashes, NUL, empty parts
    ('a//b', trailing '/'), and '.' or '..' parts (path traversal).
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
    if len(parts[0]) == 2 and parts[0][1] == ":" and parts[0][0].isalpha():
        raise UserError(f"storage key {key!r} looks like a Windows drive path", hint=hint)
    return key


def _validate_prefix(prefix: str) -> str:
    """A listing/deletion prefix: like a key, but '' (the root) and a trailing '/' are allowed."""
    prefix = prefix.rstrip("/") if prefix else ""
    return validate_key(prefix) if prefix else ""


class ObjectStore:
    """Bytes stored under string keys, rooted at a local directory or fsspec URL."""

    def __init__(self, url: str = ".", **storage_options):
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
        self._root = root.rstrip("/") if root != "/" else ""

    def __repr__(self) -> str:
        return f"ObjectStore({self.url!r})"

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

    # -- operations ----------------------------------------------------------

    def put(self, key: str, data: bytes) -> None:
        """Store `data` under `key`. Local writes are atomic (temp file, fsync, rename)."""
        validate_key(key)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise UserError(
                f"ObjectStore.put({key!r}) needs bytes, got {type(data).__name__}",
                hint="encode text first, e.g. json.dumps(obj).encode()",
            )
        try:
            if self.is_local:
                self._put_local(key, bytes(data))
            else:
                # Object stores replace a whole object per PUT, so this is atomic there.
                self.fs.pipe_file(self._path(key), bytes(data))
        except OSError as e:
            raise StorageError(
                f"could not write {self.full_url(key)}: {e}",
                hint="check that the storage location is writable and has free space",
            ) from e

    def _put_local(self, key: str, data: bytes) -> None:
        target = self.local_path(key)
        assert target is not None
        directory = os.path.dirname(target)
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=_TMP_MARK, dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        _fsync_dir(directory)

    def get(self, key: str) -> bytes:
        """Bytes stored under `key`; StorageNotFound if there are none."""
        validate_key(key)
        try:
            if self.is_local:
                with open(self.local_path(key), "rb") as f:  # type: ignore[arg-type]
                    return f.read()
            return self.fs.cat_file(self._path(key))
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
            raise StorageNotFound(
                f"no object at {self.full_url(key)}",
                hint="check the key and the storage URL; list what exists with ObjectStore.list(prefix)",
            ) from e
        except OSError as e:
            raise StorageError(
                f"could not read {self.full_url(key)}: {e}",
                hint="check that the storage location is reachable and readable",
            ) from e

    def exists(self, key: str) -> bool:
        """True if an object (a file, not a prefix) is stored under `key`."""
        validate_key(key)
        try:
            return bool(self.fs.isfile(self._path(key)))
        except OSError as e:
            raise StorageError(
                f"could not check {self.full_url(key)}: {e}",
                hint="check that the storage location is reachable",
            ) from e

    def list(self, prefix: str = "") -> list[str]:
        """Keys of all objects under `prefix` (a key or a directory-style prefix), sorted."""
        prefix = _validate_prefix(prefix)
        try:
            paths = self.fs.find(self._path(prefix))
        except FileNotFoundError:
            return []
        except OSError as e:
            raise StorageError(
                f"could not list {self.full_url(prefix)}: {e}",
                hint="check that the storage location is reachable",
            ) from e
        keys = []
        for p in paths:
            key = self._key_of(p)
            if key is None or key.rsplit("/", 1)[-1].startswith(_TMP_MARK):
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
        try:
            if self.fs.isfile(path):
                self.fs.rm_file(path)
            elif self.fs.isdir(path):
                self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise StorageError(
                f"could not delete {self.full_url(key)}: {e}",
                hint="check that the storage location is writable",
            ) from e


def _fsync_dir(directory: str) -> None:
    # Make the rename itself durable; not supported on every platform/filesystem.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
