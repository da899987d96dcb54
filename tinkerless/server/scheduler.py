"""The server's work queue: one device, many tenants, per-stream order.

Every call that touches the model becomes a `Job` run by a single executor
thread (one model in memory, so one call at a time). Three rules pick the next job:

* **Order within a stream.** A stream is one client's sequence of calls to one
  model (a Tinker `TrainingClient`, or one `HTTPBackend`). Jobs carry the client's
  sequence number and run strictly in that order, whatever order they arrived in;
  a job whose predecessor has not arrived yet waits for it. Clients number from 1.
* **Fairness between tenants.** Among runnable jobs, tenants take turns
  (round-robin), so one tenant's long queue cannot starve another's.
* **Back-pressure.** Past `max_pending` queued jobs, `submit` raises `QueueFull`
  (HTTP 429 with Retry-After) instead of queueing without bound.

A client may reserve a sequence number and never send it (it failed before
sending). After `gap_timeout` seconds a stream stuck on such a gap skips ahead,
with a warning, rather than hanging its later calls forever.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from tinkerless.errors import SequenceReused

logger = logging.getLogger(__name__)


class QueueFull(Exception):
    def __init__(self, pending: int, retry_after: float):
        super().__init__(f"the server's queue is full ({pending} calls waiting)")
        self.pending = pending
        self.retry_after = retry_after


@dataclass
class Job:
    tenant: str
    stream: str | None
    seq: int | None
    fn: Callable[[], Any]
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class _Stream:
    next_seq: int = 1
    waiting: dict[int, Job] = field(default_factory=dict)
    stalled_since: float | None = None


class Scheduler:
    """Runs submitted jobs on one thread: per-stream sequence order, round-robin across tenants."""

    def __init__(self, *, max_pending: int = 1024, gap_timeout: float = 30.0):
        self.max_pending = max_pending
        self.gap_timeout = gap_timeout
        self._cond = threading.Condition()
        self._ready: dict[str, deque[Job]] = {}  # tenant -> runnable jobs in arrival order
        self._turns: deque[str] = deque()  # tenants with runnable jobs, in round-robin order
        self._streams: dict[tuple[str, str], _Stream] = {}
        self._pending = 0
        self.in_flight = 0
        self._avg_seconds = 0.1  # moving average of job time, for Retry-After
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="tinkerless-scheduler", daemon=True)
        self._thread.start()

    # -- submitting ---------------------------------------------------------------

    def submit(
        self, fn: Callable[[], Any], *, tenant: str = "", stream: str | None = None, seq: int | None = None
    ) -> concurrent.futures.Future:
        """Queue `fn`; its future resolves to fn's result (or exception) once it has run."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the scheduler is closed")
            if self._pending >= self.max_pending:
                raise QueueFull(self._pending, retry_after=self._retry_after())
            job = Job(tenant, stream, seq, fn)
            self._pending += 1
            if stream is None or seq is None:
                self._make_ready(job)
            else:
                state = self._streams.setdefault((tenant, stream), _Stream())
                if seq < state.next_seq or seq in state.waiting:
                    self._pending -= 1
                    job.future.set_exception(SequenceReused(seq, state.next_seq))
                    return job.future
                state.waiting[seq] = job
                self._release(state)
            self._cond.notify_all()
            return job.future

    def skip(self, tenant: str, stream: str, seq: int) -> None:
        """Mark a sequence number as used without running anything (the call was refused on arrival)."""
        with self._cond:
            state = self._streams.setdefault((tenant, stream), _Stream())
            if seq < state.next_seq or seq in state.waiting:
                return
            state.waiting[seq] = Job(tenant, stream, seq, lambda: None)
            self._pending += 1
            self._release(state)
            self._cond.notify_all()

    # -- state --------------------------------------------------------------------

    @property
    def pending(self) -> int:
        with self._cond:
            return self._pending

    def close(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    # -- internals (called with the lock held) --------------------------------------

    def _retry_after(self) -> float:
        # About the time a few queued jobs take to finish, so a retry finds room; 1-30 s.
        return max(1.0, min(30.0, 8 * self._avg_seconds))

    def _make_ready(self, job: Job) -> None:
        queue = self._ready.setdefault(job.tenant, deque())
        if not queue and job.tenant not in self._turns:
            self._turns.append(job.tenant)
        queue.append(job)

    def _release(self, state: _Stream) -> None:
        """Move the stream's consecutive arrived jobs to the ready queue.

        The tenant's ready queue is first-in first-out and one thread runs jobs, so
        releasing seq n+1 right behind seq n still runs them in order.
        """
        while state.next_seq in state.waiting:
            self._make_ready(state.waiting.pop(state.next_seq))
            state.next_seq += 1
        if not state.waiting:
            state.stalled_since = None
        elif state.stalled_since is None:
            state.stalled_since = time.monotonic()

    def _skip_stalled_gaps(self) -> None:
        now = time.monotonic()
        for (tenant, stream), state in self._streams.items():
            if state.waiting and state.stalled_since is not None and now - state.stalled_since > self.gap_timeout:
                missing, waited = state.next_seq, now - state.stalled_since
                state.next_seq = min(state.waiting)
                state.stalled_since = None
                logger.warning(
                    "stream %s of tenant %r waited %.0fs for call #%d, which never arrived; continuing at #%d",
                    stream, tenant, waited, missing, state.next_seq,
                )
                self._release(state)

    def _next_job(self) -> Job | None:
        while self._turns:
            tenant = self._turns.popleft()
            queue = self._ready.get(tenant)
            if not queue:
                continue
            job = queue.popleft()
            if queue:
                self._turns.append(tenant)  # back of the line: the next tenant goes first
            return job
        return None

    def _loop(self) -> None:
        while True:
            with self._cond:
                job = self._next_job()
                while job is None:
                    if self._closed:
                        return
                    self._cond.wait(timeout=1.0)
                    self._skip_stalled_gaps()
                    job = self._next_job()
                self._pending -= 1
                self.in_flight += 1
            started = time.perf_counter()
            try:
                if job.future.set_running_or_notify_cancel():
                    try:
                        result = job.fn()
                    except BaseException as exc:  # noqa: BLE001 - delivered to the waiting caller
                        job.future.set_exception(exc)
                    else:
                        job.future.set_result(result)
            finally:
                with self._cond:
                    self._avg_seconds = 0.9 * self._avg_seconds + 0.1 * (time.perf_counter() - started)
                    self.in_flight -= 1
                    self._cond.notify_all()
