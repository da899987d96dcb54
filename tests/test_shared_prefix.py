"""Rows that share their prompt run it once per group (`functions/training/shared_prefix.py`), and nothing changes.

The reference is `test_training_memory.reference`: one masked, eager-attention full batch. The batches
here look like RL batches: groups of samples of one prompt (prompts of different lengths), several
sampled turns after the prompt, a group with nothing to train, rows with no partner.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tinkerless.functions.training import shared_prefix, forward_backward as training
from tinkerless.functions.losses import LossConfig
from tests.test_training_memory import CONFIGS, assert_grads_close, grads, lora_worker, reference  # noqa: F401

# (prompt length, samples, completion lengths per sample)
GROUPS = [(23, 4, [9, 14, 3, 30]), (11, 3, [7, 7, 20]), (23, 2, [5, 12]), (40, 1, [10]), (5, 2, [6, 6])]


def rl_batch(seed: int = 0, *, turns: bool = True) -> list:
    from tinkerless.wire.messages import Datum

    rng = np.random.default_rng(seed)
    data = []
    for g, (prompt_len, samples, completions) in enumerate(GROUPS):
        prompt = rng.integers(0, 256, size=prompt_len)
        advantages = rng.normal(size=samples)
        for s in range(samples):
            tokens = np.concatenate([prompt, rng.integers(0, 256, size=completions[s])])
            mask = np.zeros(len(tokens), dtype=np.float32)
            mask[prompt_len:] = 1.0
            if turns and completions[s] > 8:  # an observation in the middle: untrained tokens after the prompt
                mask[prompt_len + 3 : prompt_len + 6] = 0.0
            if g == 1:
                advantage = 0.0  # a group whose samples all tie: trained tokens, zero advantage
            else:
                advantage = float(advantages[s])
            sampler = np.where(mask > 0, rng.normal(-2.0, 0.3, size=len(tokens)), 0.0).astype(np.float32)
            ref = np.where(mask > 0, rng.normal(-2.0, 0.3, size=len(tokens)), 0.0).astype(np.float32)
            data.append(Datum(tokens=tokens, mask=mask, advantages=mask * advantage, sampler_logprobs=sampler,
                              ref_logprobs=ref))
    order = np.random.default_rng(seed + 1).permutation(len(data))  # the trainer's rows come in any order
    return [data[i] for i in order]


def test_rl_batches_are_found_as_groups():
    data = rl_batch()
    groups, alone = shared_prefix.find_prefix_groups([d.tokens for d in data], [d.mask for d in data])
    # The two 23-token prompts are different prompts (random tokens); the 40-token one has no partner and
    # the 5-token one is too short to share.
    assert sorted(len(g.rows) for g in groups) == [2, 3, 4]
    assert sorted(g.prefix for g in groups) == [11, 23, 23]
    assert len(alone) == 3
    for g in groups:
        first = data[g.rows[0]].tokens[: g.prefix]
        for i in g.rows:
            assert list(data[i].tokens[: g.prefix]) == list(first)
            assert data[i].mask[: g.prefix].sum() == 0 and data[i].mask[g.prefix] == 1


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.name}-{c.normalization}-tis{c.tis_cap}-kl{c.kl_coef}")
@pytest.mark.parametrize("micro_batch_size", [16, 4], ids=["one-micro-batch", "several"])
def test_shared_prompts_give_the_full_batch_loss_gradients_and_logprobs(lora_worker, config, micro_batch_size):  # noqa: F811
    model, data = lora_worker.model, rl_batch()
    expected_loss, expected_metrics, expected_logprobs = reference(model, data, config, lora_worker.pad_id)
    expected_grads = grads(lora_worker)

    metrics, logprobs = training.forward_backward(model, data, config, lora_worker.pad_id, micro_batch_size)
    assert metrics["loss"] == pytest.approx(expected_loss, rel=1e-4, abs=1e-6)
    for key in ("ratio_mean", "clip_fraction", "kl", "tis_weight_mean"):
        if key in expected_metrics:
            assert metrics[key] == pytest.approx(expected_metrics[key], rel=1e-4, abs=1e-6), key
    assert_grads_close(grads(lora_worker), expected_grads)
    for datum, got, want in zip(data, logprobs, expected_logprobs):
        on = datum.mask > 0
        assert got.shape == (len(datum.tokens),)
        np.testing.assert_allclose(got[on], want[: len(datum.tokens)].cpu().numpy()[on], rtol=1e-4, atol=1e-5)


def test_shared_path_equals_the_plain_path(lora_worker, monkeypatch):  # noqa: F811
    """The switch that turns sharing off gives the same update (what bench runs compare against)."""
    model, data, config = lora_worker.model, rl_batch(3), LossConfig(name="ppo", tis_cap=2.0, old_logprobs_current=True)
    plan, plain_rows = training._shared_plan(model, data, [d.mask for d in data], 8)
    assert len([i for m in plan for i in m.rows]) == 9 and len(plain_rows) == 3  # the shared path really runs
    shared_metrics, shared_logprobs = training.forward_backward(model, data, config, lora_worker.pad_id, 8)
    shared_grads = grads(lora_worker)
    monkeypatch.setenv(training.SHARED_PREFIX_ENV, "0")
    plain_metrics, plain_logprobs = training.forward_backward(model, data, config, lora_worker.pad_id, 8)
    for key in ("loss", "tis_weight_mean", "ratio_mean", "entropy", "tokens"):
        assert shared_metrics[key] == pytest.approx(plain_metrics[key], rel=1e-4, abs=1e-6), key
    assert_grads_close(grads(lora_worker), shared_grads)
    for datum, a, b in zip(data, shared_logprobs, plain_logprobs):
        on = datum.mask > 0
        np.testing.assert_allclose(a[on], b[on], rtol=1e-4, atol=1e-5)


def test_a_group_over_the_activation_budget_goes_the_plain_way(lora_worker, monkeypatch):  # noqa: F811
    per_token = training.plan_micro_batches.__globals__["activation_bytes_per_token"](lora_worker.model)
    monkeypatch.setenv("TINKERLESS_ACTIVATION_MB", str(50 * per_token / 2**20))  # room for 50 tokens
    data = rl_batch(4, turns=False)
    groups, _ = shared_prefix.find_prefix_groups([d.tokens for d in data], [d.mask for d in data])
    plan, rejected = shared_prefix.plan_shared(groups, [len(d.tokens) for d in data], 16, 50)
    assert rejected  # the 4-sample group of a 23-token prompt (23 + 4 x 30 padded) does not fit
    expected_loss, _, _ = reference(lora_worker.model, data, LossConfig(), lora_worker.pad_id)
    expected = grads(lora_worker)
    metrics, _ = training.forward_backward(lora_worker.model, data, LossConfig(), lora_worker.pad_id, 16)
    assert metrics["loss"] == pytest.approx(expected_loss, rel=1e-4, abs=1e-6)
    assert_grads_close(grads(lora_worker), expected)


def test_a_group_over_the_budget_is_cut_into_sub_groups_that_share_its_prompt(lora_worker, monkeypatch):  # noqa: F811
    """A multi-turn batch opens every row with the same system prompt and first message: one group of every row,
    too big for one micro-batch. It runs as several sub-groups, each sharing the prompt, with the plain loss."""
    from tinkerless.wire.messages import Datum

    rng = np.random.default_rng(7)
    prompt = rng.integers(0, 256, size=30)
    data = []
    for s in range(8):
        tokens = np.concatenate([prompt, rng.integers(0, 256, size=20 + 3 * s)])
        mask = np.zeros(len(tokens), dtype=np.float32)
        mask[30:] = 1.0
        mask[30 + 8: 30 + 12] = 0.0  # the env's reply between two sampled turns
        data.append(Datum(tokens=tokens, mask=mask, advantages=mask * float(rng.normal()),
                          sampler_logprobs=np.where(mask > 0, -2.0, 0.0).astype(np.float32)))
    per_token = training.plan_micro_batches.__globals__["activation_bytes_per_token"](lora_worker.model)
    monkeypatch.setenv("TINKERLESS_ACTIVATION_MB", str(150 * per_token / 2**20))  # room for 150 tokens
    plan, plain_rows = training._shared_plan(lora_worker.model, data, [d.mask for d in data], 16)
    parts = [part for micro in plan for part in micro.groups]
    assert len(parts) >= 3 and all(part.prefix == 30 for part in parts)
    assert len([i for part in parts for i in part.rows]) + len(plain_rows) == 8 and len(plain_rows) <= 1
    expected_loss, _, _ = reference(lora_worker.model, data, LossConfig(), lora_worker.pad_id)
    expected = grads(lora_worker)
    metrics, _ = training.forward_backward(lora_worker.model, data, LossConfig(), lora_worker.pad_id, 16)
    assert metrics["loss"] == pytest.approx(expected_loss, rel=1e-4, abs=1e-6)
    assert_grads_close(grads(lora_worker), expected)


@settings(max_examples=200, deadline=None)
@given(
    groups=st.lists(st.tuples(st.integers(1, 60), st.lists(st.integers(1, 40), min_size=1, max_size=6)), max_size=12),
    micro_batch_size=st.integers(1, 10),
    budget=st.integers(1, 600),
)
def test_shared_plans_cover_every_row_once_within_rows_and_tokens(groups, micro_batch_size, budget):
    lengths, prefix_groups, next_row = [], [], 0
    for prefix, suffixes in groups:
        rows = list(range(next_row, next_row + len(suffixes)))
        next_row += len(suffixes)
        lengths.extend(prefix + s for s in suffixes)
        prefix_groups.append(shared_prefix.PrefixGroup(rows, prefix))
    plan, rejected = shared_prefix.plan_shared(prefix_groups, lengths, micro_batch_size, budget)
    planned = [i for micro in plan for i in micro.rows]
    assert sorted(planned + rejected) == list(range(len(lengths)))
    for micro in plan:
        rows = micro.rows
        assert 1 <= len(rows) <= micro_batch_size
        width = max(g.prefix for g in micro.groups)
        suffix = max(lengths[i] - g.prefix for g in micro.groups for i in g.rows)
        assert len(micro.groups) * width + len(rows) * suffix <= budget
    owner = {i: g for g in prefix_groups for i in g.rows}
    for micro in plan:  # a group is planned in sub-groups of two or more of its own rows, under its own prefix
        for part in micro.groups:
            assert len(part.rows) >= 2
            assert all(owner[i] is owner[part.rows[0]] for i in part.rows) and part.prefix == owner[part.rows[0]].prefix
    for g in prefix_groups:  # what fits as a whole stays whole
        fits = len(g.rows) <= micro_batch_size and g.prefix + len(g.rows) * max(lengths[i] - g.prefix for i in g.rows) <= budget
        if fits and len(g.rows) >= 2:
            assert any(set(g.rows) <= set(m.rows) for m in plan)
