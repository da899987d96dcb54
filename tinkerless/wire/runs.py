"""Wire types of a server-hosted run: coordinator calls and checkpoints kept on the server.

A client that trains through `tinkerless serve` drives the run from its own loop,
but the run's state (the coordinator) and its checkpoints live in the server's
storage. Each coordinator call names the run and the `lease` the client got when it
created or opened the run: a second client that opens the same run takes the lease
over, and the first one's next call fails with `CommitConflict`, as a second process
driving the same run does on shared storage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RunCall:
    """One coordinator call (`create`, `open`, `begin_rollout`, ..., `state`) on run `run_id`."""

    run_id: str
    args: dict[str, Any] = field(default_factory=dict)
    lease: str | None = None  # None only for `create`, `open` and `state`


@dataclass
class RunReply:
    state: dict[str, Any]  # RunState.to_dict() after the call
    lease: str | None = None
    done: bool = True  # wait_rollouts: False when the server's long-poll ended before the barrier did


@dataclass
class RunListRequest:
    name: str | None = None  # only runs whose config has this name


@dataclass
class RunList:
    runs: list[dict[str, Any]]  # RunState.to_dict() of each run, newest first


@dataclass
class CheckpointPolicy:
    """One policy in a checkpoint: its files sit under `file_prefix` ("" keeps PEFT's layout at the top)."""

    name: str
    file_prefix: str
    worker_policy: str  # the name the worker holds it under (the client's namespaced name)
    version: int = 0


@dataclass
class SaveCheckpointRequest:
    """Save step `step` of the run: the server reads each policy's state off its own worker and
    writes it, with the client's own `files` (its loop state), into the run's checkpoints."""

    run_id: str
    lease: str
    step: int
    policies: list[CheckpointPolicy]
    files: dict[str, bytes] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    keep_last: int | None = None


@dataclass
class RestoreCheckpointRequest:
    """Load a checkpoint of the run (default: its latest valid one) into the worker's policies
    and return the client's files. Without a lease it only reads the run (`tinkerless eval`)."""

    run_id: str
    lease: str | None
    policies: list[CheckpointPolicy]
    client_files: list[str]  # files that belong to the client, not to a policy
    keep_last: int | None = None
    step: int | None = None


@dataclass
class RestoredCheckpoint:
    """What a restore loaded. With `step` None the run had no valid checkpoint and every policy was
    reset to its fresh init; `warnings` name the checkpoints skipped as corrupt on the way."""

    step: int | None
    files: dict[str, bytes] = field(default_factory=dict)
    policy_versions: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
