"""What an RL run's checkpoint holds, how `train()` writes one and how a resume reads it back.

A checkpoint holds every trained policy (`CheckpointPolicy`: its adapter and optimizer state, the single-agent
policy at the top in PEFT's layout, the others under `policies/<name>/`) and the client's own state
(`CLIENT_STATE_FILE`): the step, the task cursor, the policy versions and both RNG states, so a resumed run
draws exactly what the uninterrupted run would have drawn. `Checkpoints` keeps one write in flight, committed
in the coordinator once storage has it.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tinkerless.sdk.backends.client import TrainingClient
from tinkerless.sdk.backends.run_host import RunCheckpoints
from tinkerless.wire.runs import CheckpointPolicy

CLIENT_STATE_FILE = "client.json"


@dataclass
class ClientState:
    """Where a restored run goes on from (the RNGs are already set back when `Checkpoints.restore` returns it)."""

    step: int
    cursor: int
    policy_versions: dict[str, int]
    reader_versions: list[int] = field(default_factory=list)  # older versions kept for steps ahead (`pipeline`)


class Checkpoints:
    """The checkpoints of one run in `store`, committed through the run's `coordinator`."""

    def __init__(self, store: RunCheckpoints, coordinator: Any):
        self.store = store
        self.coordinator = coordinator
        self.in_flight: int | None = None  # the step whose checkpoint is being written

    def save(self, step: int, cursor: int, clients: dict[str, TrainingClient], policy_versions: dict[str, int],
             run_id: str, readers: list[CheckpointPolicy] = ()) -> None:
        """`readers`: older policy versions the steps after `step` sample from (an async run's, `pipeline`)."""
        # The client state is taken before waiting on the previous write, as the step left it.
        numpy_state = np.random.get_state()
        client_state = {
            "step": step,
            "cursor": cursor,
            "policy_versions": policy_versions,
            "reader_versions": sorted({policy.version for policy in readers}),
            "python_random": random.getstate(),
            "numpy_random": [numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]],
        }
        files = {CLIENT_STATE_FILE: json.dumps(client_state).encode()}
        self.finish()  # one write in flight: the previous one commits first
        # The policies are snapshotted now; the write and its commit overlap the next step.
        self.store.save(step, [*checkpoint_policies(clients, policy_versions), *readers], files, {"run_id": run_id},
                        background=True)
        self.in_flight = step

    def finish(self, *, wait: bool = True) -> float:
        """Record the checkpoint in flight once it is committed (waiting for it unless `wait` is False);
        returns the seconds waited. A failed write raises here, in the loop."""
        if self.in_flight is None or (not wait and getattr(self.store, "busy", False)):
            return 0.0
        started = time.perf_counter()
        self.store.flush()
        step, self.in_flight = self.in_flight, None
        self.coordinator.record_checkpoint(step)
        return time.perf_counter() - started

    def restore(self, clients: dict[str, TrainingClient]) -> ClientState | None:
        """Load the latest valid checkpoint onto `clients` and set the RNGs back; None when there is none."""
        restored = self.store.restore(checkpoint_policies(clients), [CLIENT_STATE_FILE])
        if restored.step is None:
            return None
        client_state = json.loads(restored.files[CLIENT_STATE_FILE])
        random.setstate(_tuplify(client_state["python_random"]))
        # JSON made the numpy state's key array a list and its tuple a list: both go back as they were.
        numpy_random = client_state["numpy_random"]
        np.random.set_state(tuple(numpy_random[:1]) + (np.array(numpy_random[1], dtype=np.uint32),) + tuple(numpy_random[2:]))
        return ClientState(client_state["step"], client_state["cursor"], client_state["policy_versions"],
                           client_state.get("reader_versions", []))


def checkpoint_policies(clients: dict[str, TrainingClient], versions: dict[str, int] | None = None) -> list[CheckpointPolicy]:
    return [
        CheckpointPolicy(name, _policy_prefix(name), client.remote(name), (versions or {}).get(name, 0))
        for name, client in clients.items()
    ]


def _policy_prefix(name: str) -> str:
    """Checkpoint file prefix: the single-agent policy keeps PEFT's layout at the top (step-n/adapter/)."""
    return "" if name == "default" else f"policies/{name}/"


def _tuplify(value: Any) -> Any:
    return tuple(_tuplify(v) for v in value) if isinstance(value, list) else value
