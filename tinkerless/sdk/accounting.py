"""Pay-per-use accounting: compute seconds per function, measured where the work runs.

Every backend owns a `UsageMeter` (`backend.usage`) and records, for each call, the
seconds the function body ran on its device (in-process for local, the server's own
timing for HTTP, the container's timing for Modal).
"""

from __future__ import annotations

import threading
from collections import defaultdict


class UsageMeter:
    """Thread-safe running totals of compute seconds and call counts per function."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds: dict[str, float] = defaultdict(float)
        self._calls: dict[str, int] = defaultdict(int)

    def record(self, method: str, seconds: float) -> None:
        with self._lock:
            self._seconds[method] += float(seconds)
            self._calls[method] += 1

    def seconds(self) -> dict[str, float]:
        with self._lock:
            return dict(self._seconds)

    def calls(self) -> dict[str, int]:
        with self._lock:
            return dict(self._calls)
