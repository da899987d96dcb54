"""LoRA layers' forward without peft's per-call bookkeeping, for sampling.

peft's `lora.Linear.forward` serves every case (mixed-adapter batches, DoRA, dtype casts, merged
weights, several active adapters) and pays for that on every call: property reads, a loop over the
active adapters, three submodule calls (each `F.linear` transposing its weight again), a multiply
and an add. A decode step of one row goes through 210 such layers on SmolLM2, where that cost more
than the rank-16 matmuls themselves: sampling from an adapter ran at ~0.8 of the base model's
tokens/s (BENCHMARKS.md, issue #15).

`install` gives each LoRA layer a forward that takes a short path in the common sampling case (no
gradients, at most one active adapter of plain LoRA, an input in the base's dtype, a plain `nn.Linear` base,
no extra arguments) and calls peft's own forward in every other case. fp32 adapters on a bf16 base are
sampled from a bf16 copy of their weights, refreshed when their version counters move. The short path keeps each
weight's transpose as a view (a view shares its parameter's storage, so optimizer steps and loads,
which write in place, show through it; a swapped storage, an adapter made again or a new scaling
rebuild the views) and computes `x W^T + scaling * (x A^T) B^T` in three BLAS calls. The base
model's rows (adapters disabled) take it too, so base and adapter are compared as equals; those
rows are bit-identical to peft's. Adapter rows fold the scaling and the sum into one `addmm`, a
rounding fewer than peft's separate multiply and add: they equal peft's outputs to float rounding
(~1e-7 relative), like a batch of another size does, and are deterministic
(tests/test_lora_inference.py). Training never takes the short path: gradients are on there.

`TINKERLESS_LEAN_LORA=0` turns it off (what the benchmarks compare against).
"""

from __future__ import annotations

import os
import types

import torch
from torch import nn

_MARK = "_tinkerless_lean_forward"
_VIEWS = "_tinkerless_views"
# the plain attributes behind peft's `disable_adapters`, `active_adapter` and `merged` properties
_PEFT_ATTRIBUTES = {"_disable_adapters", "_active_adapter", "merged_adapters"}


def enabled() -> bool:
    return os.environ.get("TINKERLESS_LEAN_LORA", "1").strip() != "0"


def install(model: nn.Module) -> int:
    """Give every peft LoRA `Linear` of `model` the short sampling path; returns how many layers got it.
    Idempotent: call it again after peft adds an adapter (new target modules become new layers)."""
    if not enabled():
        return 0
    from peft.tuners.lora.layer import Linear as LoraLinear

    count = 0
    for module in model.modules():
        # a peft whose layers keep that state elsewhere keeps its own forward
        if type(module) is LoraLinear and not getattr(module, _MARK, False) and _PEFT_ATTRIBUTES <= vars(module).keys():
            module.forward = types.MethodType(_forward, module)
            setattr(module, _MARK, True)
            setattr(module, _VIEWS, {})
            count += 1
    return count


def forget(model: nn.Module, adapter: str) -> None:
    """Drop the views of a deleted adapter: they hold its weights' storage."""
    for module in model.modules():
        getattr(module, _VIEWS, {}).pop(adapter, None)


class _Views:
    """One layer's operands for one adapter (or the base alone), checked once to be a case the short path
    computes as peft does: transposed views of its weights, valid while the layer holds the same parameters in
    the same storage under the same scaling."""

    __slots__ = ("name", "weight", "weight_ptr", "bias", "bias_ptr", "lora_a", "a_ptr", "lora_b", "b_ptr", "scale",
                 "dtype", "weight_t", "a_t", "b_t", "dropout", "copied", "a_version", "b_version")

    def __init__(self, name: str, base: nn.Linear, lora_a: nn.Linear | None, lora_b: nn.Linear | None, scaling: float,
                 dropout: bool) -> None:
        self.name = name
        self.weight, self.bias = base._parameters["weight"], base._parameters.get("bias")
        self.weight_ptr = self.weight.data_ptr()
        self.bias_ptr = self.bias.data_ptr() if self.bias is not None else 0
        self.lora_a = lora_a._parameters["weight"] if lora_a is not None else None
        self.lora_b = lora_b._parameters["weight"] if lora_b is not None else None
        self.a_ptr = self.lora_a.data_ptr() if lora_a is not None else 0
        self.b_ptr = self.lora_b.data_ptr() if lora_b is not None else 0
        self.scale, self.dtype = scaling, base.weight.dtype
        self.weight_t = base.weight.t()
        # fp32 adapters on a bf16 base (functions/precision.py): the short path samples from a copy in the base's
        # dtype instead of letting peft cast every input and output, in every layer, every step. A copy does not
        # see in-place writes the way a view does: the parameters' version counters (bumped by every in-place
        # write, optimizer steps and loads included) say when it is stale, and it is refreshed in place (a CUDA
        # graph captured over it keeps reading the same storage: `graphed_decode`).
        self.copied = lora_a is not None and self.lora_a.dtype != self.dtype
        self.a_version = self.lora_a._version if lora_a is not None else 0
        self.b_version = self.lora_b._version if lora_b is not None else 0
        if lora_a is None:
            self.a_t = self.b_t = None
        elif self.copied:
            self.a_t = self.lora_a.detach().to(self.dtype).t()
            self.b_t = self.lora_b.detach().to(self.dtype).t()
        else:
            self.a_t, self.b_t = self.lora_a.t(), self.lora_b.t()
        self.dropout = dropout  # a real dropout: only outside training mode is it the identity

    def current(self, layer: nn.Module, name: str) -> bool:
        """The layer still has these parameters, storages and scaling (an adapter deleted and made again,
        a load that swaps `.data`, or peft rescaling it each make new views). Straight-line reads of the
        modules' dicts: this runs in every LoRA layer on every decode step (210 times a token on SmolLM2),
        where `nn.Module.__getattr__` alone costs a microsecond a call."""
        modules = layer._modules
        base = modules["base_layer"]._parameters
        if base["weight"] is not self.weight or self.weight.data_ptr() != self.weight_ptr:
            return False
        if base.get("bias") is not self.bias or (self.bias is not None and self.bias.data_ptr() != self.bias_ptr):
            return False
        lora_a = modules["lora_A"]._modules.get(name)
        if self.lora_a is None:
            return lora_a is None  # else the adapter has since come to adapt this layer
        lora_b = modules["lora_B"]._modules.get(name)
        return (lora_a is not None and lora_b is not None
                and lora_a._parameters["weight"] is self.lora_a and self.lora_a.data_ptr() == self.a_ptr
                and lora_b._parameters["weight"] is self.lora_b and self.lora_b.data_ptr() == self.b_ptr
                and layer.scaling.get(name) == self.scale
                and (not self.copied or self._fresh()))

    def _fresh(self) -> bool:
        """Refresh the sampling copies in place if an in-place write moved the weights since (always True)."""
        if self.lora_a._version != self.a_version or self.lora_b._version != self.b_version:
            self.a_t.t().copy_(self.lora_a.detach())
            self.b_t.t().copy_(self.lora_b.detach())
            self.a_version, self.b_version = self.lora_a._version, self.lora_b._version
        return True


def _forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    views = _views(self, x, args, kwargs)
    if views is None:
        return type(self).forward(self, x, *args, **kwargs)
    flat = x.reshape(-1, x.shape[-1])
    # nn.Linear on a (batch, seq, features) input runs exactly these: mm, or addmm with a bias
    result = torch.mm(flat, views.weight_t) if views.bias is None else torch.addmm(views.bias, flat, views.weight_t)
    if views.a_t is not None:
        # peft computes result + (x A^T B^T) * scaling in three ops; one addmm does the product, the scaling
        # and the sum in the BLAS call, a rounding fewer (outputs equal peft's to float rounding, not bitwise)
        result.addmm_(torch.mm(flat, views.a_t), views.b_t, alpha=views.scale)
    return result.view(*x.shape[:-1], result.shape[-1])


def _views(self, x: torch.Tensor, args: tuple, kwargs: dict) -> _Views | None:
    """The operands of the short path when it computes what peft would; else None. Runs in each of
    the model's LoRA layers on every decode step, so it reads peft's plain attributes (the properties
    `disable_adapters`, `active_adapters` and `merged` read these) and checks the layer's modules only
    when it builds the views."""
    if args or kwargs or torch.is_grad_enabled() or self.merged_adapters:
        return None  # kwargs: peft's per-row adapter_names of a mixed batch, among others
    if self._disable_adapters:
        name = ""
    else:
        name = self._active_adapter
        if not isinstance(name, str):
            if len(name) != 1:
                return None
            name = name[0]
    views = self.__dict__[_VIEWS].get(name)
    if views is None or not views.current(self, name):
        views = _build_views(self, name)
        if views is None:
            return None
    if x.dtype != views.dtype or (views.dropout and self.training):
        return None  # peft casts the input when dtypes differ: leave the casting rules to it
    return views


def _build_views(self, name: str) -> _Views | None:
    base = self.base_layer
    if type(base) is not nn.Linear:
        return None
    if name == "" or name not in self.lora_A:  # peft skips an active adapter that does not adapt this layer
        views = _Views(name, base, None, None, 1.0, dropout=False)
    else:
        lora_a, lora_b = self.lora_A[name], self.lora_B[name]
        if name in self.lora_variant or type(lora_a) is not nn.Linear or type(lora_b) is not nn.Linear:
            return None  # DoRA and other variants
        if lora_a.bias is not None or lora_b.bias is not None or not lora_a.weight.is_floating_point():
            return None
        dropout = not isinstance(self.lora_dropout[name], nn.Identity)
        views = _Views(name, base, lora_a, lora_b, self.scaling[name], dropout)
    known = self.__dict__[_VIEWS]
    for gone in [n for n in known if n and n not in self.lora_A]:  # adapters deleted without `forget`
        del known[gone]
    known[name] = views
    return views


def views_of(layer: nn.Module, adapter: str) -> _Views | None:
    """The short path's operands `layer` samples `adapter` with ("__base__": adapters off), if it built them."""
    return getattr(layer, _VIEWS, {}).get("" if adapter == "__base__" else adapter)


def views_current(layer: nn.Module, views: _Views) -> bool:
    """`views` are still the ones `layer` samples with, and valid (sampling copies refreshed in place if stale)."""
    return layer.__dict__[_VIEWS].get(views.name) is views and views.current(layer, views.name)
