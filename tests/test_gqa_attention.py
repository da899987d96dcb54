"""Grouped-query attention without repeat_kv (functions/sampling/gqa_attention.py) changes no result.

The class of bug: an attention function that drops the padding mask or the causal rule, attends
to the wrong key/value head, or also takes over training's forwards (whose backward must stay
on transformers' path). Each check compares against transformers' own "sdpa" function on the same
model and weights: logits and log-probs within 1e-5 (measured: equal), sampled tokens equal.
The tiny model has 4 query heads and 2 key/value heads; SmolLM2 (slow tests) has 9 and 3.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import DynamicCache

from tinkerless.functions.sampling import gqa_attention
from tinkerless.functions.worker import Worker
from tinkerless.wire.messages import CreatePolicyRequest, LoraConfig, SamplingParams

TOLERANCE = 1e-5


@contextlib.contextmanager
def attention(model, name: str):
    """`model` runs attention implementation `name` inside the block."""
    saved = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(saved)


@pytest.fixture
def sdpa_calls(monkeypatch):
    """How many times the GQA function handed a forward to transformers' sdpa function (which then runs)."""
    calls = []
    real = gqa_attention.sdpa_attention_forward

    def counting(*args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(gqa_attention, "sdpa_attention_forward", counting)
    return calls


def padded_batch(vocab: int, lengths: list[int], seed: int = 0):
    """Left-padded ids, mask and positions of random prompts of `lengths`."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    positions = torch.zeros((len(lengths), width), dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(0, vocab, (n,), generator=generator)
        mask[i, width - n:] = 1
        positions[i, width - n:] = torch.arange(n)
    return ids, mask, positions


def prefill_then_decode(model, ids, mask, positions, steps: int = 3):
    """Logits of a padded prefill and of `steps` cached decode steps (greedy inputs), stacked per step."""
    cache = DynamicCache()
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
    logits = [out.logits[:, -1]]
    for _ in range(steps):
        ids = logits[-1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
        positions = positions[:, -1:] + 1
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=out.past_key_values,
                    use_cache=True)
        logits.append(out.logits[:, -1])
    return torch.stack(logits), out.logits


def test_the_tiny_model_has_grouped_query_heads_and_loads_with_this_attention(worker):
    config = worker.base_model.config
    assert config.num_key_value_heads < config.num_attention_heads
    assert config._attn_implementation == gqa_attention.NAME


def test_no_grad_forwards_take_the_gqa_path_and_match_sdpa(worker, sdpa_calls):
    model = worker.base_model
    batch = [t.to(model.device) for t in padded_batch(model.config.vocab_size, [9, 4, 7, 1])]
    with torch.no_grad():
        mine, _ = prefill_then_decode(model, *batch)
        # every layer of every forward ran the GQA function itself (on CPU: elsewhere SDPA's own kernels take GQA)
        assert sdpa_calls == [] if model.device.type == "cpu" else all(not grad for grad in sdpa_calls)
        with attention(model, "sdpa"):
            theirs, _ = prefill_then_decode(model, *batch)
    assert torch.isfinite(mine).all()
    assert (mine - theirs).abs().max().item() <= TOLERANCE


def test_an_unpadded_prefill_without_a_mask_stays_causal(worker):
    model = worker.base_model
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3)).to(model.device)
    with torch.no_grad():
        mine = model(input_ids=ids).logits
        with attention(model, "sdpa"):
            theirs = model(input_ids=ids).logits
        # Causal: a prefix's logits do not depend on the tokens after it.
        prefix = model(input_ids=ids[:, :5]).logits
    assert (mine - theirs).abs().max().item() <= TOLERANCE
    assert (mine[:, :5] - prefix).abs().max().item() <= TOLERANCE


def test_training_forwards_keep_transformers_path_and_gradients(worker, sdpa_calls):
    model = worker.base_model
    ids, mask, positions = (t.to(model.device) for t in padded_batch(model.config.vocab_size, [6, 3], seed=1))

    def gradient():
        model.zero_grad(set_to_none=True)
        with torch.enable_grad():
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
            logits.float().logsumexp(-1).sum().backward()
        weight = model.get_input_embeddings().weight
        grad = weight.grad.clone()
        model.zero_grad(set_to_none=True)
        return grad

    weight = model.get_input_embeddings().weight
    saved = weight.requires_grad
    weight.requires_grad_(True)
    try:
        mine = gradient()
        assert sdpa_calls and all(sdpa_calls)  # every layer went to transformers' function, with gradients on
        with attention(model, "sdpa"):
            theirs = gradient()
    finally:
        weight.requires_grad_(saved)
    assert torch.equal(mine, theirs)


def sample(worker: Worker, policy: str | None, seed: int):
    prompts = [[5, 9, 11, 2, 7, 7, 30], [40, 41], [5, 9, 11, 2, 7, 7, 30], list(range(60, 80))]
    sampling = SamplingParams(max_tokens=12, temperature=1.0, stop_token_ids=[])
    return worker.engine.generate(prompts, sampling, policy=policy, seed=seed)


def assert_same_generations(worker: Worker, policy: str | None, seed: int):
    mine = sample(worker, policy, seed)
    with attention(worker.base_model, "sdpa"):
        theirs = sample(worker, policy, seed)
    for a, b in zip(mine, theirs):
        assert a.tokens == b.tokens
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= TOLERANCE


def test_sampled_tokens_and_logprobs_match_sdpa_with_and_without_lora(tiny_model):
    worker = Worker(tiny_model)
    worker.create_policy(CreatePolicyRequest("p", LoraConfig(rank=4, seed=1)))
    with torch.no_grad():  # a visibly different policy from the base model
        for p in worker.policies["p"].params:
            p.copy_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    for policy in (None, "p"):
        assert_same_generations(worker, policy, seed=11)


def test_models_without_grouped_query_heads_are_left_alone():
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    assert not gqa_attention.install(model)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.slow
def test_smollm2_generations_match_sdpa():
    worker = Worker("smollm2")
    config = worker.base_model.config
    assert config.num_key_value_heads < config.num_attention_heads
    assert config._attn_implementation == gqa_attention.NAME
    assert_same_generations(worker, None, seed=5)


@pytest.mark.parametrize("heads, kv_heads, positions", [(4, 2, 7), (9, 3, 33), (32, 8, 5), (6, 1, 12)])
def test_a_folded_decode_step_equals_attention_over_expanded_keys_and_values(heads, kv_heads, positions):
    """The GPU decode path (query heads folded into the query length, no K/V copy) against repeat_kv + SDPA,
    with left padding and a mask wider than the keys (a pool's), and an additive float mask."""
    from transformers.integrations.sdpa_attention import repeat_kv

    generator = torch.Generator().manual_seed(heads * positions)
    batch, dim, groups = 3, 16, heads // kv_heads
    query = torch.randn(batch, heads, 1, dim, generator=generator)
    key = torch.randn(batch, kv_heads, positions, dim, generator=generator)
    value = torch.randn(batch, kv_heads, positions, dim, generator=generator)
    mask = torch.ones(batch, 1, 1, positions + 4, dtype=torch.bool)
    mask[0, ..., :3] = False  # left padding
    mask[2, ..., 1] = False
    for attention_mask in (mask, torch.zeros_like(mask, dtype=torch.float).masked_fill(~mask, float("-inf")), None):
        got, _ = gqa_attention.folded_decode(query, key, value, attention_mask, 0.25, groups)
        trimmed = attention_mask[..., :positions] if attention_mask is not None else None
        want = torch.nn.functional.scaled_dot_product_attention(
            query, repeat_kv(key, groups), repeat_kv(value, groups), attn_mask=trimmed, scale=0.25).transpose(1, 2)
        assert got.shape == (batch, 1, heads, dim)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_decode_steps_off_the_cpu_take_the_folded_path_and_prefills_transformers(monkeypatch, sdpa_calls):
    """Routing, with meta tensors standing in for a GPU's: one query position folds; a prefill, a forward with
    gradients, or TINKERLESS_GQA_DECODE=0 goes to transformers' sdpa."""
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    folded = []
    real = gqa_attention.folded_decode
    monkeypatch.setattr(gqa_attention, "folded_decode", lambda *a: folded.append(1) or real(*a))

    def call(q_len):
        query = torch.empty(2, 4, q_len, 8, device="meta")
        key = torch.empty(2, 2, 6, 8, device="meta")
        return gqa_attention.gqa_attention_forward(module, query, key, key, torch.ones(2, 1, q_len, 6, dtype=torch.bool,
                                                                                       device="meta"))

    with torch.no_grad():
        out, _ = call(1)
        assert out.shape == (2, 1, 4, 8) and folded == [1] and sdpa_calls == []
        call(5)
        assert folded == [1] and len(sdpa_calls) == 1
        monkeypatch.setenv("TINKERLESS_GQA_DECODE", "0")
        call(1)
        assert folded == [1] and len(sdpa_calls) == 2
