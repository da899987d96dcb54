"""Storage errors, defined in `tinkerless.errors` (so they cross the wire typed) and re-exported here."""

from tinkerless.errors import CommitConflict, PreconditionFailed, StorageConfigError

__all__ = ["CommitConflict", "PreconditionFailed", "StorageConfigError"]
