"""The old process sandbox, kept only as an explicit opt-in: `sandbox="process-unsafe"`.

A separate `python -I -S` process with resource limits (set in preexec), its own
process group and session, a fresh network namespace where the kernel allows it,
and the audit-hook layer of `bootstrap.py`. It has no PID or mount namespace, no
separate uid and no seccomp filter: as root, RLIMIT_NPROC does not bind, and the
audit hook can be removed from inside (see docs/sandbox.md). Use it only where
bubblewrap cannot run and the code is not hostile.
"""

from __future__ import annotations

import functools
import os
import resource
import sys
import sysconfig
import tempfile
from typing import Callable

from tinkerless.envs.sandbox.bootstrap import BOOTSTRAP
from tinkerless.envs.sandbox.limits import SandboxLimits, SandboxResult, rlimit_values
from tinkerless.envs.sandbox.supervise import supervise

_CLONE_NEWNET = 0x40000000


def run_process_unsafe(code: str, *, limits: SandboxLimits, stdin: str, config: dict) -> SandboxResult:
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
        config = {**config, "work": os.path.realpath(work), "code": code_path, "read_roots": read_roots()}
        argv = [sys.executable, "-I", "-S", "-B", "-u", "-X", "utf8", "-c", BOOTSTRAP, repr(config)]
        env = {"PATH": "/usr/bin:/bin", "HOME": config["work"], "TMPDIR": config["work"], "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
        with open(stdin_path, "rb") as stdin_file:
            return supervise(
                argv, kind="process-unsafe", limits=limits, stdin_fd=stdin_file.fileno(), env=env,
                cwd=config["work"], preexec=_make_preexec(limits), kill_group=True,
            )
    finally:
        _remove_tree(root)


def _make_preexec(limits: SandboxLimits) -> Callable[[], None]:
    # Everything is computed here, in the parent: preexec_fn runs between fork and exec,
    # where allocating, importing or taking locks is unsafe.
    settings = rlimit_settings(limits)
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


def rlimit_settings(limits: SandboxLimits) -> list[tuple[int, tuple[int, int]]]:
    """The per-process resource limits, for setrlimit in preexec_fn."""
    return [(getattr(resource, name), _clamp(getattr(resource, name), soft, hard)) for name, soft, hard in rlimit_values(limits)]


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
def read_roots() -> list[str]:
    """Where the audit hook lets the child read besides its working directory: the standard library and time zones."""
    paths = {sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib"), os.path.dirname(os.__file__)}
    paths |= {"/usr/share/zoneinfo", "/usr/lib/zoneinfo", "/usr/share/lib/zoneinfo", "/etc/zoneinfo"}
    return sorted(os.path.realpath(p) for p in paths if p)


def _remove_tree(root: str) -> None:
    """Delete the run's directory whatever the program left: no recursion, no path-length limit, no links followed.

    It walks with two descriptors at most (the current directory and, going up, its
    parent), so a 10,000-deep chain neither raises RecursionError (shutil.rmtree
    recurses per level) nor hits PATH_MAX or the open-file limit.
    """
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        os.chmod(root, 0o700)
        current = os.open(root, flags)
    except OSError:
        return
    names: list[str] = []
    try:
        while True:
            with os.scandir(current) as entries:
                entry = next(entries, None)
            if entry is not None:
                if entry.is_dir(follow_symlinks=False):
                    os.chmod(entry.name, 0o700, dir_fd=current, follow_symlinks=False)
                    child = os.open(entry.name, flags, dir_fd=current)
                    os.close(current)
                    current = child
                    names.append(entry.name)
                else:
                    os.unlink(entry.name, dir_fd=current)
                continue
            if not names:
                break
            parent = os.open("..", flags, dir_fd=current)
            os.close(current)
            current = parent
            os.rmdir(names.pop(), dir_fd=current)
    except OSError:
        pass  # something we cannot remove: left in the temp dir rather than crash the caller
    finally:
        os.close(current)
    try:
        os.rmdir(root)
    except OSError:
        pass


__all__ = ["read_roots", "run_process_unsafe"]
