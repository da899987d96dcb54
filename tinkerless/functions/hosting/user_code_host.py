"""The tenant's side of the pipe: runs inside the tenant's bubblewrap sandbox, holds its unpickled code.

`main(requests_fd, replies_fd)` answers `HostRequest`s until the pipe closes: "load"
unpickles a `CodeBlob` (this is the only process that ever unpickles the tenant's
code), "new" instantiates a hosted class, "call" calls a hosted object or one of its
methods, "drop" forgets objects. An exception in user code is a reply with its type,
message and traceback, never the end of the host. What the user code prints goes to
stderr, so it cannot corrupt the protocol on the replies pipe.
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys
import traceback
from typing import Any

from tinkerless.errors import infra_cause
from tinkerless.functions.hosting.user_code_protocol import HostReply, HostRequest, Ref, RngState, read_frame, write_frame
from tinkerless.wire import unpack_code

_PLAIN = (type(None), bool, int, float, str, bytes)


class _Objects:
    def __init__(self) -> None:
        self.by_handle: dict[int, Any] = {}
        self.next_handle = 1
        self.loaded: dict[bytes, int] = {}  # blob payload -> handle: a rollout's code is unpickled once
        self.control: Any = None  # the control socket (agent rollouts' channels come over it)

    def add(self, value: Any) -> int:
        handle = self.next_handle
        self.next_handle += 1
        self.by_handle[handle] = value
        return handle

    def get(self, handle: int) -> Any:
        try:
            return self.by_handle[handle]
        except KeyError:
            raise LookupError(f"no hosted object {handle}") from None


def _describe(value: Any) -> tuple[list[str], dict]:
    methods = [n for n in dir(value) if not n.startswith("_") and callable(getattr(value, n, None))]
    for special in ("__call__",):
        if callable(value) and special not in methods:
            methods.append(special)
    attributes = {}
    for name in dir(value):
        if name.startswith("_"):
            continue
        item = getattr(value, name, None)
        if isinstance(item, _PLAIN) or (isinstance(item, (list, tuple)) and all(isinstance(i, _PLAIN) for i in item)):
            attributes[name] = list(item) if isinstance(item, tuple) else item
    return methods, attributes


def plain(value: Any) -> Any:
    """What can cross the pipe: plain data, arrays and tinkerless dataclasses; anything else as its str()."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k) if not isinstance(k, (str, int)) else k: plain(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and type(value).__module__.startswith("tinkerless."):
        return dataclasses.replace(value, **{f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)})
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item) and type(value).__module__ == "numpy":
        return item()
    if type(value).__module__ == "numpy" and hasattr(value, "dtype"):
        return value
    return str(value)


def _resolve(value: Any, objects: _Objects, rngs: list[random.Random]) -> Any:
    if isinstance(value, Ref):
        return objects.get(value.handle)
    if isinstance(value, RngState):
        rng = random.Random()
        rng.setstate((value.state[0], tuple(value.state[1]), value.state[2]))
        rngs.append(rng)
        return rng
    if isinstance(value, list):
        return [_resolve(v, objects, rngs) for v in value]
    if isinstance(value, dict):
        return {k: _resolve(v, objects, rngs) for k, v in value.items()}
    return value


def answer(request: HostRequest, objects: _Objects) -> HostReply:
    if request.op == "many":  # one round trip for a whole turn's env steps (or rewards); each answered on its own
        return HostReply(True, value=[_answer_one(item, objects) for item in request.args])
    if request.op == "load":
        payload = request.blob.payload
        if payload not in objects.loaded:
            objects.loaded[payload] = objects.add(unpack_code(request.blob))
        handle = objects.loaded[payload]
        code = objects.get(handle)
        methods, attributes = _describe(code)
        kind = "class" if isinstance(code, type) else "function"
        return HostReply(True, value=kind, handle=handle, methods=methods, attributes=attributes, name=str(getattr(code, "__qualname__", request.blob.name)))
    if request.op == "agents":  # a whole agent rollout; its model channel comes over the control socket
        return HostReply(True, value=plain(_agents(request, objects)))
    if request.op == "drop":
        keep = set(objects.loaded.values())
        for handle in request.args:
            if handle not in keep:
                objects.by_handle.pop(handle, None)
        return HostReply(True)
    rngs: list[random.Random] = []
    args = _resolve(request.args, objects, rngs)
    kwargs = _resolve(request.kwargs, objects, rngs)
    target = objects.get(request.handle)
    if request.op == "new":
        instance = target(*args, **kwargs)
        methods, attributes = _describe(instance)
        return HostReply(True, handle=objects.add(instance), methods=methods, attributes=attributes, name=type(instance).__qualname__)
    if request.op == "call":
        function = target if request.method in ("", "__call__") else getattr(target, request.method)
        value = function(*args, **kwargs)
        states = [[s[0], list(s[1]), s[2]] for s in (r.getstate() for r in rngs)]
        return HostReply(True, value=plain(value), rng_states=states)
    raise ValueError(f"unknown host operation {request.op!r}")


def _agents(request: HostRequest, objects: _Objects) -> list[dict]:
    import socket

    from tinkerless.functions.hosting.agent_host import run_agents

    if objects.control is None:
        raise RuntimeError("this host was started without a control socket: it cannot run agents")
    _, fds, _, _ = socket.recv_fds(objects.control, 1, 1)
    if len(fds) != 1:
        raise RuntimeError("no model channel came with the agent rollout")
    channel = socket.socket(fileno=fds[0])
    tasks, keys = request.args
    return run_agents(objects.get(request.handle), channel, tasks, keys, float(request.kwargs["timeout"]))


def _failed(exc: BaseException) -> HostReply:
    """The reply for a call that raised `exc` (inside the `except` block: it keeps the traceback)."""
    return HostReply(False, error_type=type(exc).__name__, error=str(exc)[:2000], traceback=traceback.format_exc()[-8000:],
                     cause=infra_cause(exc) or "")


def _answer_one(request: HostRequest, objects: _Objects) -> HostReply:
    try:
        return answer(request, objects)
    except Exception as exc:
        return _failed(exc)


def main(requests_fd: int, replies_fd: int, control_fd: int = -1) -> None:
    """`control_fd`: a unix socket over which each agent rollout's model channel arrives (SCM_RIGHTS)."""
    os.dup2(2, 1)  # print() in user code goes to stderr, never into the replies pipe
    sys.stdout = sys.stderr
    objects = _Objects()
    if control_fd >= 0:
        import socket

        objects.control = socket.socket(fileno=control_fd)
    while True:
        try:
            request = read_frame(requests_fd)
        except EOFError:
            return
        try:
            reply = answer(request, objects)
        except BaseException as exc:  # the tenant's code failed: that is an answer, not the end of the host
            if isinstance(exc, (KeyboardInterrupt, SystemExit)) and request.op not in ("new", "call", "load"):
                raise
            reply = _failed(exc)
        try:
            write_frame(replies_fd, reply)
        except Exception as exc:  # a value the codec refused
            write_frame(replies_fd, HostReply(False, error_type=type(exc).__name__, error=f"the result cannot be sent back: {exc}"[:2000]))


__all__ = ["answer", "main", "plain"]
