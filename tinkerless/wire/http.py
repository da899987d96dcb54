"""The HTTP transport: its names, shared by `tinkerless serve` and `HTTPBackend`, and reading a request body
under a size limit (every API of the server, and the OpenAI endpoint a rollout serves its agents)."""

from __future__ import annotations

from typing import Any

from tinkerless.errors import ProtocolError

MSGPACK = "application/msgpack"  # request and reply bodies: codec envelopes
COMPUTE_SECONDS_HEADER = "X-Tinkerless-Compute-Seconds"  # reply: the server's timing of the function body
QUEUE_SECONDS_HEADER = "X-Tinkerless-Queue-Seconds"  # reply: how long the call waited in the server's queue first
STREAM_HEADER = "X-Tinkerless-Stream"  # request: one client's calls to a server ...
SEQ_HEADER = "X-Tinkerless-Seq"  # ... run in this order (1, 2, 3, ...), however they arrive
MODEL_HEADER = "X-Tinkerless-Model"  # request: which of the server's models a /v1/call runs on (default: its main one)


class RequestTooLarge(Exception):
    def __init__(self, size: int, limit: int):
        super().__init__(size, limit)
        self.size = size
        self.limit = limit


async def read_body(request: Any, limit: int) -> bytes:
    """The body of a Starlette/FastAPI `Request`, refusing early on the declared Content-Length and again on
    the bytes actually sent."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise ProtocolError(f"invalid Content-Length header {declared!r}", hint="send a numeric Content-Length") from None
        if size > limit:
            raise RequestTooLarge(size, limit)
    chunks: list[bytes] = []
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > limit:  # chunked uploads (or a lying header) are cut off here
            raise RequestTooLarge(received, limit)
        chunks.append(chunk)
    return b"".join(chunks)
