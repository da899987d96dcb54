"""Run coordination: `Coordinator` owns a run's `RunState` (step, policy
version, `Phase`), enforces the rollout -> update barrier across a set of
expected participants, and persists every transition to
``runs/<run_id>/state.json`` so a restarted process resumes; `list_runs`
lists the runs in a store; `policy_checkpoints` lays a run's policies out in
one checkpoint (used by the client and by `tinkerless serve` alike).
"""

from tinkerless.coordinator.coordinator import Coordinator, list_runs
from tinkerless.coordinator.state import Phase, RunState, checkpoint_prefix, run_prefix, state_key

__all__ = ["Coordinator", "Phase", "RunState", "checkpoint_prefix", "list_runs", "run_prefix", "state_key"]
