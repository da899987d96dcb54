"""LoRA layers' forward without peft's per-call bookkeeping, for sampling.

peft's `lora.Linear.forward` serves every case (mixed-adapter batches, DoRA, dtype casts, merged
weights, several active adapters) and pays for that on every call: argument checks, a loop over the
active adapters, three submodule calls, each `F.linear` re-transposing its weight, and a scalar
tensor made for the scaling. A decode step of one row goes through 210 such layers on SmolLM2, where
that bookkeeping cost more than the rank-16 matmuls themselves: sampling from an adapter ran at ~0.8
of the base model's tokens/s (BENCHMARKS.md, issue #15).

`install` gives each LoRA layer a forward that takes a short path in the common sampling case (no
gradients, at most one active adapter of plain LoRA, matching dtypes, a plain `nn.Linear` base, no
extra arguments) and calls peft's own forward in every other case. The short path keeps each
weight's transpose as a view (a view shares its parameter's storage, so optimizer steps and loads,
which write in place, show through it; a layer whose storage was swapped rebuilds its views), and
runs the same BLAS calls with the same operands and in the same order as peft, so its outputs are
bit-identical (tests/test_lora_inference.py). The base model's rows (adapters disabled) take it too:
the comparison between base and adapter stays between equals. Training never takes it: gradients
are on there.

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
    computes exactly: transposed views of its weights, valid while the layer holds the same parameters in
    the same storage under the same scaling."""

    __slots__ = ("tensors", "pointers", "scale", "dtype", "weight_t", "bias", "a_t", "b_t", "scaling", "dropout")

    def __init__(self, base: nn.Linear, lora_a: nn.Linear | None, lora_b: nn.Linear | None, scaling: float,
                 dropout: bool) -> None:
        self.tensors = _live_tensors(base, lora_a, lora_b)
        self.pointers = tuple(t.data_ptr() for t in self.tensors)
        self.scale, self.dtype = scaling, base.weight.dtype
        self.weight_t, self.bias = base.weight.t(), base.bias
        self.a_t = lora_a.weight.t() if lora_a is not None else None
        self.b_t = lora_b.weight.t() if lora_b is not None else None
        # peft multiplies by its float scaling; a 0-dim tensor of the weights' dtype gives the same products
        # without wrapping the number into a new tensor on every call
        self.scaling = torch.tensor(scaling, dtype=base.weight.dtype, device=base.weight.device)
        self.dropout = dropout  # a real dropout: only outside training mode is it the identity

    def current(self, layer: nn.Module, name: str) -> bool:
        """The layer still has these parameters, storages and scaling (an adapter deleted and made again,
        a load that swaps `.data`, or peft rescaling it each make new views). Reads the modules' dicts
        directly: `nn.Module.__getattr__` costs a microsecond a call, here 210 times a decode step."""
        modules = layer._modules
        base = modules["base_layer"]
        if self.a_t is None:
            lora_a = lora_b = None
            if name and name in modules["lora_A"]._modules:
                return False  # the adapter has since come to adapt this layer
        else:
            lora_a, lora_b = modules["lora_A"]._modules.get(name), modules["lora_B"]._modules.get(name)
            if lora_a is None or lora_b is None or layer.scaling.get(name) != self.scale:
                return False
        live = _live_tensors(base, lora_a, lora_b)
        return len(live) == len(self.tensors) and all(
            t is mine and t.data_ptr() == pointer for t, mine, pointer in zip(live, self.tensors, self.pointers))


def _live_tensors(base: nn.Module, lora_a: nn.Module | None, lora_b: nn.Module | None) -> tuple[torch.Tensor, ...]:
    tensors = [base._parameters["weight"]]
    if base._parameters.get("bias") is not None:
        tensors.append(base._parameters["bias"])
    if lora_a is not None:
        tensors += [lora_a._parameters["weight"], lora_b._parameters["weight"]]
    return tuple(tensors)


def _forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    views = _views(self, x, args, kwargs)
    if views is None:
        return type(self).forward(self, x, *args, **kwargs)
    flat = x.reshape(-1, x.shape[-1])
    # nn.Linear on a (batch, seq, features) input runs exactly these: mm, or addmm with a bias
    result = torch.mm(flat, views.weight_t) if views.bias is None else torch.addmm(views.bias, flat, views.weight_t)
    if views.a_t is not None:
        # peft's own expression, result + lora_B(lora_A(dropout(x))) * scaling, dropout being off
        delta = torch.mm(torch.mm(flat, views.a_t), views.b_t)
        result.add_(delta.mul_(views.scaling))  # in place: the same roundings, no new tensors
    return result.view(*x.shape[:-1], result.shape[-1])


def _views(self, x: torch.Tensor, args: tuple, kwargs: dict) -> _Views | None:
    """The operands of the short path when it computes exactly what peft would; else None. Runs in each of
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
        views = _Views(base, None, None, 1.0, dropout=False)
    else:
        lora_a, lora_b = self.lora_A[name], self.lora_B[name]
        if name in self.lora_variant or type(lora_a) is not nn.Linear or type(lora_b) is not nn.Linear:
            return None  # DoRA and other variants
        if lora_a.bias is not None or lora_b.bias is not None or lora_a.weight.dtype != base.weight.dtype:
            return None
        dropout = not isinstance(self.lora_dropout[name], nn.Identity)
        views = _Views(base, lora_a, lora_b, self.scaling[name], dropout)
    known = self.__dict__[_VIEWS]
    for gone in [n for n in known if n and n not in self.lora_A]:  # adapters deleted without `forget`
        del known[gone]
    known[name] = views
    return views
