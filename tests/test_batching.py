"""Continuous batching: concurrent sample requests decode in one batch and keep their own results.

The class of bug: a request whose tokens change because other requests (other adapters,
other sampling settings, the base model) shared its batch or joined it mid-generation; a
joined row's prefill or padding leaking into other rows; log-probs of the wrong adapter;
queued calls that wait for a running generation to end instead of joining it; a stream's
later call jumping ahead of its earlier one.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_sampling_integrity import END_OF_TURN, check_generation, declare_end_of_turn

from tinkerless.functions.sampling.slicing import join_due, yield_slice
from tinkerless.functions.worker import Worker
from tinkerless.server.scheduler import Scheduler
from tinkerless.wire.messages import CreatePolicyRequest, LoraConfig, SamplingParams

# (tenant, policy, prompts, sampling, seed): other adapters, the base model, other sampling settings.
REQUESTS = [
    ("alice", "pa", [[3, 4, 5], [3, 4, 5]], SamplingParams(max_tokens=14, temperature=1.0, stop_token_ids=[]), 1),
    ("bob", "pb", [[10, 11, 12, 13, 14, 15, 16]], SamplingParams(max_tokens=12, temperature=0.8, top_k=30,
                                                                stop_token_ids=[]), 2),
    ("alice", "pb", [[20, 21]], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[]), 4),
    ("carol", None, [[40], [7, 8, 9]], SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9,
                                                      stop_token_ids=None), 3),
    ("dave", "pa", [[5, 6, 7, 8]] * 3, SamplingParams(max_tokens=16, temperature=1.0, stop_token_ids=None), 1),
]


@pytest.fixture(scope="module")
def adapters_worker(tiny_model):
    worker = declare_end_of_turn(Worker(tiny_model), END_OF_TURN)
    for name, seed in (("pa", 1), ("pb", 2)):
        worker.create_policy(CreatePolicyRequest(name, LoraConfig(rank=4, seed=seed)))
        with torch.no_grad():  # visibly different policies, from each other and from the base model
            for p in worker.policies[name].params:
                torch.nn.init.normal_(p, std=0.2, generator=torch.Generator().manual_seed(seed))
    return worker


def alone(worker, requests):
    return [worker.engine.generate(prompts, sampling, policy=policy, seed=seed)
            for _, policy, prompts, sampling, seed in requests]


def assert_same(batched, expected):
    for got, want in zip(batched, expected):
        assert [(g.tokens, g.stop_reason) for g in got] == [(g.tokens, g.stop_reason) for g in want]
        for g, w in zip(got, want):  # equal up to floating-point differences of batched products
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)


def submit_all(scheduler, worker, requests):
    return [scheduler.submit(lambda p=prompts, s=sampling, pol=policy, sd=seed:
                             worker.engine.generate(p, s, policy=pol, seed=sd), tenant=tenant)
            for tenant, policy, prompts, sampling, seed in requests]


def test_concurrent_requests_of_several_adapters_share_one_batch_and_keep_their_alone_results(adapters_worker):
    worker, batcher = adapters_worker, adapters_worker.engine.batcher
    expected = alone(worker, REQUESTS)
    scheduler = Scheduler(slice_seconds=0.05)
    gate = threading.Event()
    try:
        scheduler.submit(gate.wait, tenant="gate")  # holds the model until every request is queued
        futures = submit_all(scheduler, worker, REQUESTS)
        batcher.most_jobs, steps_before = 0, batcher.steps
        gate.set()
        batched = [f.result(timeout=120) for f in futures]
    finally:
        scheduler.close()
    assert_same(batched, expected)
    assert batcher.most_jobs == len(REQUESTS)  # rows of every request were decoded in one forward
    longest = max(s.max_tokens for *_, s, _ in REQUESTS)
    assert batcher.steps - steps_before < longest + len(REQUESTS)  # one shared loop, not one per request
    for (_, policy, prompts, sampling, _), generations in zip(REQUESTS, batched):
        stop_set = set(END_OF_TURN if sampling.stop_token_ids is None else sampling.stop_token_ids)
        for prompt, g in zip(prompts, generations):  # log-probs of the row's own adapter
            check_generation(worker, prompt, g.tokens, g.logprobs, g.stop_reason, stop_set=stop_set,
                             sampling=sampling, policy=policy)


def test_requests_that_join_mid_generation_change_no_tokens(adapters_worker):
    worker, batcher = adapters_worker, adapters_worker.engine.batcher
    long_request = ("alice", "pa", [[3, 4, 5]], SamplingParams(max_tokens=40, temperature=1.0, stop_token_ids=[]), 11)
    joiners = REQUESTS[1:4]
    expected = alone(worker, [long_request, *joiners])
    scheduler = Scheduler(slice_seconds=0.05)
    try:
        started = batcher.steps
        first = submit_all(scheduler, worker, [long_request])
        deadline = time.monotonic() + 60
        while batcher.steps < started + 5 and time.monotonic() < deadline:  # the long one is decoding
            time.sleep(0.001)
        batcher.most_jobs = 0
        later = submit_all(scheduler, worker, joiners)  # join at its next step, longer prompts than its rows
        batched = [f.result(timeout=120) for f in first + later]
    finally:
        scheduler.close()
    assert batcher.most_jobs == 1 + len(joiners), "the later requests did not join the running generation"
    assert_same(batched, expected)


def test_threads_without_a_scheduler_batch_and_keep_their_results(adapters_worker):
    """A local thread pool (no server) calling generate at once: each step is atomic under the batcher's lock."""
    worker = adapters_worker
    expected = alone(worker, REQUESTS)
    results: list = [None] * len(REQUESTS)

    def run(i, policy, prompts, sampling, seed):
        results[i] = worker.engine.generate(prompts, sampling, policy=policy, seed=seed)

    threads = [threading.Thread(target=run, args=(i, *r[1:])) for i, r in enumerate(REQUESTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert_same(results, expected)


def fake_generation(log: list, name: str, steps: int):
    """A call that pauses like a generation: after each step, when a queued call could start."""
    def run():
        for _ in range(steps):
            time.sleep(0.002)
            if join_due():
                yield_slice()
        log.append(name)
    return run


def test_a_queued_call_starts_at_a_generations_next_step_but_never_ahead_of_its_tenants_ordered_calls():
    log: list[str] = []
    scheduler = Scheduler(slice_seconds=60)  # no time slicing: only joining can let others start
    gate = threading.Event()
    try:
        scheduler.submit(gate.wait, tenant="t")
        long = scheduler.submit(fake_generation(log, "long", 200), tenant="t", stream="s", seq=1)
        same_stream = scheduler.submit(lambda: log.append("same stream"), tenant="t", stream="s", seq=2)
        unordered = scheduler.submit(lambda: log.append("same tenant, unordered"), tenant="t")
        other_stream = scheduler.submit(lambda: log.append("other stream"), tenant="t", stream="s2", seq=1)
        other_tenant = scheduler.submit(lambda: log.append("other tenant"), tenant="u", stream="s", seq=1)
        gate.set()
        for future in (long, same_stream, unordered, other_stream, other_tenant):
            future.result(timeout=30)
        pauses = scheduler.slices
    finally:
        scheduler.close()
    assert pauses <= 2  # at most one for each call that could start; none for the calls that must wait
    assert log.index("same tenant, unordered") < log.index("long")  # a Tinker sample: may join
    assert log.index("other tenant") < log.index("long")
    # The tenant's ordered calls (training steps that may change the weights it samples) wait for it.
    assert log.index("same stream") > log.index("long") and log.index("other stream") > log.index("long")


def test_calls_joining_a_batch_stay_within_its_row_and_kv_position_limits(adapters_worker):
    worker, engine = adapters_worker, adapters_worker.engine
    sampling = SamplingParams(max_tokens=10, temperature=1.0, stop_token_ids=[])
    requests = [(f"t{i}", "pa" if i % 2 else None, [[3 + i, 4, 5]], sampling, i) for i in range(5)]
    expected = alone(worker, requests)
    saved = engine.max_batch_size, engine.max_batch_positions
    scheduler = Scheduler(slice_seconds=0.05)
    gate = threading.Event()
    try:
        engine.max_batch_size, engine.max_batch_positions = 8, 2 * (3 + 10)  # room for two rows
        engine.batcher.widest = 0
        scheduler.submit(gate.wait, tenant="gate")
        futures = submit_all(scheduler, worker, requests)
        gate.set()
        batched = [f.result(timeout=120) for f in futures]
    finally:
        engine.max_batch_size, engine.max_batch_positions = saved
        scheduler.close()
    assert engine.batcher.widest == 2
    assert_same(batched, expected)


def test_a_failing_call_does_not_wedge_the_shared_batch(adapters_worker):
    engine = adapters_worker.engine
    sampling = SamplingParams(max_tokens=4, temperature=1.0, stop_token_ids=[])
    with pytest.raises(Exception, match="does not exist"):
        engine.generate([[3, 4]], sampling, policy="no-such-policy", seed=1)
    assert engine.batcher.rows == 0 and not engine.batcher._waiting
    again = engine.generate([[3, 4]], sampling, policy="pa", seed=1)
    assert len(again[0].tokens) == 4
