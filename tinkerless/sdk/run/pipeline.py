"""Rollouts that run ahead of the update, under a staleness bound (`TrainConfig.max_staleness`).

With k = max_staleness ≥ 1 the rollouts of step s sample from exactly policy version max(0, s − k): the adapters
after the updates of the steps before it. They start as soon as that version exists, so while step s − 1 is
updating, the rollouts of steps s … s − 1 + k are already sampling. Because each step's version is fixed by its
number (never "whatever is newest"), a run is the same for a seed however the phases interleave, and it resumes
exactly. The importance-sampling losses correct the staleness with the sampler's recorded log-probs
(`tis_cap` truncates the ratio), and each step's record says the staleness it used.

`Readers` keeps the versions: a frozen copy of every trained policy at each version a pending step still samples
from, made on the backend with `save_state` + `load_state` (so a reader in another process or container takes
it through the proven version hand-off, `functions.handoff`). `RolloutPipeline` runs the rollouts of steps in
order on one background thread. The coordinator's barriers keep their meaning: a step's rollouts are submitted
to it when the loop takes them, so an update of one policy never sees rollouts of a later step.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from tinkerless.coordinator.policy_checkpoints import READERS_PREFIX
from tinkerless.errors import ConfigError
from tinkerless.functions.handoff import adapter_files
from tinkerless.sdk.backends.client import TrainingClient, rollout_multi_as
from tinkerless.wire.messages import MultiAgentRolloutRequest, RolloutRequest, RolloutResult, Seat
from tinkerless.wire.runs import CheckpointPolicy


def version_for(step: int, staleness: int) -> int:
    """The policy version step `step` samples from: the adapters after the updates of steps < that version."""
    return max(0, step - staleness)


class Readers:
    """Frozen copies of the trained policies at past versions, on the backend, under their own namespace."""

    def __init__(self, writers: dict[str, TrainingClient], namespace: str):
        self.writers, self.namespace = writers, namespace
        self.held: dict[int, dict[str, TrainingClient]] = {}  # version -> policy -> its reader

    def publish(self, version: int) -> None:
        """Copy every writer as it is now (after the update of step `version` − 1) as `version`'s readers."""
        if version in self.held:
            return
        self.held[version] = {}
        for name, writer in self.writers.items():
            state = writer.save_state(include_optimizer=False)
            state.files = adapter_files(state.files)
            reader = self._client(name, version)
            reader.load_state(state, include_optimizer=False)
            self.held[version][name] = reader

    def open(self, step: int, staleness: int, kept: list[int],
             load: Callable[[list[CheckpointPolicy]], Any]) -> None:
        """The versions the steps from `step` on sample from: older ones from the checkpoint that holds them
        (`kept`, loaded with `load`), `step`'s own copied from the writers."""
        older = range(version_for(step, staleness), step)
        missing = [v for v in older if v not in kept]
        if missing:
            raise ConfigError(
                f"the checkpoint at step {step} does not hold policy versions {missing}, which steps {step}.."
                f"{step + staleness - 1} sample from with max_staleness={staleness}",
                hint="resume with the max_staleness the run was started with (see its config in the run state)")
        for version in older:
            self.restore(version, load)
        self.publish(step)

    def restore(self, version: int, load: Callable[[list[CheckpointPolicy]], Any]) -> None:
        """`version`'s readers loaded from a checkpoint (`load` fills the given policies' remotes)."""
        self.held[version] = {name: self._client(name, version) for name in self.writers}
        load(self.checkpoint_policies([version]))

    def retire(self, below: int) -> None:
        """Free the readers of versions no pending step samples from any more."""
        for version in [v for v in self.held if v < below]:
            for reader in self.held.pop(version).values():
                reader.delete()

    def close(self) -> None:
        self.retire(below=1 << 62)

    def view(self, version: int) -> "VersionView":
        return VersionView(self.held[version], next(iter(self.writers.values())))

    def checkpoint_policies(self, versions: list[int]) -> list[CheckpointPolicy]:
        """The readers of `versions` as checkpoint entries (`readers/v<version>/<policy>/`)."""
        return [CheckpointPolicy(f"v{version}-{name}", f"{READERS_PREFIX}v{version}/{name}/", reader.remote(name), version)
                for version in versions for name, reader in self.held[version].items()]

    def _client(self, name: str, version: int) -> TrainingClient:
        # "_v": a writer's remote name is "<namespace>-<policy>", so no reader's can equal one
        return TrainingClient(self.writers[name].backend, policy=name, create=False,
                              namespace=f"{self.namespace}_v{version}")


class VersionView:
    """The rollout calls of one version: trained policies answer from their readers, frozen ones as before."""

    def __init__(self, readers: dict[str, TrainingClient], any_writer: TrainingClient):
        self.readers, self.any_writer = readers, any_writer

    def rollout(self, request: RolloutRequest) -> RolloutResult:
        return self.readers[request.policy].rollout(request)

    def rollout_multi(self, request: MultiAgentRolloutRequest) -> RolloutResult:
        def remote(seat: Seat) -> str | None:
            client = self.readers.get(seat.policy) if seat.trainable else None
            return (client or self.any_writer).remote(seat.policy)

        return rollout_multi_as(self.any_writer.backend, request, remote)


class RolloutPipeline:
    """Each step's rollouts, started in step order on one background thread once their version exists.

    `play(step, view)` runs step `step`'s rollouts through `view` and returns what the loop needs of them."""

    def __init__(self, staleness: int, steps: int, readers: Readers, play: Callable[[int, VersionView], Any],
                 first_step: int = 0):
        """`first_step`: a fresh run's 0 or a resumed run's step (the versions it samples from must be held)."""
        self.staleness, self.steps, self.readers, self.play = staleness, steps, readers, play
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinkerless-rollouts")
        self._futures: dict[int, Future] = {}
        self._next = first_step  # the next step whose rollouts are not started yet

    def fill(self, current: int) -> None:
        """Start the rollouts of every step up to `current` + k whose version is held."""
        last = min(current + self.staleness, self.steps - 1)
        while self._next <= last and version_for(self._next, self.staleness) in self.readers.held:
            step, view = self._next, self.readers.view(version_for(self._next, self.staleness))
            self._futures[step] = self._thread.submit(self.play, step, view)
            self._next += 1

    def take(self, step: int) -> Any:
        """Step `step`'s rollouts (waiting for them); a failure raises here, in the loop."""
        self.fill(step)
        return self._futures.pop(step).result()

    def versions_needed(self, step: int) -> list[int]:
        """The versions the steps from `step` on sample from that are older than `step` itself (a checkpoint at
        `step` keeps them: its writers hold version `step`)."""
        first = version_for(step, self.staleness)
        return [v for v in range(first, step) if v in self.readers.held]

    def close(self, wait: bool = True) -> None:
        """Start no more rollouts; the ones running finish (waited for unless `wait` is False) and are dropped."""
        self._thread.shutdown(wait=wait, cancel_futures=True)
        self._futures.clear()
