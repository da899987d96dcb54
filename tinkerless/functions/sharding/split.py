"""`SplitWorker`: one machine's GPUs split between a sampler and N training ranks (`tinkerless serve --gpus N`).

A server needs everything a `Worker` is (the OpenAI and Tinker routes sample, score prompts and read its
tokenizer), so this is a `Worker`: it samples and computes log-probs (`forward`) on its own device as one
`Worker` does, and every function that trains (`forward_backward`, `optim_step`, `update`) or holds the
training state (`save_state` with the optimizer, `load_state`, `reset_policy`) runs on a `ShardedWorker`'s ranks
too. After each change the policy's adapter (not its optimizer, not the ranks' RNG) is copied here, so the
sampler serves the version the ranks just made. Creating and dropping policies happens on both; the tenant's
policy quota is checked here first.

The sampler's copy of the model sits on GPU 0 beside rank 0's shard: the sampler must fit one GPU (a model
that does not is refused at load, naming vLLM) and the update is what the ranks make room for.
"""

from __future__ import annotations

from typing import Any

from tinkerless.functions.sharding.group import ShardedWorker
from tinkerless.functions.worker import Worker
from tinkerless.wire.messages import (
    CreatePolicyRequest,
    DeletePolicyRequest,
    ForwardBackwardRequest,
    ForwardBackwardResult,
    LoadStateRequest,
    OptimStepRequest,
    OptimStepResult,
    PolicyState,
    ResetPolicyRequest,
    SaveStateRequest,
    UpdateRequest,
    UpdateResult,
)

class SplitWorker(Worker):
    def __init__(self, model: str, *, ranks: int, **options: Any):
        super().__init__(model, **options)
        training = {k: v for k, v in options.items() if k != "device"}  # (ShardedWorker drops the sampler's)
        self.trainer = ShardedWorker(model, world_size=ranks, **training)

    def info(self, _request: Any = None) -> dict:
        return {**super().info(), "ranks": self.trainer.world_size}

    def create_policy(self, request: CreatePolicyRequest) -> dict:
        reply = super().create_policy(request)  # names, the tenant's quota: checked here first
        if reply["created"]:
            try:
                self.trainer.create_policy(request)
            except BaseException:
                super().drop_policy(request.policy)
                raise
        return reply

    def delete_policy(self, request: DeletePolicyRequest) -> dict:
        reply = super().delete_policy(request)
        if reply["deleted"]:
            self.trainer.delete_policy(request)
        return reply

    def reset_policy(self, request: ResetPolicyRequest) -> dict:
        self.trainer.reset_policy(request)
        return super().reset_policy(request)

    def forward_backward(self, request: ForwardBackwardRequest) -> ForwardBackwardResult:
        self._policy(request.policy)
        return self.trainer.forward_backward(request)

    def optim_step(self, request: OptimStepRequest) -> OptimStepResult:
        result = self.trainer.optim_step(request)
        self._pull(request.policy)
        return result

    def update(self, request: UpdateRequest) -> UpdateResult:
        self._policy(request.policy)
        result = self.trainer.update(request)
        self._pull(request.policy)
        return result

    def save_state(self, request: SaveStateRequest) -> PolicyState:
        return self.trainer.save_state(request)

    def load_state(self, request: LoadStateRequest) -> dict:
        created = request.state.policy not in self.policies
        reply = super().load_state(LoadStateRequest(_adapter_only(request.state), include_optimizer=False))
        try:
            self.trainer.load_state(request)
        except BaseException:
            if created:
                super().drop_policy(request.state.policy)
            raise
        return reply

    def _pull(self, policy: str) -> None:
        """The ranks' new version of `policy`'s adapter, here, for the sampler."""
        state = self.trainer.save_state(SaveStateRequest(policy, include_optimizer=False))
        super().load_state(LoadStateRequest(_adapter_only(state), include_optimizer=False))

    def close(self) -> None:
        self.trainer.close()


def _adapter_only(state: PolicyState) -> PolicyState:
    """The adapter's files alone: the sampler keeps its own random stream (no `worker_rng.pt`)."""
    files = {name: blob for name, blob in state.files.items() if name.startswith("adapter/")}
    return PolicyState(state.policy, files, state.policy_version)
