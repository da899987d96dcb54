"""How many CPU threads torch uses in a worker, chosen on purpose instead of left to torch.

torch's default is one intra-op thread per core of the machine. It counts cores this process may
not use (CPU affinity, a container's CPU quota) and cores that other processes keep busy.
OpenMP threads wait for each other at every operation. When one of them has no free core to
run on, every token waits for it: SmolLM2 sampled 1.2 tokens/s with the default against 30
with one thread on a loaded 2-core machine (see BENCHMARKS.md).

The choice, in order:
1. `threads=N` (TrainConfig.threads, `--threads`): exactly N;
2. the OMP_NUM_THREADS environment variable: that many;
3. otherwise, the cores this process may use (affinity and cgroup quota) minus the cores the
   machine's recent load keeps busy (1-minute load average), and at least 1.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from tinkerless.errors import ConfigError


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    reason: str  # why this many, for `info` and the docs' troubleshooting


def usable_cpus() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup v2/v1 CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    quota = _cgroup_cpu_limit()
    return max(1, min(cpus, quota)) if quota is not None else max(1, cpus)


def choose_threads(requested: int | None = None, *, environ: dict | None = None, load: float | None = None) -> ThreadChoice:
    """The thread count for this process (see the module docstring for the order of precedence)."""
    environ = os.environ if environ is None else environ
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ConfigError(f"threads must be a whole number of at least 1, got {requested!r}", hint="e.g. threads=1, or None to choose automatically")
        return ThreadChoice(requested, "threads setting")
    omp = environ.get("OMP_NUM_THREADS", "").strip()
    if omp:
        try:
            value = int(omp.split(",")[0])  # OpenMP allows a per-nesting-level list; the first level is ours
        except ValueError:
            value = 0
        if value < 1:
            raise ConfigError(f"OMP_NUM_THREADS={omp!r} is not a whole number of at least 1", hint="unset it or set e.g. OMP_NUM_THREADS=1")
        return ThreadChoice(value, "OMP_NUM_THREADS")
    cpus = usable_cpus()
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):
            load = 0.0
    busy = min(cpus - 1, int(round(load)))
    threads = max(1, cpus - busy)
    return ThreadChoice(threads, f"{cpus} usable cores, about {busy} busy with other work (load average {load:.1f})")


def apply_threads(choice: ThreadChoice) -> None:
    import torch

    torch.set_num_threads(choice.threads)


def _cgroup_cpu_limit() -> int | None:
    """Whole cores allowed by a CPU quota (rounded up), or None without one."""
    try:
        text = Path("/sys/fs/cgroup/cpu.max").read_text().split()  # cgroup v2: "<quota|max> <period>"
        if text and text[0] != "max":
            return max(1, math.ceil(int(text[0]) / int(text[1])))
        return None
    except (OSError, ValueError, IndexError):
        pass
    try:  # cgroup v1
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return max(1, math.ceil(quota / period)) if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None
