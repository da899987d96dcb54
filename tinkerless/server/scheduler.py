"""The server's work queue: one device, many tenants, per-stream order, time slices.

Every call that touches the model becomes a `Job`. One model lives in memory, so one
job runs at a time; each runs on its own thread, and the scheduler hands the model from
one to the next. Four rules pick who runs:

* **Order within a stream.** A stream is one client's sequence of calls to one
  model (a Tinker `TrainingClient`, or one `HTTPBackend`). Jobs carry the client's
  sequence number and run strictly in that order, whatever order they arrived in;
  a job whose predecessor has not arrived yet waits for it. Clients number from 1.
  (`tinkerless.server.streams`, which also skips a gap that is never filled.)
* **Fairness between tenants.** Among runnable jobs, tenants take turns
  (round-robin), so one tenant's long queue cannot starve another's.
* **Time slices.** A long job (generation) reaches a safe point after every decode step
  (`tinkerless.functions.sampling.slicing`). Once it has run `slice_seconds` while another tenant
  has work ready, it pauses there, goes back to the front of its tenant's queue (so the
  tenant's own later calls still run after it) and its tenant to the back of the turns.
  So another tenant's small call waits for at most about one slice, not for a whole
  maximal request. A paused job keeps its state (KV cache, random generators) and
  resumes where it stopped, with the same result it would have had unpaused.
* **Joining.** After every decode step a generation also pauses when a call that has not
  started may start ahead of it (`_find_new_job`); that call starts at once and, if it
  generates too, joins the running batch (`tinkerless.functions.sampling.batcher`) instead of waiting.
* **Back-pressure.** Past `max_pending` queued jobs in all, or `max_pending_per_tenant`
  unfinished jobs of one tenant, `submit` raises `QueueFull` (HTTP 429 with Retry-After)
  instead of queueing without bound.

**The resume fence.** A run driven through the server owns its policies: `bind` gives
them to one stream (the run's current driver, on open, save and restore). A job that
changes a policy (`Job.policies`) owned by another stream is refused with `StaleDriver`
(409), whether it arrives later, waits in the queue (refused at once, gaps or not) or
reaches its turn. So once a second client has taken a run over and restored it, no call
sent by the killed or replaced client can change the restored policies. A job that is
already running when `bind` is called finished its change first: the binding client's
restore is a later job, so it is ordered after it.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from tinkerless.errors import SequenceReused, StaleDriver
from tinkerless.functions.sampling.slicing import slice_host
from tinkerless.server.streams import Stream, Streams


class QueueFull(Exception):
    def __init__(self, pending: int, retry_after: float, *, tenant_quota: int | None = None):
        if tenant_quota is None:
            message = f"the server's queue is full ({pending} calls waiting)"
        else:
            message = (f"this tenant already has {pending} calls queued or running, its quota "
                       f"(max_pending_per_tenant={tenant_quota})")
        super().__init__(message)
        self.pending = pending
        self.retry_after = retry_after


@dataclass
class Job:
    tenant: str
    stream: str | None
    seq: int | None
    fn: Callable[[], Any]
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    counted: bool = True  # counts against its tenant's quota (skip placeholders do not)
    policies: frozenset[str] = frozenset()  # the policies it changes: fenced by `Scheduler.bind`
    thread: threading.Thread | None = None  # set once started
    turn: threading.Event = field(default_factory=threading.Event)  # set: the job may run
    handback: threading.Event = field(default_factory=threading.Event)  # set: the job paused or finished
    finished: bool = False
    admit: bool = False  # paused so that a not-yet-started job could start
    started: float = 0.0
    slice_started: float = 0.0


class _Host:
    """What a running job's `slice_due` / `yield_slice` talk to (see `tinkerless.functions.sampling.slicing`)."""

    def __init__(self, scheduler: Scheduler, job: Job):
        self.scheduler, self.job = scheduler, job

    def due(self) -> bool:
        if time.monotonic() - self.job.slice_started < self.scheduler.slice_seconds:
            return False
        return self.scheduler._others_waiting(self.job.tenant)

    def joinable(self) -> bool:
        return self.scheduler.join_queued and self.scheduler._new_job_ready()

    def pause(self) -> None:
        job = self.job
        job.admit = self.scheduler._new_job_ready()  # start that job next, not the round-robin pick
        job.turn.clear()
        job.handback.set()  # the scheduler thread takes the model back...
        job.turn.wait()  # ...and hands it over again on this job's next turn
        job.slice_started = time.monotonic()


class Scheduler:
    """Runs submitted jobs one at a time: per-stream sequence order, round-robin tenants, time slices."""

    def __init__(
        self,
        *,
        max_pending: int = 1024,
        max_pending_per_tenant: int | None = None,
        gap_timeout: float = 30.0,
        slice_seconds: float = 0.05,
        budgets: Any = None,
    ):
        self.budgets = budgets  # server/run_budgets.Charges: a charged job is reserved against its key's and run's budgets
        self.max_pending = max_pending
        self.max_pending_per_tenant = max_pending_per_tenant
        self.gap_timeout = gap_timeout
        self.slice_seconds = slice_seconds
        # A debug switch for benchmarks (bench/cookbook_rl.py): TINKERLESS_JOIN_QUEUED_CALLS=0 makes a
        # generation never pause for queued calls to join its batch, so calls decode one after another
        # (the "before batching" baseline). Other tenants' calls still get time slices.
        self.join_queued = os.environ.get("TINKERLESS_JOIN_QUEUED_CALLS", "1") != "0"
        self._cond = threading.Condition()
        self._ready: dict[str, deque[Job]] = {}  # tenant -> runnable jobs in arrival order
        self._turns: deque[str] = deque()  # tenants with runnable jobs, in round-robin order
        self._streams = Streams()  # per-stream order; gaps skipped after gap_timeout
        self._owners: dict[tuple[str, str], str | None] = {}  # (tenant, policy) -> the stream driving its run
        self._pending = 0  # jobs not yet started
        self._unfinished: dict[str, int] = {}  # tenant -> its jobs queued, running or paused
        self.in_flight = 0  # jobs started and not finished (one running, others paused)
        self.slices = 0  # times a job paused for another tenant's
        self._avg_seconds = 0.1  # moving average of job time, for Retry-After
        self._closed = False
        self._current: Job | None = None  # the job holding the model, if any
        self._thread = threading.Thread(target=self._loop, name="tinkerless-scheduler", daemon=True)
        self._thread.start()

    # -- submitting ---------------------------------------------------------------

    def submit(
        self,
        fn: Callable[[], Any],
        *,
        tenant: str = "",
        stream: str | None = None,
        seq: int | None = None,
        policies: frozenset[str] = frozenset(),
        charge: str | None = None,
    ) -> concurrent.futures.Future:
        """Queue `fn`, which changes `policies`; its future resolves to fn's result (or exception) once it
        has run, or to `StaleDriver` when one of those policies belongs to another stream's run. A `charge`d
        job (its kind: "rollout", "openai", ...) is first reserved against the calling key's budget and the budget of
        the run its stream drives, which raise `BudgetExceeded` when it would not fit (server/budgets.py,
        server/run_budgets.py), and settled with its seconds."""
        reservation = None
        if charge is not None and self.budgets is not None:
            from tinkerless.server.budgets import calling_key

            reservation = self.budgets.reserve(calling_key.get(), charge, tenant=tenant, stream=stream)
        if reservation is not None:
            fn = self._charged(fn, reservation)
        try:
            future = self._submit(fn, tenant, stream, seq, policies)
        except BaseException:
            self.budgets.release(reservation) if reservation is not None else None
            raise
        if reservation is not None:  # a job refused or dropped before it ran gives its hold back
            future.add_done_callback(lambda _: self.budgets.release(reservation))
        return future

    def _charged(self, fn: Callable[[], Any], reservation: Any) -> Callable[[], Any]:
        from tinkerless.functions.companions.judge import JudgeMeter, metering

        def run() -> Any:
            started, judge = time.perf_counter(), JudgeMeter()  # the judge's part of the call, metered apart
            try:
                with metering(judge):
                    return fn()
            finally:
                self.budgets.settle(reservation, time.perf_counter() - started, judge=judge)

        return run

    def _submit(self, fn: Callable[[], Any], tenant: str, stream: str | None, seq: int | None,
                policies: frozenset[str]) -> concurrent.futures.Future:
        with self._cond:
            if self._closed:
                raise RuntimeError("the scheduler is closed")
            if self._pending >= self.max_pending:
                raise QueueFull(self._pending, retry_after=self._retry_after())
            mine = self._unfinished.get(tenant, 0)
            if self.max_pending_per_tenant is not None and mine >= self.max_pending_per_tenant:
                raise QueueFull(mine, retry_after=self._retry_after(mine), tenant_quota=self.max_pending_per_tenant)
            job = Job(tenant, stream, seq, fn, policies=frozenset(policies))
            if stream is not None and seq is not None:
                state = self._streams.get(tenant, stream)
                if state.used(seq):
                    job.future.set_exception(SequenceReused(seq, state.next_seq))
                    return job.future
            refusal = self._refusal(job)
            if refusal is not None:  # a replaced driver: refused now, its number used so later ones never wait
                job.future.set_exception(refusal)
                if stream is not None and seq is not None:
                    self._placeholder(state, job)
                    self._cond.notify_all()
                return job.future
            self._pending += 1
            self._unfinished[tenant] = mine + 1
            if stream is None or seq is None:
                self._make_ready(job)
            else:
                self._make_ready(*state.hold(job))
            self._cond.notify_all()
            return job.future

    def skip(self, tenant: str, stream: str, seq: int, *, refuse_reused: bool = False) -> None:
        """Mark a sequence number as used without running anything: the call was refused on arrival, or
        (`refuse_reused`) it needs no model and runs at once, so a number used before is SequenceReused."""
        with self._cond:
            state = self._streams.get(tenant, stream)
            if state.used(seq):
                if refuse_reused:
                    raise SequenceReused(seq, state.next_seq)
                return
            self._placeholder(state, Job(tenant, stream, seq, lambda: None, counted=False))
            self._cond.notify_all()

    def bind(self, tenant: str, stream: str | None, policies: Iterable[str]) -> None:
        """Give `policies` to `stream`, the driver of their run: from now on only its calls may change them.

        Every queued job of another stream that changes one of them is refused at once (`StaleDriver`),
        including jobs held behind a gap in their stream, which would otherwise run once the gap times out.
        A job already running is left to finish: the caller's next job on the model is ordered after it."""
        policies = frozenset(policies)
        if not policies:
            return
        with self._cond:
            for policy in policies:
                self._owners[(tenant, policy)] = stream
            queued = [job for job in self._ready.get(tenant, ())]
            queued += self._streams.held(tenant)
            for job in queued:
                if job.stream != stream and job.policies & policies and not job.future.running():
                    self._refuse(job, self._refusal(job))
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

    # -- internals (called with the lock held unless said otherwise) ------------------

    def _refusal(self, job: Job) -> StaleDriver | None:
        """`StaleDriver` when `job` changes a policy that another stream's run now owns."""
        for policy in job.policies:
            owner = self._owners.get((job.tenant, policy), job.stream)
            if owner != job.stream:
                return StaleDriver(
                    "this call would change a policy of a run that another client has since opened or resumed, "
                    "and that client now drives it; calls from the replaced client are refused",
                    hint="this client no longer drives its run: stop it. To drive the run from here, resume it "
                    "again (`tinkerless train ... --resume`), which takes it over from the other client",
                )
        return None

    def _refuse(self, job: Job, refusal: Exception | None) -> None:
        """Answer a queued job with `refusal` now; it stays in place as a no-op, so its stream's order holds."""
        if job.future.done():
            return
        job.future.set_exception(refusal)
        job.fn = lambda: None
        if job.counted:  # its tenant's quota is free again at once
            job.counted = False
            self._unfinished[job.tenant] -= 1
            if not self._unfinished[job.tenant]:
                del self._unfinished[job.tenant]

    def _placeholder(self, state: Stream, job: Job) -> None:
        """Mark `job`'s sequence number used by a job that runs nothing."""
        job.counted = False
        job.fn = lambda: None
        self._pending += 1
        self._make_ready(*state.hold(job))

    def _retry_after(self, ahead: int = 8) -> float:
        # About the time the calls ahead take to finish, so a retry finds room; 1-30 s.
        return max(1.0, min(30.0, max(ahead, 1) * self._avg_seconds))

    def _others_waiting(self, tenant: str) -> bool:
        """Whether a tenant other than `tenant` has a job ready to run (takes the lock)."""
        with self._cond:
            return any(t != tenant and self._ready.get(t) for t in self._turns)

    def _new_job_ready(self) -> bool:
        """Whether a job that has not started could start now (takes the lock): see `_next_new_job`."""
        with self._cond:
            return self._find_new_job() is not None

    def _find_new_job(self) -> tuple[str, Job] | None:
        """The first not-yet-started ready job, tenants in turn order, that may start ahead of the
        tenant's paused job: any job of a tenant with none paused; an unordered job (a Tinker `sample`)
        of a tenant with one. A tenant's ordered calls (training steps, which may change the weights
        its paused generation samples from) never overtake it."""
        paused = {j.tenant for q in self._ready.values() for j in q if j.thread is not None}
        if self._current is not None:  # the running job counts: it asks this before it pauses
            paused.add(self._current.tenant)
        for tenant in self._turns:
            for job in self._ready.get(tenant, ()):
                if job.thread is None and (job.stream is None or tenant not in paused):
                    return tenant, job
        return None

    def _next_new_job(self) -> Job | None:
        """Take the job `_find_new_job` names out of its queue (its tenant keeps its place in the turns)."""
        found = self._find_new_job()
        if found is None:
            return None
        tenant, job = found
        queue = self._ready[tenant]
        queue.remove(job)
        if not queue:
            self._turns.remove(tenant)
        return job

    def _make_ready(self, *jobs: Job) -> None:
        """Queue `jobs` to run, in order (a stream's are released in its sequence order)."""
        for job in jobs:
            queue = self._ready.setdefault(job.tenant, deque())
            if not queue and job.tenant not in self._turns:
                self._turns.append(job.tenant)
            queue.append(job)

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
        admit = False  # the last job paused so that a queued job could start (and join its batch)
        while True:
            with self._cond:
                job = self._next_new_job() if admit else None
                admit = False
                job = job or self._next_job()
                while job is None:
                    if self._closed:
                        return
                    self._cond.wait(timeout=1.0)
                    self._make_ready(*self._streams.skip_stalled_gaps(self.gap_timeout))
                    job = self._next_job()
                if job.thread is None:
                    self._pending -= 1
                    self.in_flight += 1
                self._current = job
            self._give_turn(job)
            job.handback.wait()  # the job paused at a slice boundary or finished
            job.handback.clear()
            with self._cond:
                self._current = None
                if job.finished:
                    self.in_flight -= 1
                    self._avg_seconds = 0.9 * self._avg_seconds + 0.1 * (time.monotonic() - job.started)
                    if job.counted:
                        self._unfinished[job.tenant] -= 1
                        if not self._unfinished[job.tenant]:
                            del self._unfinished[job.tenant]
                else:  # paused: first in its tenant's line again, its tenant last in the turns
                    self.slices += 1
                    admit = job.admit
                    queue = self._ready.setdefault(job.tenant, deque())
                    queue.appendleft(job)
                    if job.tenant not in self._turns:
                        self._turns.append(job.tenant)
                self._cond.notify_all()

    def _give_turn(self, job: Job) -> None:
        """Start `job` on its own thread, or resume it where it paused (no lock held)."""
        job.slice_started = time.monotonic()
        if job.thread is not None:
            job.turn.set()
            return
        job.started = job.slice_started
        job.thread = threading.Thread(target=self._run, args=(job,), name=f"tinkerless-job-{job.tenant}", daemon=True)
        job.thread.start()

    def _run(self, job: Job) -> None:
        """A job's thread: runs its function, pausing at safe points when other tenants wait."""
        try:
            with self._cond:  # atomic with `bind`: a job either runs as its stream's driver or is refused
                if not job.future.done() and not job.future.running():
                    refusal = self._refusal(job)
                    if refusal is not None:
                        self._refuse(job, refusal)
                # A cancelled future still gets its notification (what set_running_or_notify_cancel is for).
                runnable = job.future.cancelled() or not job.future.done()
                runnable = runnable and job.future.set_running_or_notify_cancel()
            if runnable:
                with slice_host(_Host(self, job)):
                    try:
                        result = job.fn()
                    except BaseException as exc:  # noqa: BLE001 - delivered to the waiting caller
                        job.future.set_exception(exc)
                    else:
                        job.future.set_result(result)
        finally:
            job.finished = True
            job.handback.set()
