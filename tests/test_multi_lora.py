"""Several adapters in one forward through grouped LoRA matmuls equal peft's per-row forward.

The class of bug: a row multiplied through another row's adapter (a mask or slot off by one), an adapter's
rank or scaling mixed with another's in the stacked copies, a projection of a group given its sibling's
expand, a stacked copy left stale after an update, a base row that picks up an adapter, and the grouped
path leaking into training or into forwards outside its block.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from tinkerless.functions.sampling import lora_inference
from tinkerless.functions.sampling.multi_lora import BASE, MultiLoRA

ADAPTERS = {  # different ranks, scalings and target modules
    "pa": LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
    "pb": LoraConfig(r=8, lora_alpha=4, target_modules="all-linear"),
    "pc": LoraConfig(r=2, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]),
    "pd": LoraConfig(r=3, lora_alpha=3, target_modules=["up_proj", "o_proj"]),
}


@pytest.fixture(scope="module")
def model(tiny_model):
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    names = list(ADAPTERS)
    model = get_peft_model(base, ADAPTERS[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, ADAPTERS[name])
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    model.eval()
    return model


def peft_logits(model, ids, attention, adapter_names):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=attention, adapter_names=adapter_names).logits


def batch(rows: int, width: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 200, (rows, width), generator=generator)
    attention = torch.ones_like(ids)
    attention[::3, : width // 2] = 0  # left padding on some rows
    return ids, attention


CASES = {  # (rows' adapters, positions per row)
    "all four and the base, decode": (["pa", "pb", BASE, "pc", "pd", "pa", "pb", BASE], 1),
    "all four and the base, prefill": (["pd", BASE, "pa", "pc", "pb"], 6),
    "one adapter": (["pb"] * 3, 2),
    "adapters without shared layers, base only": (["pc", "pd", BASE], 3),
}


@pytest.mark.parametrize("mix, width", CASES.values(), ids=CASES.keys())
def test_each_row_equals_peft_through_its_own_adapter(model, mix, width):
    multi = MultiLoRA(model, list(ADAPTERS))
    try:
        ids, attention = batch(len(mix), width, seed=len(mix) + width)
        want = peft_logits(model, ids, attention, mix)
        with torch.no_grad(), multi.rows(mix):
            got = model(input_ids=ids, attention_mask=attention).logits
        assert torch.allclose(got, want, atol=2e-5, rtol=1e-5), float((got - want).abs().max())
        for row, name in enumerate(mix):  # and each row as its adapter alone gives it
            alone = peft_logits(model, ids[row : row + 1], attention[row : row + 1], [name])
            assert torch.allclose(got[row : row + 1], alone, atol=2e-5, rtol=1e-5)
        outside = peft_logits(model, ids, attention, mix)  # the grouped path ends with its block
        assert torch.equal(outside, want)
    finally:
        multi.remove()


def test_projections_that_share_an_input_share_one_shrink(model):
    multi = MultiLoRA(model, ["pa", "pb"])
    try:
        names = sorted(tuple(n for n, m in model.named_modules() if any(m is g for g in group.modules))
                       for group in multi.groups)
        attention_groups = [g for g in names if any(n.endswith("q_proj") for n in g)]
        assert attention_groups and all(len(g) == 3 and {n.rsplit(".", 1)[1] for n in g} == {"q_proj", "k_proj", "v_proj"}
                                        for g in attention_groups)
        mlp = [g for g in names if any(n.endswith("gate_proj") for n in g)]
        assert mlp and all({n.rsplit(".", 1)[1] for n in g} == {"gate_proj", "up_proj"} for g in mlp)
        shrinks = []
        original = torch.mm

        def counting(*args, **kwargs):
            shrinks.extend(i for i, group in enumerate(multi.groups) if args[1] is group.a_cat)
            return original(*args, **kwargs)

        ids, attention = batch(2, 1, seed=0)
        torch.mm = counting
        try:
            with torch.no_grad(), multi.rows(["pa", "pb"]):
                model(input_ids=ids, attention_mask=attention)
        finally:
            torch.mm = original
        # one shrink per group and forward: q/k/v share one, gate/up share one, o and down have their own
        assert sorted(shrinks) == list(range(len(multi.groups)))
        assert len(multi.groups) == 4 * model.base_model.model.config.num_hidden_layers
    finally:
        multi.remove()


def test_stacked_copies_follow_in_place_updates_and_training_keeps_peft(model):
    multi = MultiLoRA(model, list(ADAPTERS))
    mix = ["pa", "pc", BASE, "pd"]
    ids, attention = batch(len(mix), 4, seed=9)
    try:
        lora = [p for n, p in model.named_parameters() if "lora_" in n and (".pa." in n or ".pc." in n)]
        with torch.no_grad():
            for p in lora:
                p.mul_(-1.5)  # an optimizer step writes in place
        want = peft_logits(model, ids, attention, mix)
        with torch.no_grad(), multi.rows(mix):
            got = model(input_ids=ids, attention_mask=attention).logits
        assert torch.allclose(got, want, atol=2e-5, rtol=1e-5)
        with multi.rows(mix):  # gradients on: peft's own forward, which trains
            model.base_model.set_adapter("pa")
            loss = model(input_ids=ids, attention_mask=attention).logits.sum()
        loss.backward()
        assert any(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in lora)
    finally:
        for p in model.parameters():
            p.grad = None
        multi.remove()


def test_the_lean_sampling_forward_stays_underneath(model):
    lora_inference.install(model)
    multi = MultiLoRA(model, ["pa", "pb"])
    ids, attention = batch(3, 2, seed=4)
    model.base_model.set_adapter("pb")
    with torch.no_grad():
        lean = model(input_ids=ids, attention_mask=attention).logits
        with multi.rows(["pb", "pa", BASE]):
            grouped = model(input_ids=ids, attention_mask=attention).logits
    assert torch.allclose(grouped[0], lean[0], atol=2e-5, rtol=1e-5)
    multi.remove()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, attention_mask=attention).logits, lean)
    with pytest.raises(KeyError, match="not stacked"):
        with MultiLoRA(model, ["pa"]).rows(["zzz"]):
            pass
