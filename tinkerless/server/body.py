"""Reading a request body under a size limit, for both of the server's APIs."""

from __future__ import annotations

from fastapi import Request

from tinkerless.errors import ProtocolError


class RequestTooLarge(Exception):
    def __init__(self, size: int, limit: int):
        super().__init__(size, limit)
        self.size = size
        self.limit = limit


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refusing early on the declared Content-Length and again on the bytes actually sent."""
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
