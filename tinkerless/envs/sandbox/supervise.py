"""Start a sandbox process, read its output within bounds, stop it at the wall clock, and say why it ended.

Shared by the bubblewrap and the process sandbox: both are one host process (bwrap,
or the sandboxed interpreter itself) whose death ends everything it started.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from typing import Callable, Sequence

from tinkerless.envs.sandbox.limits import SandboxLimits, SandboxResult, SandboxUnavailable, reason_for

EXIT_GRACE_SECONDS = 1.0  # after the main process exits, how long stray output may still drain


class Capture:
    """Keeps the first `limit` bytes of a stream and counts the rest."""

    def __init__(self, limit: int):
        self.limit = limit
        self.data = bytearray()
        self.dropped = 0

    def add(self, chunk: bytes) -> None:
        room = max(self.limit - len(self.data), 0)
        self.data += chunk[:room]
        self.dropped += max(len(chunk) - room, 0)

    def text(self) -> str:
        text = self.data.decode("utf-8", errors="replace")
        if self.dropped:
            text += f"\n[output truncated: {self.dropped} more bytes not shown]"
        return text


def supervise(
    argv: Sequence[str],
    *,
    kind: str,
    limits: SandboxLimits,
    stdin_fd: int,
    env: dict[str, str],
    cwd: str | None = None,
    pass_fds: Sequence[int] = (),
    preexec: Callable[[], None] | None = None,
    kill_group: bool = False,
    cpu_reported: bool = True,
) -> SandboxResult:
    """Run `argv`, return its bounded output and the reason it ended; always returns within ~wall_seconds + 1 s.

    `kill_group`: the sandbox is a process group (the process sandbox) rather than a
    PID namespace owned by one process (bwrap); stray children are then killed by group.
    `cpu_reported`: whether the reaped process's rusage includes the sandbox's CPU time.
    """
    started = time.monotonic()
    try:
        proc = subprocess.Popen(
            list(argv),
            stdin=stdin_fd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=env,
            pass_fds=tuple(pass_fds),
            start_new_session=True,
            preexec_fn=preexec,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise SandboxUnavailable(
            f"cannot start the {kind} sandbox ({argv[0]}): {exc}",
            hint="see docs/sandbox.md for what the sandbox needs (bubblewrap, user namespaces or root)",
        ) from exc
    return watch(proc, kind=kind, limits=limits, started=started, kill_group=kill_group, cpu_reported=cpu_reported)


def watch(
    proc: subprocess.Popen, *, kind: str, limits: SandboxLimits, started: float, kill_group: bool = False, cpu_reported: bool = True
) -> SandboxResult:
    """Supervise an already started sandbox (stdout and stderr piped) from `started` on; see `supervise`."""
    deadline = started + limits.wall_seconds
    out_capture, err_capture = Capture(limits.max_output_bytes), Capture(limits.max_output_bytes)
    streams = {proc.stdout.fileno(): out_capture, proc.stderr.fileno(): err_capture}
    kill = _kill_group if kill_group else _kill_process
    try:
        timed_out = _pump(proc.pid, streams, deadline, kill)
        _, status, usage = os.wait4(proc.pid, 0)
    except BaseException:
        kill(proc.pid)  # interrupted before reaping it: nothing may outlive us
        raise
    finally:
        proc.stdout.close()
        proc.stderr.close()
    exit_code = os.waitstatus_to_exitcode(status)
    proc.returncode = exit_code  # reaped with wait4 above; tell Popen so it does not wait again
    cpu = usage.ru_utime + usage.ru_stime if cpu_reported else None
    seconds = time.monotonic() - started
    reason = reason_for(exit_code, timed_out, cpu, limits, seconds)
    return SandboxResult(
        ok=reason == "ok",
        stdout=out_capture.text(),
        stderr=err_capture.text(),
        exit_code=exit_code,
        reason=reason,
        seconds=seconds,
        cpu_seconds=cpu,
        truncated=out_capture.dropped > 0 or err_capture.dropped > 0,
        pid=proc.pid,
        sandbox=kind,
    )


def _pump(pid: int, streams: dict[int, Capture], deadline: float, kill: Callable[[int], None]) -> bool:
    """Read output until the process ends (or the deadline kills it); True if it was killed for time."""
    timed_out = False
    exited_at: float | None = None
    with selectors.DefaultSelector() as selector:
        for fd in streams:
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        while True:
            now = time.monotonic()
            if exited_at is None and _has_exited(pid):
                exited_at = now
                kill(pid)  # anything it left behind; the zombie still holds its pid
            if exited_at is None and now >= deadline:
                kill(pid)
                timed_out = True
                exited_at = now
            open_streams = selector.get_map()
            if exited_at is not None and (not open_streams or now - exited_at > EXIT_GRACE_SECONDS):
                return timed_out
            if not open_streams:  # it closed stdout/stderr but still runs
                time.sleep(min(0.002, max(deadline - now, 0)))
                continue
            # Poll the exit state every 20 ms: a stray child may keep the pipes open.
            timeout = min(0.02, max(deadline - now, 0.0)) if exited_at is None else 0.02
            for key, _ in selector.select(timeout):
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if chunk:
                    streams[key.fd].add(chunk)
                else:
                    selector.unregister(key.fd)


def _has_exited(pid: int) -> bool:
    # WNOWAIT leaves the zombie in place, so its pid (and group id) cannot be reused before we kill it.
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _kill_process(pid: int) -> None:
    # bwrap: its PID-1 child dies with it (--die-with-parent), and the kernel then kills the whole PID namespace.
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


__all__ = ["Capture", "supervise", "watch"]
