"""Where a run lives: its coordinator (state, barriers) and its checkpoints.

`train()` drives every run the same way and asks a `RunHost` for those two things:

- `StorageRunHost`: in object storage the client writes itself (a local directory,
  s3://...), with the `Coordinator` in this process. Local, Modal and custom backends.
- `ServerRunHost` (`server_runs`): on a `tinkerless serve` server, in its storage,
  tenant-prefixed. HTTP and SkyPilot backends, whose `run_host()` returns one.

Checkpoints name their policies as `CheckpointPolicy` (file prefix and worker name);
whoever holds the worker reads and loads the adapters, so they never travel further
than from the functions to storage.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from tinkerless.coordinator import Coordinator, RunState, checkpoint_prefix, list_runs, run_prefix
from tinkerless.coordinator.policy_checkpoints import restore_policies, save_policies
from tinkerless.errors import UserError
from tinkerless.sdk.backends.base import Backend, call
from tinkerless.storage import CheckpointStore, ObjectStore
from tinkerless.storage.checkpoint import BackgroundSaves
from tinkerless.wire.messages import LoadStateRequest, PolicyState, ResetPolicyRequest, SaveStateRequest
from tinkerless.wire.runs import CheckpointPolicy, RestoredCheckpoint


class RunCheckpoints(Protocol):
    def save(
        self, step: int, policies: list[CheckpointPolicy], files: dict[str, bytes], metadata: dict, *, background: bool = False
    ) -> None: ...

    def flush(self) -> None: ...  # every save so far committed

    def restore(
        self, policies: list[CheckpointPolicy], client_files: list[str], step: int | None = None, *, driver: bool = True
    ) -> RestoredCheckpoint:
        """Load checkpoint `step` (default: the latest valid one). The run's `driver` resuming it resets every
        policy to its fresh init when there is none; a reader (eval) leaves the worker as it was."""
        ...


class RunHost(Protocol):
    where: str  # the URL runs live under (messages; scopes the run's policy names on a shared worker)

    def create(self, run_id: str, config: dict) -> Any: ...  # a Coordinator or a stand-in with its methods

    def open(self, run_id: str, *, limits: dict | None = None) -> Any: ...  # limits: the run's budget (a server holds it)

    def latest_run_id(self, name: str) -> str: ...

    def run_dir(self, run_id: str) -> Path: ...  # a local directory for the run's metrics and plots

    def checkpoints(self, run_id: str, keep_last: int | None = None, coordinator: Any = None) -> RunCheckpoints:
        """The run's checkpoints; saving (and resuming) goes through the run's `coordinator`."""
        ...


class StorageRunHost:
    """Runs in `store`, coordinated in this process; policy states come from `backend`'s worker."""

    def __init__(self, store: ObjectStore, backend: Backend):
        self.store = store
        self.backend = backend
        self.where = store.url

    def create(self, run_id: str, config: dict) -> Coordinator:
        return Coordinator.create(self.store, run_id, config)

    def open(self, run_id: str, *, limits: dict | None = None) -> Coordinator:
        return Coordinator.open(self.store, run_id)  # a local run's budget is checked by its own loop

    def latest_run_id(self, name: str) -> str:
        return newest_run_id(list_runs(self.store), name, self.where)

    def run_dir(self, run_id: str) -> Path:
        local = self.store.local_path(run_prefix(run_id))
        return Path(local) if local else Path("runs") / run_id  # metrics stay on this machine

    def checkpoints(
        self, run_id: str, keep_last: int | None = None, coordinator: Coordinator | None = None
    ) -> "StoredCheckpoints":
        return StoredCheckpoints(CheckpointStore(self.store, checkpoint_prefix(run_id), keep_last=keep_last), self.backend)


class StoredCheckpoints:
    """A run's checkpoints in the client's storage; adapters are read off (and loaded onto) the backend."""

    def __init__(self, store: CheckpointStore, backend: Backend):
        self.store = store
        self.backend = backend
        self.writer = BackgroundSaves()

    def save(
        self, step: int, policies: list[CheckpointPolicy], files: dict[str, bytes], metadata: dict, *, background: bool = False
    ) -> None:
        """Snapshot every policy now; write and commit now, or with `background` on a thread (see `flush`)."""
        states = {
            policy.name: call(self.backend, "save_state", SaveStateRequest(policy.worker_policy, True)).files
            for policy in policies
        }

        def write() -> str:
            return save_policies(self.store, step, policies, lambda policy: states[policy.name], files, metadata)

        if background:
            self.writer.submit(write)
        else:
            self.flush()  # commits stay in step order
            write()

    def flush(self) -> None:
        """Wait until every checkpoint saved so far is committed (re-raises a background write's error)."""
        self.writer.wait()

    @property
    def busy(self) -> bool:
        """A background write is still running."""
        return self.writer.busy

    def restore(
        self, policies: list[CheckpointPolicy], client_files: list[str], step: int | None = None, *, driver: bool = True
    ) -> RestoredCheckpoint:
        self.flush()  # a restore reads what every earlier save committed

        def load(policy: CheckpointPolicy, files: dict[str, bytes], version: int) -> None:
            call(self.backend, "load_state", LoadStateRequest(PolicyState(policy.worker_policy, files, version), True))

        def reset(policy: CheckpointPolicy) -> None:
            call(self.backend, "reset_policy", ResetPolicyRequest(policy.worker_policy, missing_ok=True))

        return restore_policies(self.store, policies, client_files, load, reset if driver else None, step)


def newest_run_id(runs: list[RunState], name: str, where: str) -> str:
    """The id of the newest run named `name` among `runs` (newest first)."""
    for run in runs:
        if run.config.get("name") == name:
            return run.run_id
    raise UserError(
        f"no run named {name!r} to resume in {where}",
        hint="pass run_id=... (see `tinkerless runs`) or drop resume to start a new run",
    )


def run_host_for(backend: Backend, storage: str, storage_options: dict | None = None) -> RunHost:
    """The backend's own host when it has one (a server keeps its runs), else runs in `storage`."""
    hosted = getattr(backend, "run_host", None)
    if callable(hosted):
        return hosted(local_dir=storage if "://" not in storage else ".")
    return StorageRunHost(ObjectStore(storage, **(storage_options or {})), backend)
