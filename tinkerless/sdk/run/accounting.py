"""Pay-per-use accounting: compute seconds per function, measured where the work runs.

Every backend owns a `UsageMeter` (`backend.usage`) and records, for each call, the
seconds the function body ran on its device (in-process for local, the server's own
timing for HTTP, the container's timing for Modal). A run's `RunUsage` attributes
those seconds to the trainer's phases and prices them with a `PriceTable`.
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from collections.abc import Iterator, Mapping

# Prices live with the functions (the server's budgets and the estimates read them too); still importable here.
from tinkerless.functions.prices import DEFAULT_PRICES_PER_HOUR, PRICE_HINT as _PRICE_HINT, PriceTable  # noqa: F401

# The server's timing of the function body, sent on every /v1/call reply (server and client share it).
from tinkerless.wire.http import COMPUTE_SECONDS_HEADER  # noqa: F401 - re-exported for backends

# "teacher": a distillation teacher's forward (`distillation`); "judge": an LLM judge's verdicts (`judging`).
PHASES = ("setup", "rollout", "forward", "teacher", "judge", "update", "storage")


class UsageMeter:
    """Thread-safe running totals of compute seconds and call counts per function.

    `device` names what the seconds ran on (a backend that knows it sets it); `source` says
    who measured them. Seconds a backend could only time from the client (no device-side
    timing came back) are recorded with `client_timed=True` and counted apart.
    """

    def __init__(self, *, source: str = "worker", device: str | None = None) -> None:
        self.source = source
        self.device = device
        self._lock = threading.Lock()
        self._seconds: dict[str, float] = defaultdict(float)
        self._calls: dict[str, int] = defaultdict(int)
        self._client_timed_calls = 0
        self._queue_seconds = 0.0  # waiting in a server's queue before a function ran: not compute, not billed

    def record_queue(self, seconds: float) -> None:
        with self._lock:
            self._queue_seconds += float(seconds)

    def queue_seconds(self) -> float:
        with self._lock:
            return self._queue_seconds

    def record(self, method: str, seconds: float, *, client_timed: bool = False) -> None:
        with self._lock:
            self._seconds[method] += float(seconds)
            self._calls[method] += 1
            self._client_timed_calls += int(client_timed)

    def seconds(self) -> dict[str, float]:
        with self._lock:
            return dict(self._seconds)

    def calls(self) -> dict[str, int]:
        with self._lock:
            return dict(self._calls)

    def total_seconds(self) -> float:
        with self._lock:
            return sum(self._seconds.values())

    def client_timed_calls(self) -> int:
        with self._lock:
            return self._client_timed_calls


class RunUsage:
    """One run's compute: a meter's seconds attributed to the phase they ran in, and their cost.

    Phases run one after another in the client, so a phase's seconds are the meter's growth
    while it was open (its calls may come from several threads). `prior` is what earlier
    attempts of a resumed run already used (a `summary()` dict); it is added to the totals.
    """

    def __init__(self, meter: UsageMeter, prices: PriceTable, *, device: str | None = None, prior: dict | None = None):
        self.meter = meter
        self.prices = prices
        self.device = device or meter.device or "unknown"
        self.phases: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.step_phases: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._start_seconds, self._start_calls = meter.seconds(), meter.calls()
        self._start_client_timed = meter.client_timed_calls()
        self._queue_mark = meter.queue_seconds()
        self.prior = prior or {}
        self.extra_meters: dict[str, UsageMeter] = {}  # another model's own worker (a teacher), by its role

    def add_meter(self, role: str, meter: UsageMeter) -> None:
        """Count a second worker's seconds too (a teacher on a model of its own), in whatever phase runs them."""
        self.extra_meters[role] = meter

    def _metered(self) -> float:
        return self.meter.total_seconds() + sum(m.total_seconds() for m in self.extra_meters.values())

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        before = self._metered()
        try:
            yield
        finally:
            seconds = self._metered() - before
            self.phases[name] += seconds
            self.step_phases[name] += seconds

    def move(self, seconds: float, source: str, target: str) -> None:
        """Attribute `seconds` already counted in phase `source` to `target` instead (a judge batched inside a
        rollout call: the call's own stats say how long the judge took)."""
        seconds = max(0.0, min(float(seconds), self.phases[source]))
        for table in (self.phases, self.step_phases):
            table[source] -= seconds
            table[target] += seconds

    def total_seconds(self) -> float:
        return sum(self.phases.values()) + seconds_total(self.prior)

    def cost_usd(self) -> float | None:
        cost = self.prices.cost(self.device, sum(self.phases.values()))
        prior_seconds = seconds_total(self.prior)
        prior_cost = self.prior.get("cost_usd", 0.0)
        if prior_cost is None and prior_seconds > 0:
            # Earlier seconds had no price; one given now (e.g. on resume) prices them too.
            rate = self.prices.per_hour(str(self.prior.get("device", "unknown")))
            prior_cost = None if rate is None else prior_seconds * rate / 3600.0
            if prior_cost is None:
                return None
        return None if cost is None else cost + (prior_cost or 0.0)

    def step_columns(self) -> dict[str, float | None]:
        """Metrics columns: seconds per phase since the last line, and the run's cumulative seconds and cost.

        Each call starts the next line's count, so work done between two lines (a step's
        checkpoint, written after its line) lands in the next one."""
        # compute_s: device-seconds on whatever device ran them (the summary names it), CPU or GPU alike.
        columns: dict[str, float | None] = {f"compute_s/{p}": self.step_phases[p] for p in PHASES if p != "setup"}
        columns["compute_s/step"] = sum(v for p, v in self.step_phases.items() if p != "setup")
        columns["compute_s/total"] = self.total_seconds()
        columns["cost_usd"] = self.cost_usd()
        queued = self.meter.queue_seconds()  # a backend without a queue (local) reports 0
        columns["queue_s"], self._queue_mark = queued - self._queue_mark, queued
        self.step_phases = dict.fromkeys(PHASES, 0.0)
        return columns

    def summary(self) -> dict:
        """Plain data for the run state: seconds per phase and per function, device, price, cost."""
        prior_phases = seconds_by_phase(self.prior)
        phases = {p: self.phases[p] + float(prior_phases.get(p, 0.0)) for p in PHASES}
        seconds, calls = self.meter.seconds(), self.meter.calls()
        by_function: dict[str, dict] = {}
        for method in sorted(set(seconds) | set(self.prior.get("by_function", {}))):
            before = self.prior.get("by_function", {}).get(method, {})
            by_function[method] = {
                "seconds": seconds.get(method, 0.0) - self._start_seconds.get(method, 0.0) + before.get("seconds", 0.0),
                "calls": calls.get(method, 0) - self._start_calls.get(method, 0) + before.get("calls", 0),
            }
        for role, meter in self.extra_meters.items():  # a second worker's calls, under its role
            for method, spent in meter.seconds().items():
                before = self.prior.get("by_function", {}).get(f"{role}/{method}", {})
                by_function[f"{role}/{method}"] = {"seconds": spent + before.get("seconds", 0.0),
                                                   "calls": meter.calls().get(method, 0) + before.get("calls", 0)}
        by_function = {m: v for m, v in by_function.items() if v["calls"]}
        client_timed = self.meter.client_timed_calls() - self._start_client_timed
        return {
            "device": self.device,
            "measured_by": self.meter.source,
            "client_timed_calls": client_timed + int(self.prior.get("client_timed_calls", 0)),
            "price_per_hour": self.prices.per_hour(self.device),
            "compute_seconds": phases,
            "compute_seconds_total": sum(phases.values()),
            "by_function": by_function,
            "cost_usd": self.cost_usd(),
        }


def latest_usage(run_summary: Mapping) -> dict | None:
    """The most complete usage an earlier attempt of a run left in its state (cumulative, so the largest)."""
    candidates = [run_summary.get("usage"), (run_summary.get("last_metrics") or {}).get("usage")]
    candidates = [c for c in candidates if isinstance(c, dict) and _total_key(c) is not None]
    return max(candidates, key=seconds_total, default=None)


# Usage written before tinkerless named these figures for any device called them gpu_seconds / gpu_s: still read.
_TOTAL_KEYS = ("compute_seconds_total", "gpu_seconds_total")


def _total_key(usage: Mapping) -> str | None:
    return next((k for k in _TOTAL_KEYS if isinstance(usage.get(k), (int, float))), None)


def seconds_total(usage: Mapping) -> float:
    """A usage summary's total device-seconds, whichever version of tinkerless wrote it (0 without one)."""
    key = _total_key(usage)
    return float(usage[key]) if key is not None else 0.0


def seconds_by_phase(usage: Mapping) -> dict:
    """A usage summary's device-seconds per phase, whichever version wrote it."""
    phases = usage.get("compute_seconds", usage.get("gpu_seconds", {}))
    return phases if isinstance(phases, dict) else {}


def renamed_metric(key: str) -> str:
    """A metrics.jsonl column under its current name (`gpu_s/...` became `compute_s/...`)."""
    return "compute_s/" + key[len("gpu_s/"):] if key.startswith("gpu_s/") else key


def format_usage(usage: Mapping) -> str:
    """One line for the final report: seconds, their split by phase, and the cost."""
    kind = "CPU" if usage.get("device") == "cpu" else "GPU"
    phases = ", ".join(f"{p} {_seconds(s)}" for p, s in seconds_by_phase(usage).items() if s > 0)
    rate = usage.get("price_per_hour")
    cost = format_cost(usage.get("cost_usd"))
    priced = f"{cost} at ${rate:.2f}/h" if rate is not None else f"cost n/a ({_PRICE_HINT})"
    source = str(usage.get("measured_by"))
    client_timed = usage.get("client_timed_calls", 0)
    if client_timed and not source.startswith("client"):
        source += f", {client_timed} calls timed by the client"
    return (
        f"{_seconds(seconds_total(usage))} {kind}-seconds on {usage.get('device')} ({phases or 'none'}), "
        f"measured by {source}; {priced}"
    )


def format_cost(cost: float | None) -> str:
    if cost is None:
        return "n/a"
    return f"${cost:.4f}" if cost < 100 else f"${cost:,.0f}"


def _seconds(value: float) -> str:
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"
