"""Tenants' env, reward and agent code on a shared server: never in the server process.

On a multi-tenant `tinkerless serve`, the worker does not unpickle the code a client
ships. Each tenant gets a `UserCodeHost`: a process of its own in a bubblewrap sandbox
(the confinement of `tinkerless.envs.sandbox.bwrap`: its own uid, PID/mount/network
namespaces, seccomp, limits), which sees the interpreter, the standard library,
tinkerless and its installed dependencies read-only, a scratch tmpfs read-write, and
nothing else: not the server's storage (other tenants' runs, the key store), not its
home, not its environment. The host unpickles the tenant's code and answers calls over
a pipe in the wire codec (`user_code_protocol.py`).

The worker gets proxies (`HostedClass`, `HostedObject`, `HostedFunction`) that the agent
loops use as they would the real classes and functions: the model and the batched
generation stay in the server process; env construction, reset, step and the reward
cross the pipe. A hosted call that raises, hangs past `call_timeout` or kills its host
fails only the episodes that used it, with the error recorded; a dead host is replaced
on the next call.

The local backend and `tinkerless serve --single-user` keep user code in-process (it is
the user's own machine or cluster); see docs/sandbox.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import random
import socket
import sysconfig
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import tinkerless
from tinkerless.envs.sandbox.bwrap import Profile, SpawnedSandbox, spawn
from tinkerless.envs.sandbox.limits import SandboxLimits
from tinkerless.errors import UserCodeError, infra_cause_tag
from tinkerless.functions.rollout.rollout_clock import measure
from tinkerless.functions.hosting.user_code_protocol import HostReply, HostRequest, Ref, RngState, read_frame, write_frame
from tinkerless.wire.code import CodeBlob

# Per process for the host's whole life: the CPU limit is a backstop, `call_timeout` bounds each call.
HOST_LIMITS = SandboxLimits(
    cpu_seconds=24 * 3600, wall_seconds=24 * 3600, memory_bytes=4 * 2**30, max_processes=32,
    max_file_bytes=64 * 2**20, disk_bytes=256 * 2**20,
)
CALL_TIMEOUT_SECONDS = 120.0
# bwrap runs with --die-with-parent, whose signal fires when the *thread* that started it exits. Calls run on
# short-lived threads (a scheduler job's, an executor's), so hosts are started from this one long-lived thread:
# otherwise a host dies with the job that happened to start it, and the next call pays for a fresh one.
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tenant-host-spawner")
STDERR_TAIL_LINES = 20

_tenant: contextvars.ContextVar[str] = contextvars.ContextVar("tinkerless_tenant", default="")


@contextlib.contextmanager
def tenant_scope(tenant: str) -> Iterator[None]:
    """Calls made inside run the tenant's code in that tenant's host (the server sets this per request)."""
    token = _tenant.set(tenant)
    try:
        yield
    finally:
        _tenant.reset(token)


def current_tenant() -> str:
    return _tenant.get()


class HostedCodeError(UserCodeError):
    """The tenant's code raised, hung or died in its sandbox; `traceback` is the one from inside the sandbox.

    `infra_cause` is set when the episode failed for a reason outside the policy's control: the sandbox process
    died, or the tenant's code raised an `InfrastructureFailure` (its env server or judge failed); such episodes
    are retried and dropped, never scored (`errors.infra_cause`)."""

    def __init__(self, message: str, *, hint: str | None = None, traceback: str | None = None,
                 infra_cause: str | None = None):
        super().__init__(message, hint=hint)
        self.traceback = traceback
        self.infra_cause = infra_cause_tag(infra_cause) if infra_cause else None


def _error(reply: HostReply) -> HostedCodeError:
    return HostedCodeError(
        f"{reply.error_type}: {reply.error}", hint="raised by the tenant's code in its sandbox", traceback=reply.traceback or None,
        infra_cause=reply.cause if isinstance(reply.cause, str) and reply.cause else None,
    )


def tenant_profile(hide: tuple[str, ...] = ()) -> Profile:
    """Read-only: the tinkerless package and the installed packages it and the user's code import."""
    package = os.path.dirname(os.path.realpath(tinkerless.__file__))
    source_root = os.path.dirname(package)
    site_dirs = sorted({os.path.realpath(p) for p in (sysconfig.get_path("purelib"), sysconfig.get_path("platlib")) if p and os.path.isdir(p)})
    # Only the package directory of tinkerless, not the checkout around it (where a server's storage may live).
    return Profile(name="tenant", read_only=(package, *site_dirs), python_path=(source_root, *site_dirs), hide=hide)


class UserCodeHost:
    """One tenant's sandboxed code process, started on first use and again after it dies."""

    def __init__(self, tenant: str, *, profile: Profile, limits: SandboxLimits = HOST_LIMITS, call_timeout: float = CALL_TIMEOUT_SECONDS):
        self.tenant = tenant
        self.profile = profile
        self.limits = limits
        self.call_timeout = call_timeout
        self._lock = threading.RLock()
        self._sandbox: SpawnedSandbox | None = None
        self._requests_w = self._replies_r = -1
        self._control: socket.socket | None = None  # agent rollouts' model channels go over it (fd passing)
        self._stderr_tail: deque[str] = deque(maxlen=STDERR_TAIL_LINES)
        self._created: list[int] = []  # instances made since the last release()

    # ---- process ----------------------------------------------------------------
    def _start(self) -> None:
        requests_r, self._requests_w = os.pipe()
        self._replies_r, replies_w = os.pipe()
        stderr_r, stderr_w = os.pipe()
        self._control, control = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for fd in (self._requests_w, self._replies_r, stderr_r, self._control.fileno()):
            os.set_inheritable(fd, False)
        code = f"from tinkerless.functions.hosting.user_code_host import main\nmain({requests_r}, {replies_w}, {control.fileno()})\n"
        try:
            self._sandbox = _SPAWNER.submit(spawn, code, limits=self.limits, profile=self.profile,
                                            pass_fds=(requests_r, replies_w, control.fileno()), stderr=stderr_w).result()
        finally:
            for fd in (requests_r, replies_w, stderr_w):
                os.close(fd)
            control.close()
        self._stderr_tail.clear()
        threading.Thread(target=self._drain, args=(stderr_r,), daemon=True, name=f"tenant-host-stderr-{self.tenant}").start()

    def _drain(self, fd: int) -> None:
        """Keep the end of what the tenant's code printed (for error reports); never let its pipe fill up."""
        pending = b""
        with os.fdopen(fd, "rb", buffering=0) as stream:
            while chunk := stream.read(65536):
                lines = (pending + chunk).split(b"\n")
                pending = lines.pop()[-4096:]
                self._stderr_tail.extend(line[:500].decode("utf-8", "replace") for line in lines[-STDERR_TAIL_LINES:])

    def close(self) -> None:
        with self._lock:
            if self._sandbox is not None:
                self._sandbox.kill()
                self._sandbox = None
                for fd in (self._requests_w, self._replies_r):
                    with contextlib.suppress(OSError):
                        os.close(fd)
                self._requests_w = self._replies_r = -1
                if self._control is not None:
                    self._control.close()
                    self._control = None

    def kill(self) -> None:
        """SIGKILL the sandbox now, without the lock (a call may hold it, blocked on the dead host's answer:
        that call then sees the pipe close, fails, and tidies up with `close`)."""
        sandbox = self._sandbox
        if sandbox is not None:
            with contextlib.suppress(ProcessLookupError):
                sandbox.proc.kill()

    # ---- calls ------------------------------------------------------------------
    def request(self, request: HostRequest, *, timeout: float | None = None, channel: socket.socket | None = None) -> HostReply:
        """One call to the host; `channel` (an agent rollout's model channel) is passed to it first."""
        timeout = self.call_timeout if timeout is None else timeout
        with self._lock:
            if self._sandbox is None or self._sandbox.proc.poll() is not None:
                self.close()
                self._start()
            deadline = time.monotonic() + timeout
            try:
                if channel is not None:
                    socket.send_fds(self._control, [b"c"], [channel.fileno()])
                write_frame(self._requests_w, request, deadline)
                reply = self._read_reply(deadline)
            except TimeoutError:
                self.close()
                raise HostedCodeError(
                    f"the tenant's code did not answer within {timeout:g} s and was stopped",
                    hint="an env step or reward must return; its sandbox was killed and starts afresh on the next call",
                ) from None
            except (EOFError, OSError) as exc:
                self.close()
                tail = "\n".join(self._stderr_tail)
                raise HostedCodeError(
                    f"the sandboxed process running tenant code died ({exc})",
                    hint=f"it may have hit its memory or CPU limit; its last output:\n{tail}" if tail else "it may have hit its memory or CPU limit",
                    infra_cause="sandbox_died",
                ) from None
        if not reply.ok:
            raise _error(reply)
        return reply

    def _read_reply(self, deadline: float) -> HostReply:
        reply = read_frame(self._replies_r, deadline)
        if not isinstance(reply, HostReply):
            raise EOFError(f"unexpected message {type(reply).__name__}")
        return reply

    def load(self, blob: CodeBlob) -> Any:
        reply = self.request(HostRequest("load", blob=blob))
        if reply.value == "class":
            return HostedClass(self, reply)
        return HostedFunction(self, reply.handle, reply.name)

    def release(self) -> None:
        """Forget the instances (envs) made since the last release; loaded code stays for the next rollout."""
        with self._lock:
            created, self._created = self._created, []
            if created and self._sandbox is not None and self._sandbox.proc.poll() is None:
                with contextlib.suppress(HostedCodeError):
                    self.request(HostRequest("drop", args=created))


def _wire_args(values: Any, rngs: list[random.Random]) -> Any:
    """Arguments as they cross: hosted objects by handle, random generators by state, plain data as is."""
    if isinstance(values, (HostedObject, HostedClass, HostedFunction)):
        return Ref(values.handle)
    if isinstance(values, random.Random):
        rngs.append(values)
        state = values.getstate()
        return RngState([state[0], list(state[1]), state[2]])
    if isinstance(values, (list, tuple)):
        return [_wire_args(v, rngs) for v in values]
    if isinstance(values, dict):
        return {k: _wire_args(v, rngs) for k, v in values.items()}
    return values


def _call(host: UserCodeHost, handle: int, method: str, args: tuple, kwargs: dict) -> Any:
    rngs: list[random.Random] = []
    request = HostRequest("call", handle=handle, method=method, args=_wire_args(list(args), rngs), kwargs=_wire_args(kwargs, rngs))
    reply = host.request(request)
    for rng, state in zip(rngs, reply.rng_states):  # the hosted code drew from the caller's generator
        rng.setstate((state[0], tuple(state[1]), state[2]))
    return reply.value


def call_each(targets: list[Any], method: str, arguments: list[tuple]) -> list[Any] | None:
    """`getattr(target, method)(*args)` for each pair in one round trip, when every target lives in the same host;
    each result is the value or the `HostedCodeError` that call raised. None when they are not all hosted there
    (the caller then calls them one by one as usual)."""
    if not targets or not all(isinstance(t, (HostedObject, HostedFunction)) for t in targets):
        return None
    host = targets[0].host
    if any(t.host is not host for t in targets):
        return None
    name = "" if isinstance(targets[0], HostedFunction) else method
    calls = []
    for target, args in zip(targets, arguments):
        rngs: list[random.Random] = []
        calls.append(HostRequest("call", handle=target.handle, method=name, args=_wire_args(list(args), rngs)))
        if rngs:
            return None  # generators must come back in order: keep to single calls
    try:
        with measure("env"):  # the env's (or reward's) own time, in the tenant's host
            replies = host.request(HostRequest("many", args=calls)).value
    except HostedCodeError as exc:  # the host died or hung: every call of the batch failed with it
        return [exc] * len(calls)
    return [r.value if r.ok else _error(r) for r in replies]


class HostedFunction:
    """A reward function or scripted opponent living in the tenant's host."""

    def __init__(self, host: UserCodeHost, handle: int, name: str):
        self.host, self.handle, self.__qualname__ = host, handle, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _call(self.host, self.handle, "", args, kwargs)


class HostedObject:
    """An env instance living in the tenant's host; its public methods are calls over the pipe."""

    def __init__(self, host: UserCodeHost, reply: HostReply):
        self.host = self._host = host
        self.handle, self._methods = reply.handle, frozenset(reply.methods)
        self.__dict__.update({k: v for k, v in reply.attributes.items() if k not in self._methods})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in self._methods:
            raise AttributeError(name)
        return lambda *args, **kwargs: _call(self._host, self.handle, name, args, kwargs)


class HostedClass:
    """An env class living in the tenant's host: calling it makes a `HostedObject`; plain class attributes
    (such as a multi-agent env's `agents`) are readable here."""

    def __init__(self, host: UserCodeHost, reply: HostReply):
        self._host, self.handle, self.__qualname__ = host, reply.handle, reply.name
        self.__dict__.update({k: v for k, v in reply.attributes.items() if k not in reply.methods})

    def __call__(self, *args: Any, **kwargs: Any) -> HostedObject:
        rngs: list[random.Random] = []
        reply = self._host.request(HostRequest("new", handle=self.handle, args=_wire_args(list(args), rngs), kwargs=_wire_args(kwargs, rngs)))
        self._host._created.append(reply.handle)
        return HostedObject(self._host, reply)


class UserCodeHosts:
    """The hosts of a shared server, one per tenant."""

    def __init__(self, *, hide: tuple[str, ...] = (), limits: SandboxLimits = HOST_LIMITS, call_timeout: float = CALL_TIMEOUT_SECONDS):
        self.profile = tenant_profile(tuple(os.path.realpath(p) for p in hide))
        self.limits, self.call_timeout = limits, call_timeout
        self._hosts: dict[str, UserCodeHost] = {}
        self._lock = threading.Lock()

    def check(self) -> None:
        """Start a trivial sandbox with the tenants' profile now; SandboxUnavailable (naming the fix) if it cannot."""
        from tinkerless.envs.sandbox.bwrap import bwrap_path, check_available

        bwrap_path()
        check_available(self.profile)

    def for_tenant(self, tenant: str) -> UserCodeHost:
        with self._lock:
            if tenant not in self._hosts:
                self._hosts[tenant] = UserCodeHost(tenant, profile=self.profile, limits=self.limits, call_timeout=self.call_timeout)
            return self._hosts[tenant]

    def load(self, blob: CodeBlob) -> Any:
        return self.for_tenant(current_tenant()).load(blob)

    def release(self) -> None:
        host = self._hosts.get(current_tenant())
        if host is not None:
            host.release()

    def close(self) -> None:
        with self._lock:
            for host in self._hosts.values():
                host.close()
            self._hosts.clear()


__all__ = ["HostedCodeError", "UserCodeHost", "UserCodeHosts", "call_each", "current_tenant", "tenant_profile", "tenant_scope"]
