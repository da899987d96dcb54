"""A sandbox started ahead of time, so a tool call does not wait for namespaces and an interpreter to start.

For each kind of call (profile, limits, audit hook) one bubblewrap sandbox is kept
ready: bwrap has built its namespaces, mounts and seccomp filter, and the interpreter
inside has dropped to its uid and waits on a pipe for its program (bootstrap.py,
`_receive`); it sets its resource limits only once the program arrives, so waiting
costs none of them. A call takes it, writes the program and stdin down the pipe and
supervises it as usual; then a replacement is started in the background.

The replacement is started by one long-lived thread: bwrap's --die-with-parent is tied
to the thread that started it, so a short-lived thread would take its sandbox with it.
A ready sandbox that died (or never started) is simply not used: the call starts one
the ordinary way.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import queue
import subprocess
import threading
from dataclasses import dataclass
from typing import Callable, Hashable

logger = logging.getLogger("tinkerless.sandbox")
MAX_READY = 4


@dataclass
class Ready:
    proc: subprocess.Popen
    program_fd: int  # write end of the pipe the bootstrap reads its program from
    lease: contextlib.ExitStack  # the uid it holds, given back after it has run

    def discard(self) -> None:
        import os

        with contextlib.suppress(OSError):
            os.close(self.program_fd)
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()
        self.lease.close()


_ready: dict[Hashable, Ready] = {}
_lock = threading.Lock()
_requests: queue.SimpleQueue = queue.SimpleQueue()
_spawner: threading.Thread | None = None


def take(key: Hashable) -> Ready | None:
    """The sandbox ready for `key`, if one is (and still alive)."""
    with _lock:
        ready = _ready.pop(key, None)
    if ready is not None and ready.proc.poll() is not None:
        ready.discard()
        return None
    return ready


def prepare(key: Hashable, start: Callable[[], Ready]) -> None:
    """Have a sandbox for `key` ready for the next call (started in the background)."""
    global _spawner
    with _lock:
        if key in _ready:
            return
        if _spawner is None or not _spawner.is_alive():
            _spawner = threading.Thread(target=_spawn_forever, name="tinkerless-sandbox-spawner", daemon=True)
            _spawner.start()
    _requests.put((key, start))


def _spawn_forever() -> None:
    while True:
        key, start = _requests.get()
        with _lock:
            if key in _ready:
                continue
        try:
            ready = start()
        except Exception:  # the next call starts its sandbox the ordinary way and reports what is wrong
            logger.debug("could not start a sandbox ahead of time", exc_info=True)
            continue
        with _lock:
            evicted = [_ready.pop(key)] if key in _ready else []
            while len(_ready) >= MAX_READY:  # kinds of call seen long ago give way (each holds a process and a uid)
                evicted.append(_ready.pop(next(iter(_ready))))
            _ready[key] = ready
        for item in evicted:
            item.discard()


def discard_all() -> None:
    """Stop every ready sandbox and give its uid back (at exit, before module teardown)."""
    with _lock:
        ready = list(_ready.values())
        _ready.clear()
    for item in ready:
        item.discard()


atexit.register(discard_all)


__all__ = ["Ready", "discard_all", "prepare", "take"]
