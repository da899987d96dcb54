"""Typed errors. Every error says what went wrong and what to do about it.

`category` mirrors the wire protocol: "user" errors are caused by the caller's
code, data or configuration; "server" errors are tinkerless's or the machine's.
"""

from __future__ import annotations


class TinkerlessError(Exception):
    """Base class for all tinkerless errors."""

    category = "server"

    def __init__(self, message: str, *, hint: str | None = None):
        self.message = message
        self.hint = hint
        super().__init__(f"{message}\n  hint: {hint}" if hint else message)


class UserError(TinkerlessError):
    """The caller's code, data or configuration is at fault."""

    category = "user"


class ConfigError(UserError):
    """A run or algorithm setting is invalid."""


class DatasetError(UserError):
    """The task dataset is empty, malformed or unreadable."""


class UserCodeError(UserError):
    """User code (env, reward, tool) cannot be packaged or raised while running."""


class EnvError(UserCodeError):
    """An environment's reset/step raised, or it broke the env protocol."""


class RewardError(UserCodeError):
    """A reward function raised or returned something that is not a finite number."""


class ModelNotFoundError(UserError):
    """A model name or path could not be resolved to weights."""


class ProtocolError(UserError):
    """A request does not match what the receiver speaks (version, type, size)."""


class InvalidRequest(ProtocolError):
    """A value in a request is of the wrong type, not finite, or out of range (HTTP 400)."""


class SequenceReused(ProtocolError, ValueError):
    """A call's sequence number (X-Tinkerless-Seq) was already used on its stream (HTTP 400)."""

    def __init__(self, seq: int, next_seq: int):
        super().__init__(
            f"sequence number {seq} was already used on this stream (next is {next_seq})",
            hint="send each call once, with the next sequence number; HTTPBackend does this by itself",
        )


class BudgetExceeded(UserError):
    """A call or run would spend past a budget (a key's on the server, or the run's own max_cost_usd /
    max_compute_seconds): refused before its work starts (HTTP 402). The message names what was spent, the
    limit, and how to raise it."""


class PhaseError(TinkerlessError):
    """A coordinator barrier was violated (e.g. update before rollouts finished): the caller's call order (409)."""

    category = "user"


class BarrierTimeout(TinkerlessError):
    """A barrier or turn did not complete within its timeout."""


class ServerBusy(TinkerlessError):
    """The server's queue is full; retry after a short wait (HTTP 429 with Retry-After)."""


class StorageError(TinkerlessError):
    """Object storage failed."""


class StorageNotFound(StorageError):
    """A key does not exist in object storage."""


class CorruptCheckpoint(StorageError):
    """A checkpoint failed verification against its manifest."""


class CheckpointMismatch(UserError):
    """A checkpoint does not hold what the caller asked to restore from it (another policy, another file
    prefix), or a save asked for a layout that could not be restored (two policies under one prefix): HTTP 400."""


class PreconditionFailed(StorageError):
    """A conditional write found the object in another state than the caller expected."""


class CommitConflict(PreconditionFailed):
    """Another writer committed to the same run while this one was writing (two writers on one run)."""

    category = "user"


class StaleDriver(CommitConflict):
    """A call from a client that no longer drives its run: another client opened (took over) or resumed the
    run, and the run's policies on the server now take calls only from that client."""


class StorageConfigError(StorageError, ConfigError):
    """The storage location cannot be used as configured: missing credentials, no such bucket, access denied."""


class RankFailed(TinkerlessError):
    """A rank of a sharded update died or failed alone mid-call: the call did not complete, and the ranks restart
    on the next call with every policy at its last saved version (`functions/sharding`)."""


class InfrastructureFailure(TinkerlessError):
    """An episode could not be played for a reason outside the policy's control: a sandbox or hosted-agent
    process that died, an env server or judge that is unreachable or timed out, a worker restart.

    Such an episode is never a reward: it is retried, then dropped from its group and counted
    (`episodes_infra_failed`), with `cause` recorded in episodes.jsonl. Raise it (or a subclass) from code
    that talks to such a service; errors of the user's own env or reward stay EnvError / RewardError."""

    def __init__(self, message: str, *, cause: str, hint: str | None = None):
        self.cause = infra_cause_tag(cause)  # a short machine-readable tag: "judge_timeout", "env_server_unreachable", ...
        super().__init__(message, hint=hint)


def infra_cause_tag(cause: object) -> str:
    """`cause` as it is recorded and sent: a short printable tag (anything else becomes "unknown")."""
    if not isinstance(cause, str):
        return "unknown"
    tag = "".join(c if c.isalnum() or c in "_-.:" else "_" for c in cause.strip()[:64])
    return tag or "unknown"


def infra_cause(exc: BaseException) -> str | None:
    """The cause tag when `exc` is an infrastructure failure (an `InfrastructureFailure`, or an error that carries
    one across a process boundary as its `infra_cause`, like a hosted code error whose sandbox died), else None."""
    if isinstance(exc, InfrastructureFailure):
        return exc.cause
    carried = getattr(exc, "infra_cause", None)
    return infra_cause_tag(carried) if carried else None


class RemoteError(TinkerlessError):
    """An error reported by a remote function, re-raised on the client."""

    def __init__(
        self, message: str, *, category: str = "server", remote_type: str = "", traceback: str = "", hint: str | None = None
    ):
        self.category = category
        self.remote_type = remote_type
        self.remote_traceback = traceback
        super().__init__(message, hint=hint)


class ServerUnreachable(InfrastructureFailure, RemoteError):
    """The tinkerless server cannot be reached, or its connection broke mid-call (it died or is restarting). A run
    through it waits for it to come back and resumes from its last checkpoint (`TrainConfig.reconnect_timeout`).
    Still a `RemoteError`, as a lost server was before."""

    def __init__(self, message: str, *, cause: str = "server_unreachable", hint: str | None = None):
        super().__init__(message, cause=cause, hint=hint)


def error_class_for(name: str) -> type[TinkerlessError] | None:
    """Map an error class name received over the wire back to its class."""
    cls = globals().get(name)
    if isinstance(cls, type) and issubclass(cls, TinkerlessError):
        return cls
    return None


def rebuild_error(name: str, message: str, *, hint: str | None = None, cause: str | None = None) -> TinkerlessError | None:
    """The error named `name`, rebuilt from what the wire carries (message, hint and, for an infrastructure
    failure, its cause); None when this side has no such class or cannot build it from those alone."""
    cls = error_class_for(name)
    if cls is None or cls is RemoteError:
        return None
    try:
        if issubclass(cls, InfrastructureFailure):
            return cls(message, cause=cause or "unknown", hint=hint)
        return cls(message, hint=hint)
    except TypeError:  # a class with its own constructor (SequenceReused)
        return None
