"""The short LoRA sampling path (functions/sampling/lora_inference.py) computes what peft's forward does: base rows
bit-identical, adapter rows to float rounding (one fused addmm instead of peft's mm, multiply and add),
deterministically, and always from the layer's current weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from peft.tuners.lora.layer import Linear as LoraLinear

from tinkerless.functions.sampling import lora_inference
from tinkerless.functions.worker import Worker
from tinkerless.wire.messages import CreatePolicyRequest, LoraConfig, SampleRequest, SamplingParams


def _perturbed_worker(tiny_model) -> Worker:
    worker = Worker(tiny_model)
    worker.create_policy(CreatePolicyRequest("pa", LoraConfig(rank=4, seed=1)))
    worker.create_policy(CreatePolicyRequest("pb", LoraConfig(rank=8, seed=2, target_modules=["q_proj", "v_proj"])))
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():  # lora_B starts at zero: move it so the adapters change the outputs
        for name in ("pa", "pb"):
            for p in worker.policies[name].params:
                p.add_(0.2 * torch.randn(p.shape, generator=generator).to(p.device))
    return worker


@pytest.fixture(scope="module")
def worker(tiny_model):
    return _perturbed_worker(tiny_model)


def _lora_layers(model):
    return [m for m in model.modules() if type(m) is LoraLinear]


def _peft_logits(model, ids):
    """The model's logits with every LoRA layer on peft's own forward."""
    layers = _lora_layers(model)
    saved = [layer.__dict__.pop("forward") for layer in layers]
    try:
        return model(input_ids=ids).logits
    finally:
        for layer, forward in zip(layers, saved):
            layer.forward = forward


def test_every_lora_layer_gets_the_short_path(worker):
    layers = _lora_layers(worker.model)
    assert layers and all("forward" in layer.__dict__ for layer in layers)
    assert lora_inference.install(worker.model) == 0  # idempotent


def _assert_same_outputs(mine: torch.Tensor, theirs: torch.Tensor, policy: str | None) -> None:
    if policy is None:
        assert torch.equal(mine, theirs)  # the same BLAS calls on the same operands
    else:
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", ["pa", "pb", None])
def test_sampling_forward_equals_peft(worker, policy):
    ids = torch.randint(0, worker.vocab_size, (3, 11), generator=torch.Generator().manual_seed(0)).to(worker.device)
    with torch.no_grad(), worker._activate(policy):
        mine = worker.model(input_ids=ids).logits
        again = worker.model(input_ids=ids).logits
        theirs = _peft_logits(worker.model, ids)
        with worker._activate(None):
            base = worker.model(input_ids=ids).logits
    assert torch.equal(mine, again)  # deterministic
    _assert_same_outputs(mine, theirs, policy)
    if policy is not None:
        assert (mine - base).abs().max() > 1e-2  # the adapter really acts on this path


def test_gradients_mixed_batches_and_other_cases_go_to_peft(worker, monkeypatch):
    calls = []
    real = LoraLinear.forward

    def counting(self, x, *args, **kwargs):
        calls.append(kwargs.get("adapter_names") is not None)
        return real(self, x, *args, **kwargs)

    monkeypatch.setattr(LoraLinear, "forward", counting)
    ids = torch.randint(0, worker.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1)).to(worker.device)
    with worker._activate("pa"):
        with torch.no_grad():
            worker.model(input_ids=ids)
        assert calls == []  # the short path took every layer
        with torch.enable_grad():
            worker.model(input_ids=ids).logits.sum().backward()
        worker.model.zero_grad(set_to_none=True)
        assert len(calls) == len(_lora_layers(worker.model)) and not any(calls)
        calls.clear()
        with torch.no_grad():
            worker.model(input_ids=ids, adapter_names=["pa", "pb"])
        assert calls and all(calls)  # a mixed-adapter batch: peft's per-row path
        calls.clear()
        with torch.no_grad():
            worker.model(input_ids=ids.to(torch.long), attention_mask=torch.ones_like(ids))
        assert calls == []


def test_samples_match_with_the_short_path_off(tiny_model, worker, monkeypatch):
    """Tokens and sampler log-probs of a seeded batch are those of peft's own path (the switch off)."""
    request = SampleRequest(
        policy="pa", prompts=[[5, 9, 12, 7], [3, 4]], num_samples=2, seed=11,
        sampling=SamplingParams(max_tokens=6, temperature=1.0, stop_token_ids=[]),
    )  # fmt: skip
    mine = [s for group in worker.sample(request).sequences for s in group]
    monkeypatch.setenv("TINKERLESS_LEAN_LORA", "0")
    plain = _perturbed_worker(tiny_model)
    assert not any("forward" in layer.__dict__ for layer in _lora_layers(plain.model))
    theirs = [s for group in plain.sample(request).sequences for s in group]
    assert [s.tokens for s in mine] == [s.tokens for s in theirs]
    for a, b in zip(mine, theirs):
        np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs), rtol=1e-5, atol=1e-5)
    again = [s for group in worker.sample(request).sequences for s in group]
    assert [(s.tokens, list(s.logprobs)) for s in again] == [(s.tokens, list(s.logprobs)) for s in mine]


def _assert_matches_peft(worker, policy, seed=3):
    ids = torch.randint(0, worker.vocab_size, (2, 7), generator=torch.Generator().manual_seed(seed)).to(worker.device)
    with torch.no_grad(), worker._activate(policy):
        mine = worker.model(input_ids=ids).logits
        theirs = _peft_logits(worker.model, ids)
    _assert_same_outputs(mine, theirs, policy)
    return mine


def test_the_base_model_takes_the_short_path_too(worker, monkeypatch):
    """Base rows (every adapter disabled) skip peft's bookkeeping as adapter rows do: the two are compared as equals."""
    calls = []
    monkeypatch.setattr(LoraLinear, "forward", lambda self, x, *a, **k: calls.append(1))
    ids = torch.randint(0, worker.vocab_size, (2, 5), generator=torch.Generator().manual_seed(2)).to(worker.device)
    with torch.no_grad(), worker._activate(None):
        worker.model(input_ids=ids)
    assert calls == []


def test_in_place_updates_show_through_and_swapped_storage_rebuilds(tiny_model):
    """Optimizer steps write the weights in place (the views see them at once); a load may swap a parameter's
    storage, and peft may rescale: either way the next forward uses the layer's current weights."""
    worker = _perturbed_worker(tiny_model)
    before = _assert_matches_peft(worker, "pa")
    params = worker.policies["pa"].params
    with torch.no_grad():
        params[1].add_(0.5)  # in place, as AdamW does
    after = _assert_matches_peft(worker, "pa")
    assert (before - after).abs().max() > 1e-3
    with torch.no_grad():
        for p in params:
            p.data = p.data.clone() * 1.5  # a new storage under the same Parameter
    swapped = _assert_matches_peft(worker, "pa")
    assert (after - swapped).abs().max() > 1e-3
    layer = _lora_layers(worker.model)[0]
    layer.scaling["pa"] *= 2
    rescaled = _assert_matches_peft(worker, "pa")
    assert (swapped - rescaled).abs().max() > 1e-3


def test_a_policy_made_again_under_a_deleted_name_is_not_served_stale_weights(tiny_model):
    worker = _perturbed_worker(tiny_model)
    old = _assert_matches_peft(worker, "pb")
    assert worker.drop_policy("pb")
    assert all("pb" not in getattr(layer, "_tinkerless_views") for layer in _lora_layers(worker.model))  # freed
    worker.create_policy(CreatePolicyRequest("pb", LoraConfig(rank=8, seed=5, target_modules=["q_proj", "v_proj"])))
    with torch.no_grad():
        for p in worker.policies["pb"].params:
            p.add_(0.3)
    new = _assert_matches_peft(worker, "pb")
    assert (old - new).abs().max() > 1e-3


def test_a_real_dropout_in_training_mode_goes_to_peft(tiny_model):
    worker = Worker(tiny_model)
    worker.create_policy(CreatePolicyRequest("dropped", LoraConfig(rank=4, seed=1, dropout=0.5)))
    layer = _lora_layers(worker.model)[0]
    x = torch.randn(1, 3, layer.in_features, generator=torch.Generator().manual_seed(0)).to(worker.device)
    with torch.no_grad(), worker._activate("dropped"):
        layer.eval()
        assert lora_inference._views(layer, x, (), {}) is not None  # eval mode: dropout is the identity
        layer.train()
        try:
            assert lora_inference._views(layer, x, (), {}) is None
        finally:
            layer.eval()
