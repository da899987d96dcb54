"""One unprivileged host uid per concurrent sandbox, so RLIMIT_NPROC counts exactly that sandbox's tasks.

Used when the worker runs as root: bubblewrap then needs no user namespace, and the
sandboxed interpreter drops from root to a uid of its own. The kernel counts
RLIMIT_NPROC per uid, so two sandboxes sharing a uid would share one process budget
(and root's is not enforced at all). A uid is leased by holding an flock on its
lock file, which works across threads and across worker processes on one machine,
and is released by the kernel if the holder dies.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import time
from typing import Iterator

from tinkerless.envs.sandbox.limits import SandboxUnavailable

UID_BASE = 1_960_000_000  # far above any uid a distribution hands out; no /etc/passwd entry needed
UID_SLOTS = 4096
LOCK_DIR = "/run/tinkerless-sandbox-uids"
FALLBACK_LOCK_DIR = "/tmp/tinkerless-sandbox-uids"


def _lock_dir() -> str:
    for path in (LOCK_DIR, FALLBACK_LOCK_DIR):
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
            info = os.lstat(path)
            # Root-owned and private: another user must not be able to hold our locks.
            if info.st_uid == 0 and (info.st_mode & 0o077) == 0 and not os.path.islink(path):
                return path
        except OSError:
            continue
    raise SandboxUnavailable(
        f"cannot create a private lock directory for sandbox uids ({LOCK_DIR} or {FALLBACK_LOCK_DIR})",
        hint=f"make {LOCK_DIR} a directory owned by root with mode 0700",
    )


@contextlib.contextmanager
def lease_uid() -> Iterator[int]:
    """A uid no other sandbox on this machine holds until the block ends."""
    directory = _lock_dir()
    start = random.randrange(UID_SLOTS)
    for step in range(UID_SLOTS):
        slot = (start + step) % UID_SLOTS
        fd = os.open(os.path.join(directory, str(slot)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        uid = UID_BASE + slot
        try:
            yield uid
        finally:
            wait_until_no_process_has(uid)
            os.close(fd)  # releases the lock
        return
    raise SandboxUnavailable(f"all {UID_SLOTS} sandbox uids are in use", hint="run fewer sandboxes at once")


def wait_until_no_process_has(uid: int, timeout: float = 2.0) -> None:
    """After a killed sandbox its tasks may take a moment to die; the next lease must not count them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(_owned_by(entry, uid) for entry in os.listdir("/proc") if entry.isdigit()):
            return
        time.sleep(0.005)


def _owned_by(pid: str, uid: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}").st_uid == uid
    except OSError:
        return False


__all__ = ["UID_BASE", "lease_uid"]
