"""The way back from a sandboxed agent to the model: HTTP requests as frames over a socket.

On a shared server an agent function runs in its tenant's bubblewrap sandbox (`user_code.py`), which
has no network. Each agent rollout gets a fresh socketpair; one end goes into the sandbox (as an fd
passed over the host's control socket), the other stays with the worker (`agent_channel_server.py`).
Inside, every copy's `openai.AsyncOpenAI` client uses `ChannelTransport`: each HTTP request becomes
one frame, each reply one frame, so the agent's client is the real `openai` client over the same
routes the in-process path uses.

A frame is a 4-byte big-endian length and a msgpack map of plain values (no extension types, so
decoding one can neither run nor import anything):

    request  {"id": int, "method": str, "path": str, "headers": [[str, str], ...], "body": bytes}
    reply    {"id": int, "status": int, "headers": [[str, str], ...], "body": bytes}
    done     {"done": str}   a copy (named by its key) has finished: the worker stops waiting for its calls

This module runs on both sides and imports nothing heavy (it is imported inside the sandbox).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import struct
from typing import Any

import httpx
import msgpack

MAX_BODY_BYTES = 4 * 2**20  # a request body over this is answered 413
MAX_FRAME_BYTES = MAX_BODY_BYTES + 2**20  # a frame over this is a protocol violation: the sender is stopped
MAX_HEADERS = 64
_LENGTH = struct.Struct(">I")


class FrameError(Exception):
    """The peer sent something that is not a frame of this protocol (garbage, or over the size limit)."""


def _no_ext(code: int, data: bytes) -> None:
    raise ValueError(f"msgpack extension type {code}")


def encode_frame(message: dict) -> bytes:
    data = msgpack.packb(message, use_bin_type=True)
    return _LENGTH.pack(len(data)) + data


class FrameReader:
    """Cuts a byte stream into decoded frames; FrameError on a frame over `limit` or one that is not msgpack."""

    def __init__(self, limit: int = MAX_FRAME_BYTES):
        self.limit = limit
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        self._buffer += data
        frames = []
        while len(self._buffer) >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(self._buffer)
            if length > self.limit:
                raise FrameError(f"a frame of {length} bytes is over the limit of {self.limit}")
            if len(self._buffer) < _LENGTH.size + length:
                break
            data, self._buffer = bytes(self._buffer[_LENGTH.size:_LENGTH.size + length]), self._buffer[_LENGTH.size + length:]
            try:  # raw=False: str stays str; strict_map_key: only str/bytes keys; ext types are refused
                frames.append(msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=_no_ext))
            except Exception as exc:  # noqa: BLE001 - any decoding failure is the same protocol violation
                raise FrameError(f"a frame that is not msgpack ({type(exc).__name__})") from None
        return frames


def error_reply(request_id: Any, status: int, message: str, code: str, kind: str = "invalid_request_error") -> dict:
    """A reply frame with the OpenAI error body, so the agent's client raises the usual `openai.APIStatusError`."""
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    return {"id": request_id, "status": status, "headers": [["content-type", "application/json"]], "body": body}


class ChannelTransport(httpx.AsyncBaseTransport):
    """An httpx transport that sends each request over the channel socket and waits for its reply frame.

    All copies of a rollout share it (one asyncio loop): requests are numbered, one task reads replies
    and hands each to the request with its number.
    """

    def __init__(self, sock: socket.socket):
        sock.setblocking(False)
        self.sock = sock
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None
        self._write = asyncio.Lock()
        self._closed: BaseException | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        if len(body) > MAX_BODY_BYTES:  # answered here too: sending it would only get the sandbox stopped
            reply = error_reply(0, 413, f"a request body of {len(body)} bytes is over the limit of {MAX_BODY_BYTES}",
                                "request_too_large")
            return self._response(reply, request)
        request_id = next(self._ids)
        path = request.url.raw_path.decode("ascii", "replace")
        frame = {"id": request_id, "method": request.method, "path": path,
                 "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in request.headers.raw], "body": body}
        future = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        try:
            await self._send(frame)
            if self._reader is None:
                self._reader = asyncio.create_task(self._read())
            return self._response(await future, request)
        finally:
            self._waiting.pop(request_id, None)

    async def done(self, key: str) -> None:
        """Tell the worker that the copy with this key has finished (it then batches the others' calls sooner)."""
        try:
            await self._send({"done": key})
        except httpx.TransportError:
            pass  # the channel is gone: nothing is waiting for this copy's calls any more

    async def _send(self, frame: dict) -> None:
        if self._closed is not None:
            raise httpx.ConnectError(f"the model channel is closed: {self._closed}")
        async with self._write:
            try:
                await asyncio.get_running_loop().sock_sendall(self.sock, encode_frame(frame))
            except OSError as exc:
                raise httpx.ConnectError(f"the model channel is closed: {exc}") from None

    async def _read(self) -> None:
        reader, loop = FrameReader(), asyncio.get_running_loop()
        try:
            while True:
                data = await loop.sock_recv(self.sock, 1 << 20)
                if not data:
                    raise ConnectionError("the worker closed the model channel")
                for reply in reader.feed(data):
                    future = self._waiting.get(reply.get("id")) if isinstance(reply, dict) else None
                    if future is not None and not future.done():
                        future.set_result(reply)
        except (OSError, FrameError) as exc:
            self._closed = exc
            for future in self._waiting.values():
                if not future.done():
                    future.set_exception(httpx.ConnectError(f"the model channel is closed: {exc}"))

    @staticmethod
    def _response(reply: dict, request: httpx.Request) -> httpx.Response:
        headers = [(k, v) for k, v in reply.get("headers", []) if k.lower() not in ("content-length", "transfer-encoding")]
        return httpx.Response(int(reply.get("status", 502)), headers=headers, content=reply.get("body", b""), request=request)

    async def aclose(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self.sock.close()


__all__ = ["ChannelTransport", "FrameError", "FrameReader", "MAX_BODY_BYTES", "MAX_FRAME_BYTES", "MAX_HEADERS",
           "encode_frame", "error_reply"]
