"""What crosses the pipe between the model-holding process and a tenant's sandboxed code host.

Frames are a 4-byte big-endian length and a wire-codec message (tinkerless.wire.codec):
only plain data and tinkerless dataclasses, so neither side can make the other
import or run anything by sending a frame. User code crosses only as `CodeBlob`s,
and is unpickled only on the host side.
"""

from __future__ import annotations

import os
import select
import struct
import time
from dataclasses import dataclass, field
from typing import Any

from tinkerless.wire.code import CodeBlob
from tinkerless.wire.codec import decode_message, encode_message

_LENGTH = struct.Struct(">I")
MAX_FRAME_BYTES = 256 * 2**20


@dataclass
class Ref:
    """An object living in the host (an env class, an env, a reward function), named by its handle."""

    handle: int


@dataclass
class RngState:
    """A `random.Random` passed to hosted code: its state goes over and comes back after the call."""

    state: list


@dataclass
class HostRequest:
    op: str  # "load" | "new" | "call" | "drop"
    handle: int = 0
    method: str = ""  # for "call": "" calls the object itself
    args: list = field(default_factory=list)
    kwargs: dict = field(default_factory=dict)
    blob: CodeBlob | None = None


@dataclass
class HostReply:
    ok: bool
    value: Any = None
    handle: int = 0  # "load"/"new": the new object's handle
    methods: list = field(default_factory=list)  # its public callables, so hasattr() answers as it would in-process
    attributes: dict = field(default_factory=dict)  # its public plain-data class attributes (e.g. `agents`)
    name: str = ""  # its __qualname__
    rng_states: list = field(default_factory=list)  # updated states of the RngState arguments, in order
    error_type: str = ""
    error: str = ""
    traceback: str = ""
    cause: str = ""  # the tenant's code raised an InfrastructureFailure: its cause (a tag, re-checked on arrival)


def write_frame(fd: int, value: Any, deadline: float | None = None) -> None:
    """Send one message; TimeoutError past `deadline` if the peer stops reading (a full pipe would block forever)."""
    data = encode_message(value)
    view = memoryview(_LENGTH.pack(len(data)) + data)
    while view:
        if deadline is not None:
            _, ready, _ = select.select([], [fd], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError("the peer did not read the request before the deadline")
        view = view[os.write(fd, view[:65536]) :]


def read_frame(fd: int, deadline: float | None = None) -> Any:
    """The next message; EOFError when the other side is gone, TimeoutError past `deadline` (time.monotonic()).

    The deadline covers the whole frame: a peer that sends half a frame and stalls
    cannot hold the reader (the model-holding server) forever.
    """
    (length,) = _LENGTH.unpack(_read_exactly(fd, _LENGTH.size, deadline))
    if length > MAX_FRAME_BYTES:
        raise EOFError(f"a frame of {length} bytes is over the limit of {MAX_FRAME_BYTES}")
    return decode_message(_read_exactly(fd, length, deadline))


def _read_exactly(fd: int, size: int, deadline: float | None = None) -> bytes:
    chunks, remaining = [], size
    while remaining:
        if deadline is not None:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError("no complete answer before the deadline")
        chunk = os.read(fd, min(remaining, 1 << 20))
        if not chunk:
            raise EOFError("the other side closed the pipe")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


__all__ = ["HostReply", "HostRequest", "Ref", "RngState", "read_frame", "write_frame"]
