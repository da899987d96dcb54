"""Pieces every msgpack route of the server shares: error envelopes, the caller's call stream."""

from __future__ import annotations

import os
import re

from fastapi import Request
from fastapi.responses import Response

from tinkerless.errors import (
    BarrierTimeout, BudgetExceeded, CommitConflict, PhaseError, ProtocolError, StorageNotFound, TinkerlessError, UserError,
    infra_cause,
)
from tinkerless.wire import encode_message
from tinkerless.wire.http import MSGPACK, SEQ_HEADER, STREAM_HEADER
from tinkerless.wire.messages import ErrorReply


STORAGE_PLACEHOLDER = "<server storage>"
_SEQ = re.compile(r"[0-9]{1,18}")


class Redactor:
    """Hides where the server keeps its data: a client learns a run's key, never the server's disk layout."""

    def __init__(self, *roots: str | None):
        spellings = set()
        for root in roots:
            if root:
                spellings |= {root.rstrip("/"), os.path.abspath(root) if "://" not in root else root.rstrip("/")}
                if "://" not in root:
                    spellings.add(os.path.realpath(root))
        # Longest first, so a root inside another is not half-replaced.
        self.roots = sorted((s for s in spellings if len(s) > 1), key=len, reverse=True)

    def __call__(self, text: str | None) -> str | None:
        if not text:
            return text
        for root in self.roots:
            text = text.replace(root, STORAGE_PLACEHOLDER)
        return text


def error_response(
    status: int, exc: TinkerlessError, headers: dict[str, str] | None = None, redact: Redactor | None = None
) -> Response:
    message, hint = (redact(exc.message), redact(exc.hint)) if redact else (exc.message, exc.hint)
    reply = ErrorReply(error=message or "", category=exc.category, type=type(exc).__name__, hint=hint,
                       cause=infra_cause(exc))
    return Response(content=encode_message(reply), status_code=status, media_type=MSGPACK, headers=headers)


def status_of(exc: TinkerlessError) -> int:
    """409 for a run in another state than the call needs (or driven by another client), 404 for a missing
    object, 503 for a service the call needed that failed (an infrastructure failure: retry), else 400 (user)
    or 500."""
    if infra_cause(exc) is not None:
        return 503
    if isinstance(exc, BudgetExceeded):
        return 402
    if isinstance(exc, (PhaseError, BarrierTimeout, CommitConflict)):
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
    # ASCII digits only (str.isdigit accepts '²', which int() refuses), from 1, within 64 bits.
    if not _SEQ.fullmatch(seq) or int(seq) < 1 or not 0 < len(stream) <= 128:
        raise ProtocolError(
            f"invalid {SEQ_HEADER} {seq[:32]!r} or {STREAM_HEADER} (of {len(stream)} characters)",
            hint="sequence numbers are integers from 1, one per call; a stream id is 1-128 characters",
        )
    return stream, int(seq)
