"""The memory-lean training path (no attention mask, length-bucketed micro-batches chosen by tokens,
activation recompute for long ones) gives the loss, gradients and log-probs of a plain full-batch pass.

The reference below is the straightforward computation: one right-padded batch with an attention mask,
eager attention, the full vocabulary projection, one `compute_loss` over the whole batch.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tinkerless.functions.training import forward_backward as training
from tinkerless.functions.losses import LossConfig, compute_loss
from tinkerless.functions.training.micro_batches import (
    activation_bytes_per_token,
    plan_micro_batches,
    recompute_in_backward,
)
from tinkerless.functions.worker import Worker
from tinkerless.wire.messages import CreatePolicyRequest, Datum, LoraConfig

LENGTHS = [37, 5, 64, 18, 64, 9, 41]  # ragged, with ties, one too short to train much


@pytest.fixture(scope="module")
def lora_worker(tiny_model):
    worker = Worker(tiny_model)
    worker.create_policy(CreatePolicyRequest("default", LoraConfig(rank=4, seed=3)))
    # Move the adapter off its zero init so gradients reach every LoRA matrix.
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in worker.policies["default"].params:
            p.add_(0.05 * torch.randn(p.shape, generator=generator).to(p.device))
    return worker


def episodes(seed: int = 0) -> list[Datum]:
    rng = np.random.default_rng(seed)
    data = []
    for row, n in enumerate(LENGTHS):
        tokens = rng.integers(0, 256, size=n)
        mask = np.zeros(n, dtype=np.float32)
        for start in range(3, n, 11):  # several sampled turns with observations between them
            mask[start : start + 4] = 1.0
        if row == 5:
            mask[:] = 0.0  # an episode with nothing to train
        sampler = np.where(mask > 0, rng.normal(-2.0, 0.3, size=n), 0.0).astype(np.float32)
        ref = np.where(mask > 0, rng.normal(-2.0, 0.3, size=n), 0.0).astype(np.float32)
        advantage = float(rng.normal())
        data.append(Datum(tokens=tokens, mask=mask, advantages=mask * advantage, sampler_logprobs=sampler, ref_logprobs=ref))
    return data


def reference(model, data: list[Datum], config: LossConfig, pad_id: int):
    """Loss, metrics, grads and per-datum log-probs of one masked full-batch pass with eager attention."""
    batch = training.make_batch(data, pad_id, model.device)
    previous = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention).logits.float()
    finally:
        model.config._attn_implementation = previous
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    picked = torch.gather(logp, 2, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    logprobs = torch.cat([torch.zeros(len(data), 1, device=picked.device), picked], dim=1)
    loss, metrics = compute_loss(
        config,
        logprobs,
        batch.field([d.mask for d in data]),
        advantages=batch.field([d.advantages for d in data]),
        sampler_logprobs=batch.field([d.sampler_logprobs for d in data]),
        old_logprobs=batch.field([d.old_logprobs for d in data]),
        ref_logprobs=batch.field([d.ref_logprobs for d in data]),
    )
    loss.backward()
    return float(loss.detach()), metrics, logprobs.detach()


def assert_grads_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Equal up to float32 rounding, which grows with the summation order of many tokens: each
    gradient is compared to within 1e-5 of its own largest entry."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-5 * float(w.abs().max()) + 1e-12)


def grads(worker) -> list[torch.Tensor]:
    out = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in worker.policies["default"].params]
    for p in worker.policies["default"].params:
        p.grad = None
    return out


CONFIGS = [
    LossConfig(name="importance_sampling"),
    LossConfig(name="ppo", normalization="sequence", kl_coef=0.1),
    LossConfig(name="cispo", normalization="constant", normalization_constant=50.0),
    LossConfig(name="ppo", tis_cap=2.0, old_logprobs_current=True),
    LossConfig(name="cross_entropy"),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.name}-{c.normalization}-tis{c.tis_cap}-kl{c.kl_coef}")
@pytest.mark.parametrize("budget_mb", [None, "0.05"], ids=["buckets", "recompute-every-row"])
def test_lean_path_matches_a_full_masked_batch(lora_worker, monkeypatch, config, budget_mb):
    if budget_mb is not None:  # a budget of a few tokens: one row per micro-batch, each recomputed in backward
        monkeypatch.setenv("TINKERLESS_ACTIVATION_MB", budget_mb)
    model, data = lora_worker.model, episodes()
    expected_loss, expected_metrics, expected_logprobs = reference(model, data, config, lora_worker.pad_id)
    expected_grads = grads(lora_worker)

    metrics, logprobs = training.forward_backward(model, data, config, lora_worker.pad_id, micro_batch_size=3)
    assert metrics["loss"] == pytest.approx(expected_loss, rel=1e-4, abs=1e-6)
    for key in ("ratio_mean", "clip_fraction", "kl", "tis_weight_mean"):
        if key in expected_metrics:
            assert metrics[key] == pytest.approx(expected_metrics[key], rel=1e-4, abs=1e-6), key
    assert_grads_close(grads(lora_worker), expected_grads)
    # Log-probs come back in the caller's order, exact at every trained token.
    assert len(logprobs) == len(data)
    for datum, got, want in zip(data, logprobs, expected_logprobs):
        on = datum.mask > 0
        assert got.shape == (len(datum.tokens),)
        np.testing.assert_allclose(got[on], want[: len(datum.tokens)].cpu().numpy()[on], rtol=1e-4, atol=1e-5)


def test_forward_matches_the_masked_batch_at_every_position(lora_worker, monkeypatch):
    monkeypatch.setenv("TINKERLESS_ACTIVATION_MB", "0.2")  # several micro-batches, reordered by length
    data = episodes(1)
    batch = training.make_batch(data, lora_worker.pad_id, lora_worker.model.device)
    with torch.no_grad():
        logits = lora_worker.model(input_ids=batch.input_ids, attention_mask=batch.attention).logits.float()
        picked = torch.gather(torch.log_softmax(logits[:, :-1], -1), 2, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    got = training.forward(lora_worker.model, data, lora_worker.pad_id, micro_batch_size=2)
    for row, (datum, values) in enumerate(zip(data, got)):
        n = len(datum.tokens)
        assert values.shape == (n,) and values[0] == 0.0
        np.testing.assert_allclose(values[1:], picked[row, : n - 1].cpu().numpy(), rtol=1e-4, atol=1e-5)


def test_tis_from_the_current_pass_equals_a_separate_forward(lora_worker):
    """old_logprobs_current=True gives what the trainer got with an extra forward for old_logprobs."""
    model, pad = lora_worker.model, lora_worker.pad_id
    data = episodes(2)
    old = training.forward(model, data, pad, micro_batch_size=4)
    with_forward = [dataclasses.replace(d, old_logprobs=o) for d, o in zip(data, old)]
    explicit, _ = training.forward_backward(model, with_forward, LossConfig(name="ppo", tis_cap=1.5), pad, 4)
    explicit_grads = grads(lora_worker)
    current, _ = training.forward_backward(model, data, LossConfig(name="ppo", tis_cap=1.5, old_logprobs_current=True), pad, 4)
    for key in ("loss", "tis_weight_mean", "ratio_mean"):
        assert current[key] == pytest.approx(explicit[key], rel=1e-5, abs=1e-7)
    assert_grads_close(grads(lora_worker), explicit_grads)


def test_tis_without_old_logprobs_still_needs_the_flag(lora_worker):
    from tinkerless.errors import ConfigError

    with pytest.raises(ConfigError, match="old_logprobs"):
        training.forward_backward(lora_worker.model, episodes(), LossConfig(name="ppo", tis_cap=2.0), lora_worker.pad_id, 4)
    with pytest.raises(ConfigError, match="old_logprobs_current"):
        LossConfig(old_logprobs_current="yes").validate()


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=40),
    micro_batch_size=st.integers(1, 9),
    token_budget=st.integers(1, 2000),
)
def test_micro_batches_cover_every_row_once_within_rows_and_tokens(lengths, micro_batch_size, token_budget):
    plan = plan_micro_batches(lengths, micro_batch_size, token_budget=token_budget)
    rows = [i for micro in plan for i in micro.rows]
    assert sorted(rows) == list(range(len(lengths)))
    for micro in plan:
        assert 1 <= len(micro.rows) <= micro_batch_size
        assert micro.width == max(lengths[i] for i in micro.rows)
        padded = micro.width * len(micro.rows)
        # Over the budget only as a single row, and exactly then recomputed.
        assert padded <= token_budget or len(micro.rows) == 1
        assert micro.recompute == (padded > token_budget)
    # Longest first: padding stays small, lengths never interleave across micro-batches.
    widths = [lengths[i] for i in rows]
    assert widths == sorted(widths, reverse=True)


def test_token_budget_follows_the_model_size(lora_worker, monkeypatch):
    per_token = activation_bytes_per_token(lora_worker.model)
    assert per_token and per_token > 0
    monkeypatch.setenv("TINKERLESS_ACTIVATION_MB", str(100 * per_token / 2**20))  # room for 100 tokens
    plan = plan_micro_batches([30, 30, 30, 30, 200], 16, lora_worker.model)
    assert [len(m.rows) for m in plan] == [1, 3, 1]
    assert [m.recompute for m in plan] == [True, False, False]
    monkeypatch.setenv("TINKERLESS_ACTIVATION_MB", "-3")
    from tinkerless.errors import ConfigError

    with pytest.raises(ConfigError, match="TINKERLESS_ACTIVATION_MB"):
        plan_micro_batches([3], 4, lora_worker.model)


def test_recompute_keeps_dropout_off_and_restores_the_layers(tiny_model):
    """Checkpointing flags only the decoder layers as training: a LoRA dropout of 0.5 stays off."""
    worker = Worker(tiny_model)
    worker.create_policy(CreatePolicyRequest("default", LoraConfig(rank=4, dropout=0.5, seed=1)))
    with torch.no_grad():
        for p in worker.policies["default"].params:
            p.add_(0.1 * torch.randn_like(p))
    ids = torch.arange(40, device=worker.model.device).reshape(2, 20)
    plain = worker.model(input_ids=ids).logits
    flags_before = {name: m.training for name, m in worker.model.named_modules()}
    with recompute_in_backward(worker.model):
        again = worker.model(input_ids=ids).logits
        again.sum().backward()
    torch.testing.assert_close(again, plain, rtol=0, atol=0)  # no dropout: the same function
    assert {name: m.training for name, m in worker.model.named_modules()} == flags_before
    assert not any(getattr(m, "gradient_checkpointing", False) for m in worker.model.modules())
