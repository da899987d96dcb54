"""Per-stream order for the server's work queue (`tinkerless.server.scheduler`).

A stream is one client's sequence of calls to one model (a Tinker `TrainingClient`, or one
`HTTPBackend`). Its jobs carry the client's sequence number, from 1, and are released to the
scheduler's ready queues strictly in that order, whatever order they arrived in: a job whose
predecessor has not arrived yet is held until it has. A number used without anything to run (a
call refused on arrival, `Scheduler.skip`) is held as a placeholder that runs nothing, so the
numbers after it are not held behind it.

A client may reserve a sequence number and never send it (it failed before sending). After
`gap_timeout` seconds a stream stuck on such a gap skips ahead, with a warning, rather than
hanging its later calls forever.

Nothing here locks: the scheduler calls it with its lock held, and makes ready the jobs it releases.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tinkerless.server.scheduler import Job

# The scheduler's logger: skipping a gap is the queue's doing, and is logged where it always was.
logger = logging.getLogger("tinkerless.server.scheduler")


@dataclass
class Stream:
    """One stream: the next sequence number due, the jobs that arrived ahead of it, and since when it waits."""

    next_seq: int = 1
    waiting: dict[int, Job] = field(default_factory=dict)
    stalled_since: float | None = None

    def used(self, seq: int) -> bool:
        """Whether `seq` has been used already: released (or skipped past), or held."""
        return seq < self.next_seq or seq in self.waiting

    def hold(self, job: Job) -> list[Job]:
        """Hold `job` under its sequence number; the jobs that releases (`release`)."""
        self.waiting[job.seq] = job
        return self.release()

    def release(self) -> list[Job]:
        """Take the consecutive arrived jobs out, in order, for the ready queue.

        The tenant's ready queue is first-in first-out, and a paused job goes back to its
        front, so releasing seq n+1 right behind seq n still runs them in order.
        """
        released = []
        while self.next_seq in self.waiting:
            released.append(self.waiting.pop(self.next_seq))
            self.next_seq += 1
        if not self.waiting:
            self.stalled_since = None
        elif self.stalled_since is None:
            self.stalled_since = time.monotonic()
        return released


class Streams:
    """Every stream's `Stream`, by (tenant, stream name)."""

    def __init__(self):
        self._streams: dict[tuple[str, str], Stream] = {}

    def get(self, tenant: str, stream: str) -> Stream:
        return self._streams.setdefault((tenant, stream), Stream())

    def held(self, tenant: str) -> list[Job]:
        """The tenant's jobs held behind a gap in their stream."""
        return [job for (t, _), state in self._streams.items() if t == tenant for job in state.waiting.values()]

    def skip_stalled_gaps(self, gap_timeout: float) -> list[Job]:
        """Skip every gap that has held its stream for over `gap_timeout` seconds; the jobs that releases.
        (The timeout is passed in, not kept: it is the scheduler's setting, which may change.)"""
        now = time.monotonic()
        released = []
        for (tenant, stream), state in self._streams.items():
            if state.waiting and state.stalled_since is not None and now - state.stalled_since > gap_timeout:
                missing, waited = state.next_seq, now - state.stalled_since
                state.next_seq = min(state.waiting)
                state.stalled_since = None
                logger.warning(
                    "stream %s of tenant %r waited %.0fs for call #%d, which never arrived; continuing at #%d",
                    stream, tenant, waited, missing, state.next_seq,
                )
                released += state.release()
        return released
