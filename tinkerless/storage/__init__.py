"""Object storage for runs: `ObjectStore` (bytes under safe '/'-separated keys,
over a local directory or any fsspec URL such as s3:// or gs://) and
`CheckpointStore` (sha256-verified, crash-safe numbered checkpoints with a
`latest` pointer, pruning and fallback past corrupt or half-written steps).
"""

from tinkerless.storage.checkpoint import Checkpoint, CheckpointStore
from tinkerless.storage.store import ObjectStore, validate_key

__all__ = ["Checkpoint", "CheckpointStore", "ObjectStore", "validate_key"]
