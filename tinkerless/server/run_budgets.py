"""What each hosted run may spend on this server: its own budget, held here as a key's is, not only by its client.

A run driven through `tinkerless serve` carries its budget in its config (`TrainConfig.max_compute_seconds`,
`max_cost_usd`, sent on create and on every resume, kept in the run's state). The server charges the run every
call on the model that its driver's call stream makes (the stream named on create/open: `RunBudgets.drive`),
by the rule of the keys' budgets (server/budgets.py): before a call is queued its expected cost (the longest
call of its kind this run made, with a margin, times one more than the run's calls already running) is
reserved, a call that would take the run past its limit is refused before any work (`BudgetExceeded`, HTTP 402),
and when it ends the reservation is replaced by its measured seconds. Dollars are the server's device-seconds at
its `price_per_hour` (a CPU server's is $0 unless given, so there only `max_compute_seconds` bites).

So a run's limit holds whatever its client does (a hand-made client, or one that does not check its budget
between steps), within one call's worth. What each run spent is kept in the tenant's storage beside its state
(`runs/<run_id>/server_usage.json`, written within a second of a call), so a restarted server goes on counting.
A resume that raises the limit in its config lets the run's next calls through.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable

from tinkerless.errors import BudgetExceeded, InvalidRequest, StorageNotFound
from tinkerless.server.budgets import FIRST_CALL_SECONDS, MARGIN, PERSIST_SECONDS, KeyBudgets
from tinkerless.storage import ObjectStore

logger = logging.getLogger(__name__)
RUN_USAGE_FILE = "server_usage.json"  # under the run's directory in its tenant's storage
LIMITS = ("max_compute_seconds", "max_cost_usd")
MAX_LIMIT = 1e9


def check_run_limits(config: Any, *, where: str = "config") -> None:
    """A run config's limits as a client sent them: each None or a finite number in (0, 1e9]; else 400."""
    if not isinstance(config, dict):
        return
    for name in LIMITS:
        value = config.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not 0 < value <= MAX_LIMIT:
            raise InvalidRequest(f"{where}.{name} must be a number above 0 and at most {MAX_LIMIT:.0e}, or null; "
                                 f"got {str(value)[:40]!r}", hint=f"e.g. {name}=5.0, or None for no limit")


@dataclass
class RunReservation:
    run: tuple[str, str]  # (tenant, run_id)
    kind: str
    seconds: float
    done: bool = False


class RunBudgets:
    """Spending per hosted run on one server (thread-safe). `limits_of(tenant, run_id)` gives the run's limits
    from its state (a dict with LIMITS, or None); `store_of(tenant)` the tenant's storage."""

    def __init__(self, store_of: Callable[[str], ObjectStore], limits_of: Callable[[str, str], dict | None],
                 price_per_hour: float):
        self.store_of, self.limits_of, self.price_per_hour = store_of, limits_of, float(price_per_hour)
        self._lock = threading.Lock()
        self._driver: dict[tuple[str, str], str] = {}  # (tenant, stream) -> the run it drives
        self._spent: dict[tuple[str, str], dict] = {}  # loaded from storage on first use
        self._reserved: dict[tuple[str, str], float] = {}
        self._running: dict[tuple[str, str], int] = {}
        self._longest: dict[tuple[tuple[str, str], str], float] = {}
        self._dirty: set[tuple[str, str]] = set()
        self._flush_timer: threading.Timer | None = None

    def drive(self, tenant: str, stream: str | None, run_id: str) -> None:
        """`stream` drives `run_id` from now on: its calls on the model are charged to the run."""
        if stream is not None:
            with self._lock:
                self._driver[(tenant, stream)] = run_id

    def reserve(self, tenant: str, stream: str | None, kind: str) -> RunReservation | None:
        """Hold a call's expected seconds against its run's limit; `BudgetExceeded` (nothing held) when it would not
        fit. None for a call of no hosted run."""
        with self._lock:
            run_id = self._driver.get((tenant, stream)) if stream is not None else None
        if run_id is None:
            return None
        run = (tenant, run_id)
        limits = self.limits_of(tenant, run_id) or {}
        with self._lock:
            spent = self._usage(run)
            running = self._running.get(run, 0)
            expected = self._longest.get((run, kind), FIRST_CALL_SECONDS) * MARGIN * (1 + running)
            used = float(spent["compute_seconds"]) + self._reserved.get(run, 0.0)
            refusal = self._over(run_id, limits, used, expected, kind)
            if refusal is not None:
                raise refusal
            self._reserved[run] = self._reserved.get(run, 0.0) + expected
            self._running[run] = running + 1
            return RunReservation(run, kind, expected)

    def _over(self, run_id: str, limits: dict, used: float, expected: float, kind: str) -> BudgetExceeded | None:
        seconds_limit, usd_limit = limits.get("max_compute_seconds"), limits.get("max_cost_usd")
        hint = (f"raise the run's limit and resume it: train(config, resume=True, run_id={run_id!r}, "
                "max_compute_seconds=... or max_cost_usd=...); its checkpoints are kept")
        if seconds_limit is not None and used + expected > seconds_limit:
            return BudgetExceeded(f"run {run_id!r} has used {used:.1f} of its max_compute_seconds={seconds_limit:g} on "
                                  f"this server (with its calls running now); this call ({kind}) is expected to take up "
                                  f"to {expected:.1f} s, so it was not started", hint=hint)
        if usd_limit is not None and self.price_per_hour > 0:
            usd, more = self._usd(used), self._usd(expected)
            if usd + more > usd_limit:
                return BudgetExceeded(f"run {run_id!r} has spent ${usd:.4f} of its max_cost_usd=${usd_limit:g} on this "
                                      f"server (at ${self.price_per_hour:g}/hour, with its calls running now); this call "
                                      f"({kind}) is expected to cost up to ${more:.4f}, so it was not started", hint=hint)
        return None

    def settle(self, reservation: RunReservation | None, seconds: float) -> None:
        """The call ran `seconds`: its reservation is replaced by what it used."""
        if reservation is None or reservation.done:
            return
        seconds = float(seconds) if math.isfinite(seconds) and seconds > 0 else 0.0
        with self._lock:
            self._release(reservation)
            usage = self._usage(reservation.run)
            usage["compute_seconds"] = float(usage["compute_seconds"]) + seconds
            usage["spent_usd"] = float(usage.get("spent_usd", 0.0)) + self._usd(seconds)
            usage["calls"] = int(usage.get("calls", 0)) + 1
            key = (reservation.run, reservation.kind)
            self._longest[key] = max(self._longest.get(key, 0.0), seconds)
            self._dirty.add(reservation.run)
            if self._flush_timer is None:  # written within PERSIST_SECONDS, not on every call (storage may be S3)
                self._flush_timer = threading.Timer(PERSIST_SECONDS, self._flush_logged)
                self._flush_timer.daemon = True
                self._flush_timer.start()

    def release(self, reservation: RunReservation | None) -> None:
        """A reserved call that never ran: its hold is given back."""
        if reservation is None or reservation.done:
            return
        with self._lock:
            self._release(reservation)

    def usage(self, tenant: str, run_id: str) -> dict:
        """What a run used on this server: compute_seconds, spent_usd, calls, and what its running calls hold."""
        with self._lock:
            return {**self._usage((tenant, run_id)), "reserved_seconds": self._reserved.get((tenant, run_id), 0.0)}

    def flush(self) -> None:
        with self._lock:
            self._flush_timer = None
            dirty, self._dirty = self._dirty, set()
            for tenant, run_id in dirty:  # under the lock: a file never goes back to an older total
                self.store_of(tenant).put(f"runs/{run_id}/{RUN_USAGE_FILE}", json.dumps(self._spent[(tenant, run_id)]).encode())

    def _flush_logged(self) -> None:
        try:
            self.flush()
        except Exception:  # noqa: BLE001 - storage failed: the totals stay in memory, written with the next call's
            logger.warning("could not write the runs' spending", exc_info=True)

    def _usage(self, run: tuple[str, str]) -> dict:
        """The run's totals (the lock held): read from its storage the first time this server sees the run."""
        if run not in self._spent:
            try:
                loaded = json.loads(self.store_of(run[0]).get(f"runs/{run[1]}/{RUN_USAGE_FILE}"))
            except (StorageNotFound, ValueError):
                loaded = {}
            loaded = loaded if isinstance(loaded, dict) else {}
            self._spent[run] = {"compute_seconds": float(loaded.get("compute_seconds", 0.0)),
                                "spent_usd": float(loaded.get("spent_usd", 0.0)), "calls": int(loaded.get("calls", 0))}
        return self._spent[run]

    def _release(self, reservation: RunReservation) -> None:
        reservation.done = True
        run = reservation.run
        left = self._reserved.get(run, 0.0) - reservation.seconds
        self._reserved[run] = max(left, 0.0) if self._running.get(run, 1) > 1 else 0.0
        self._running[run] = max(self._running.get(run, 1) - 1, 0)

    def _usd(self, seconds: float) -> float:
        return seconds * self.price_per_hour / 3600.0


class Charges:
    """What the scheduler reserves a charged call against: its key's budget and its run's, both or neither."""

    def __init__(self, keys: KeyBudgets | None, runs: RunBudgets | None):
        self.keys, self.runs = keys, runs

    def reserve(self, key_id: str | None, kind: str, *, tenant: str = "", stream: str | None = None):
        held = self.keys.reserve(key_id, kind) if self.keys is not None else None
        try:
            run = self.runs.reserve(tenant, stream, kind) if self.runs is not None else None
        except BaseException:
            self.keys.release(held) if held is not None else None
            raise
        return None if held is None and run is None else (held, run)

    def settle(self, reservation, seconds: float, judge: Any = None) -> None:
        """`judge`: what an LLM judge inside the call took, metered apart in its key's usage (`KeyBudgets.settle`)."""
        if reservation is not None:
            self.keys.settle(reservation[0], seconds, judge=judge) if reservation[0] is not None else None
            self.runs.settle(reservation[1], seconds) if reservation[1] is not None else None

    def release(self, reservation) -> None:
        if reservation is not None:
            self.keys.release(reservation[0]) if reservation[0] is not None else None
            self.runs.release(reservation[1]) if reservation[1] is not None else None
