"""Pieces every msgpack route of the server shares: error envelopes, the caller's call stream."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from tinkerless.errors import BarrierTimeout, PhaseError, ProtocolError, StorageNotFound, TinkerlessError, UserError
from tinkerless.wire import encode_message
from tinkerless.wire.http import MSGPACK, SEQ_HEADER, STREAM_HEADER
from tinkerless.wire.messages import ErrorReply


def error_response(status: int, exc: TinkerlessError, headers: dict[str, str] | None = None) -> Response:
    reply = ErrorReply(error=exc.message, category=exc.category, type=type(exc).__name__, hint=exc.hint)
    return Response(content=encode_message(reply), status_code=status, media_type=MSGPACK, headers=headers)


def status_of(exc: TinkerlessError) -> int:
    """409 for a run in another state than the call needs, 404 for a missing object, else 400 (user) or 500."""
    if isinstance(exc, (PhaseError, BarrierTimeout)):
        return 409
    if isinstance(exc, StorageNotFound):
        return 404
    return 400 if exc.category == "user" else 500


def unauthorized() -> Response:
    return error_response(
        401,
        UserError(
            "missing or invalid API key",
            hint="pass api_key= to HTTPBackend or set TINKERLESS_API_KEY; "
            "an admin issues keys with `tinkerless keys create --tenant NAME`",
        ),
    )


def stream_of(request: Request) -> tuple[str | None, int | None]:
    """The client's call stream and sequence number, when it sends them (HTTPBackend does)."""
    stream = request.headers.get(STREAM_HEADER)
    seq = request.headers.get(SEQ_HEADER)
    if stream is None or seq is None:
        return None, None
    if not seq.isdigit() or len(stream) > 128:
        raise ProtocolError(f"invalid {SEQ_HEADER} {seq!r} or {STREAM_HEADER}", hint="sequence numbers are integers from 1")
    return stream, int(seq)
