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

from typing import Any

from tinkerless.functions.losses import LossConfig
from tinkerless.sdk.backends import Backend, call
from tinkerless.wire.messages import (
    AdamParams,
    CreatePolicyRequest,
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
    UpdateRequest,
    UpdateResult,
)


def _loss(loss: LossConfig | str) -> LossConfig:
    return LossConfig(name=loss) if isinstance(loss, str) else loss


class TrainingClient:
    def __init__(self, backend: Backend, policy: str = "default", lora: LoraConfig | None = None, *, create: bool = True):
        self.backend = backend
        self.policy = policy
        if create:
            call(backend, "create_policy", CreatePolicyRequest(policy, lora or LoraConfig()))

    def info(self) -> dict:
        return call(self.backend, "info", {})

    def rollout(self, request: RolloutRequest) -> RolloutResult:
        return call(self.backend, "rollout", request)

    def rollout_multi(self, request: MultiAgentRolloutRequest) -> RolloutResult:
        return call(self.backend, "rollout_multi", request)

    def sample(
        self, prompts: list[Any], n: int = 1, params: SamplingParams | None = None, *, seed: int = 0
    ) -> SampleResult:
        """Sample `n` completions per prompt. A prompt is token ids, or a string sent as one user message."""
        return call(self.backend, "sample", SampleRequest(self.policy, list(prompts), n, params or SamplingParams(), seed))

    def forward(self, data: list[Datum], *, with_reference: bool = False) -> ForwardResult:
        return call(self.backend, "forward", ForwardRequest(self.policy, data, with_reference))

    def forward_backward(self, data: list[Datum], loss: LossConfig | str) -> ForwardBackwardResult:
        return call(self.backend, "forward_backward", ForwardBackwardRequest(self.policy, data, _loss(loss)))

    def optim_step(self, adam: AdamParams | None = None) -> OptimStepResult:
        return call(self.backend, "optim_step", OptimStepRequest(self.policy, adam or AdamParams()))

    def update(self, data: list[Datum], loss: LossConfig | str, adam: AdamParams | None = None) -> UpdateResult:
        return call(self.backend, "update", UpdateRequest(self.policy, data, _loss(loss), adam or AdamParams()))

    def save_state(self, include_optimizer: bool = True) -> PolicyState:
        return call(self.backend, "save_state", SaveStateRequest(self.policy, include_optimizer))

    def load_state(self, state: PolicyState, include_optimizer: bool = True) -> dict:
        state.policy = self.policy
        return call(self.backend, "load_state", LoadStateRequest(state, include_optimizer))
