"""What a sandboxed run may use (`SandboxLimits`) and what came back (`SandboxResult`).

Shared by every sandbox kind (bubblewrap, Modal, the opt-in process sandbox), so a
tool's observation reads the same wherever the code ran.
"""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass

from tinkerless.errors import ConfigError, TinkerlessError

# Exit codes the in-sandbox bootstrap uses to say which limit an uncaught exception came from.
EXIT_FORBIDDEN = 86  # the audit-hook layer refused an operation
EXIT_MEMORY = 87  # MemoryError: RLIMIT_AS
EXIT_FILE_SIZE = 88  # EFBIG: RLIMIT_FSIZE
EXIT_DISK = 89  # ENOSPC: the size-capped work dir is full
EXIT_PROCESSES = 90  # EAGAIN from fork/thread start: RLIMIT_NPROC
EXIT_OPEN_FILES = 91  # EMFILE: RLIMIT_NOFILE
BOOTSTRAP_EXIT_CODES = {
    EXIT_FORBIDDEN: "forbidden",
    EXIT_MEMORY: "memory_limit",
    EXIT_FILE_SIZE: "file_limit",
    EXIT_DISK: "disk_limit",
    EXIT_PROCESSES: "process_limit",
    EXIT_OPEN_FILES: "open_files_limit",
}
MAX_OPEN_FILES = 64
_CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE}

# Every reason a run can end with; the *_limit ones and "timeout" name the limit that stopped it.
REASONS = (
    "ok", "error", "timeout", "cpu_limit", "memory_limit", "file_limit", "disk_limit",
    "process_limit", "open_files_limit", "forbidden", "crashed", "killed",
)


class SandboxUnavailable(TinkerlessError):
    """The requested sandbox cannot run on this machine; the message names the fix. Never downgraded silently."""


@dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: float = 2.0  # RLIMIT_CPU per process, rounded up to whole seconds
    wall_seconds: float = 5.0  # the whole sandbox (its PID namespace) is killed after this
    memory_bytes: int = 256 * 2**20  # RLIMIT_AS (address space) per process
    max_processes: int = 0  # extra processes/threads allowed; 0 = no fork, no threads
    max_output_bytes: int = 16_384  # stdout and stderr are each truncated to this
    max_file_bytes: int = 1 * 2**20  # RLIMIT_FSIZE: the largest single file
    disk_bytes: int = 16 * 2**20  # size of the tmpfs work dir: everything written, together
    network: bool = False  # only the Modal sandbox can grant network; bubblewrap never does

    def __post_init__(self) -> None:
        for name in ("cpu_seconds", "wall_seconds", "memory_bytes", "max_output_bytes", "max_file_bytes", "disk_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not value > 0:
                raise ConfigError(f"SandboxLimits.{name} must be a positive finite number, got {value!r}")
        if isinstance(self.max_processes, bool) or not isinstance(self.max_processes, int) or not 0 <= self.max_processes <= 1024:
            raise ConfigError(f"SandboxLimits.max_processes must be an int from 0 to 1024, got {self.max_processes!r}")
        if not isinstance(self.network, bool):
            raise ConfigError(f"SandboxLimits.network must be True or False, got {self.network!r}")

    @property
    def cpu_limit(self) -> int:
        """RLIMIT_CPU in whole seconds (the kernel counts whole seconds)."""
        return max(1, math.ceil(self.cpu_seconds))


@dataclass
class SandboxResult:
    ok: bool
    stdout: str
    stderr: str
    exit_code: int | None  # negative: killed by that signal
    reason: str  # one of REASONS
    seconds: float  # wall clock
    cpu_seconds: float | None = None  # CPU time where the kernel reports it (not through bwrap's PID 1)
    truncated: bool = False  # stdout or stderr was cut to max_output_bytes
    pid: int | None = None  # the host pid of the sandbox's outermost process
    sandbox: str = ""  # which kind ran it: "bwrap", "modal" or "process-unsafe"


def rlimit_values(limits: SandboxLimits) -> list[tuple[str, int, int]]:
    """The per-process resource limits, as (RLIMIT name, soft, hard): the soft CPU limit sends SIGXCPU, the hard
    one (a second later) SIGKILL for a program that catches SIGXCPU."""
    cpu = limits.cpu_limit
    return [
        ("RLIMIT_CPU", cpu, cpu + 1),
        ("RLIMIT_AS", int(limits.memory_bytes), int(limits.memory_bytes)),
        ("RLIMIT_FSIZE", int(limits.max_file_bytes), int(limits.max_file_bytes)),
        ("RLIMIT_CORE", 0, 0),
        ("RLIMIT_NOFILE", MAX_OPEN_FILES, MAX_OPEN_FILES),
    ]


def reason_for(exit_code: int, timed_out: bool, cpu: float | None, limits: SandboxLimits, seconds: float = 0.0) -> str:
    """Why a run ended, from its exit status, whether the wall clock stopped it and the CPU it used.

    `cpu` is None where the kernel does not report the sandbox's CPU time (bwrap's
    PID-1 process does not pass its child's usage on); then a SIGKILL that we did not
    send counts as the hard CPU limit if the run lasted long enough to reach it.
    """
    if timed_out:
        return "timeout"
    if exit_code == 0:
        return "ok"
    if exit_code < 0:
        sig = -exit_code
        if cpu is not None:
            reached_hard_cpu_limit = cpu >= limits.cpu_limit - 0.05
        else:
            reached_hard_cpu_limit = seconds >= limits.cpu_limit / (1 + limits.max_processes) - 0.05
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and reached_hard_cpu_limit):
            return "cpu_limit"  # SIGXCPU at the soft limit, SIGKILL at the hard one if SIGXCPU was caught
        if sig == signal.SIGXFSZ:
            return "file_limit"
        return "crashed" if sig in _CRASH_SIGNALS else "killed"
    # A shell reports a child killed by signal N as 128 + N; bwrap passes the child's status on that way.
    if 128 < exit_code < 128 + 65 and exit_code - 128 in (signal.SIGXCPU, signal.SIGKILL, signal.SIGXFSZ, *_CRASH_SIGNALS):
        return reason_for(-(exit_code - 128), False, cpu, limits, seconds)
    return BOOTSTRAP_EXIT_CODES.get(exit_code, "error")


__all__ = ["REASONS", "SandboxLimits", "SandboxResult", "SandboxUnavailable", "reason_for", "rlimit_values"]
