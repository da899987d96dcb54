"""Coordinator phases, rollout barrier and persistence against a real local store."""

from __future__ import annotations

import json
import threading
import time

import pytest

from tinkerless.coordinator import Coordinator, Phase, RunState, list_runs
from tinkerless.errors import BarrierTimeout, PhaseError, UserError
from tinkerless.storage import ObjectStore


@pytest.fixture
def store(tmp_path) -> ObjectStore:
    return ObjectStore(str(tmp_path))


def run_one_step(coord: Coordinator, step: int, participants=("default",)) -> None:
    coord.begin_rollout(step, list(participants))
    for p in participants:
        coord.submit_rollout(step, p)
    coord.wait_rollouts(step, timeout=1)
    coord.begin_update(step)
    coord.commit_update(step, {"reward": float(step)})


def test_phase_ordering(store):
    coord = Coordinator.create(store, "r1", {"lr": 1e-4})
    s = coord.state
    assert (s.step, s.policy_version, s.phase, s.status) == (0, 0, Phase.IDLE, "running")

    coord.begin_rollout(0, ["a", "b"])
    assert coord.state.phase == Phase.ROLLOUT
    coord.submit_rollout(0, "a")
    coord.submit_rollout(0, "a")  # idempotent
    coord.submit_rollout(0, "b")
    coord.wait_rollouts(0, timeout=0)
    coord.begin_update(0)
    assert coord.state.phase == Phase.UPDATE
    coord.wait_rollouts(0)  # already past the barrier: returns at once
    coord.commit_update(0, {"loss": 0.25})
    s = coord.state
    assert (s.step, s.policy_version, s.phase) == (1, 1, Phase.IDLE)
    assert s.summary["last_metrics"] == {"loss": 0.25}
    assert s.rollout_participants == [] and s.rollouts_submitted == []

    run_one_step(coord, 1)
    assert (coord.state.step, coord.state.policy_version) == (2, 2)


def test_barrier_violations_raise_phase_error(store):
    coord = Coordinator.create(store, "r1", {})
    with pytest.raises(PhaseError, match="at step 0"):
        coord.begin_rollout(1)  # wrong step
    with pytest.raises(PhaseError, match="rollout of step 0 to be open"):
        coord.begin_update(0)  # no rollout yet
    with pytest.raises(PhaseError):
        coord.commit_update(0)  # no update begun

    coord.begin_rollout(0, ["a", "b"])
    with pytest.raises(PhaseError, match="phase 'rollout'"):
        coord.begin_rollout(0)  # previous step not committed
    coord.submit_rollout(0, "a")
    with pytest.raises(PhaseError, match=r"rollouts from \['b'\] are not in yet") as info:
        coord.begin_update(0)
    assert "wait_rollouts" in info.value.hint
    with pytest.raises(PhaseError, match="not part of the rollout barrier"):
        coord.submit_rollout(0, "intruder")
    with pytest.raises(PhaseError):
        coord.submit_rollout(1, "b")  # wrong step
    with pytest.raises(UserError):
        coord.begin_rollout(0, [])

    # Failed transitions change nothing, in memory or on disk.
    assert coord.state.phase == Phase.ROLLOUT and coord.state.rollouts_submitted == ["a"]
    assert Coordinator.open(store, "r1").state.to_dict() == coord.state.to_dict()


def test_wait_rollouts_returns_when_thread_submits(store):
    coord = Coordinator.create(store, "r1", {})
    coord.begin_rollout(0, ["w1", "w2"])

    def worker(name: str, delay: float) -> None:
        time.sleep(delay)
        coord.submit_rollout(0, name)

    threads = [
        threading.Thread(target=worker, args=("w1", 0.05)),
        threading.Thread(target=worker, args=("w2", 0.15)),
    ]
    for t in threads:
        t.start()
    started = time.monotonic()
    coord.wait_rollouts(0, timeout=10)
    elapsed = time.monotonic() - started
    for t in threads:
        t.join()
    assert 0.1 <= elapsed < 5
    assert sorted(coord.state.rollouts_submitted) == ["w1", "w2"]
    coord.begin_update(0)


def test_wait_rollouts_timeout_names_missing(store):
    coord = Coordinator.create(store, "r1", {})
    coord.begin_rollout(0, ["fast", "slow"])
    coord.submit_rollout(0, "fast")
    started = time.monotonic()
    with pytest.raises(BarrierTimeout) as info:
        coord.wait_rollouts(0, timeout=0.2)
    assert time.monotonic() - started >= 0.19
    assert "'slow'" in info.value.message and "missing" in info.value.message
    assert "still missing: ['slow']" in str(info.value)


def test_wait_rollouts_wrong_step_or_finished(store):
    coord = Coordinator.create(store, "r1", {})
    with pytest.raises(PhaseError, match="no rollout of step 0 is open"):
        coord.wait_rollouts(0, timeout=0)
    coord.begin_rollout(0, ["a"])

    def fail_later() -> None:
        time.sleep(0.05)
        coord.finish("failed", {"error": "worker crashed"})

    t = threading.Thread(target=fail_later)
    t.start()
    with pytest.raises(PhaseError, match="failed"):
        coord.wait_rollouts(0, timeout=10)  # woken by finish, not by the timeout
    t.join()


def test_state_persisted_and_reopened(store):
    coord = Coordinator.create(store, "r1", {"model": "smollm2"})
    run_one_step(coord, 0)
    coord.record_checkpoint(1)
    coord.begin_rollout(1, ["a", "b"])
    coord.submit_rollout(1, "a")

    on_disk = json.loads(store.get("runs/r1/state.json"))
    assert on_disk["phase"] == "rollout" and on_disk["step"] == 1

    # A restarted process sees exactly the same state, barrier included.
    again = Coordinator.open(store, "r1")
    s = again.state
    assert (s.step, s.policy_version, s.phase, s.last_checkpoint_step) == (1, 1, Phase.ROLLOUT, 1)
    assert s.config == {"model": "smollm2"}
    assert s.rollout_participants == ["a", "b"] and s.rollouts_submitted == ["a"]
    assert s.created_at == coord.state.created_at and s.updated_at >= s.created_at
    again.submit_rollout(1, "b")
    again.begin_update(1)
    again.commit_update(1)
    assert Coordinator(store, "r1").state.step == 2


def test_reset_to_checkpoint_and_finish(store):
    coord = Coordinator.create(store, "r1", {})
    for step in range(3):
        run_one_step(coord, step)
    coord.record_checkpoint(2)
    with pytest.raises(PhaseError):
        coord.record_checkpoint(9)  # ahead of the run
    coord.begin_rollout(3)  # crash mid-step, then resume from checkpoint 2
    resumed = Coordinator.open(store, "r1")
    resumed.reset_to_checkpoint(2)
    s = resumed.state
    assert (s.step, s.policy_version, s.phase, s.last_checkpoint_step) == (2, 2, Phase.IDLE, 2)
    run_one_step(resumed, 2)

    resumed.finish(summary={"final_reward": 1.0})
    s = Coordinator.open(store, "r1").state
    assert (s.status, s.phase, s.summary["final_reward"]) == ("finished", Phase.DONE, 1.0)
    with pytest.raises(PhaseError, match="finished"):
        resumed.begin_rollout(3)
    with pytest.raises(UserError):
        resumed.finish("running")


def test_create_twice_fails_and_open_missing(store):
    Coordinator.create(store, "r1", {})
    with pytest.raises(UserError, match="already exists") as info:
        Coordinator.create(store, "r1", {})
    assert "open" in info.value.hint and "another run id" in info.value.hint
    with pytest.raises(UserError, match="does not exist") as info:
        Coordinator.open(store, "nope")
    assert "without --resume" in info.value.hint and "tinkerless runs" in info.value.hint
    for bad in ("../escape", "a/b", "", ".hidden"):
        with pytest.raises(UserError, match="invalid run id"):
            Coordinator.create(store, bad, {})
    with pytest.raises(UserError, match="JSON"):
        Coordinator.create(store, "r2", {"fn": object()})
    assert not store.exists("runs/r2/state.json")


def test_list_runs(store):
    assert list_runs(store) == []
    first = Coordinator.create(store, "first", {})
    time.sleep(0.01)
    Coordinator.create(store, "second", {})
    run_one_step(first, 0)  # more recent activity does not reorder by creation
    store.put("runs/broken/state.json", b"{oops")
    store.put("runs/first/checkpoints/step-1/state.json", b"{}")  # not a run state
    runs = list_runs(store)
    assert [r.run_id for r in runs] == ["second", "first"]
    assert isinstance(runs[1], RunState) and runs[1].step == 1


def test_run_state_dict_round_trip():
    s = RunState(run_id="x", step=3, policy_version=3, phase=Phase.UPDATE, config={"a": 1}, summary={"m": 2})
    d = s.to_dict()
    assert d["phase"] == "update"
    json.dumps(d)  # plain data
    assert RunState.from_dict(d) == s
    assert RunState.from_dict({**d, "from_a_newer_version": True}) == s
    with pytest.raises(ValueError):
        RunState.from_dict({"step": 1})


def test_two_coordinators_driving_one_run_are_caught(tmp_path):
    from tinkerless.errors import CommitConflict

    store = ObjectStore(str(tmp_path))
    first = Coordinator.create(store, "shared", {})
    second = Coordinator.open(store, "shared")  # a second process resumed the same run id
    first.begin_rollout(0, ["p"])
    with pytest.raises(CommitConflict, match="another process"):
        second.begin_rollout(0, ["p"])  # its view of state.json is stale: refused, not overwritten
    assert Coordinator.open(store, "shared").state.phase == first.state.phase
