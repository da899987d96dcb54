"""Several LoRA adapters in one forward, with grouped matmuls: one shrink per shared input, the expand in addmm.

peft serves a batch that mixes adapters (`adapter_names=[...]`, one per row) by splitting every LoRA layer's
input by adapter and running each adapter's two small matmuls on its rows: per layer, per adapter, a gather,
two matmuls, a scatter, and index tensors made from Python lists (a host-to-device copy each on a GPU, which
waits for the device, and cannot be captured in a CUDA graph). With many small kernels per layer that is
where a decode step's time goes (docs/performance.md). `MultiLoRA` computes the same sum differently:

* **Grouped shrink.** Projections that read the same input (q/k/v of an attention, gate/up of an MLP: a
  `GROUPS` entry) share one matmul `x @ A_cat`, A_cat holding every (projection, adapter)'s A^T side by side,
  each padded with zero columns to the largest rank.
* **Per-row adapter mask.** The shrink's columns of adapters a row does not use are multiplied by 0 (a
  (rows, adapters) mask set per forward: `rows()`), so one matmul serves any mix, with fixed shapes (a graph
  replays any mix of the same adapters by refilling the mask).
* **Fused expand.** Each projection's output is `addmm(x W^T, shrink_p, B_p)`: B_p stacks every adapter's
  scaled B^T (zeros where an adapter does not adapt the layer), so the product, scaling and sum are one BLAS
  call.

Rows of the base model (None / "__base__") have an all-zero mask row: exactly the base projection. The stacked
copies follow the adapters' weights: their version counters are checked at each `rows()` and stale copies are
refreshed in place (a graph captured over them keeps reading the same storage). Results equal peft's per-row
forward to float rounding (the sum is ordered differently): tests/test_multi_lora.py.

Only forwards without gradients take this path (sampling); training keeps peft's modules.
"""

from __future__ import annotations

import contextlib
import os
import types
from typing import Iterator

import torch
from torch import nn

BASE = "__base__"
# Sibling projections that read the same input tensor in the model families tinkerless serves.
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("query_key_value",), ("c_attn",))
_MARK = "_tinkerless_multi_lora"


class _Group:
    """One shared input's projections: their base layers, the stacked A^T and per-projection stacked B^T."""

    def __init__(self, owner: MultiLoRA, modules: list[nn.Module]):
        self.owner, self.modules = owner, modules
        adapters = owner.adapters
        self.rank = max((m.lora_A[a].weight.shape[0] for m in modules for a in adapters if a in m.lora_A), default=1)
        like = modules[0].base_layer.weight
        width = self.rank * len(adapters)  # one projection's shrink columns: [adapter][rank]
        self.a_cat = like.new_zeros((like.shape[1], width * len(modules)))
        self.b = [like.new_zeros((width, m.base_layer.weight.shape[0])) for m in modules]
        self.sources: list[tuple] = []  # (projection, adapter slot, lora_A weight, lora_B weight, scaling, versions)
        for p, module in enumerate(modules):
            for slot, name in enumerate(adapters):
                if name in module.lora_A:
                    a, b = module.lora_A[name].weight, module.lora_B[name].weight
                    self.sources.append([p, slot, a, b, module.scaling[name], None])
        self.refresh()
        self.input: torch.Tensor | None = None  # the last input shrunk, held so its identity cannot be reused
        self.shrink: torch.Tensor | None = None

    def refresh(self) -> None:
        """Copy the adapters' weights whose version moved since the last copy (in place: same storage)."""
        width = self.rank * len(self.owner.adapters)
        for source in self.sources:
            p, slot, a, b, scaling, versions = source
            if versions == (a._version, b._version):
                continue
            rank = a.shape[0]
            start = p * width + slot * self.rank
            with torch.no_grad():
                self.a_cat[:, start : start + rank].copy_(a.detach().t())
                self.b[p][slot * self.rank : slot * self.rank + rank].copy_(b.detach().t() * scaling)
            source[5] = (a._version, b._version)

    def forward(self, p: int, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        base = self.modules[p].base_layer
        weight_t = base.weight.t()
        out = torch.mm(flat, weight_t) if base.bias is None else torch.addmm(base.bias, flat, weight_t)
        if not self.sources:  # none of the adapters adapts these projections
            return out.view(*x.shape[:-1], out.shape[-1])
        if self.input is not x:  # the group's first projection on this input: one shrink for all of them
            mask = self.owner.token_mask(flat.shape[0])
            shrink = torch.mm(flat, self.a_cat).view(flat.shape[0], len(self.modules), -1, self.rank)
            self.shrink = (shrink * mask[:, None, :, None]).view(flat.shape[0], -1)
            self.input = x
        width = self.rank * len(self.owner.adapters)
        out.addmm_(self.shrink[:, p * width : (p + 1) * width], self.b[p])
        return out.view(*x.shape[:-1], out.shape[-1])


class MultiLoRA:
    """`adapters`' LoRA weights stacked over `model`'s LoRA layers, for forwards mixing them row by row."""

    def __init__(self, model: nn.Module, adapters: list[str]):
        from peft.tuners.lora.layer import Linear as LoraLinear

        self.adapters = [a for a in adapters if a != BASE]
        self.mask: torch.Tensor | None = None  # (rows, adapters): 1 where a row uses an adapter, during rows()
        self._token_mask: torch.Tensor | None = None
        self.groups: list[_Group] = []
        by_parent: dict[nn.Module, dict[str, nn.Module]] = {}
        for parent in model.modules():
            for name, child in parent.named_children():
                if type(child) is LoraLinear and type(child.base_layer) is nn.Linear:
                    by_parent.setdefault(parent, {})[name] = child
        for children in by_parent.values():
            grouped = set()
            for names in GROUPS:
                members = [children[n] for n in names if n in children]
                if members and len({m.base_layer.weight.shape[1] for m in members}) == 1:
                    self.groups.append(_Group(self, members))
                    grouped.update(n for n in names if n in children)
            for name, child in children.items():
                if name not in grouped:
                    self.groups.append(_Group(self, [child]))
        for group in self.groups:
            for p, module in enumerate(group.modules):
                _install(module, group, p)

    @contextlib.contextmanager
    def rows(self, adapter_of_row: list[str | None]) -> Iterator[None]:
        """Forwards in this block run each batch row through its adapter (None or "__base__": none)."""
        slots = {name: i for i, name in enumerate(self.adapters)}
        unknown = {a for a in adapter_of_row if a not in (None, BASE) and a not in slots}
        if unknown:
            raise KeyError(f"adapters {sorted(unknown)} are not stacked in this MultiLoRA")
        like = self.groups[0].a_cat if self.groups else torch.empty(0)
        mask = torch.zeros((len(adapter_of_row), len(self.adapters)), dtype=like.dtype)
        for row, name in enumerate(adapter_of_row):
            if name in slots:
                mask[row, slots[name]] = 1
        with self.using(mask.to(like.device)):
            yield

    @contextlib.contextmanager
    def using(self, mask: torch.Tensor) -> Iterator[None]:
        """Forwards in this block use `mask` (rows, adapters) as is (a graph's static mask buffer)."""
        for group in self.groups:
            group.refresh()
        self.mask, self._token_mask = mask, None
        try:
            yield
        finally:
            self.mask = self._token_mask = None
            for group in self.groups:
                group.input = group.shrink = None

    def token_mask(self, tokens: int) -> torch.Tensor:
        """The mask for `tokens` flattened (row, position) inputs: each row's mask repeated over its positions."""
        rows = self.mask.shape[0]
        if tokens == rows:
            return self.mask
        if self._token_mask is None or self._token_mask.shape[0] != tokens:
            self._token_mask = self.mask.repeat_interleave(tokens // rows, dim=0)
        return self._token_mask

    def current(self) -> bool:
        """Every stacked weight is still its layer's (an adapter deleted and made again, or a load that swaps
        tensors, makes new ones) and every grouped layer still runs this MultiLoRA's forward."""
        for group in self.groups:
            for p, module in enumerate(group.modules):
                if _MARK not in module.__dict__:
                    return False
            for p, slot, a, b, scaling, _ in group.sources:
                module, name = group.modules[p], self.adapters[slot]
                lora_a = module.lora_A[name] if name in module.lora_A else None
                lora_b = module.lora_B[name] if name in module.lora_B else None
                if lora_a is None or lora_b is None or lora_a.weight is not a or lora_b.weight is not b \
                        or module.scaling.get(name) != scaling:
                    return False
        return True

    def remove(self) -> None:
        """Give the layers back their own forward."""
        for group in self.groups:
            for module in group.modules:
                previous = module.__dict__.pop(_MARK, None)
                if previous is not None:
                    if previous[0] is None:
                        module.__dict__.pop("forward", None)
                    else:
                        module.forward = previous[0]
        self.groups = []


def _install(module: nn.Module, group: _Group, p: int) -> None:
    """`module`'s forward takes the grouped path while its MultiLoRA has a mask (no gradients, no extra
    arguments); otherwise the forward it had."""
    previous = module.__dict__.get("forward")  # an instance-level forward (`lora_inference`'s), or None

    def forward(self, x: torch.Tensor, *args, **kwargs):
        if group.owner.mask is not None and not args and not kwargs and not torch.is_grad_enabled():
            return group.forward(p, x)
        if previous is not None:
            return previous(x, *args, **kwargs)
        return type(self).forward(self, x, *args, **kwargs)

    module.__dict__[_MARK] = (previous,)
    module.forward = types.MethodType(forward, module)


def enabled() -> bool:
    """TINKERLESS_GROUPED_LORA=0: mixed-adapter batches take peft's per-row path (the benchmarks' "before")."""
    return os.environ.get("TINKERLESS_GROUPED_LORA", "1").strip() != "0"


def grouped_single() -> bool:
    """TINKERLESS_GROUPED_LORA_SINGLE=1: graphed blocks of one adapter also replay the stacked path (one shrink
    for q/k/v and one for gate/up) instead of `lora_inference`'s per-projection matmuls; off until a GPU run
    (bench/gpu_shapes_decode.py's `decode_speed`) shows which is faster."""
    return os.environ.get("TINKERLESS_GROUPED_LORA_SINGLE", "0").strip() == "1"


def covers(model: nn.Module, adapters: tuple[str, ...]) -> bool:
    """Whether every LoRA layer adapted by one of `adapters` is one MultiLoRA computes (a peft LoRA `Linear` over
    a plain `nn.Linear`, plain LoRA: no DoRA or other variant, no bias on A/B); else peft's path must serve them."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    for module in model.modules():
        lora_a = getattr(module, "lora_A", None)
        if not isinstance(lora_a, nn.ModuleDict) or not any(a in lora_a for a in adapters):
            continue
        if type(module) is not LoraLinear or type(module.base_layer) is not nn.Linear:
            return False
        for name in adapters:
            if name in lora_a and (name in getattr(module, "lora_variant", {}) or lora_a[name].bias is not None
                                   or module.lora_B[name].bias is not None):
                return False
    return True


class StackedAdapters:
    """A batcher's MultiLoRA for the adapters of its mixed block, rebuilt when the set or their weights change."""

    def __init__(self) -> None:
        self.multi: MultiLoRA | None = None
        self.key: tuple[str, ...] | None = None
        self.builds = 0  # statistics for tests and benchmarks

    def rows(self, model: nn.Module, adapter_of_row: list[str]):
        """A context running each row through its adapter with grouped matmuls, or None where peft must."""
        multi = self.prepare(model, adapter_of_row)
        return multi.rows(adapter_of_row) if multi is not None else None

    def prepare(self, model: nn.Module, adapter_of_row: list[str]) -> MultiLoRA | None:
        """The MultiLoRA of these rows' adapters (built or rebuilt as needed), or None where peft must serve them."""
        if not enabled() or model.training:  # training mode: peft applies the adapters' dropout
            return None
        adapters = tuple(sorted({a for a in adapter_of_row if a not in (None, BASE)}))
        if self.key == adapters and self.multi is None:
            return None  # these adapters were found to need peft's path
        if self.multi is None or self.key != adapters or not self.multi.current():
            self.release()
            self.key = adapters
            if covers(model, adapters):
                self.multi = MultiLoRA(model, list(adapters))
                self.builds += 1
        return self.multi

    def release(self) -> None:
        if self.multi is not None:
            self.multi.remove()
        self.multi, self.key = None, None
