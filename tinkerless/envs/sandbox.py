"""Run model-written Python in a separate, limited process: `run_python(code) -> SandboxResult`.

What is enforced, and by what
-----------------------------
Kernel-enforced (cannot be undone from inside the child):

- a separate process: `python -I -S -B -u` (isolated: no env vars, no site-packages,
  no user site, no script dir on sys.path), started with `start_new_session=True`
  so it and anything it spawns share one process group;
- `preexec_fn` resource limits: RLIMIT_CPU (`cpu_seconds`, rounded up to whole
  seconds; SIGXCPU, then SIGKILL one second later), RLIMIT_AS (`memory_bytes`;
  allocations beyond it raise MemoryError), RLIMIT_FSIZE (`max_file_bytes`),
  RLIMIT_CORE 0, RLIMIT_NOFILE 64, and RLIMIT_NPROC 0 when `max_processes` is 0
  (this last one binds only non-root users: root ignores RLIMIT_NPROC);
- wall clock: the parent kills the whole process group with SIGKILL after
  `wall_seconds`, and again when the main process exits (stray children), so a
  run always ends;
- a fresh network namespace (`unshare(CLONE_NEWNET)`, only loopback, down) where
  the kernel allows it (root, or unprivileged user namespaces); silently skipped
  otherwise, the audit hook below still applies;
- output: the parent reads at most `max_output_bytes` of stdout and of stderr and
  discards the rest, so a chatty program cannot exhaust the parent's memory;
- a fresh temporary working directory (also HOME and TMPDIR), deleted afterwards.

Enforced by a bootstrap that runs in the child before the user's code
(`sys.addaudithook` plus replaced functions):

- no new processes: os.fork/forkpty (beyond `max_processes`), and never
  exec/posix_spawn/system/subprocess (a new program would run without the hook);
  `_posixsubprocess.fork_exec` is replaced, and threads count as processes;
- no network: creating any socket but AF_UNIX (socketpair, needed by asyncio),
  connect, bind, sendto/sendmsg and name lookups are denied;
- no writes outside the working directory: every `open`/`os.open` for writing,
  and remove/rename/mkdir/rmdir/link/symlink/chmod/chown/utime/truncate/xattr,
  is checked against the working directory after resolving symlinks with the
  hook's own resolver (`..`, symlink, `/proc/self/fd` and dir_fd escapes
  included); symlinks may only point, by absolute path, inside the directory;
  C-level file writers that bypass audit events are unavailable (mkfifo, mknod,
  sqlite3, dbm, readline, shared memory);
- reads only from the working directory, the standard library, a few device
  files, time zones and /proc of the process itself (no secrets from the host);
- no native code: importing ctypes and the CPython test/extension back doors is
  denied; no changing resource limits, no signals to other processes, no
  gc.get_objects/get_referrers (which would reach the hook's state).

Not restricted: directory listings and file metadata (os.listdir, os.stat)
anywhere. With `max_processes` > 0 the count of forks and threads lives in a page
shared by the sandbox's processes, which a determined program could reset; as
root nothing in the kernel backs that count up, but every process still dies
with the group at the wall-clock limit.

A forbidden operation raises PermissionError("sandbox: ..."). Uncaught, the run
reports reason "forbidden"; a program that keeps trying after catching it is
stopped at the 16th attempt, also as "forbidden".

`preexec_fn` only calls setrlimit and unshare with arguments prepared in the
parent, which keeps it safe enough in a parent with threads (envs run in pools).

The audit-hook layer is NOT a security boundary against a determined attacker:
it runs inside the attacker's own interpreter, and native code (ctypes, a crafted
extension, an interpreter memory-corruption bug) could remove it. That is why
ctypes and the test modules are blocked, and why the kernel limits above do not
depend on it. For hostile code, run the worker itself in a container or VM.

Reasons: "ok", "error" (non-zero exit, traceback in stderr), "timeout",
"cpu_limit", "memory_limit", "file_limit", "forbidden", "crashed" (a fatal
signal such as SIGSEGV) and "killed" (any other signal).
The bootstrap reports forbidden/memory/file-size failures by exit codes 86/87/88,
so a program calling sys.exit(86) itself is reported as "forbidden".
"""

from __future__ import annotations

import functools
import json
import math
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from typing import BinaryIO, Callable

from tinkerless.errors import ConfigError, TinkerlessError

EXIT_FORBIDDEN = 86
EXIT_MEMORY = 87
EXIT_FILE_SIZE = 88
MAX_OPEN_FILES = 64
EXIT_GRACE_SECONDS = 1.0  # after the main process exits, how long stray output may still drain
_CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE}
_CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: float = 2.0  # RLIMIT_CPU, rounded up to whole seconds
    wall_seconds: float = 5.0  # the whole process group is killed after this
    memory_bytes: int = 256 * 2**20  # RLIMIT_AS (address space)
    max_processes: int = 0  # extra processes/threads allowed; 0 = no fork, no threads
    max_output_bytes: int = 16_384  # stdout and stderr are each truncated to this
    max_file_bytes: int = 1 * 2**20  # RLIMIT_FSIZE

    def __post_init__(self) -> None:
        for name in ("cpu_seconds", "wall_seconds", "memory_bytes", "max_output_bytes", "max_file_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"SandboxLimits.{name} must be a positive number, got {value!r}")
        if isinstance(self.max_processes, bool) or not isinstance(self.max_processes, int) or self.max_processes < 0:
            raise ConfigError(f"SandboxLimits.max_processes must be an int >= 0, got {self.max_processes!r}")


@dataclass
class SandboxResult:
    ok: bool
    stdout: str
    stderr: str
    exit_code: int | None  # negative: killed by that signal
    reason: str  # "ok" | "error" | "timeout" | "cpu_limit" | "memory_limit" | "file_limit" | "forbidden" | "crashed" | "killed"
    seconds: float  # wall clock
    cpu_seconds: float = 0.0
    truncated: bool = False  # stdout or stderr was cut to max_output_bytes
    pid: int | None = None  # the sandbox process (also its process group and session id)


def run_python(code: str, *, limits: SandboxLimits = SandboxLimits(), stdin: str = "") -> SandboxResult:
    """Run `code` as a fresh Python program under `limits`; always returns within about `wall_seconds`."""
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    root = tempfile.mkdtemp(prefix="tinkerless-sandbox-")
    try:
        work = os.path.join(root, "work")
        os.mkdir(work, 0o700)
        code_path = os.path.join(root, "main.py")  # outside `work`: the program cannot rewrite it
        with open(code_path, "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(code)
        stdin_path = os.path.join(root, "stdin")
        with open(stdin_path, "w", encoding="utf-8", errors="replace") as f:
            f.write(stdin)
        config = {
            "work": os.path.realpath(work),
            "code": code_path,
            "max_processes": limits.max_processes,
            "read_roots": _read_roots(),
            "exit_codes": [EXIT_FORBIDDEN, EXIT_MEMORY, EXIT_FILE_SIZE],
        }
        with open(stdin_path, "rb") as stdin_file:
            return _supervise(config, limits, stdin_file)
    finally:
        shutil.rmtree(root, onerror=_force_remove)


# ---------------------------------------------------------------------------
# parent side


def _supervise(config: dict, limits: SandboxLimits, stdin_file: BinaryIO) -> SandboxResult:
    argv = [sys.executable, "-I", "-S", "-B", "-u", "-X", "utf8", "-c", _BOOTSTRAP, json.dumps(config)]
    env = {"PATH": "/usr/bin:/bin", "HOME": config["work"], "TMPDIR": config["work"], "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    started = time.monotonic()
    deadline = started + limits.wall_seconds
    try:
        proc = subprocess.Popen(
            argv,
            stdin=stdin_file,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=config["work"],
            env=env,
            start_new_session=True,
            preexec_fn=_make_preexec(limits),
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise TinkerlessError(
            f"cannot start the Python sandbox ({sys.executable}): {exc}",
            hint="the worker needs a working Python interpreter and permission to set resource limits",
        ) from exc
    out_capture, err_capture = _Capture(limits.max_output_bytes), _Capture(limits.max_output_bytes)
    streams = {proc.stdout.fileno(): out_capture, proc.stderr.fileno(): err_capture}
    try:
        timed_out = _pump(proc.pid, streams, deadline)
        _, status, usage = os.wait4(proc.pid, 0)
    except BaseException:
        _kill_group(proc.pid)  # interrupted before reaping it: nothing may outlive us
        raise
    finally:
        proc.stdout.close()
        proc.stderr.close()
    exit_code = os.waitstatus_to_exitcode(status)
    proc.returncode = exit_code  # reaped with wait4 above; tell Popen so it does not wait again
    cpu = usage.ru_utime + usage.ru_stime
    reason = _reason(exit_code, timed_out, cpu, limits)
    return SandboxResult(
        ok=reason == "ok",
        stdout=out_capture.text(),
        stderr=err_capture.text(),
        exit_code=exit_code,
        reason=reason,
        seconds=time.monotonic() - started,
        cpu_seconds=cpu,
        truncated=out_capture.dropped > 0 or err_capture.dropped > 0,
        pid=proc.pid,
    )


class _Capture:
    """Keeps the first `limit` bytes of a stream and counts the rest."""

    def __init__(self, limit: int):
        self.limit = limit
        self.data = bytearray()
        self.dropped = 0

    def add(self, chunk: bytes) -> None:
        room = self.limit - len(self.data)
        self.data += chunk[: max(room, 0)]
        self.dropped += max(len(chunk) - max(room, 0), 0)

    def text(self) -> str:
        text = self.data.decode("utf-8", errors="replace")
        if self.dropped:
            text += f"\n[output truncated: {self.dropped} more bytes not shown]"
        return text


def _pump(pid: int, streams: dict[int, _Capture], deadline: float) -> bool:
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
                _kill_group(pid)  # anything it left behind; the zombie still holds the group id
            if exited_at is None and now >= deadline:
                _kill_group(pid)
                timed_out = True
                exited_at = now
            open_streams = selector.get_map()
            if exited_at is not None and (not open_streams or now - exited_at > EXIT_GRACE_SECONDS):
                return timed_out
            if not open_streams:  # it closed stdout/stderr but still runs
                time.sleep(min(0.01, max(deadline - now, 0)))
                continue
            # Poll the exit state every 50 ms: a stray child may keep the pipes open.
            timeout = min(0.05, max(deadline - now, 0.0)) if exited_at is None else 0.05
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
    # WNOWAIT leaves the zombie in place, so its pid (the group id) cannot be reused before we kill the group.
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _reason(exit_code: int, timed_out: bool, cpu: float, limits: SandboxLimits) -> str:
    if timed_out:
        return "timeout"
    if exit_code == 0:
        return "ok"
    if exit_code < 0:
        sig = -exit_code
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= _cpu_limit(limits) - 0.05):
            return "cpu_limit"  # SIGXCPU at the soft limit, SIGKILL at the hard one if SIGXCPU was caught
        if sig == signal.SIGXFSZ:
            return "file_limit"
        return "crashed" if sig in _CRASH_SIGNALS else "killed"
    return {EXIT_FORBIDDEN: "forbidden", EXIT_MEMORY: "memory_limit", EXIT_FILE_SIZE: "file_limit"}.get(exit_code, "error")


def _cpu_limit(limits: SandboxLimits) -> int:
    return max(1, math.ceil(limits.cpu_seconds))


def _make_preexec(limits: SandboxLimits) -> Callable[[], None]:
    # Everything is computed here, in the parent: preexec_fn runs between fork and exec,
    # where allocating, importing or taking locks is unsafe.
    cpu = _cpu_limit(limits)
    settings = [
        (resource.RLIMIT_CPU, _clamp(resource.RLIMIT_CPU, cpu, cpu + 1)),
        (resource.RLIMIT_AS, _clamp(resource.RLIMIT_AS, limits.memory_bytes, limits.memory_bytes)),
        (resource.RLIMIT_FSIZE, _clamp(resource.RLIMIT_FSIZE, limits.max_file_bytes, limits.max_file_bytes)),
        (resource.RLIMIT_CORE, (0, 0)),
        (resource.RLIMIT_NOFILE, _clamp(resource.RLIMIT_NOFILE, MAX_OPEN_FILES, MAX_OPEN_FILES)),
    ]
    if limits.max_processes == 0:
        settings.append((resource.RLIMIT_NPROC, (0, 0)))
    unshare = _unshare_function()
    setrlimit = resource.setrlimit

    def preexec() -> None:
        for which, value in settings:
            setrlimit(which, value)
        if unshare is not None:
            unshare(_CLONE_NEWNET)  # failure (no privilege) is fine: the audit hook still blocks sockets

    return preexec


def _clamp(which: int, soft: int, hard: int) -> tuple[int, int]:
    """Limits no higher than the current hard limit, which an unprivileged process cannot raise."""
    _, current_hard = resource.getrlimit(which)
    if current_hard != resource.RLIM_INFINITY:
        soft, hard = min(soft, current_hard), min(hard, current_hard)
    return int(soft), int(hard)


@functools.lru_cache(maxsize=1)
def _unshare_function() -> Callable[[int], object] | None:
    if hasattr(os, "unshare"):  # Python 3.12+

        def call(flags: int) -> None:
            try:
                os.unshare(flags)
            except OSError:
                pass

        return call
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.unshare
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int]
    function.restype = ctypes.c_int
    return function  # returns -1 on failure, which preexec ignores


@functools.lru_cache(maxsize=1)
def _read_roots() -> list[str]:
    """Where the child may read besides its working directory: the standard library and time zones."""
    paths = {sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib"), os.path.dirname(os.__file__)}
    paths |= {"/usr/share/zoneinfo", "/usr/lib/zoneinfo", "/usr/share/lib/zoneinfo", "/etc/zoneinfo"}
    return sorted(os.path.realpath(p) for p in paths if p)


def _force_remove(function: Callable, path: str, exc_info: object) -> None:
    # The program may have made files or directories read-only; make them writable and retry once.
    try:
        os.chmod(os.path.dirname(path), 0o700)
        os.chmod(path, 0o700)
        function(path)
    except OSError:
        pass


# ---------------------------------------------------------------------------
# child side: runs as `python -c _BOOTSTRAP CONFIG_JSON` before the user's code.
# Kept free of module globals the user's code could reach: the policy lives in the
# closure of the audit hook, which nothing but the interpreter references.

_BOOTSTRAP = r'''
import sys


def _install(config):
    import _thread
    import mmap
    import pathlib
    import posix
    import _posixsubprocess

    work = config["work"]
    max_processes = config["max_processes"]
    exit_forbidden = config["exit_codes"][0]
    read_roots = tuple(config["read_roots"])
    read_files = frozenset(["/dev/null", "/dev/zero", "/dev/urandom", "/dev/random", "/etc/localtime"])
    write_files = frozenset(["/dev/null"])
    max_violations = 16

    # Bound now, so a program that monkeypatches os or posixpath cannot change what the hook does.
    lstat, readlink, getcwd, getpid = posix.lstat, posix.readlink, posix.getcwd, posix.getpid
    getpgrp, getpgid, write_fd, hard_exit = posix.getpgrp, posix.getpgid, posix.write, posix._exit
    str_join, bytes_join, int_add = "".join, b"".join, int.__add__
    path_types = frozenset([pathlib.PurePath, pathlib.PurePosixPath, pathlib.Path, pathlib.PosixPath])
    path_fspath, path_str = pathlib.PurePath.__fspath__, pathlib.PurePath.__str__
    no_dir_fd = (None, -1, -100)  # -100 is AT_FDCWD
    violations = [0]
    slots = mmap.mmap(-1, 8) if max_processes > 0 else None  # shared with forked children

    class SandboxViolation(PermissionError):
        pass

    # Tracebacks then say just "SandboxViolation: sandbox: ...".
    SandboxViolation.__module__, SandboxViolation.__qualname__ = "builtins", "SandboxViolation"

    def deny(message):
        violations[0] += 1
        if violations[0] >= max_violations:
            write_fd(2, ("sandbox: stopped after %d forbidden operations; last: %s\n" % (violations[0], message)).encode())
            hard_exit(exit_forbidden)
        raise SandboxViolation("sandbox: " + message)

    # --- paths -------------------------------------------------------------

    def as_text(path):
        kind = type(path)
        if kind is str:
            return path
        if kind is bytes:
            return path.decode("utf-8", "surrogateescape")
        if isinstance(path, str):  # a subclass: copy the characters, ignore its methods
            return str_join((path,))
        if isinstance(path, bytes):
            return bytes_join((path,)).decode("utf-8", "surrogateescape")
        if isinstance(path, int):
            return "/proc/self/fd/%d" % int_add(path, 0)
        if kind in path_types and kind.__fspath__ is path_fspath and kind.__str__ is path_str:
            return as_text(path_str(path))
        # Another PathLike could answer differently when the real call converts it again.
        deny("paths of type %s are not allowed; pass a str" % kind.__name__)

    def resolve(text, base=None):
        """An absolute path with every symlink resolved (missing parts kept as written)."""
        if not text.startswith("/"):
            text = (base if base is not None else getcwd()) + "/" + text
        pending = text.split("/")[::-1]
        parts = []
        hops = 0
        while pending:
            name = pending.pop()
            if name in ("", "."):
                continue
            if name == "..":
                if parts:
                    parts.pop()
                continue
            candidate = "/" + "/".join(parts + [name])
            try:
                mode = lstat(candidate).st_mode
            except (OSError, ValueError):
                parts.append(name)
                continue
            if mode & 0o170000 == 0o120000:
                hops += 1
                if hops > 40:
                    deny("too many levels of symbolic links in %r" % text)
                target = readlink(candidate)
                if target.startswith("/"):
                    parts = []
                pending.extend(target.split("/")[::-1])
            else:
                parts.append(name)
        return "/" + "/".join(parts)

    def inside(path, root):
        return path == root or path.startswith(root + "/")

    def base_of(dir_fd):
        if dir_fd in no_dir_fd:
            return None
        base = resolve(as_text(dir_fd))
        if not inside(base, work):
            deny("using a directory outside the working directory")
        return base

    def entry_of(text, base):
        """The directory entry itself (not what a final symlink points to)."""
        head, _, tail = text.rstrip("/").rpartition("/")
        if tail in ("", ".", "..") or "/" not in text.rstrip("/"):
            if tail in ("", ".", ".."):
                return resolve(text, base)
            head = "."
        return resolve(head or "/", base).rstrip("/") + "/" + tail

    def check_write(path, dir_fd=None):
        text = as_text(path)
        base = base_of(dir_fd)
        target = resolve(text, base)
        if target in write_files:
            return
        if target.startswith("/proc/%d/fd/pipe:[" % getpid()):
            return  # its own stdout/stderr, e.g. /dev/stdout
        if not (inside(target, work) and inside(entry_of(text, base), work)):
            deny("writing %s is not allowed; only the working directory %s is writable" % (text, work))

    def check_read(text, target):
        if inside(target, work) or target in read_files or inside(target, "/proc/%d" % getpid()):
            return
        for root in read_roots:
            if inside(target, root):
                return
        deny("reading %s is not allowed; only the working directory and the standard library are readable" % text)

    write_flags = posix.O_WRONLY | posix.O_RDWR | posix.O_CREAT | posix.O_TRUNC | posix.O_APPEND

    def on_open(args):
        path, mode, flags = args[0], args[1], args[2]
        if isinstance(path, int) and not isinstance(path, bool) and mode is not None:
            return  # open(fd): wraps a descriptor it already has
        text = as_text(path)
        if mode is None and not text.startswith("/") and ".." in text.split("/"):
            # os.open may carry a dir_fd the event does not show; without ".." it cannot climb out of it
            deny("os.open with '..' in a relative path is not allowed; use an absolute path")
        if flags & write_flags:
            check_write(path)
            return
        target = resolve(text)
        check_read(text, target)
        if mode is None and not inside(target, work):
            try:
                is_dir = lstat(target).st_mode & 0o170000 == 0o040000
            except (OSError, ValueError):
                is_dir = False
            if is_dir:  # a directory fd would be a dir_fd to write through
                deny("opening the directory %s is not allowed" % text)

    def on_symlink(args):
        target, link, dir_fd = as_text(args[0]), args[1], args[2]
        parts = target.split("/")
        if not (target.startswith("/") and inside(target, work) and ".." not in parts and "." not in parts):
            deny("symlinks must point inside the working directory by an absolute path without '..'")
        check_write(link, dir_fd)

    # --- processes, signals, limits ------------------------------------------

    def take_slot(what):
        if slots is None:
            deny("%s is not allowed: no new processes or threads (max_processes=0)" % what)
        used = int.from_bytes(slots[:8], "little")
        if used >= max_processes:
            deny("%s is not allowed: the limit of %d extra processes/threads is used up" % (what, max_processes))
        slots[:8] = (used + 1).to_bytes(8, "little")

    def own_group(pid):
        try:
            return pid in (0, getpid()) or getpgid(abs(pid)) == getpgrp()
        except OSError:
            return False

    def on_kill(args):
        if not own_group(args[0]):
            deny("signalling other processes is not allowed")

    def on_killpg(args):
        if args[0] not in (0, getpgrp()):
            deny("signalling other process groups is not allowed")

    def on_socket(args):
        if args[1] != 1:  # AF_UNIX: socketpair() for asyncio; connect/bind/sendto stay denied
            deny("network access is not allowed (socket)")

    blocked_imports = frozenset([
        "ctypes", "_ctypes", "_posixsubprocess", "_thread", "posix", "_testcapi", "_testinternalcapi",
        "_testbuffer", "_testmultiphase", "_testimportmultiple", "_testsinglephase", "_testclinic",
        "_xxsubinterpreters", "_xxinterpchannels", "_xxtestfuzz", "_sqlite3", "_dbm", "_gdbm",
        "readline", "_posixshmem", "_multiprocessing", "syslog",
    ])

    def on_import(args):
        if args[0] in blocked_imports:  # also catches reloading the modules patched below
            deny("importing %s is not allowed (native code or file access outside the hook)" % args[0])

    def always(message):
        def handler(args):
            deny(message)
        return handler

    program = always("running other programs is not allowed")
    network = always("network access is not allowed")
    handlers = {
        "open": on_open,
        "os.symlink": on_symlink,
        "os.remove": lambda a: check_write(a[0], a[1]),
        "os.rmdir": lambda a: check_write(a[0], a[1]),
        "os.mkdir": lambda a: check_write(a[0], a[2]),
        "os.rename": lambda a: (check_write(a[0], a[2]), check_write(a[1], a[3])),
        "os.link": lambda a: (check_write(a[0], a[2]), check_write(a[1], a[3])),
        "os.chmod": lambda a: check_write(a[0], a[2]),
        "os.chown": lambda a: check_write(a[0], a[3]),
        "os.utime": lambda a: check_write(a[0], a[3]),
        "os.truncate": lambda a: check_write(a[0]),
        "os.setxattr": lambda a: check_write(a[0]),
        "os.removexattr": lambda a: check_write(a[0]),
        "os.chflags": lambda a: check_write(a[0]),
        "os.lchflags": lambda a: check_write(a[0]),
        "shutil.rmtree": lambda a: check_write(a[0], a[1]),
        "os.fork": lambda a: take_slot("os.fork"),
        "os.forkpty": lambda a: take_slot("os.forkpty"),
        "_thread.start_new_thread": lambda a: None,  # counted by the replaced function below
        "os.exec": program,
        "os.posix_spawn": program,
        "os.spawn": program,
        "os.system": program,
        "os.startfile": program,
        "subprocess.Popen": program,
        "os.kill": on_kill,
        "os.killpg": on_killpg,
        "socket.__new__": on_socket,
        "socket.connect": network,
        "socket.bind": network,
        "socket.sendto": network,
        "socket.sendmsg": network,
        "socket.getaddrinfo": network,
        "socket.gethostbyname": network,
        "socket.gethostbyaddr": network,
        "socket.getnameinfo": network,
        "socket.sethostname": network,
        "import": on_import,
        "resource.setrlimit": always("changing resource limits is not allowed"),
        "resource.prlimit": always("changing resource limits is not allowed"),
        "fcntl.ioctl": always("ioctl is not allowed"),
        "gc.get_objects": always("gc.get_objects is not allowed"),
        "gc.get_referrers": always("gc.get_referrers is not allowed"),
        "gc.get_referents": always("gc.get_referents is not allowed"),
        "sqlite3.connect": always("sqlite3 is not allowed"),
    }
    lookup = handlers.get

    def hook(event, args):
        handler = lookup(event)
        if handler is not None:
            handler(args)
        elif event.startswith("ctypes."):
            deny("native code (ctypes) is not allowed")

    # --- functions that have no audit event ------------------------------------

    def denied(message):
        def function(*args, **kwargs):
            deny(message)
        return function

    def start_new_thread(function, args, kwargs=None):
        take_slot("starting a thread")
        return original_start(function, args, {} if kwargs is None else kwargs)

    original_start = _thread.start_new_thread if max_processes > 0 else None
    thread_stub = start_new_thread if max_processes > 0 else denied("threads are not allowed (max_processes=0)")
    _thread.start_new_thread = _thread.start_new = thread_stub
    if "threading" in sys.modules:
        sys.modules["threading"]._start_new_thread = thread_stub
    _posixsubprocess.fork_exec = denied("running other programs is not allowed")
    modules = [posix] + ([sys.modules["os"]] if "os" in sys.modules else [])
    for name in ("setsid", "setpgid", "setpgrp", "mkfifo", "mknod", "chroot", "setns", "unshare", "setpriority"):
        for module in modules:
            if hasattr(module, name):  # process-group escapes and file creation without audit events
                setattr(module, name, denied("os.%s is not allowed" % name))

    sys.addaudithook(hook)
    return SandboxViolation


def _main():
    import json
    import linecache
    import posix
    import traceback

    config = json.loads(sys.argv[1])
    exit_forbidden, exit_memory, exit_file_size = config["exit_codes"]
    with open(config["code"], encoding="utf-8", errors="surrogatepass") as f:
        source = f.read()
    linecache.cache["main.py"] = (len(source), None, source.splitlines(True), "main.py")
    try:
        code = compile(source, "main.py", "exec")
    except (SyntaxError, ValueError) as exc:
        traceback.print_exception(exc.__class__, exc, None)
        posix._exit(1)
    violation = _install(config)
    sys.argv = ["main.py"]
    sys.path.insert(0, config["work"])  # like `python main.py` run in the working directory
    # A fresh __main__ module (pickle and dataclasses look classes up there), without the bootstrap's globals.
    main = type(sys)("__main__")
    main.__file__ = "main.py"
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    del config, source
    try:
        exec(code, main.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:
        status = 1
        if isinstance(exc, violation):
            status = exit_forbidden
        elif isinstance(exc, MemoryError):
            status = exit_memory
        elif isinstance(exc, OSError) and exc.errno == 27:  # EFBIG: RLIMIT_FSIZE
            status = exit_file_size
        try:
            _strip_bootstrap(exc)
            traceback.print_exception(exc.__class__, exc, exc.__traceback__)
        except BaseException:
            posix.write(2, ("%s\n" % exc.__class__.__name__).encode())
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            posix._exit(status)


def _strip_bootstrap(exc):
    """Drop the bootstrap's own frames (the exec call, the audit hook) from the traceback."""
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename != "<string>":
            frames.append(tb)
        tb = tb.tb_next
    for current, following in zip(frames, frames[1:] + [None]):
        current.tb_next = following
    exc.__traceback__ = frames[0] if frames else None


_main()
'''


__all__ = ["SandboxLimits", "SandboxResult", "run_python"]
