"""The coordinator: owns a run's state and enforces the barrier between phases.

One step is::

    IDLE --begin_rollout--> ROLLOUT --(all participants submit)--> begin_update
         --> UPDATE --commit_update--> IDLE (step + 1, policy_version + 1)

A step's update may only start once every expected participant has submitted
its rollouts, and the next step's rollout only after the update is committed.
Every transition is written to ``runs/<run_id>/state.json`` before it becomes
visible, so a restarted process resumes from the last transition.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from typing import Callable, Sequence

from tinkerless.errors import (
    BarrierTimeout,
    CommitConflict,
    PhaseError,
    PreconditionFailed,
    StorageError,
    StorageNotFound,
    UserError,
)
from tinkerless.coordinator.state import (
    RUNS_PREFIX,
    STATE_FILE,
    STATUSES,
    Phase,
    RunState,
    state_key,
    validate_run_id,
)
from tinkerless.storage.store import ObjectStore

logger = logging.getLogger(__name__)

_RESUME_HINT = "call reset_to_checkpoint(step) to resume from a checkpoint, or create a new run"


class Coordinator:
    """Thread-safe owner of one run's RunState, persisted after every transition."""

    def __init__(self, store: ObjectStore, run_id: str, state: RunState | None = None):
        self.store = store
        self.run_id = validate_run_id(run_id)
        self.key = state_key(run_id)
        # One condition guards the state; waiters on the rollout barrier sleep on it.
        self._cond = threading.Condition(threading.RLock())
        self._version: str | None = None  # of state.json as last read or written, for compare-and-swap
        if state is None:
            state, self._version = _load_state(store, run_id, with_version=True)
        self.state = state

    # -- construction ----------------------------------------------------------

    @classmethod
    def create(cls, store: ObjectStore, run_id: str, config: dict) -> "Coordinator":
        """Start a new run; UserError if a run with this id already exists."""
        key = state_key(run_id)
        exists = UserError(
            f"run {run_id!r} already exists at {store.full_url(key)}",
            hint="resume it with Coordinator.open(store, run_id), or choose another run id",
        )
        if store.exists(key):
            raise exists
        _require_json(config, f"config of run {run_id!r}")
        now = time.time()
        state = RunState(run_id=run_id, config=dict(config or {}), created_at=now, updated_at=now)
        coord = cls(store, run_id, state)
        try:
            coord._persist(create=True)
        except PreconditionFailed:  # another process created it between the check and the write
            raise exists from None
        return coord

    @classmethod
    def open(cls, store: ObjectStore, run_id: str) -> "Coordinator":
        """Load an existing run's coordinator."""
        return cls(store, run_id)

    # -- transitions -------------------------------------------------------------

    def begin_rollout(self, step: int, participants: Sequence[str] = ("default",)) -> None:
        """Open step `step`'s rollout barrier for the given participants."""
        names = list(participants)
        if not names or any(not isinstance(p, str) or not p for p in names) or len(set(names)) != len(names):
            raise UserError(
                f"begin_rollout(step={step}) needs a non-empty list of distinct participant names, got {names!r}",
                hint="pass e.g. ['default'] or one name per rollout worker/agent",
            )

        def apply(s: RunState) -> None:
            self._require_running(s, "begin a rollout")
            if s.phase != Phase.IDLE:
                raise PhaseError(
                    f"cannot begin the rollout of step {step}: run {s.run_id!r} is in phase "
                    f"{s.phase.value!r} of step {s.step}; a rollout may only begin after the previous "
                    "step's update is committed",
                    hint=_next_action_hint(s),
                )
            if step != s.step:
                raise PhaseError(
                    f"cannot begin the rollout of step {step}: run {s.run_id!r} is at step {s.step}",
                    hint=f"begin the rollout of step {s.step}",
                )
            s.phase = Phase.ROLLOUT
            s.rollout_participants = names
            s.rollouts_submitted = []

        self._transition(apply)

    def submit_rollout(self, step: int, participant: str) -> None:
        """Mark `participant`'s rollouts for `step` as done. Re-submitting is a no-op."""

        def apply(s: RunState) -> None:
            self._require_rollout_phase(s, step, f"submit rollouts of participant {participant!r}")
            if participant not in s.rollout_participants:
                raise PhaseError(
                    f"participant {participant!r} is not part of the rollout barrier of step {step} "
                    f"(expected: {s.rollout_participants})",
                    hint="submit under one of the names passed to begin_rollout",
                )
            if participant not in s.rollouts_submitted:
                s.rollouts_submitted.append(participant)

        self._transition(apply)

    def wait_rollouts(self, step: int, timeout: float | None = None) -> None:
        """Block until every participant of `step` has submitted; BarrierTimeout if not in time."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                s = self.state
                if step < s.step or (step == s.step and s.phase == Phase.UPDATE):
                    return  # this step's rollouts were all in already
                if s.phase in (Phase.DONE, Phase.FAILED, Phase.INTERRUPTED):
                    raise PhaseError(
                        f"stopped waiting for the rollouts of step {step}: run {s.run_id!r} is {s.status}",
                        hint=_RESUME_HINT,
                    )
                if step != s.step or s.phase != Phase.ROLLOUT:
                    raise PhaseError(
                        f"cannot wait for the rollouts of step {step}: run {s.run_id!r} is in phase "
                        f"{s.phase.value!r} of step {s.step}, so no rollout of step {step} is open",
                        hint=f"call begin_rollout({s.step}, participants) first",
                    )
                missing = s.missing_rollouts()
                if not missing:
                    return
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise BarrierTimeout(
                        f"rollouts of step {step} did not complete within {timeout}s; "
                        f"still missing: {missing} (submitted: {s.rollouts_submitted})",
                        hint="check that those rollout workers are alive and call submit_rollout, "
                        "or raise the timeout",
                    )
                self._cond.wait(remaining)

    def begin_update(self, step: int) -> None:
        """Start step `step`'s policy update; all its rollouts must be in."""

        def apply(s: RunState) -> None:
            self._require_rollout_phase(s, step, "begin the update")
            missing = s.missing_rollouts()
            if missing:
                raise PhaseError(
                    f"cannot begin the update of step {step}: rollouts from {missing} are not in yet "
                    "(an update may only start after all of its step's rollouts are submitted)",
                    hint="call wait_rollouts(step) before begin_update(step)",
                )
            s.phase = Phase.UPDATE

        self._transition(apply)

    def commit_update(self, step: int, metrics: dict | None = None) -> None:
        """Finish step `step`'s update: policy_version and step advance, phase back to IDLE."""
        _require_json(metrics, f"metrics of step {step}")

        def apply(s: RunState) -> None:
            self._require_running(s, "commit an update")
            if s.phase != Phase.UPDATE or step != s.step:
                raise PhaseError(
                    f"cannot commit the update of step {step}: run {s.run_id!r} is in phase "
                    f"{s.phase.value!r} of step {s.step}; only a begun update can be committed",
                    hint=_next_action_hint(s),
                )
            s.policy_version += 1
            s.step += 1
            s.phase = Phase.IDLE
            s.rollout_participants = []
            s.rollouts_submitted = []
            if metrics is not None:
                s.summary["last_metrics"] = dict(metrics)
            s.summary["last_committed_step"] = step

        self._transition(apply)

    def record_checkpoint(self, step: int) -> None:
        """Note that a checkpoint of the policy at `step` was saved."""

        def apply(s: RunState) -> None:
            if not isinstance(step, int) or step < 0 or step > s.step:
                raise PhaseError(
                    f"cannot record a checkpoint for step {step}: run {s.run_id!r} is at step {s.step}",
                    hint="record the step a checkpoint was saved at after its update was committed "
                    "(0 <= step <= current step)",
                )
            s.last_checkpoint_step = step

        self._transition(apply)

    def reset_to_checkpoint(self, step: int, config: dict | None = None) -> None:
        """On resume: rewind to checkpoint `step` (phase IDLE, policy_version = step).

        `config` replaces the stored run config (a resumed run may ask for more steps)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise UserError(
                f"reset_to_checkpoint needs a non-negative integer step, got {step!r}",
                hint="pass the step of the checkpoint you loaded (CheckpointStore.latest_step())",
            )

        def apply(s: RunState) -> None:
            s.step = step
            s.policy_version = step
            s.phase = Phase.IDLE
            s.status = "running"
            s.heartbeat_at = time.time()  # a resumed run is alive now, whatever its last attempt left
            s.last_checkpoint_step = step
            s.rollout_participants = []
            s.rollouts_submitted = []
            if config is not None:
                s.config = dict(config)

        _require_json(config, "config of the resumed run")
        self._transition(apply)

    def finish(self, status: str = "finished", summary: dict | None = None) -> None:
        """End the run as finished, failed or interrupted, merging `summary` into the state's summary."""
        if status not in STATUSES or status == "running":
            raise UserError(
                f"finish() status must be 'finished', 'failed' or 'interrupted', got {status!r}",
                hint="use finish('failed', {...}) when the run errored, finish('interrupted') when it was stopped",
            )
        _require_json(summary, "finish summary")

        def apply(s: RunState) -> None:
            s.status = status
            s.phase = {"finished": Phase.DONE, "interrupted": Phase.INTERRUPTED}.get(status, Phase.FAILED)
            s.summary.update(summary or {})

        self._transition(apply)

    def heartbeat(self, interval: float) -> None:
        """The driver is alive and beats every `interval` seconds; a run that stopped running ignores it."""
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0 < interval <= 86400:
            raise UserError(
                f"heartbeat needs an interval in seconds (0 < interval <= 86400), got {interval!r}",
                hint="send the seconds between your heartbeats, e.g. 30",
            )

        def apply(s: RunState) -> None:
            if s.status == "running":
                s.heartbeat_at = time.time()
                s.heartbeat_interval = float(interval)

        self._transition(apply)

    # -- internals ---------------------------------------------------------------

    def _transition(self, apply: Callable[[RunState], None]) -> None:
        """Apply a change, persist it, and only then publish it; roll back if persisting fails."""
        with self._cond:
            before = copy.deepcopy(self.state)
            try:
                apply(self.state)
                self.state.updated_at = time.time()
                self._persist()
            except BaseException:
                self.state = before
                raise
            self._cond.notify_all()

    def _persist(self, create: bool = False) -> None:
        data = json.dumps(self.state.to_dict(), indent=1, sort_keys=True).encode()
        if not self.store.supports_conditional_writes:
            self.store.put(self.key, data)  # best effort: this store cannot detect a second coordinator
            return
        # Compare-and-swap on the state we last wrote or read: a second coordinator driving the
        # same run (two processes resumed the same run id) is caught instead of overwritten.
        match = None if create else self._version
        try:
            self._version = self.store.put_if(self.key, data, match=match)
        except PreconditionFailed:
            if create:
                raise
            raise CommitConflict(
                f"the state of run {self.run_id!r} was changed by another process while this one was driving it",
                hint="two processes are running the same run id; stop one, then resume the run from its checkpoint",
            ) from None

    @staticmethod
    def _require_running(s: RunState, action: str) -> None:
        if s.status != "running":
            raise PhaseError(f"cannot {action}: run {s.run_id!r} is {s.status}", hint=_RESUME_HINT)

    def _require_rollout_phase(self, s: RunState, step: int, action: str) -> None:
        self._require_running(s, action)
        if s.phase != Phase.ROLLOUT or step != s.step:
            raise PhaseError(
                f"cannot {action} for step {step}: run {s.run_id!r} is in phase {s.phase.value!r} "
                f"of step {s.step}; that needs the rollout of step {step} to be open",
                hint=_next_action_hint(s),
            )


def _next_action_hint(s: RunState) -> str:
    if s.phase == Phase.IDLE:
        return f"call begin_rollout({s.step}, participants) next"
    if s.phase == Phase.ROLLOUT:
        return f"wait_rollouts({s.step}) then begin_update({s.step}) next"
    if s.phase == Phase.UPDATE:
        return f"call commit_update({s.step}) next"
    return _RESUME_HINT


def _require_json(value: object, what: str) -> None:
    try:  # as `_persist` writes it: sorted keys (a map mixing int and str keys cannot be sorted)
        json.dumps(value, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise UserError(
            f"{what} is not JSON-serializable: {e}",
            hint="use only str/int/float/bool/None, lists and dicts (convert tensors with .item())",
        ) from e


def _load_state(store: ObjectStore, run_id: str, with_version: bool = False):
    """The run's state (and, with `with_version`, the version of state.json it was read at)."""
    key = state_key(run_id)
    version = None
    try:
        if with_version and store.supports_conditional_writes:
            raw, version = store.get_with_version(key)
        else:
            raw = store.get(key)
    except StorageNotFound:
        raise UserError(
            f"run {run_id!r} does not exist at {store.full_url(key)}, so there is nothing to resume",
            hint="to start it, run without --resume (resume=False); to resume an existing run, pick its id "
            "from `tinkerless runs` (with the same --storage or server)",
        ) from None
    try:
        state = RunState.from_dict(json.loads(raw))
    except (ValueError, TypeError) as e:
        raise StorageError(
            f"state of run {run_id!r} at {store.full_url(key)} is unreadable: {e}",
            hint="restore the file from a backup, or start a new run id",
        ) from e
    if state.run_id != run_id:
        raise StorageError(
            f"state at {store.full_url(key)} belongs to run {state.run_id!r}, not {run_id!r}",
            hint="the runs directory was edited by hand; move the state back or start a new run id",
        )
    return (state, version) if with_version else state


def list_runs(store: ObjectStore) -> list[RunState]:
    """Every run in the store, newest first; unreadable state files are skipped with a log warning.

    A run still marked running whose heartbeat is stale is listed as interrupted (the stored
    state is left as it is: resuming the run is what changes it)."""
    runs: list[RunState] = []
    for key in store.list(RUNS_PREFIX):
        parts = key.split("/")
        if len(parts) != 3 or parts[2] != STATE_FILE:
            continue
        try:
            runs.append(_load_state(store, parts[1]))
        except (StorageError, UserError) as e:
            logger.warning("skipping run %r in listing: %s", parts[1], e)
    now = time.time()
    for run in runs:
        if run.heartbeat_stale(now):  # its driver is gone without saying so (SIGKILL, a lost machine)
            run.status, run.phase = "interrupted", Phase.INTERRUPTED
    runs.sort(key=lambda s: (s.created_at, s.updated_at), reverse=True)
    return runs
