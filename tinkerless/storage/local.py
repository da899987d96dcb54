"""Local-filesystem primitives of ObjectStore: atomic writes and compare-and-swap.

A local object's version is the sha256 of its content. A conditional write
takes an exclusive lock on a lock file next to the target (``fcntl.flock``,
so it excludes other processes and, through separate open files, other
threads), compares the current content's hash with the expected one, and
replaces the file by an atomic rename. Readers never need the lock: a rename
swaps whole files, so a read sees the old or the new content, never a mix.
The holder deletes the lock file before it lets go, so none outlives a write.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import threading
from collections.abc import Iterator

# Temp files and lock files carry this marker; listings skip such names.
TMP_MARK = ".tinkerless-tmp-"

# flock excludes per open file, which covers threads too; these extra locks
# (striped by path, so they stay few) keep threads of one process correct on
# filesystems where flock falls back to per-process POSIX locks (NFS).
_THREAD_LOCKS = [threading.Lock() for _ in range(64)]


def content_version(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def atomic_write(target: str, data: bytes) -> None:
    """Write via a temp file in the same directory, fsync, rename over `target`, fsync the directory."""
    directory = os.path.dirname(target)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TMP_MARK, dir=directory)
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
    fsync_dir(directory)


def read_version(target: str) -> tuple[bytes, str] | None:
    """Content and version of `target`, or None if it does not exist."""
    try:
        with open(target, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    return data, content_version(data)


@contextlib.contextmanager
def exclusive(target: str) -> Iterator[None]:
    """Hold the exclusive lock that guards conditional writes of `target`."""
    import fcntl  # POSIX only; imported here so the module imports everywhere

    directory, name = os.path.split(target)
    os.makedirs(directory, exist_ok=True)
    lock_path = os.path.join(directory, f"{TMP_MARK}lock.{name}")
    with _THREAD_LOCKS[hash(lock_path) % len(_THREAD_LOCKS)]:
        while True:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                # The lock file may have been deleted (with its directory) and
                # recreated while we waited; a lock on the old inode guards nothing.
                try:
                    same = os.fstat(fd).st_ino == os.stat(lock_path).st_ino
                except FileNotFoundError:
                    same = False
                if same:
                    try:
                        yield
                    finally:
                        # Remove the lock file while still holding it, so none is left behind. A waiter
                        # that then gets the lock on this unlinked inode sees it is no longer the file
                        # at `lock_path` (the inode check above) and locks a fresh one.
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(lock_path)
                    return
            finally:
                os.close(fd)  # also releases the flock


def fsync_dir(directory: str) -> None:
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
