"""The graphed decoder's pooled layout decodes exactly what the eager batcher decodes.

On a GPU the pool's forward is captured once per (policy, rows) as a CUDA graph and replayed; here the same
layout runs without capturing (`GraphedDecoder(capture=False)`), so every rule of the pool is checked token by
token against the eager path: rows that stop and leave their slots, live rows moved to a smaller bucket, rows
that join a running block, multi-turn KV sessions, mixed adapters, weights written in place
or moved to new storage between calls, and a bf16 base sampling fp32 adapters from copies refreshed in place.
Mixed adapters replay graphs of the adapters stacked (`multi_lora`).
The class of bug: a replay that reads a stale slot, mask, column or weight copy, so a row samples from keys
or weights that are not its own, with no error.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from test_sampling_integrity import END_OF_TURN, declare_end_of_turn

from tinkerless.functions.losses import LossConfig
from tinkerless.functions.sampling.graphed_decode import BUCKETS, GraphedDecoder, PooledCache, bucket
from tinkerless.functions.sampling.kv_cache import KVSession
from tinkerless.functions.worker import Worker
from tinkerless.wire.messages import (AdamParams, CreatePolicyRequest, Datum, DeletePolicyRequest, LoraConfig,
                                      SamplingParams, UpdateRequest)

PROMPTS = [[3, 4, 5], [10, 11, 12, 13, 14, 15, 16], [40], [7, 8, 9, 10, 11]] * 5
SETTINGS = [
    SamplingParams(max_tokens=30, temperature=1.0),  # rows stop at their own times (END_OF_TURN is ~14% of tokens)
    SamplingParams(max_tokens=20, temperature=0.0),
    SamplingParams(max_tokens=25, temperature=0.8, top_k=20, top_p=0.9),
    SamplingParams(max_tokens=12, temperature=1.0, stop_token_ids=[]),  # every row to the end
]


def make_worker(model: str, dtype: str = "fp32") -> Worker:
    worker = declare_end_of_turn(Worker(model, dtype=dtype), END_OF_TURN)
    for name, seed in (("pa", 1), ("pb", 2)):
        worker.create_policy(CreatePolicyRequest(name, LoraConfig(rank=4, seed=seed)))
        randomize(worker, name, seed)
    return worker


def randomize(worker: Worker, policy: str, seed: int) -> None:
    with torch.no_grad():  # visibly different policies, from each other and from the base model
        for p in worker.policies[policy].params:
            torch.nn.init.normal_(p, std=0.2, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def worker(tiny_model):
    return make_worker(tiny_model)


def both(worker: Worker, call):
    """`call()` decoded eagerly, then through a fresh graphed decoder: (eager, graphed, decoder)."""
    worker.engine.graphs = None
    eager = call()
    decoder = worker.engine.graphs = GraphedDecoder(worker.engine.model, capture=False)
    try:
        graphed = call()
    finally:
        worker.engine.graphs = None
    return eager, graphed, decoder


def assert_same(got, want, tolerance=1e-5):
    assert [(g.tokens, g.stop_reason) for g in got] == [(w.tokens, w.stop_reason) for w in want]
    for g, w in zip(got, want):
        assert g.logprobs == pytest.approx(w.logprobs, abs=tolerance)


@pytest.mark.parametrize("sampling", SETTINGS, ids=["stops", "greedy", "top-k-p", "no-stop"])
def test_pooled_decode_draws_the_eager_tokens_and_log_probs(worker, sampling):
    eager, graphed, decoder = both(worker, lambda: worker.engine.generate(PROMPTS, sampling, policy="pa", seed=3))
    assert_same(graphed, eager)
    assert decoder.replays > 0 and decoder.eager_steps == 0
    assert decoder.captures <= len(BUCKETS)


def test_rows_that_stop_leave_their_slots_and_live_rows_move_to_a_smaller_bucket(worker):
    sampling = SETTINGS[0]
    _, graphed, decoder = both(worker, lambda: worker.engine.generate(PROMPTS, sampling, policy="pb", seed=5))
    lengths = sorted(len(g.tokens) for g in graphed)
    assert lengths[0] < 5 and lengths[-1] > 15, "the check needs rows that stop early and rows that go on"
    rows_seen = {rows for _, rows, _ in decoder._graphs}
    assert bucket(len(PROMPTS)) in rows_seen and min(rows_seen) < bucket(len(PROMPTS)), rows_seen


def test_a_graph_attends_over_the_live_width_not_the_whole_pool(worker):
    """After a long call grew the pool, a short call's graphs read only its live width (rounded up to a power of
    two from 128, at most the pool), and a block whose width crosses a span moves to the next; the tokens are the
    eager ones."""
    long = SamplingParams(max_tokens=260, temperature=1.0, stop_token_ids=[])
    short = SamplingParams(max_tokens=20, temperature=0.8, top_k=20)
    replays_by_span: list = []  # the graphed run's graphs after the long call, then the short call's replays

    def calls():
        graphs = worker.engine.graphs  # None in the eager run
        out = [worker.engine.generate(PROMPTS[:4], long, policy="pa", seed=1)]
        if graphs is not None:
            replays_by_span.append(set(graphs._graphs))
            replays = graphs.replays
        out.append(worker.engine.generate(PROMPTS[:4], short, policy="pa", seed=2))
        if graphs is not None:
            replays_by_span.append(graphs.replays - replays)
        return out

    eager, graphed, decoder = both(worker, calls)
    for got, want in zip(graphed, eager):
        assert_same(got, want)
    after_long = replays_by_span[0]
    assert decoder.pool.positions == 384 and {span for _, _, span in after_long} == {128, 256, 384}  # 384: the pool
    assert replays_by_span[1] > 0
    assert {span for _, _, span in set(decoder._graphs) - after_long} <= {128}, "the short call reads 128 positions"


def test_the_base_model_and_each_policy_replay_their_own_graphs(worker):
    sampling = SETTINGS[1]

    def calls():
        return [worker.engine.generate(PROMPTS[:6], sampling, policy=policy, seed=1) for policy in ("pa", None, "pb")]

    eager, graphed, decoder = both(worker, calls)
    for got, want in zip(graphed, eager):
        assert_same(got, want)
    assert decoder.captured == {"pa", "pb", "__base__"}
    assert eager[0][0].tokens != eager[2][0].tokens or eager[0][1].tokens != eager[2][1].tokens


def test_rows_joining_a_running_block_and_mixed_adapters_change_no_tokens(worker):
    """Threads without a scheduler batch together: later calls join the running block (which leaves the pool) and
    rows of two adapters share a forward (a graph of the adapters stacked); every call keeps its alone result."""
    requests = [("pa", PROMPTS[:4], SETTINGS[0], 1), ("pb", PROMPTS[4:9], SETTINGS[2], 2),
                (None, PROMPTS[9:11], SETTINGS[1], 3), ("pa", PROMPTS[11:16], SETTINGS[3], 4)]
    alone = [worker.engine.generate(p, s, policy=pol, seed=seed) for pol, p, s, seed in requests]
    decoder = worker.engine.graphs = GraphedDecoder(worker.engine.model, capture=False)
    try:
        results: list = [None] * len(requests)
        barrier = threading.Barrier(len(requests))

        def run(i, policy, prompts, sampling, seed):
            barrier.wait()
            results[i] = worker.engine.generate(prompts, sampling, policy=policy, seed=seed)

        threads = [threading.Thread(target=run, args=(i, *r)) for i, r in enumerate(requests)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        worker.engine.graphs = None
    for got, want in zip(results, alone):
        assert_same(got, want, tolerance=1e-4)  # batched products: float rounding
    assert any(adapter.startswith("mixed:") for adapter, _, _ in decoder._graphs), \
        "rows of several adapters replay a graph of the adapters stacked (multi_lora)"


def test_multi_turn_sessions_keep_the_pooled_keys_and_values(worker):
    """A row that finishes in the pool leaves its keys/values in its session; the next turn prefills only what
    was appended, and the turns equal the eager ones."""
    def conversation():
        sessions = [KVSession() for _ in range(4)]
        prompts = [list(p) for p in PROMPTS[:4]]
        turns = []
        for turn in range(3):
            out = worker.engine.generate(prompts, SETTINGS[0], policy="pa", seed=turn, sessions=sessions)
            turns.append(out)
            prompts = [p + g.tokens + [20 + turn, 21] for p, g in zip(prompts, out)]
        for session in sessions:
            session.close()
        return turns

    hits = worker.engine.sessions.hits
    eager, graphed, decoder = both(worker, conversation)
    for got, want in zip(graphed, eager):
        assert_same(got, want)
        assert [g.cached_tokens for g in got] == [w.cached_tokens for w in want]
    assert sum(g.cached_tokens for turn in graphed[1:] for g in turn) > 0
    assert worker.engine.sessions.hits > hits and decoder.replays > 0


def test_a_graph_samples_the_weights_after_an_update_a_reload_and_a_remade_adapter(tiny_model):
    worker = make_worker(tiny_model)
    decoder = GraphedDecoder(worker.engine.model, capture=False)
    sampling = SETTINGS[1]

    def sample():
        return worker.engine.generate(PROMPTS[:8], sampling, policy="pa", seed=2)

    def compare():
        worker.engine.graphs = None
        eager = sample()
        worker.engine.graphs = decoder
        assert_same(sample(), eager)
        worker.engine.graphs = None
        return eager

    first = compare()
    tokens = np.arange(5, 25, dtype=np.int32)
    ones = np.ones(len(tokens), np.float32)
    for _ in range(3):  # optimizer steps write in place: the graph reads the new weights
        worker.update(UpdateRequest("pa", [Datum(tokens, ones, advantages=ones, sampler_logprobs=-ones)],
                                    LossConfig(), AdamParams(learning_rate=0.5)))
    after_update = compare()
    assert [g.tokens for g in after_update] != [g.tokens for g in first]
    captures = decoder.captures
    with torch.no_grad():  # weights moved to new storage: the graph is recaptured, not replayed stale
        for p in worker.policies["pa"].params:
            p.data = torch.randn_like(p) * 0.2
    compare()
    assert decoder.captures > captures
    worker.delete_policy(DeletePolicyRequest("pa"))  # an adapter deleted and made again under the same name
    worker.create_policy(CreatePolicyRequest("pa", LoraConfig(rank=4, seed=9)))
    randomize(worker, "pa", 9)
    captures = decoder.captures
    compare()
    assert decoder.captures > captures


def test_a_bf16_base_samples_fp32_adapters_from_copies_refreshed_in_place(tiny_model):
    """The bf16 copies a graph reads keep their storage: an update refreshes them in place before the replay."""
    worker = make_worker(tiny_model, dtype="bf16")
    decoder = GraphedDecoder(worker.engine.model, capture=False)
    sampling = SETTINGS[1]
    tokens = np.arange(5, 25, dtype=np.int32)
    ones = np.ones(len(tokens), np.float32)
    for step in range(3):
        worker.engine.graphs = decoder
        graphed = worker.engine.generate(PROMPTS[:8], sampling, policy="pa", seed=2)
        worker.engine.graphs = None
        eager = worker.engine.generate(PROMPTS[:8], sampling, policy="pa", seed=2)
        assert_same(graphed, eager, tolerance=1e-2)  # bf16 rounding of batched products
        worker.update(UpdateRequest("pa", [Datum(tokens, ones, advantages=ones, sampler_logprobs=-ones)],
                                    LossConfig(), AdamParams(learning_rate=0.5)))
    assert decoder.captures <= 2, "an in-place refresh must not force a recapture"


def test_a_pooled_block_gives_each_row_its_own_slot_and_frees_nothing_twice(worker):
    """The pool's bookkeeping at the seams: slots after rows leave, compaction, and the copy back out."""
    worker.engine.graphs = decoder = GraphedDecoder(worker.engine.model, capture=False)
    try:
        job = worker.engine.start(PROMPTS[:6], SETTINGS[3], seed=1)
        batcher = worker.engine.batcher
        with torch.no_grad():
            from tinkerless.functions.sampling.blocks import _Member

            batcher._waiting.append(_Member(job, "pa", job.prompt_width + job.sampling.max_tokens))
            batcher.step()  # the prefill
            batcher.step()  # the first decode step: the block moves into the pool
            block = batcher._running
            assert isinstance(block.cache, PooledCache) and block.cache.slots == list(range(6))
            block.cache.batch_select_indices(torch.tensor([1, 4]))
            assert block.cache.slots == [1, 4]
            keys_before = decoder.pool.layers[0][0][[1, 4], :, : block.cache.length].clone()
            block.cache.compact()
            assert block.cache.slots == [0, 1]
            assert torch.equal(decoder.pool.layers[0][0][:2, :, : block.cache.length], keys_before)
            growing = block.cache.to_growing()
            assert torch.equal(growing.layers[0].keys, keys_before)
            batcher._running = None
    finally:
        worker.engine.graphs = None


def test_a_forward_that_cannot_be_captured_turns_graphs_off_and_samples_eagerly(worker, monkeypatch):
    """A model doing something a CUDA graph cannot replay fails its capture: the engine warns once, decodes
    eagerly from then on, and the tokens are the eager ones (never a failed or wrong sample)."""
    from tinkerless.functions.sampling import graphed_decode

    def refuse(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphed_decode, "_Graph", refuse)
    with pytest.warns(RuntimeWarning, match="CUDA graphs are off"):
        eager, graphed, decoder = both(worker, lambda: worker.engine.generate(PROMPTS, SETTINGS[0], policy="pa", seed=8))
    assert_same(graphed, eager)
    assert decoder.disabled and "stream is capturing" in decoder.disabled and decoder.replays == 0
