"""A run's persistent state: plain data that round-trips through JSON.

Kept free of locks and storage handles so it can later be sent over HTTP or
Modal unchanged.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from enum import Enum

from tinkerless.storage.names import RUN_ID, check_name

RUNS_PREFIX = "runs"
STATE_FILE = "state.json"
STATUSES = ("running", "finished", "failed", "interrupted")



class Phase(str, Enum):
    IDLE = "idle"  # between steps: the next rollout may begin
    ROLLOUT = "rollout"  # collecting this step's rollouts from participants
    UPDATE = "update"  # all rollouts in; the policy update is running
    DONE = "done"  # run finished
    FAILED = "failed"  # run failed
    INTERRUPTED = "interrupted"  # stopped by Ctrl-C / SIGTERM; resumable from its last checkpoint


@dataclass
class RunState:
    run_id: str
    step: int = 0
    policy_version: int = 0
    phase: Phase = Phase.IDLE
    status: str = "running"  # running | finished | failed | interrupted
    config: dict = field(default_factory=dict)
    last_checkpoint_step: int | None = None
    created_at: float = 0.0
    updated_at: float = 0.0
    summary: dict = field(default_factory=dict)  # e.g. last metrics, cost
    # The rollout barrier of the current step; persisted so a restarted
    # coordinator knows who still owes rollouts.
    rollout_participants: list[str] = field(default_factory=list)
    rollouts_submitted: list[str] = field(default_factory=list)
    # The driving process renews `heartbeat_at` every `heartbeat_interval` seconds, so a run whose
    # process is gone (SIGKILL, a lost machine) can be told from one that is still working.
    heartbeat_at: float = 0.0
    heartbeat_interval: float = 0.0  # 0: no heartbeat (runs written before heartbeats existed)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["phase"] = self.phase.value
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "RunState":
        """Build from `to_dict()` output; unknown keys (from newer versions) are ignored."""
        if not isinstance(d, dict) or not isinstance(d.get("run_id"), str):
            raise ValueError("run state must be an object with a string 'run_id'")
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known}
        kwargs["phase"] = Phase(kwargs.get("phase", Phase.IDLE.value))
        state = cls(**kwargs)
        if not isinstance(state.step, int) or not isinstance(state.policy_version, int):
            raise ValueError("'step' and 'policy_version' must be integers")
        if state.status not in STATUSES:
            raise ValueError(f"unknown status {state.status!r}")
        state.rollout_participants = list(state.rollout_participants)
        state.rollouts_submitted = list(state.rollouts_submitted)
        return state

    def heartbeat_stale(self, now: float) -> bool:
        """True when a running run's driver missed several heartbeats: its process is gone."""
        if self.status != "running" or self.heartbeat_interval <= 0:
            return False
        return now - self.heartbeat_at > stale_after(self.heartbeat_interval)

    def missing_rollouts(self) -> list[str]:
        """Participants of the current rollout barrier that have not submitted yet."""
        done = set(self.rollouts_submitted)
        return [p for p in self.rollout_participants if p not in done]


def stale_after(interval: float) -> float:
    """Seconds without a heartbeat after which a running run counts as interrupted: a few missed
    beats, so a slow storage write or a busy machine does not make a live run look dead."""
    return 4 * interval + 5.0


def validate_run_id(run_id: str) -> str:
    """Run ids become one storage key part, so they must be a plain, safe name."""
    return check_name(run_id, RUN_ID)


def run_prefix(run_id: str) -> str:
    return f"{RUNS_PREFIX}/{validate_run_id(run_id)}"


def state_key(run_id: str) -> str:
    return f"{run_prefix(run_id)}/{STATE_FILE}"


def checkpoint_prefix(run_id: str) -> str:
    """Where a run's CheckpointStore lives."""
    return f"{run_prefix(run_id)}/checkpoints"
