"""Errors across the wire: a failed call's exception as an `ErrorReply`, and a reply raised back as its error.

`error_reply` is what every function host answers with (a Worker, a sharded group, a reader process). Read back,
the error's own class when this side knows it and can build it from a message and a hint; else a `RemoteError`
that keeps the remote type, category, traceback and hint. Clients (`sdk/backends`) and the sharded update's
driver (`functions/sharding`, reading its rank 0's replies) raise replies the same way.
"""

from __future__ import annotations

import traceback

from tinkerless.errors import RemoteError, TinkerlessError, infra_cause, rebuild_error
from tinkerless.wire.messages import ErrorReply


def error_reply(exc: Exception) -> ErrorReply:
    """The structured reply for a call that raised `exc` (call inside the `except` block: it keeps the traceback)."""
    return ErrorReply(
        error=getattr(exc, "message", str(exc)),
        category=exc.category if isinstance(exc, TinkerlessError) else "server",
        type=type(exc).__name__,
        traceback=traceback.format_exc(),
        hint=getattr(exc, "hint", None),
        cause=infra_cause(exc),
    )


def raise_error_reply(reply: ErrorReply, *, where: str) -> None:
    error = rebuild_error(reply.type, reply.error, hint=reply.hint, cause=reply.cause)
    if error is None:  # a class this side does not know or cannot build (SequenceReused): a RemoteError
        error = RemoteError(
            f"{where} failed: {reply.type}: {reply.error}",
            category=reply.category,
            remote_type=reply.type,
            traceback=reply.traceback,
            hint=reply.hint,  # what to do about it: a server-side error class the client does not know keeps it too
        )
        if reply.cause:  # an infrastructure failure of a class only the remote side defines: still one here
            error.infra_cause = reply.cause  # type: ignore[attr-defined]
    error.remote_traceback = reply.traceback  # type: ignore[attr-defined]
    raise error
