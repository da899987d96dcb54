"""A run's checkpoint: every policy's state plus the driver's own files, in one `CheckpointStore` step.

Used on both sides of the wire with the same layout: by the client when the run
lives in its own storage, and by `tinkerless serve` when the run lives on the
server (the server reads the policies off its worker, so adapters never travel to
the client and back). How a policy's state is read or loaded is the caller's:
`save_state(policy)` returns its files, `load_state(policy, files, version)` loads them.
"""

from __future__ import annotations

from typing import Callable

from tinkerless.errors import CheckpointMismatch
from tinkerless.storage import CheckpointStore
from tinkerless.wire.runs import CheckpointPolicy, RestoredCheckpoint

# Where a checkpoint keeps the older policy versions an async run's next steps sample from (sdk/run/pipeline.py).
READERS_PREFIX = "readers/"


def save_policies(
    checkpoints: CheckpointStore,
    step: int,
    policies: list[CheckpointPolicy],
    save_state: Callable[[CheckpointPolicy], dict[str, bytes]],
    files: dict[str, bytes],
    metadata: dict,
) -> str:
    """Write step `step`: each policy's files under its prefix, then `files` at the top. A layout that
    `restore_policies` could not read back as written is refused before anything is written (`check_layout`)."""
    check_policies(policies)
    owned: dict[str, CheckpointPolicy | None] = {}
    everything: dict[str, bytes] = {}
    for policy in policies:
        for name, data in save_state(policy).items():
            _claim(owned, policy.file_prefix + name, policy)
            everything[policy.file_prefix + name] = data
    for name, data in files.items():
        _claim(owned, name, None)
        everything[name] = data
    check_layout(policies, owned)
    versions = {p.name: p.version for p in policies}
    return checkpoints.save(step, everything, {**metadata, "policy_versions": versions})


def check_policies(policies: list[CheckpointPolicy]) -> None:
    """Two policies of one checkpoint must differ in name and in file prefix: one prefix holding two policies'
    files cannot be told apart on restore. Checked at the boundary (`wire.validate`) and again here."""
    for field in ("name", "file_prefix"):
        seen: dict[str, str] = {}
        for policy in policies:
            value = getattr(policy, field)
            if value in seen:
                raise CheckpointMismatch(
                    f"policies {seen[value]!r} and {policy.name!r} of one checkpoint have the same {field} {value!r}",
                    hint="give each policy of a checkpoint its own name and its own file_prefix (e.g. 'policies/NAME/')",
                )
            seen[value] = policy.name


def _claim(owned: dict[str, CheckpointPolicy | None], key: str, owner: CheckpointPolicy | None) -> None:
    if key in owned:
        first, second = (_owner_name(o) for o in (owned[key], owner))
        raise CheckpointMismatch(f"checkpoint file {key!r} would be written by both {first} and {second}",
                                 hint="give the policies file prefixes that do not overlap, and the client's files "
                                 "names no policy uses")
    owned[key] = owner


def _owner_name(owner: CheckpointPolicy | None) -> str:
    return "the client's files" if owner is None else f"policy {owner.name!r}"


def check_layout(policies: list[CheckpointPolicy], owned: dict[str, CheckpointPolicy | None]) -> None:
    """Every file must come back to the policy that wrote it: `restore_policies` gives a file to the policy of
    the longest prefix it starts with, and skips an async run's reader files unless readers are asked for."""
    readers = [p for p in policies if p.file_prefix.startswith(READERS_PREFIX)]
    for key, owner in owned.items():
        if owner is None:
            continue  # the client's files are taken by name, first
        if owner in readers:  # read back by a restore of the readers alone
            restorer = _owner(key, readers)
        elif key.startswith(READERS_PREFIX):  # a restore without readers skips these
            restorer = None
        else:
            restorer = _owner(key, [p for p in policies if p not in readers])
        if restorer is not owner:
            raise CheckpointMismatch(
                f"policy {owner.name!r}'s file {key!r} would be restored "
                + (f"into policy {restorer.name!r}" if restorer is not None else "into no policy")
                + f": file prefix {owner.file_prefix!r} overlaps another policy's",
                hint="give each policy a file prefix that no other policy's files start with (e.g. 'policies/NAME/')",
            )


def _owner(key: str, policies: list[CheckpointPolicy]) -> CheckpointPolicy | None:
    """The policy a restore gives `key` to: the longest prefix first (the single-agent "" claims every file)."""
    return next((p for p in sorted(policies, key=lambda p: len(p.file_prefix), reverse=True)
                 if key.startswith(p.file_prefix)), None)


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
    check_policies(policies)
    skipped: list[str] = []
    checkpoint = checkpoints.load(step) if step is not None else checkpoints.load_latest(skipped)
    if checkpoint is None:
        for policy in policies if reset is not None else ():
            reset(policy)
        return RestoredCheckpoint(step=None, warnings=skipped)
    files = dict(checkpoint.files)
    own = {name: files.pop(name) for name in client_files if name in files}
    versions = checkpoint.metadata.get("policy_versions", {})
    claimed: dict[str, dict[str, bytes]] = {p.name: {} for p in policies}
    for key, data in files.items():
        if key.startswith(READERS_PREFIX) and not any(p.file_prefix.startswith(READERS_PREFIX) for p in policies):
            continue  # an async run's older versions: only a restore that asks for them takes them
        owner = _owner(key, policies)
        if owner is not None:
            claimed[owner.name][key[len(owner.file_prefix):]] = data
    for policy in policies:
        if not claimed[policy.name]:  # the files verified against the manifest: what was asked is not there
            raise CheckpointMismatch(
                f"checkpoint step-{checkpoint.step} at {checkpoints.location(checkpoint.step)} has no files "
                f"for policy {policy.name!r} (expected them under {policy.file_prefix or 'the top level'!r}); "
                f"it holds the policies {sorted(versions)}",
                hint="resume with the same agents the run was started with, or start a new run",
            )
        load_state(policy, claimed[policy.name], int(versions.get(policy.name, checkpoint.step)))
    return RestoredCheckpoint(
        checkpoint.step, own, {p.name: int(versions.get(p.name, checkpoint.step)) for p in policies}, skipped
    )
