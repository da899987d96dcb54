"""Object storage for runs: `ObjectStore` (bytes under safe '/'-separated keys,
over a local directory or any fsspec URL such as s3:// or gs://, with versioned
reads and conditional writes) and `CheckpointStore` (sha256-verified numbered
checkpoints committed by a compare-and-swap of a `latest` pointer, with pruning
and fallback past corrupt or half-written steps; `background.BackgroundSaves` runs its saves off
the training loop). `names.check_name` is the one validator
for names that become keys (run ids, checkpoint, policy and tenant names): nothing path-shaped
reaches a store.
"""

from tinkerless.storage.checkpoint import Checkpoint, CheckpointStore
from tinkerless.storage.errors import (
    CommitConflict,
    PreconditionFailed,
    StorageConfigError,
)
from tinkerless.storage.store import ObjectStore, validate_key

__all__ = [
    "Checkpoint",
    "CheckpointStore",
    "CommitConflict",
    "ObjectStore",
    "PreconditionFailed",
    "StorageConfigError",
    "validate_key",
]
