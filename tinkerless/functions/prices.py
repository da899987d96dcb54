"""What a device-hour costs: list prices per GPU class, and the table a run or a server prices its seconds with.

Read by the client's accounting (`sdk/run/accounting.py`), the server's key budgets (`server/budgets.py`) and the
run estimates (`functions/estimate.py`), so it lives below all of them.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Mapping

from tinkerless.errors import ConfigError

# Modal list prices, mid-2026 (https://modal.com/pricing), in $ per GPU-hour. "cpu" is the local
# backend's device: your own machine, free by default.
DEFAULT_PRICES_PER_HOUR: dict[str, float] = {
    "B200": 6.25,
    "H200": 4.54,
    "H100": 3.95,
    "A100-80GB": 2.50,
    "A100": 2.10,  # the 40 GB card; the 80 GB one matches the more specific key above
    "L40S": 1.95,
    "A10G": 1.10,
    "L4": 0.80,
    "T4": 0.59,
    "cpu": 0.0,
}

PRICE_HINT = "set TrainConfig(prices={'<device>': dollars_per_hour}) or TrainConfig(price_per_hour=...)"


class PriceTable:
    """Dollars per device-hour, found by device name.

    A key matches a device when every word of the key is a word of the device name,
    case-insensitively ("H100" matches "NVIDIA H100 80GB HBM3", "A100-80GB" matches
    "NVIDIA A100-SXM4-80GB", "L4" does not match "NVIDIA L40S"). The user's keys are
    tried before the defaults; among matches the most specific key wins. A flat
    `price_per_hour` prices every device.
    """

    def __init__(self, prices: Mapping[str, float] | None = None, *, price_per_hour: float | None = None):
        self.user = {str(k): check_price(k, v) for k, v in (prices or {}).items()}
        for key in self.user:
            if not _words(key):
                raise ConfigError(f"prices key {key!r} names no device", hint="use a device name such as 'H100' or 'cpu'")
        self.flat = None if price_per_hour is None else check_price("price_per_hour", price_per_hour)
        self._warned: set[str] = set()

    def per_hour(self, device: str) -> float | None:
        """The $/hour for `device`, or None when no key matches."""
        if self.flat is not None:
            return self.flat
        for table in (self.user, DEFAULT_PRICES_PER_HOUR):
            matches = [key for key in table if set(_words(key)) <= set(_words(device))]
            if matches:
                return table[max(matches, key=lambda k: (len(_words(k)), len(k)))]
        return None

    def cost(self, device: str, seconds: float) -> float | None:
        """Dollars for `seconds` on `device`; None (with one warning per device) when its price is unknown."""
        rate = self.per_hour(device)
        if rate is None:
            if device not in self._warned:
                self._warned.add(device)
                warnings.warn(
                    f"no price known for device {device!r}, so the run's cost is reported as n/a; {PRICE_HINT}",
                    UserWarning,
                    stacklevel=2,
                )
            return None
        return seconds * rate / 3600.0


def _words(name: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", str(name).lower())


def check_price(key: object, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(
            f"price for {key!r} must be a non-negative number of dollars per hour, got {value!r}",
            hint="e.g. prices={'H100': 3.95} or price_per_hour=2.5",
        )
    return float(value)
