"""Cooperative time slicing: how a long call lets other tenants' calls run before it finishes.

The server runs one model call at a time. A call that generates for a long time
asks `slice_due()` after every decode step; when it says yes, the call leaves a safe
point (its adapter deactivated, its KV cache and random state kept in a
`GenerationJob`) and calls `yield_slice()`. The server's scheduler installs a
`SliceHost` on the thread running the call: it parks the call there while other
tenants' queued calls run, then resumes it. Outside a server (the local backend,
tests, Modal functions) no host is installed: `slice_due()` is False and
`yield_slice()` does nothing.

The same safe point lets queued calls start early (`join_due()`): a generation pauses
after a step when a call that has not started is queued, so that call starts at once and,
if it generates too, joins the running batch (`tinkerless.functions.sampling.batcher`).

This module imports nothing heavy, so the scheduler can use it without loading torch.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Protocol

_local = threading.local()


class SliceHost(Protocol):
    def due(self) -> bool:
        """Whether the running call should pause at its next safe point (others are waiting, its turn is up)."""
        ...

    def pause(self) -> None:
        """Block until the call's next turn (returns at once when nothing else is waiting)."""
        ...

    def joinable(self) -> bool:
        """Whether a call that has not started yet could start now (and join a running generation batch)."""
        ...


def slice_due() -> bool:
    host: SliceHost | None = getattr(_local, "host", None)
    return host is not None and host.due()


def join_due() -> bool:
    """Whether a generation should pause at this step so that a queued call can start and join its batch."""
    host: SliceHost | None = getattr(_local, "host", None)
    joinable = getattr(host, "joinable", None)  # hosts from before batching may not offer it
    return joinable is not None and joinable()


def yield_slice() -> None:
    """A safe point between two slices of work: let queued calls run now, if the host wants to."""
    host: SliceHost | None = getattr(_local, "host", None)
    if host is not None:
        host.pause()


@contextlib.contextmanager
def slice_host(host: SliceHost) -> Iterator[None]:
    """Install `host` for this thread's calls to `slice_due` / `yield_slice` during the block."""
    previous = getattr(_local, "host", None)
    _local.host = host
    try:
        yield
    finally:
        _local.host = previous
