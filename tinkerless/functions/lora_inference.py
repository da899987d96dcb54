"""LoRA layers' forward without peft's per-call bookkeeping, for sampling.

peft's `lora.Linear.forward` serves every case (mixed-adapter batches, DoRA, dtype casts, merged
weights, several active adapters) and pays for that on every call: argument checks, a loop over the
active adapters, three submodule calls. A decode step of one row goes through 210 such layers on
SmolLM2, where that bookkeeping cost more than the rank-16 matmuls themselves: sampling from an
adapter ran at ~0.8 of the base model's tokens/s (BENCHMARKS.md, issue #15).

`install` gives each LoRA layer of a model a forward that takes a short path in the common sampling
case (no gradients, one active adapter of plain LoRA, eval mode, matching dtypes, a plain
`nn.Linear` base, no extra arguments) and calls peft's own forward in every other case. The short
path runs the very same operations in the same order as peft's (`F.linear` is what `nn.Linear`
calls), so its outputs are bit-identical (tests/test_lora_inference.py). Training never takes it:
gradients are on there.

`TINKERLESS_LEAN_LORA=0` turns it off (what the benchmarks compare against).
"""

from __future__ import annotations

import os
import types

import torch
from torch import nn
from torch.nn import functional as F

_MARK = "_tinkerless_lean_forward"


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
        if type(module) is LoraLinear and not getattr(module, _MARK, False):
            module.forward = types.MethodType(_forward, module)
            setattr(module, _MARK, True)
            count += 1
    return count


def _forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    name = _short_path_adapter(self, x, args, kwargs)
    if name is None:
        return type(self).forward(self, x, *args, **kwargs)
    base, lora_a, lora_b = self.base_layer, self.lora_A[name], self.lora_B[name]
    result = F.linear(x, base.weight, base.bias)
    # peft's own expression: result + lora_B(lora_A(dropout(x))) * scaling, dropout being off.
    return result + F.linear(F.linear(x, lora_a.weight, lora_a.bias), lora_b.weight, lora_b.bias) * self.scaling[name]


def _short_path_adapter(self, x: torch.Tensor, args: tuple, kwargs: dict) -> str | None:
    """The active adapter's name when the short path computes exactly what peft would; else None."""
    if args or kwargs or torch.is_grad_enabled() or self.disable_adapters or self.merged:
        return None  # kwargs: peft's per-row adapter_names of a mixed batch, among others
    active = self.active_adapters
    if len(active) != 1:
        return None
    name = active[0]
    if name not in self.lora_A or name in self.lora_variant:  # not adapted here, or DoRA and other variants
        return None
    if type(self.base_layer) is not nn.Linear or type(self.lora_A[name]) is not nn.Linear:
        return None
    if self.training and not isinstance(self.lora_dropout[name], nn.Identity):
        return None
    if x.dtype != self.lora_A[name].weight.dtype or x.dtype != self.base_layer.weight.dtype:
        return None  # peft casts the input here: leave the casting rules to it
    return name
