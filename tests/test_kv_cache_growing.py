"""KV caches grown in place (kv_cache.GrowingLayer / growing_cache) hold exactly what DynamicLayer's torch.cat would.

The class of bug: a write at the wrong offset, a view that sees positions not yet written (or a later
write through an old view), growth that loses the filled part, a row selection that drops the room
(every later token copies the cache again) or mixes rows up, left padding that is not zero (a masked
NaN still poisons attention), and a decode that no longer matches transformers' own cache. The
engine-level checks (cached multi-turn rollouts against the uncached path) are tests/test_kv_cache.py.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from tinkerless.functions.sampling.kv_cache import GrowingLayer, growing_cache, stack_left_padded
from tinkerless.wire.messages import SamplingParams


def states(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randn((batch, 2, length, 4), generator=torch.Generator().manual_seed(seed))


def test_updates_equal_dynamic_layer_and_grow_by_doubling():
    mine, theirs = GrowingLayer(reserve=3), DynamicLayer()
    capacities = []
    for step, length in enumerate([5, 1, 1, 1, 1, 2, 1, 7, 1]):
        k, v = states(3, length, step), states(3, length, 100 + step)
        got, want = mine.update(k, v), theirs.update(k, v)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert mine.get_seq_length() == theirs.get_seq_length()
        capacities.append(mine.capacity)
    # The first update allocates its length plus the reserve; later growth doubles, so copies stay rare.
    assert capacities[0] == 5 + 3
    assert capacities == sorted(capacities) and len(set(capacities)) <= 3
    assert all(c >= n for c, n in zip(capacities, [5, 6, 7, 8, 9, 11, 12, 19, 20]))


def test_a_decode_step_writes_in_place_without_copying_the_cache():
    layer = GrowingLayer(reserve=4)
    layer.update(states(2, 6, 0), states(2, 6, 1))
    buffer = layer._keys.data_ptr()
    before = layer.keys.clone()
    old_view = layer.keys
    for step in range(4):
        keys, _ = layer.update(states(2, 1, 10 + step), states(2, 1, 20 + step))
        assert keys.data_ptr() == buffer  # the same storage: no torch.cat of the whole cache
    assert torch.equal(layer.keys[:, :, :6], before)
    assert old_view.shape[2] == 6 and torch.equal(old_view, before)  # an earlier view still sees only its positions


def test_selecting_rows_keeps_their_room_and_order():
    layer = GrowingLayer(reserve=5)
    k, v = states(4, 3, 0), states(4, 3, 1)
    layer.update(k, v)
    index = torch.tensor([2, 0, 0])  # a dropped row, a reordering and a repeat (rows sharing one prefill)
    layer.batch_select_indices(index)
    assert torch.equal(layer.keys, k[index]) and torch.equal(layer.values, v[index])
    assert layer.capacity == 3 + 5
    buffer = layer._keys.data_ptr()
    layer.update(states(3, 1, 2), states(3, 1, 3))
    assert layer._keys.data_ptr() == buffer


def test_assigned_tensors_are_adopted_and_grow_from_there():
    layer = GrowingLayer()
    k, v = states(2, 4, 0), states(2, 4, 1)
    layer.keys, layer.values = k, v  # what DynamicLayer's own methods (crop, repeat) and merges do
    assert layer.get_seq_length() == 4
    new_k, new_v = states(2, 1, 2), states(2, 1, 3)
    keys, values = layer.update(new_k, new_v)
    assert torch.equal(keys, torch.cat([k, new_k], dim=2)) and torch.equal(values, torch.cat([v, new_v], dim=2))
    assert layer.capacity == 8


def test_stack_left_padded_aligns_rows_and_zeroes_the_padding():
    a, b = states(2, 3, 0), states(1, 5, 1)
    empty = a.new_empty((1, 2, 0, 4))
    stacked = stack_left_padded([a, b, empty], 6, 9)
    assert stacked.shape == (4, 2, 9, 4)
    assert torch.equal(stacked[:2, :, 3:6], a) and torch.equal(stacked[2:3, :, 1:6], b)
    assert (stacked[:2, :, :3] == 0).all() and (stacked[2, :, :1] == 0).all() and (stacked[3, :, :6] == 0).all()
    assert torch.isfinite(stacked[:, :, :6]).all()


def test_growing_cache_decodes_like_transformers_cache(worker):
    """A padded prefill and cached decode steps give the same logits with either cache, on the model itself."""
    model = worker.base_model
    ids = torch.randint(0, model.config.vocab_size, (3, 7), generator=torch.Generator().manual_seed(0)).to(model.device)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :5] = 0
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    results = []
    for cache in (DynamicCache(), growing_cache(reserve=2)):  # reserve 2 < the 4 steps: it also has to grow
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
            logits, step_mask, step_positions = [out.logits[:, -1]], mask, positions[:, -1:]
            for _ in range(4):
                step_mask = torch.cat([step_mask, step_mask.new_ones((3, 1))], dim=1)
                step_positions = step_positions + 1
                out = model(input_ids=logits[-1].argmax(-1, keepdim=True), attention_mask=step_mask,
                            position_ids=step_positions, past_key_values=out.past_key_values, use_cache=True)
                logits.append(out.logits[:, -1])
        results.append(torch.stack(logits))
        if isinstance(cache.layers[0], GrowingLayer):
            assert cache.layers[0].capacity >= cache.get_seq_length() == 7 + 4
    assert (results[0] - results[1]).abs().max().item() <= 1e-6


def test_a_batch_decodes_into_the_room_its_prefill_allocated(worker):
    """The engine's batch: prefilled into GrowingLayers with room for max_tokens, so no decode step copies the
    cache (the buffers stay put while no row leaves), and the tokens are those of a plain generate call."""
    from tinkerless.functions.sampling.batcher import _Member

    engine, batcher = worker.engine, worker.engine.batcher
    prompts = [[5, 6, 7], [5, 6, 7], list(range(30, 52)), [9]]  # two rows share a prefill; lengths differ (groups)
    sampling = SamplingParams(max_tokens=10, temperature=1.0, stop_token_ids=[])  # no row leaves early
    want = engine.generate(prompts, sampling, policy=None, seed=3)
    job = engine.start(prompts, sampling, seed=3)
    batcher._waiting.append(_Member(job, None, job.prompt_width + sampling.max_tokens))
    buffers = set()
    with torch.no_grad():
        while not job.done:
            batcher.step()
            if batcher._running is not None:
                layers = batcher._running.cache.layers
                assert all(isinstance(layer, GrowingLayer) for layer in layers)
                buffers.add(layers[0]._keys.data_ptr())
    assert len(buffers) == 1
    assert [g.tokens for g in job.results()] == [g.tokens for g in want]
    assert [g.logprobs for g in job.results()] == [g.logprobs for g in want]


def test_a_batch_with_more_tokens_than_its_reserve_grows_and_draws_the_same(worker, monkeypatch):
    """Room is capped (a chat call's large max_tokens is not preallocated): past it the cache doubles, same tokens."""
    from tinkerless.functions.sampling import batcher as batcher_module

    engine = worker.engine
    prompts = [[5, 6, 7], list(range(30, 45))]
    sampling = SamplingParams(max_tokens=12, temperature=1.0, stop_token_ids=[])
    want = engine.generate(prompts, sampling, policy=None, seed=4)
    monkeypatch.setattr(batcher_module, "MAX_RESERVE", 2)
    job = engine.start(prompts, sampling, seed=4)
    engine.batcher._waiting.append(batcher_module._Member(job, None, job.prompt_width + sampling.max_tokens))
    capacities = []
    with torch.no_grad():
        while not job.done:
            engine.batcher.step()
            if engine.batcher._running is not None:
                capacities.append(engine.batcher._running.cache.layers[0].capacity)
    assert capacities[0] == 15 + 2 and max(capacities) > capacities[0]
    assert [g.tokens for g in job.results()] == [g.tokens for g in want]
    assert [g.logprobs for g in job.results()] == [g.logprobs for g in want]
