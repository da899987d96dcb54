"""What each API key may spend on this server's compute: reserved before a call's work, settled after it.

A key's budget (`KeyRecord.budget_usd`, set by `tinkerless keys create --budget-usd` / `keys set-budget`) is
read from the key file on every call, so a change applies at once. Every call that runs on the model (the
msgpack `/v1/call` routes, the OpenAI and the Tinker routes) goes through the scheduler, which asks
`KeyBudgets.reserve` before queueing it: the call's expected cost (the longest call of its kind seen on this
server, with a margin, times one more than the key's calls already running, priced at the server's $/hour) is
held against the key's budget while it runs, and a
call that would take the key past its budget is refused there, before any work (`BudgetExceeded`, HTTP 402).
When the call ends, `settle` replaces the reservation by what it really cost (its measured seconds).

So concurrent calls of one key share one budget: all of them reserve first, and the key overspends only by
what its running calls cost beyond their reservations, at most about one call's worth. What each key spent
is kept in the server's storage (`server/key_usage.json`, written within a second of a call), so a restarted
server goes on counting (a crash loses at most the last second's spending).
"""

from __future__ import annotations

import contextvars
import json
import logging
import math
import threading
from dataclasses import dataclass
from typing import Any

from tinkerless.errors import BudgetExceeded, StorageNotFound
from tinkerless.server.keys import KeyStore
from tinkerless.storage import ObjectStore

logger = logging.getLogger(__name__)
USAGE_FILE = "server/key_usage.json"
FIRST_CALL_SECONDS = 1.0  # a kind of call never seen on this server is expected to take this long
PERSIST_SECONDS = 1.0  # spending reaches the server's storage this long after a call at most
MARGIN = 1.5  # a call is expected to take up to this many times the longest call of its kind seen so far

# The key of the request being handled (its id), set where the request's key is checked (`app.tenant_of`).
calling_key: contextvars.ContextVar[str | None] = contextvars.ContextVar("tinkerless_calling_key", default=None)
# The extra model (`served_models`) the request being handled runs on, None for the main one: counted apart per key.
served_model: contextvars.ContextVar[str | None] = contextvars.ContextVar("tinkerless_served_model", default=None)


@dataclass
class Reservation:
    key_id: str
    kind: str
    usd: float
    done: bool = False
    model: str | None = None  # an extra model's id (`served_model`): its seconds also counted under it


class KeyBudgets:
    """Spending per key on one server (thread-safe); `price_per_hour` prices its device-seconds."""

    def __init__(self, keys: KeyStore, store: ObjectStore, price_per_hour: float):
        self.keys, self.store, self.price_per_hour = keys, store, float(price_per_hour)
        self._lock = threading.Lock()
        self._reserved: dict[str, float] = {}
        self._running: dict[str, int] = {}  # calls reserved and not settled, per key
        self._flush_timer: threading.Timer | None = None
        self._longest: dict[str, float] = {}  # seconds of the longest call of each kind
        try:
            loaded = json.loads(self.store.get(USAGE_FILE))
        except StorageNotFound:
            loaded = {}
        self._spent: dict[str, dict] = {k: v for k, v in loaded.items() if isinstance(v, dict)}

    def usd(self, seconds: float) -> float:
        return seconds * self.price_per_hour / 3600.0

    def reserve(self, key_id: str | None, kind: str) -> Reservation | None:
        """Hold the expected cost of a call of `kind` against the key's budget; raise `BudgetExceeded` (nothing
        held) when it would not fit. None for a call without a budgeted key (no key, or one from the environment)."""
        record = self.keys.record(key_id) if key_id else None
        if record is None:
            return None
        with self._lock:
            # A call that joins n running calls of its key is batched with them (or follows them): it is expected
            # to take as long as all of them. So the key's concurrency shrinks as its budget runs out.
            running = self._running.get(key_id, 0)
            expected = self.usd(self._longest.get(kind, FIRST_CALL_SECONDS) * MARGIN * (1 + running))
            spent, reserved = self._spent_usd(key_id), self._reserved.get(key_id, 0.0)
            budget = record.budget_usd
            if budget is not None and spent + reserved + expected > budget:
                raise BudgetExceeded(
                    f"API key {key_id} has spent ${spent:.4f} of its ${budget:.4f} budget"
                    + (f" (and ${reserved:.4f} is held by its calls running now)" if reserved else "")
                    + f"; this call ({kind}) is expected to cost up to ${expected:.4f}, so it was not started",
                    hint=f"an admin of the server raises it with `tinkerless keys set-budget {key_id} --budget-usd "
                    f"DOLLARS --storage STORAGE`; what the key spent: GET /v1/usage or `tinkerless keys usage`",
                )
            self._reserved[key_id] = reserved + expected
            self._running[key_id] = running + 1
            return Reservation(key_id, kind, expected, model=served_model.get())

    def settle(self, reservation: Reservation | None, seconds: float, judge: Any = None) -> None:
        """The call ran `seconds`: its reservation is replaced by what it cost. `judge` (a `JudgeMeter`): what an
        LLM judge inside the call read and took, counted apart (its seconds are part of the call's, and charged)."""
        if reservation is None or reservation.done:
            return
        seconds = float(seconds) if math.isfinite(seconds) and seconds > 0 else 0.0
        with self._lock:
            self._release(reservation)
            usage = self._spent.setdefault(reservation.key_id, {"spent_usd": 0.0, "compute_seconds": 0.0, "calls": 0})
            usage["spent_usd"] = float(usage.get("spent_usd", 0.0)) + self.usd(seconds)
            usage["compute_seconds"] = float(usage.get("compute_seconds", 0.0)) + seconds
            usage["calls"] = int(usage.get("calls", 0)) + 1
            if reservation.model is not None:  # a call on an extra model (a teacher's forward): its own line too
                line = usage.setdefault("models", {}).setdefault(reservation.model, {"compute_seconds": 0.0, "calls": 0})
                line["compute_seconds"] = float(line.get("compute_seconds", 0.0)) + seconds
                line["calls"] = int(line.get("calls", 0)) + 1
            if judge is not None and judge.questions:
                # never more than the call's own seconds (the judge's clock runs inside the call's)
                usage["judge_seconds"] = float(usage.get("judge_seconds", 0.0)) + min(max(judge.seconds, 0.0), seconds)
                usage["judge_tokens"] = int(usage.get("judge_tokens", 0)) + int(judge.prompt_tokens)
                usage["judge_verdicts"] = int(usage.get("judge_verdicts", 0)) + int(judge.questions)
                usage["judge_cache_hits"] = int(usage.get("judge_cache_hits", 0)) + int(judge.cache_hits)
            self._longest[reservation.kind] = max(self._longest.get(reservation.kind, 0.0), seconds)
            if self._flush_timer is None:  # written within PERSIST_SECONDS, not on every call (storage may be S3)
                self._flush_timer = threading.Timer(PERSIST_SECONDS, self._flush_logged)
                self._flush_timer.daemon = True
                self._flush_timer.start()

    def _flush_logged(self) -> None:
        try:
            self.flush()
        except Exception:  # noqa: BLE001 - storage failed: the totals stay in memory, written with the next call's
            logger.warning("could not write the keys' spending to %s", USAGE_FILE, exc_info=True)

    def flush(self) -> None:
        """Write what every key spent to the server's storage (at most PERSIST_SECONDS after a call settled)."""
        with self._lock:
            self._flush_timer = None
            snapshot = json.dumps(self._spent, indent=1).encode()
            self.store.put(USAGE_FILE, snapshot)  # under the lock: the file never goes back to an older total

    def release(self, reservation: Reservation | None) -> None:
        """A reserved call that never ran (refused in the queue): nothing spent, the hold is given back."""
        if reservation is None or reservation.done:
            return
        with self._lock:
            self._release(reservation)

    def _release(self, reservation: Reservation) -> None:
        reservation.done = True
        left = self._reserved.get(reservation.key_id, 0.0) - reservation.usd
        self._reserved[reservation.key_id] = max(left, 0.0) if self._running.get(reservation.key_id, 1) > 1 else 0.0
        self._running[reservation.key_id] = max(self._running.get(reservation.key_id, 1) - 1, 0)

    def _spent_usd(self, key_id: str) -> float:
        return float(self._spent.get(key_id, {}).get("spent_usd", 0.0))

    def usage(self, key_id: str) -> dict:
        """What a key spent, holds and may still spend (GET /v1/usage, `tinkerless keys usage`)."""
        record = self.keys.record(key_id)
        with self._lock:
            used = dict(self._spent.get(key_id, {}))
            reserved = self._reserved.get(key_id, 0.0)
        return usage_row(key_id, record.tenant if record else None, record.budget_usd if record else None, used,
                         reserved, self.price_per_hour)


def usage_row(key_id: str, tenant: str | None, budget: float | None, used: dict, reserved: float,
              price_per_hour: float | None) -> dict:
    """A key's usage as GET /v1/usage shows it: `compute_seconds` is all its calls' (the judge's included),
    `judge_*` the part an LLM judge inside its rollouts took (seconds, tokens read, verdicts, of them cached),
    `models` the calls on the server's extra models (`--also-model`: a teacher's forwards), by model id, and
    `policy_seconds` the rest."""
    spent = float(used.get("spent_usd", 0.0))
    compute, judge_s = float(used.get("compute_seconds", 0.0)), float(used.get("judge_seconds", 0.0))
    raw = used.get("models") if isinstance(used.get("models"), dict) else {}
    models = {str(k): {"compute_seconds": float(v.get("compute_seconds", 0.0)), "calls": int(v.get("calls", 0))}
              for k, v in raw.items() if isinstance(v, dict)}
    model_s = sum(v["compute_seconds"] for v in models.values())
    return {"key_id": key_id, "tenant": tenant, "budget_usd": budget, "spent_usd": spent, "reserved_usd": reserved,
            "remaining_usd": None if budget is None else max(budget - spent - reserved, 0.0),
            "compute_seconds": compute, "calls": int(used.get("calls", 0)),
            "policy_seconds": max(compute - judge_s - model_s, 0.0), "judge_seconds": judge_s, "models": models,
            "judge_tokens": int(used.get("judge_tokens", 0)), "judge_verdicts": int(used.get("judge_verdicts", 0)),
            "judge_cache_hits": int(used.get("judge_cache_hits", 0)), "price_per_hour": price_per_hour}


def stored_usage(store: ObjectStore) -> dict[str, dict]:
    """Every key's spending as the server last wrote it (for `tinkerless keys usage`, with no server running)."""
    try:
        loaded = json.loads(store.get(USAGE_FILE))
    except StorageNotFound:
        return {}
    return {k: v for k, v in loaded.items() if isinstance(v, dict)}
