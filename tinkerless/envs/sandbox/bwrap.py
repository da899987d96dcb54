"""Run Python under bubblewrap: the kernel-enforced sandbox for model-written tool code and tenants' code.

Each call gets, from the kernel:

- its own PID, mount, network (loopback only), IPC, UTS and (where possible) cgroup
  namespaces; `--die-with-parent` and `--new-session`; when the interpreter (PID 2
  under bwrap's PID 1) exits, or the wall clock runs out and we kill bwrap, the
  kernel kills everything left in the PID namespace, so nothing outlives a call;
- an unprivileged uid/gid with no capabilities and no_new_privs: as root, a uid of
  its own from `uid_pool` (the interpreter drops to it before any user code runs);
  otherwise uid 65534 in a user namespace that cannot create further ones;
- a read-only root holding only the interpreter, its standard library (its
  site-packages hidden under an empty read-only tmpfs), the shared libraries they
  load and time zones; no /home, /root, /etc (beyond ld.so.cache), no site-packages,
  no host /tmp. A `Profile` may add read-only paths (tenant code needs tinkerless
  and its dependencies);
- a size-capped tmpfs at /tmp as work dir and HOME, gone with the mount namespace;
- the seccomp filter of `seccomp_filter.py`;
- RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_CORE and RLIMIT_NPROC
  (for the sandbox's own uid), set by the bootstrap before any user code and
  inherited by everything it starts; output bounded by the parent.

The audit-hook layer of `bootstrap.py` runs inside as an extra layer with readable refusals.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time

from tinkerless.envs.sandbox import warm
from tinkerless.envs.sandbox.bootstrap import BOOTSTRAP
from tinkerless.envs.sandbox.layout import CODE_PATH, TOOL_PROFILE, Profile, layout
from tinkerless.envs.sandbox.limits import BOOTSTRAP_EXIT_CODES, SandboxLimits, SandboxResult, SandboxUnavailable, rlimit_values
from tinkerless.envs.sandbox.seccomp_filter import compiled_filter
from tinkerless.envs.sandbox.supervise import supervise, watch
from tinkerless.envs.sandbox.uid_pool import lease_uid
from tinkerless.errors import ConfigError

WORK_DIR = "/tmp"
NOBODY = 65534
INSTALL_HINT = (
    "install bubblewrap (`apt-get install bubblewrap`; scripts/install.sh does it) and run the worker as root or "
    "where unprivileged user namespaces are enabled (sysctl kernel.unprivileged_userns_clone=1, "
    "user.max_user_namespaces > 0); on Modal use sandbox='modal'. Only for code you trust: sandbox='process-unsafe'. "
    "See docs/sandbox.md"
)


def bwrap_path() -> str:
    found = shutil.which("bwrap")
    if found is None:
        raise SandboxUnavailable("bubblewrap (bwrap) is not installed on this machine", hint=INSTALL_HINT)
    return found


def run_bwrap(code: str, *, limits: SandboxLimits, stdin: str, config: dict, profile: Profile = TOOL_PROFILE) -> SandboxResult:
    """Run `code` in a fresh bubblewrap sandbox; SandboxUnavailable if bubblewrap cannot run here."""
    if limits.network:
        raise ConfigError(
            "SandboxLimits(network=True) cannot be granted by the bubblewrap sandbox: it has no network at all",
            hint="use sandbox='modal' for tool code that needs the network",
        )
    bwrap_path()  # every call: a missing bwrap is reported even where a sandbox is still ready
    check_available(profile)
    key = (profile, limits, bool(config.get("audit_hook")), os.geteuid() == 0)
    ready = warm.take(key)
    result = _run_ready(ready, code, stdin, limits) if ready is not None else None
    if result is None:
        result = _run(code, limits=limits, stdin=stdin, config=config, profile=profile)
    warm.prepare(key, lambda: _start_ready(profile, limits, config))
    return result


def _start_ready(profile: Profile, limits: SandboxLimits, config: dict) -> warm.Ready:
    """A sandbox whose interpreter waits for its program on a pipe (see warm.py)."""
    as_root = os.geteuid() == 0
    lease = contextlib.ExitStack()
    uid = lease.enter_context(_leased_uid(as_root))
    program_r, program_w = os.pipe()
    os.set_inheritable(program_w, False)
    seccomp_fd = _memfd("seccomp", compiled_filter())
    try:
        config = _boot_config(config, profile, limits, uid, as_root, code=f"fd:{program_r}")
        argv = _argv(profile, limits, as_root, seccomp_fd, None, config)
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={"PATH": "/usr/bin:/bin"},
            pass_fds=(seccomp_fd, program_r), start_new_session=True,
        )
    except BaseException:
        os.close(program_w)
        lease.close()
        raise
    finally:
        os.close(seccomp_fd)
        os.close(program_r)
    return warm.Ready(proc, program_w, lease)


def _run_ready(ready: warm.Ready, code: str, stdin: str, limits: SandboxLimits) -> SandboxResult | None:
    """Run `code` in a sandbox started ahead of time; None if it turned out to be unusable."""
    program = code.encode("utf-8", "surrogatepass")
    data = stdin.encode("utf-8", "replace")
    try:
        _write_all(ready.program_fd, b"%d %d\n" % (len(program), len(data)) + program + data)
        os.close(ready.program_fd)
    except OSError:
        ready.discard()
        return None
    try:
        return watch(ready.proc, kind="bwrap", limits=limits, started=time.monotonic(), cpu_reported=False)
    finally:
        ready.lease.close()


def _run(code: str, *, limits: SandboxLimits, stdin: str, config: dict, profile: Profile) -> SandboxResult:
    as_root = os.geteuid() == 0
    with _leased_uid(as_root) as uid:
        seccomp_fd = _memfd("seccomp", compiled_filter())
        code_fd = _memfd("code", code.encode("utf-8", "surrogatepass"))
        stdin_fd = _memfd("stdin", stdin.encode("utf-8", "replace"))
        try:
            config = _boot_config(config, profile, limits, uid, as_root)
            argv = _argv(profile, limits, as_root, seccomp_fd, code_fd, config)
            return supervise(
                argv, kind="bwrap", limits=limits, stdin_fd=stdin_fd, env={"PATH": "/usr/bin:/bin"},
                pass_fds=(seccomp_fd, code_fd), cpu_reported=False,
            )
        finally:
            for fd in (seccomp_fd, code_fd, stdin_fd):
                os.close(fd)


class SpawnedSandbox:
    """A long-lived process in a bubblewrap sandbox (a tenant's code host): the Popen, and the uid it holds."""

    def __init__(self, proc: subprocess.Popen, lease: contextlib.ExitStack):
        self.proc = proc
        self._lease = lease

    def kill(self) -> None:
        """SIGKILL bwrap (its PID namespace dies with it), reap it, give its uid back."""
        try:
            self.proc.kill()
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._lease.close()


def spawn(code: str, *, limits: SandboxLimits, profile: Profile, pass_fds: tuple[int, ...], stderr: int) -> SpawnedSandbox:
    """Start `code` in a bubblewrap sandbox and return at once; the caller talks to it over `pass_fds`.

    Same confinement as `run_bwrap` (limits too, set by the bootstrap), without the audit hook;
    the caller bounds each exchange in time and kills the sandbox when done.
    """
    check_available(profile)
    as_root = os.geteuid() == 0
    lease = contextlib.ExitStack()
    uid = lease.enter_context(_leased_uid(as_root))
    seccomp_fd = _memfd("seccomp", compiled_filter())
    code_fd = _memfd("code", code.encode("utf-8", "surrogatepass"))
    try:
        base = {"max_processes": limits.max_processes, "exit_codes": sorted(BOOTSTRAP_EXIT_CODES), "audit_hook": False}
        config = _boot_config(base, profile, limits, uid, as_root)
        argv = _argv(profile, limits, as_root, seccomp_fd, code_fd, config)
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr, env={"PATH": "/usr/bin:/bin"},
            pass_fds=(seccomp_fd, code_fd, *pass_fds), start_new_session=True,
        )
    except BaseException:
        lease.close()
        raise
    finally:
        os.close(seccomp_fd)
        os.close(code_fd)
    return SpawnedSandbox(proc, lease)


def _leased_uid(as_root: bool):
    if as_root:
        return lease_uid()
    return _fixed(NOBODY)


class _fixed:
    def __init__(self, uid: int):
        self.uid = uid

    def __enter__(self) -> int:
        return self.uid

    def __exit__(self, *exc: object) -> None:
        return None


def _boot_config(
    config: dict, profile: Profile, limits: SandboxLimits, uid: int, as_root: bool, *, code: str = CODE_PATH
) -> dict:
    """What the bootstrap inside needs besides the caller's `config`: where the work dir and program are, what
    it may read, the uid to drop to (as root) and the limits it sets on itself before any user code."""
    return {
        **config,
        "work": WORK_DIR,
        "code": code,
        "read_roots": list(layout(profile).read_roots),
        "drop_to": [uid, uid] if as_root else None,
        "nproc": limits.max_processes,
        "rlimits": rlimit_values(limits),
    }


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(f"tinkerless-{name}", os.MFD_CLOEXEC)
    os.write(fd, data) if len(data) < 65536 else _write_all(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _argv(profile: Profile, limits: SandboxLimits, as_root: bool, seccomp_fd: int, code_fd: int | None, config: dict) -> list[str]:
    root = layout(profile)
    argv = [bwrap_path(), "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    argv += ["--die-with-parent", "--new-session", "--hostname", "sandbox", "--cap-drop", "ALL"]
    if as_root:
        # Root in no user namespace: the interpreter keeps only what it needs to drop to its own uid (bootstrap.py).
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY), "--disable-userns"]
    argv += ["--seccomp", str(seccomp_fd)]
    # The work dir first: a read-only bind under /tmp (a checkout or venv there, as in CI's fresh clone) must
    # show through it, not be covered by it. Sticky and root-owned, those binds' parents cannot be moved.
    argv += ["--perms", "1777", "--size", str(int(limits.disk_bytes)), "--tmpfs", WORK_DIR]
    argv += root.mounts
    argv += ["--proc", "/proc", "--dev", "/dev"]
    if code_fd is not None:  # (a sandbox started ahead of time gets its program down a pipe instead)
        argv += ["--perms", "0444", "--ro-bind-data", str(code_fd), CODE_PATH]
    env = {"HOME": WORK_DIR, "TMPDIR": WORK_DIR, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TZ": "UTC", "PATH": "/usr/bin:/bin"}
    if profile.python_path:
        env["PYTHONPATH"] = os.pathsep.join(profile.python_path)
    argv += ["--chdir", WORK_DIR, "--clearenv"]
    for key, value in env.items():
        argv += ["--setenv", key, value]
    # -I ignores PYTHONPATH: a profile with python_path runs without -I, keeping -s (no user site) and -P (no script dir).
    flags = ["-I"] if not profile.python_path else ["-s", "-P"]
    argv += ["--", root.interpreter, *flags, "-S", "-B", "-u", "-X", "utf8", "-c", BOOTSTRAP, repr(config)]
    return argv


_available: set[Profile] = set()


def check_available(profile: Profile) -> None:
    """Run a trivial program once per process and profile; SandboxUnavailable with bwrap's own message if it fails."""
    if profile in _available:
        return
    bwrap_path()
    probe = _run("pass", limits=SandboxLimits(wall_seconds=30, cpu_seconds=10), stdin="", config=_probe_config(), profile=profile)
    if not probe.ok:
        detail = probe.stderr.strip().splitlines()[-1:] or [f"exit status {probe.exit_code}"]
        raise SandboxUnavailable(f"bubblewrap cannot start a sandbox on this machine: {detail[0]}", hint=INSTALL_HINT)
    _available.add(profile)


def _probe_config() -> dict:
    return {"max_processes": 0, "exit_codes": sorted(BOOTSTRAP_EXIT_CODES), "audit_hook": False}


__all__ = ["INSTALL_HINT", "Profile", "SpawnedSandbox", "TOOL_PROFILE", "bwrap_path", "check_available", "run_bwrap", "spawn"]
