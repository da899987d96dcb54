"""`TrainingClient`: Tinker-style primitives on one policy (a LoRA adapter and its optimizer).

A power user can drive training by hand:

    client = TrainingClient(LocalBackend("smollm2"))
    out = client.sample(["What is 2+3?"], n=4)
    client.forward_backward(data, "importance_sampling")
    client.optim_step(AdamParams(learning_rate=5e-4))
    state = client.save_state()

`tinkerless.train` is built on the same calls.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable

from tinkerless.errors import TinkerlessError
from tinkerless.functions.losses import LossConfig
from tinkerless.sdk.backends.base import Backend, call
from tinkerless.wire.messages import (
    BASE_POLICY,
    AdamParams,
    CreatePolicyRequest,
    DeletePolicyRequest,
    Datum,
    ForwardBackwardRequest,
    ForwardBackwardResult,
    ForwardRequest,
    ForwardResult,
    LoadStateRequest,
    LoraConfig,
    MultiAgentRolloutRequest,
    OptimStepRequest,
    OptimStepResult,
    PolicyState,
    RolloutRequest,
    RolloutResult,
    SampleRequest,
    SampleResult,
    SamplingParams,
    SaveStateRequest,
    Seat,
    UpdateRequest,
    UpdateResult,
)


def _loss(loss: LossConfig | str) -> LossConfig:
    return LossConfig(name=loss) if isinstance(loss, str) else loss


class TrainingClient:
    """Calls on one policy. `namespace` scopes policy names on the worker, so runs that share
    a server (one base model, many adapters) never touch each other's adapters."""

    def __init__(
        self,
        backend: Backend,
        policy: str = "default",
        lora: LoraConfig | None = None,
        *,
        create: bool = True,
        namespace: str = "",
    ):
        self.backend = backend
        self.policy = policy
        self.namespace = namespace
        if create:
            call(backend, "create_policy", CreatePolicyRequest(self.remote(policy), lora or LoraConfig()))

    def remote(self, policy: str | None) -> str | None:
        """The worker-side name of a policy ("base", the bare model, is shared)."""
        if not self.namespace or policy in (None, BASE_POLICY):
            return policy
        return f"{self.namespace}-{policy}"

    def info(self) -> dict:
        return call(self.backend, "info", {})

    def rollout(self, request: RolloutRequest) -> RolloutResult:
        request = dataclasses.replace(request, policy=self.remote(request.policy))
        return call(self.backend, "rollout", request)

    def rollout_multi(self, request: MultiAgentRolloutRequest) -> RolloutResult:
        return rollout_multi_as(self.backend, request, lambda seat: self.remote(seat.policy))

    def sample(
        self, prompts: list[Any], n: int = 1, params: SamplingParams | None = None, *, seed: int = 0
    ) -> SampleResult:
        """Sample `n` completions per prompt. A prompt is token ids, or a string sent as one user message."""
        request = SampleRequest(self.remote(self.policy), list(prompts), n, params or SamplingParams(), seed)
        return call(self.backend, "sample", request)

    def forward(self, data: list[Datum], *, with_reference: bool = False, topk: int = 0) -> ForwardResult:
        return call(self.backend, "forward", ForwardRequest(self.remote(self.policy), data, with_reference, topk))

    def forward_backward(self, data: list[Datum], loss: LossConfig | str) -> ForwardBackwardResult:
        request = ForwardBackwardRequest(self.remote(self.policy), data, _loss(loss))
        return call(self.backend, "forward_backward", request)

    def optim_step(self, adam: AdamParams | None = None) -> OptimStepResult:
        return call(self.backend, "optim_step", OptimStepRequest(self.remote(self.policy), adam or AdamParams()))

    def update(self, data: list[Datum], loss: LossConfig | str, adam: AdamParams | None = None, *,
               max_staleness: int | None = None) -> UpdateResult:
        """forward_backward + optim_step; with `max_staleness`, the worker first checks that every token carrying its
        sampled version (`Datum.sampled_versions`) is at most that many versions behind the policy."""
        request = UpdateRequest(self.remote(self.policy), data, _loss(loss), adam or AdamParams(),
                                max_staleness=max_staleness)
        return call(self.backend, "update", request)

    def save_state(self, include_optimizer: bool = True) -> PolicyState:
        state = call(self.backend, "save_state", SaveStateRequest(self.remote(self.policy), include_optimizer))
        state.policy = self.policy
        return state

    def delete(self) -> bool:
        """Free this policy's adapter and optimizer on the worker (a server counts them against your quota;
        checkpoints in storage stay). False if the worker did not hold it."""
        return bool(call(self.backend, "delete_policy", DeletePolicyRequest(self.remote(self.policy)))["deleted"])

    def load_state(self, state: PolicyState, include_optimizer: bool = True) -> dict:
        state = dataclasses.replace(state, policy=self.remote(self.policy))
        return call(self.backend, "load_state", LoadStateRequest(state, include_optimizer))


def rollout_multi_as(backend: Backend, request: MultiAgentRolloutRequest,
                     remote: Callable[[Seat], str | None]) -> RolloutResult:
    """Play `request` with each seat's policy under its worker-side name `remote(seat)`; the episodes report
    policies by the names the caller used."""
    seats = {role: dataclasses.replace(seat, policy=remote(seat)) for role, seat in request.seats.items()}
    result = call(backend, "rollout_multi", dataclasses.replace(request, seats=seats))
    local = {seats[role].policy: seat.policy for role, seat in request.seats.items()}
    for episode in result.episodes:
        episode.info["policy"] = local.get(episode.info.get("policy"), episode.info.get("policy"))
    return result


def free_policies(clients: list[TrainingClient]) -> None:
    """A finished run frees its policies on the worker: a shared server counts them against the tenant's
    quota, and the run's checkpoints hold everything a resume or `RUN@latest` needs. Best effort: a
    failure here warns, it does not undo a run that finished."""
    for client in clients:
        try:
            client.delete()
        except TinkerlessError as exc:
            warnings.warn(f"could not free policy {client.policy!r} on the worker: {exc}", stacklevel=2)
