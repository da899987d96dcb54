"""`/metrics` for `tinkerless serve`: `ServerStats` counts answered calls and renders them, with the
scheduler's queue, CPU time and (when torch is already loaded) GPU memory, as Prometheus text."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tinkerless.server.scheduler import Scheduler


@dataclass
class ServerStats:
    """Counters for `/metrics` (Prometheus text format): queue depth, work in flight, requests, CPU."""

    scheduler: Scheduler
    requests: dict[tuple[str, int], int] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)

    def count(self, method: str, status: int) -> None:
        self.requests[(method, status)] = self.requests.get((method, status), 0) + 1

    def prometheus(self) -> str:
        lines = [
            "# HELP tinkerless_queue_depth Calls waiting for the model.",
            "# TYPE tinkerless_queue_depth gauge",
            f"tinkerless_queue_depth {self.scheduler.pending}",
            "# HELP tinkerless_in_flight Calls started and not finished (one runs; others paused between slices).",
            "# TYPE tinkerless_in_flight gauge",
            f"tinkerless_in_flight {self.scheduler.in_flight}",
            "# HELP tinkerless_slices_total Times a generation paused so that another tenant's call could run.",
            "# TYPE tinkerless_slices_total counter",
            f"tinkerless_slices_total {self.scheduler.slices}",
            "# HELP tinkerless_requests_total Calls answered, by function and HTTP status.",
            "# TYPE tinkerless_requests_total counter",
        ]
        lines += [
            f'tinkerless_requests_total{{method="{m}",status="{s}"}} {n}' for (m, s), n in sorted(self.requests.items())
        ]
        # CPU utilization = rate of this counter over wall time (as process_cpu_seconds_total usually is).
        lines += [
            "# HELP process_cpu_seconds_total CPU time used by the server process.",
            "# TYPE process_cpu_seconds_total counter",
            f"process_cpu_seconds_total {time.process_time():.3f}",
            "# HELP tinkerless_uptime_seconds Seconds since the server started.",
            "# TYPE tinkerless_uptime_seconds gauge",
            f"tinkerless_uptime_seconds {time.monotonic() - self.started:.3f}",
        ]
        lines += _gpu_lines()
        return "\n".join(lines) + "\n"


def _gpu_lines() -> list[str]:
    import sys

    torch = sys.modules.get("torch")  # only report what is already loaded; never import CUDA for a scrape
    if torch is None or not torch.cuda.is_available():
        return []
    lines = ["# HELP tinkerless_gpu_memory_bytes GPU memory allocated by torch.", "# TYPE tinkerless_gpu_memory_bytes gauge"]
    for index in range(torch.cuda.device_count()):
        lines.append(f'tinkerless_gpu_memory_bytes{{device="{index}"}} {torch.cuda.memory_allocated(index)}')
    try:
        lines += [f'tinkerless_gpu_utilization_percent{{device="{i}"}} {torch.cuda.utilization(i)}' for i in range(torch.cuda.device_count())]
    except Exception:  # needs pynvml; memory is still reported
        pass
    return lines
