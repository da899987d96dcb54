"""`RankWorker`: the `Worker` on one rank of a sharded update, its model under FSDP2.

Every rank holds the same Worker with the same policies, gets every request whole, and runs the same method:
the training functions take this rank's share of the batch (`training.forward_backward`, `rank`/`world_size`),
and the results of all ranks are gathered so that every rank (rank 0 answers) returns what one process would.

What differs from one process, and why:
- the base model is built on the CPU with placeholder weights (`base_weights`: one element of memory each) and the
  first policy is created there, its LoRA weights seeded as on one process; `fully_shard` (each decoder layer,
  then the whole model) then puts each layer's shard on this rank's GPU, and the rank reads its rows of every
  base weight from the checkpoint into its shard. So neither the host nor a GPU ever holds a rank's whole model
  (a checkpoint that cannot be read in shards loads whole on the CPU first, as before). One rank keeps the
  plain model on its GPU: FSDP2 over one rank would split nothing.
  Base weights keep the run's dtype, LoRA weights and Adam's moments fp32 (`precision.py`), all
  sharded: each rank keeps 1/N of every tensor, gradients are reduce-scattered (summed: each micro-batch is
  already weighted by its share of the whole batch) and the optimizer steps on the shards;
- FSDP2 shards the parameters a model has when it is sharded, so a policy created (or dropped) later rebuilds
  the rank: every policy's full state is gathered, the base model is built again, the policies are made again and
  sharded, and their states load back (`_rebuild`: one model build per policy added after the first, which a run does once at its start);
- LoRA weights and moments are gathered one tensor at a time (`full_tensor`), not with the whole model's state
  dict, whose frozen base weights would be gathered too;
- saving gathers full, unsharded tensors (on the CPU) and writes the same adapter files, optimizer.pt and RNG
  as one process; loading shards full tensors (every rank has them: the request came whole). So a state saved
  by 4 ranks loads on 1, and the other way round.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tinkerless.errors import ConfigError
from tinkerless.functions.policies import Policy, PolicyAdapters
from tinkerless.functions.sharding import base_weights
from tinkerless.functions.training.micro_batches import model_token_budget
from tinkerless.functions.worker import Worker
from tinkerless.wire.messages import (
    CreatePolicyRequest,
    ForwardBackwardRequest,
    ForwardBackwardResult,
    ForwardRequest,
    ForwardResult,
    LoadStateRequest,
    ResetPolicyRequest,
    SaveStateRequest,
)

SAMPLING_METHODS = ("rollout", "rollout_multi", "sample")
# Metrics that every rank computes alike (the optimizer step's): rank 0's value stands for all.
_SAME_ON_EVERY_RANK = ("learning_rate", "optim_step_skipped", "grad_norm")


class RankWorker(Worker):

    def __init__(self, model: str, *, rank: int, world_size: int, mesh: Any, group: Any, device: str, **options: Any):
        """`mesh`: the ranks' 1-D device mesh; `group`: a gloo group for gathering Python objects (results)."""
        # Several ranks: the CPU first, the model is sharded on its way to the GPU (`_shard`). One rank: straight to
        # its device, never sharded (see `_shard`). Sampling is not served here.
        self.rank, self.world_size, self.mesh, self.group = rank, world_size, mesh, group
        self.checkpoint: base_weights.Checkpoint | None = None  # where the base weights lie, read into the shards
        super().__init__(model, device=_load_device(world_size, device), engine="transformers", **options)
        self.device = device
        self.rank_args = {"rank": rank, "world_size": world_size}
        self.sharded = False
        self._fresh: dict[str, dict[str, torch.Tensor]] = {}  # each policy's init, for reset_policy

    def _no_sampling(self, request: Any) -> Any:
        """Generation would need every rank in every decode step; the rollout role samples instead."""
        raise ConfigError(
            "the ranks of a sharded update do not sample",
            hint="send rollouts and samples to the rollout role (on one GPU, or several with the vLLM engine's "
            "tensor_parallel_size); the sharded ranks serve forward, forward_backward, optim_step and state",
        )

    rollout = rollout_multi = sample = _no_sampling

    def _load_base_model(self, device: str) -> tuple[Any, Any]:
        """Several ranks: placeholder base weights, each rank's share read from the checkpoint once sharded
        (`base_weights`), so no rank holds the whole model; the whole model where the checkpoint cannot be read so."""
        if self.world_size > 1:
            found = base_weights.placeholder_model(self.model_name, self.dtype)
            if found is not None:
                model, tokenizer, self.checkpoint = found
                return model, tokenizer
        self.checkpoint = None
        return super()._load_base_model(device)

    # ---- sharding ---------------------------------------------------------------
    def _shard(self) -> None:
        """FSDP2 over the model and every policy's adapter as they are now (fresh from their seeds).

        One rank keeps the plain model: sharding over one rank splits nothing and would only add FSDP2's gathers,
        copies and hooks to every layer (torchtitan, too, applies FSDP only for a shard degree above 1). Everything
        else (the process, the requests to every rank, the gathered results, the watchdog) runs as for N."""
        if self.world_size == 1:
            return
        from peft.utils import set_peft_model_state_dict
        from torch.distributed.fsdp import FSDPModule, fully_shard
        from transformers.modeling_layers import GradientCheckpointingLayer

        self._fresh.update(self._adapters_now())  # for reset_policy, and below
        buffers = base_weights.parameters_to_meta(self.model) if self.checkpoint is not None else None
        # One unit per decoder layer: its weights are gathered for its own forward and backward only.
        for layer in [m for m in self.model.modules() if isinstance(m, GradientCheckpointingLayer)]:
            fully_shard(layer, mesh=self.mesh)
        fully_shard(self.model, mesh=self.mesh)
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                # A plain sum (gloo has no pre-multiplied sum): micro-batches are weighted by their global share.
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        self.sharded = True
        if buffers is not None:  # sharded on the meta device: this rank's rows of every base weight, its LoRA shards
            base_weights.materialize(self.model, self.device, buffers)
            base_weights.fill(self.model, self.checkpoint)
            for name in self.policies:
                set_peft_model_state_dict(self.model, self._weights_to_load(self._fresh[name]), adapter_name=name)
        for name, policy in self.policies.items():  # FSDP2 put new (sharded) parameters in place of the old ones
            policy.params = [p for n, p in self.model.named_parameters() if "lora_" in n and f".{name}." in n]
            policy.optimizer = torch.optim.AdamW(policy.params, lr=1e-4)

    def _adapters_now(self) -> dict[str, dict[str, torch.Tensor]]:
        """A copy of each policy's adapter weights as they are now."""
        from peft.utils import get_peft_model_state_dict

        return {name: {k: v.detach().clone() for k, v in get_peft_model_state_dict(
            self.model, adapter_name=name, save_embedding_layers=False).items()} for name in self.policies}

    def _rebuild(self, *, add: CreatePolicyRequest | None = None, drop: str | None = None) -> None:
        """The model again with one policy more or less: full states out, base model rebuilt, sharded, states in."""
        states = [self.save_state(SaveStateRequest(name, include_optimizer=True)) for name in self.policies if name != drop]
        loras = {name: p.lora for name, p in self.policies.items() if name != drop}
        self.adapters = self.base_model = self.engine.model = None  # type: ignore[assignment]  (the old model, freed)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.base_model, _ = self._load_base_model(_load_device(self.world_size, self.device))
        self.adapters = PolicyAdapters(self.base_model)
        self.sharded, self._fresh = False, {}
        for name, lora in loras.items():
            self.adapters.add(name, lora, on_wrap=self._engine_samples_from)
        try:
            if add is not None:
                super().create_policy(add)
        finally:
            self._shard()
            for state in states:
                super().load_state(LoadStateRequest(state, include_optimizer=True))

    def _engine_samples_from(self, model: Any) -> None:
        self.engine.model = model  # (never samples: see handle)

    def create_policy(self, request: CreatePolicyRequest) -> dict:
        if request.policy in self.policies:
            return super().create_policy(request)
        if not self.sharded:
            reply = super().create_policy(request)
            self._shard()
            return reply
        self._rebuild(add=request)
        return {"policy": request.policy, "created": True}

    def drop_policy(self, name: str) -> bool:
        if not self.sharded or name not in self.policies or len(self.policies) == 1:
            return super().drop_policy(name)
        self._rebuild(drop=name)
        return True

    def reset_policy(self, request: ResetPolicyRequest) -> dict:
        from peft.utils import set_peft_model_state_dict

        if not self.sharded or request.policy not in self.policies:
            return super().reset_policy(request)
        policy = self._policy(request.policy)
        set_peft_model_state_dict(self.model, self._weights_to_load(self._fresh[request.policy]), adapter_name=request.policy)
        policy.optimizer = torch.optim.AdamW(policy.params, lr=1e-4)
        for p in policy.params:
            p.grad = None
        policy.version = 0
        self._forget_snapshots(request.policy)
        return {"policy": request.policy, "policy_version": 0}

    @contextlib.contextmanager
    def _activate(self, policy: str | None):
        """peft marks only the live adapter trainable; FSDP2 fixes a parameter's flag the first time it gathers it,
        so every policy's adapter stays trainable (an adapter that is not live gets no gradient anyway)."""
        with super()._activate(policy):
            for p in self.policies.values():
                for param in p.params:
                    param.requires_grad_(True)
            yield

    # ---- the batch split over the ranks, the results gathered ---------------------
    def _agree_on_budget(self) -> None:
        """One micro-batch plan on every rank: the smallest of the ranks' token budgets (free memory differs)."""
        budget = torch.tensor([model_token_budget(self.model)], dtype=torch.int64)
        dist.all_reduce(budget, op=dist.ReduceOp.MIN, group=self.group)
        self.rank_args = {"rank": self.rank, "world_size": self.world_size, "token_budget": int(budget)}

    def _gather(self, part: Any) -> list[Any]:
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, part, group=self.group)
        return parts

    def forward(self, request: ForwardRequest) -> ForwardResult:
        if not self.sharded:  # the base model's log-probs before any policy exists: its weights are read on sharding
            self._shard()
        self._agree_on_budget()
        result = super().forward(request)
        parts = self._gather((result.logprobs, result.ref_logprobs))
        ref = merge_rows([p[1] for p in parts]) if request.with_reference else None
        return ForwardResult(merge_rows([p[0] for p in parts]), ref)

    def forward_backward(self, request: ForwardBackwardRequest) -> ForwardBackwardResult:
        self._agree_on_budget()
        result = super().forward_backward(request)
        parts = self._gather((result.metrics, result.logprobs))
        return ForwardBackwardResult(merge_metrics([p[0] for p in parts]), merge_rows([p[1] for p in parts]))

    # ---- full tensors out, shards in (the hooks of Worker.save_state / load_state) ----
    def _adapter_weights(self, name: str) -> dict[str, torch.Tensor] | None:
        if not self.sharded:
            return None
        # Every rank joins each gather, in the same (named_parameters) order.
        return {n: _full(p) for n, p in self.model.named_parameters() if "lora_" in n and f".{name}." in n}

    def _optimizer_state(self, policy: Policy) -> dict:
        state = policy.optimizer.state_dict()
        for key in sorted(state["state"]):
            entry = state["state"][key]
            state["state"][key] = {k: _full(v) if isinstance(v, torch.Tensor) else v for k, v in sorted(entry.items())}
        return state

    def _weights_to_load(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not self.sharded:
            return weights
        # Every LoRA parameter is cut the same way (dim 0 over the one mesh); shapes are checked by the caller.
        like = next(p for n, p in self.model.named_parameters() if "lora_" in n)
        return {k: _distribute(v.to(like.dtype), like) for k, v in weights.items()}

    def _optimizer_state_to_load(self, policy: Policy, state: dict) -> dict:
        if not self.sharded:
            return state
        entries = {}
        for key, entry in state["state"].items():
            if not (isinstance(key, int) and 0 <= key < len(policy.params)) or not isinstance(entry, dict):
                raise ValueError(f"state entry {key!r} is for no parameter of this adapter")
            param = policy.params[key]
            entries[key] = {
                k: _shard_like(v, param) if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(param.shape) else v
                for k, v in entry.items()
            }
        return {**state, "state": entries}


def _load_device(world_size: int, device: str) -> str:
    """Where a rank's Worker loads the model: one rank on its device; several on the CPU, sharded from there."""
    return device if world_size == 1 else "cpu"


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A whole tensor on the CPU from a sharded one (a collective: every rank calls it), or the tensor itself."""
    full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return full.detach().cpu()


def _shard_like(full: torch.Tensor, param: Any) -> Any:
    """`full` cut as `param` is, which it must fit."""
    if tuple(full.shape) != tuple(param.shape):
        raise ValueError(f"a tensor of shape {tuple(full.shape)} for a parameter of shape {tuple(param.shape)}")
    return _distribute(full, param)


def _distribute(full: torch.Tensor, like: Any) -> Any:
    """`full` cut over `like`'s mesh as `like` is (each rank keeps its own part, with no communication: every
    rank has the whole tensor)."""
    from torch.distributed.tensor import distribute_tensor

    if not hasattr(like, "device_mesh"):
        return full
    return distribute_tensor(full.to(like.device), like.device_mesh, like.placements, src_data_rank=None)


def merge_rows(parts: list[list[np.ndarray | None] | None]) -> list[np.ndarray]:
    """Each row's result from the one rank that computed it."""
    rows = max((len(p) for p in parts if p is not None), default=0)
    out = []
    for i in range(rows):
        found = next((p[i] for p in parts if p is not None and p[i] is not None), None)
        if found is None:
            raise ConfigError(f"row {i} was computed by no rank", hint="a bug in the sharded batch split; see the logs")
        out.append(found)
    return out


def merge_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """The batch's metrics from the ranks' parts: the loss (each part already weighted by its share of the batch)
    and token counts add up; every other metric is a token-weighted mean, weighted by the part's tokens."""
    tokens = [float(p.get("tokens", 0.0)) for p in parts]
    total = sum(tokens)
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for p in parts for k in p):
        have = [(p[key], t) for p, t in zip(parts, tokens) if key in p]
        if key in ("loss", "tokens"):
            out[key] = float(sum(v for v, _ in have))
        elif key in _SAME_ON_EVERY_RANK:
            out[key] = float(have[0][0])
        else:
            weight = sum(t for _, t in have)
            out[key] = float(sum(v * t for v, t in have) / weight) if weight > 0 else float(have[0][0])
    if "tokens" in out:
        out["tokens"] = total
    return out
