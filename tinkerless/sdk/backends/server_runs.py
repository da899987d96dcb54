"""Runs kept by a `tinkerless serve` server: its coordinator and checkpoints, driven from here.

`ServerRunHost` is the `RunHost` of HTTP (and SkyPilot) backends. `RemoteCoordinator`
has the `Coordinator`'s methods and a `state` refreshed by every reply, so `train()`
drives it unchanged; each call carries the lease the server gave on create/open.
Barrier waits are long-polls that the client repeats until its own timeout.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any, Sequence

from tinkerless.coordinator import Phase, RunState
from tinkerless.coordinator.state import validate_run_id
from tinkerless.errors import BarrierTimeout, ProtocolError
from tinkerless.sdk.backends.base import raise_error_reply
from tinkerless.sdk.backends.run_host import newest_run_id
from tinkerless.wire import decode_message, encode_message
from tinkerless.wire.messages import ErrorReply
from tinkerless.wire.runs import (
    CheckpointPolicy,
    RestoreCheckpointRequest,
    RestoredCheckpoint,
    RunCall,
    RunList,
    RunListRequest,
    RunReply,
    SaveCheckpointRequest,
)


class ServerRunHost:
    """Runs on the server behind `http` (an `HTTPBackend`); metrics and plots go to `local_dir`/runs."""

    def __init__(self, http: Any, *, local_dir: str = "."):
        self.http = http
        self.local_dir = Path(local_dir)
        self.where = f"{http.base_url} (the server's storage)"

    def request(self, path: str, message: Any, *, ordered: bool = False, label: str | None = None) -> Any:
        """Send `message`; `ordered` calls run on the model in this client's order and are billed as `label`."""
        label = label or path.rsplit("/", 1)[-1]
        reply = decode_message(self.http.post(path, encode_message(message), label=label, ordered=ordered))
        if isinstance(reply, ErrorReply):
            raise_error_reply(reply, where=f"{self.http.base_url}{path}")
        return reply

    def create(self, run_id: str, config: dict) -> "RemoteCoordinator":
        return RemoteCoordinator(self, run_id, "create", {"config": config})

    def open(self, run_id: str, *, limits: dict | None = None) -> "RemoteCoordinator":
        """Open a run to drive it; `limits` (max_compute_seconds, max_cost_usd) is its budget from now on, which the
        server holds (server/run_budgets.py): a resume that raised it can work at once."""
        return RemoteCoordinator(self, run_id, "open", {} if limits is None else {"limits": limits})

    def list(self, name: str | None = None) -> list[RunState]:
        """The caller's runs on the server (another tenant's are never listed), newest first."""
        reply = self.request("/v1/runs/list", RunListRequest(name))
        _expect(reply, RunList)
        return [RunState.from_dict(run) for run in reply.runs]

    def latest_run_id(self, name: str) -> str:
        return newest_run_id(self.list(name), name, self.where)

    def run_dir(self, run_id: str) -> Path:
        return self.local_dir / "runs" / validate_run_id(run_id)

    def checkpoints(
        self, run_id: str, keep_last: int | None = None, coordinator: "RemoteCoordinator | None" = None
    ) -> "ServerCheckpoints":
        return ServerCheckpoints(self, run_id, keep_last, coordinator)


class RemoteCoordinator:
    """A run's coordinator on the server, with the methods (and `state`) of `Coordinator`."""

    def __init__(self, host: ServerRunHost, run_id: str, opening: str, args: dict):
        self.host = host
        self.run_id = validate_run_id(run_id)
        self.lease: str | None = None
        self.state: RunState
        self._call(opening, **args)

    def _call(self, method: str, **args: Any) -> RunReply:
        reply = self.host.request(f"/v1/runs/call/{method}", RunCall(self.run_id, args, self.lease))
        _expect(reply, RunReply)
        self.state = RunState.from_dict(reply.state)
        self.lease = reply.lease or self.lease
        return reply

    def begin_rollout(self, step: int, participants: Sequence[str] = ("default",)) -> None:
        self._call("begin_rollout", step=step, participants=list(participants))

    def submit_rollout(self, step: int, participant: str) -> None:
        self._call("submit_rollout", step=step, participant=participant)

    def wait_rollouts(self, step: int, timeout: float | None = None) -> None:
        s = self.state
        if s.step == step and s.phase == Phase.ROLLOUT and not s.missing_rollouts():
            return  # the last reply already showed the barrier complete; it cannot reopen within a step
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:  # each call is one server-side poll; the deadline is ours alone
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            if self._call("wait_rollouts", step=step, timeout=remaining).done:
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise BarrierTimeout(
                    f"rollouts of step {step} did not complete within {timeout}s; "
                    f"still missing: {self.state.missing_rollouts()} (submitted: {self.state.rollouts_submitted})",
                    hint="check that those rollout workers are alive and call submit_rollout, or raise the timeout",
                )

    def begin_update(self, step: int) -> None:
        self._call("begin_update", step=step)

    def commit_update(self, step: int, metrics: dict | None = None) -> None:
        self._call("commit_update", step=step, metrics=metrics)

    def record_checkpoint(self, step: int) -> None:
        if self.state.last_checkpoint_step != step:  # the server records the checkpoints it saves itself
            self._call("record_checkpoint", step=step)

    def reset_to_checkpoint(self, step: int, config: dict | None = None) -> None:
        self._call("reset_to_checkpoint", step=step, config=config)

    def finish(self, status: str = "finished", summary: dict | None = None) -> None:
        self._call("finish", status=status, summary=summary)

    def heartbeat(self, interval: float) -> None:
        # Sent from the heartbeat thread: its reply's state is not kept, so it can never
        # replace a newer state that the driving thread got meanwhile.
        reply = self.host.request("/v1/runs/call/heartbeat", RunCall(self.run_id, {"interval": interval}, self.lease))
        _expect(reply, RunReply)

    def refresh(self) -> RunState:
        """Re-read the run's state from the server."""
        self._call("state")
        return self.state


class ServerCheckpoints:
    """A run's checkpoints on the server: it reads the adapters off its own worker and stores them.

    With the run's `coordinator` (its driver's lease) it saves and resumes; without, it only loads."""

    def __init__(self, host: ServerRunHost, run_id: str, keep_last: int | None, coordinator: RemoteCoordinator | None):
        self.host = host
        self.run_id = validate_run_id(run_id)
        self.keep_last = keep_last
        self.coordinator = coordinator

    def save(
        self, step: int, policies: list[CheckpointPolicy], files: dict[str, bytes], metadata: dict, *, background: bool = False
    ) -> None:
        # Always synchronous: the server snapshots and writes in one request, which must stay ordered
        # with this client's updates; the transfer is small (adapters never leave the server).
        lease = self.coordinator.lease if self.coordinator else None
        request = SaveCheckpointRequest(self.run_id, lease or "", step, policies, files, metadata, self.keep_last)
        # Ordered: the save must see every update this client sent before it.
        reply = self.host.request("/v1/runs/checkpoint/save", request, ordered=True, label="save_checkpoint")
        _expect(reply, RunReply)
        if self.coordinator is not None:
            self.coordinator.state = RunState.from_dict(reply.state)  # now naming this checkpoint

    def flush(self) -> None:
        """Nothing in flight: `save` returns once the server committed."""

    def restore(
        self, policies: list[CheckpointPolicy], client_files: list[str], step: int | None = None, *, driver: bool = True
    ) -> RestoredCheckpoint:
        # The server tells the driver from a reader by the lease: only the run's driver holds one.
        lease = self.coordinator.lease if self.coordinator and driver else None
        request = RestoreCheckpointRequest(self.run_id, lease, policies, client_files, self.keep_last, step)
        reply = self.host.request("/v1/runs/checkpoint/restore", request, ordered=True, label="restore_checkpoint")
        _expect(reply, RestoredCheckpoint)
        for message in reply.warnings:  # corrupt checkpoints the server skipped: as loud here as in a local run
            warnings.warn(f"{self.host.http.base_url}: {message}", RuntimeWarning, stacklevel=2)
        return reply


def _expect(reply: Any, kind: type) -> None:
    if not isinstance(reply, kind):
        raise ProtocolError(
            f"the server answered a {type(reply).__name__} where a {kind.__name__} was expected",
            hint="client and server run different tinkerless versions; install the same version on both",
        )
