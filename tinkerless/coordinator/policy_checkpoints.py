"""A run's checkpoint: every policy's state plus the driver's own files, in one `CheckpointStore` step.

Used on both sides of the wire with the same layout: by the client when the run
lives in its own storage, and by `tinkerless serve` when the run lives on the
server (the server reads the policies off its worker, so adapters never travel to
the client and back). How a policy's state is read or loaded is the caller's:
`save_state(policy)` returns its files, `load_state(policy, files, version)` loads them.
"""

from __future__ import annotations

from typing import Callable

from tinkerless.errors import CorruptCheckpoint
from tinkerless.storage import CheckpointStore
from tinkerless.wire.runs import CheckpointPolicy, RestoredCheckpoint


def save_policies(
    checkpoints: CheckpointStore,
    step: int,
    policies: list[CheckpointPolicy],
    save_state: Callable[[CheckpointPolicy], dict[str, bytes]],
    files: dict[str, bytes],
    metadata: dict,
) -> str:
    """Write step `step`: each policy's files under its prefix, then `files` at the top."""
    everything: dict[str, bytes] = {}
    for policy in policies:
        everything.update({policy.file_prefix + k: v for k, v in save_state(policy).items()})
    everything.update(files)
    versions = {p.name: p.version for p in policies}
    return checkpoints.save(step, everything, {**metadata, "policy_versions": versions})


# Where a checkpoint keeps the older policy versions an async run's next steps sample from (sdk/run/pipeline.py).
READERS_PREFIX = "readers/"

def restore_policies(
    checkpoints: CheckpointStore,
    policies: list[CheckpointPolicy],
    client_files: list[str],
    load_state: Callable[[CheckpointPolicy, dict[str, bytes], int], None],
    reset: Callable[[CheckpointPolicy], None] | None,
    step: int | None = None,
) -> RestoredCheckpoint:
    """Put every one of `policies` into exactly the state of checkpoint `step` (default: the latest valid
    one); the `client_files` come back. With no valid checkpoint every policy is `reset` to its fresh init
    (a reader such as `tinkerless eval` passes reset=None: it changes nothing and learns step None).

    A resume must never continue from what the worker still holds: a client killed before its first
    checkpoint, or whose checkpoints are all corrupt, would otherwise go on from adapters and optimizer
    moments trained by its earlier attempt, and end with other weights than an uninterrupted run."""
    skipped: list[str] = []
    checkpoint = checkpoints.load(step) if step is not None else checkpoints.load_latest(skipped)
    if checkpoint is None:
        for policy in policies if reset is not None else ():
            reset(policy)
        return RestoredCheckpoint(step=None, warnings=skipped)
    files = dict(checkpoint.files)
    own = {name: files.pop(name) for name in client_files if name in files}
    versions = checkpoint.metadata.get("policy_versions", {})
    # Longest prefix first: the single-agent policy's prefix is "" and would claim every file.
    by_prefix = sorted(policies, key=lambda p: len(p.file_prefix), reverse=True)
    claimed: dict[str, dict[str, bytes]] = {p.name: {} for p in policies}
    for key, data in files.items():
        if key.startswith(READERS_PREFIX) and not any(p.file_prefix.startswith(READERS_PREFIX) for p in policies):
            continue  # an async run's older versions: only a restore that asks for them takes them
        owner = next((p for p in by_prefix if key.startswith(p.file_prefix)), None)
        if owner is not None:
            claimed[owner.name][key[len(owner.file_prefix):]] = data
    for policy in policies:
        if not claimed[policy.name]:
            raise CorruptCheckpoint(
                f"checkpoint step-{checkpoint.step} at {checkpoints.location(checkpoint.step)} has no files "
                f"for policy {policy.name!r} (expected them under {policy.file_prefix or 'the top level'!r})",
                hint="resume with the same agents the run was started with, or start a new run",
            )
        load_state(policy, claimed[policy.name], int(versions.get(policy.name, checkpoint.step)))
    return RestoredCheckpoint(
        checkpoint.step, own, {p.name: int(versions.get(p.name, checkpoint.step)) for p in policies}, skipped
    )
