"""Several decode steps per host read decode exactly what the one-step loop decodes.

On a GPU `device_decode` runs N steps (draws, stop checks, token buffer) before one host read, replaying
graphs; here the same chunks run eagerly and through the pooled layout without capture, compared token by
token with the one-step loop (and, with greedy decoding, with the one-step loop of the engine before the
draws moved to the device: the argmax). The class of bug: a row that stops mid-chunk whose later (masked)
steps leak into its tokens, its kept keys/values or another row; a row recorded one step off; a draw at a
wrong position; rows that join, mix adapters or continue sessions getting other tokens than alone.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_graphed_decode import PROMPTS, SETTINGS, assert_same, make_worker, randomize

from tinkerless.errors import UserError
from tinkerless.functions.losses import LossConfig
from tinkerless.functions.sampling.blocks import _Member
from tinkerless.functions.sampling.device_decode import default_steps
from tinkerless.functions.sampling.graphed_decode import GraphedDecoder
from tinkerless.functions.sampling.kv_cache import KVSession
from tinkerless.wire.messages import AdamParams, Datum, SamplingParams, UpdateRequest

CHUNKS = [3, 8]
last_decoder: list = [None]  # the graphed decoder of the last `run`


@pytest.fixture(scope="module")
def worker(tiny_model):
    return make_worker(tiny_model)


def run(worker, call, steps: int, pooled: bool = False):
    """`call()` with `steps` decode steps per host read (1: the one-step loop), eagerly or in the pool."""
    batcher = worker.engine.batcher
    batcher.decode_steps = steps
    worker.engine.graphs = decoder = GraphedDecoder(worker.engine.model, capture=False) if pooled else None
    last_decoder[:] = [decoder]
    chunks = batcher.chunks
    try:
        result = call()
        assert (batcher.chunks > chunks) == (steps > 1), "the chunked path must run exactly when asked"
        assert not pooled or decoder.replays > 0
        return result
    finally:
        batcher.decode_steps = 1
        worker.engine.graphs = None


@pytest.mark.parametrize("pooled", [False, True], ids=["eager", "pooled"])
@pytest.mark.parametrize("sampling", SETTINGS, ids=["stops", "greedy", "top-k-p", "no-stop"])
def test_chunks_of_steps_draw_the_one_step_tokens_and_log_probs(worker, sampling, pooled):
    def call():
        return worker.engine.generate(PROMPTS, sampling, policy="pa", seed=3)

    want = run(worker, call, 1)
    for steps in CHUNKS:
        assert_same(run(worker, call, steps, pooled), want)
    lengths = sorted(len(g.tokens) for g in want)
    if sampling is SETTINGS[0]:
        assert lengths[0] < 5 and lengths[-1] > 12, "the check needs rows that stop at their own times"


def test_greedy_chunks_equal_the_argmax_of_a_full_forward(worker):
    """Greedy decoding is what the engine gave before the draws moved to the device: each token the argmax
    of one forward over the prompt and the tokens before it."""
    sampling = SamplingParams(max_tokens=9, temperature=0.0, stop_token_ids=[])
    got = run(worker, lambda: worker.engine.generate(PROMPTS[:4], sampling, policy="pb", seed=0), 4)
    for prompt, generation in zip(PROMPTS[:4], got):
        ids = torch.tensor([prompt + generation.tokens])
        with torch.no_grad(), worker._activate("pb"):
            logits = worker.engine.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        assert generation.tokens == logits.argmax(-1).tolist()
        assert generation.logprobs == pytest.approx(
            torch.log_softmax(logits, -1).max(-1).values.tolist(), abs=1e-5)


def test_a_row_draws_the_same_tokens_whatever_rows_share_its_batch(worker):
    """Same (seed, row index): same tokens, alone or beside rows of other prompts, settings and policies."""
    mine = SamplingParams(max_tokens=20, temperature=1.0, top_k=30)
    alone = run(worker, lambda: worker.engine.generate([PROMPTS[1]], mine, policy="pa", seed=11), 1)
    others = [(PROMPTS[2:7], SETTINGS[2], "pb", 1), (PROMPTS[7:9], SETTINGS[1], None, 2),
              (PROMPTS[3:6], SETTINGS[3], "pa", 5)]
    for steps in (1, 5):
        batcher = worker.engine.batcher
        jobs = [worker.engine.start(p, s, seed=seed, policy=pol) for p, s, pol, seed in others]
        job = worker.engine.start([PROMPTS[1]], mine, seed=11, policy="pa")
        members = [_Member(j, pol, j.prompt_width + s.max_tokens) for j, (_, s, pol, _) in zip(jobs, others)]
        members.insert(1, _Member(job, "pa", job.prompt_width + mine.max_tokens))
        got = run(worker, lambda: drive(batcher, members), steps)
        assert_same(got[1], alone, tolerance=1e-4)  # batched products: float rounding


def drive(batcher, members, join_later=(), after: int = 0):
    """Step the batcher over `members` (and `join_later` once `after` steps ran) until every job is done."""
    batcher._waiting.extend(members)
    steps = 0
    with torch.no_grad():
        while not all(m.job.done for m in [*members, *join_later]):
            batcher.step()
            steps += 1
            if steps == after:
                batcher._waiting.extend(join_later)
    for m in [*members, *join_later]:
        if m.job.error is not None:
            raise m.job.error
    return [m.job.results() for m in [*members, *join_later]]


@pytest.mark.parametrize("pooled", [False, True], ids=["eager", "pooled"])
def test_rows_joining_mid_generation_and_mixed_adapters_keep_their_alone_tokens(worker, pooled):
    requests = [("pa", PROMPTS[:4], SETTINGS[0], 1), ("pb", PROMPTS[4:9], SETTINGS[2], 2),
                (None, PROMPTS[9:11], SETTINGS[1], 3), ("pa", PROMPTS[11:16], SETTINGS[3], 4)]
    alone = [run(worker, lambda r=r: worker.engine.generate(r[1], r[2], policy=r[0], seed=r[3]), 1) for r in requests]
    for steps in CHUNKS:
        jobs = [worker.engine.start(p, s, seed=seed, policy=pol) for pol, p, s, seed in requests]
        members = [_Member(j, r[0], j.prompt_width + r[2].max_tokens) for j, r in zip(jobs, requests)]
        # two calls start together (mixed adapters in one forward); two join after the block has decoded
        got = run(worker, lambda: drive(worker.engine.batcher, members[:2], members[2:], after=2), steps, pooled)
        for mine, want in zip(got, alone):
            assert_same(mine, want, tolerance=1e-4)
        assert worker.engine.batcher.most_jobs >= 3
        if pooled:
            assert any(adapter.startswith("mixed:") for adapter, _, _ in last_decoder[0]._graphs)
    assert worker.engine.batcher.stacked.builds > 0, "the mixed block must run through the stacked adapters"


def test_mixed_blocks_through_peft_or_the_stacked_adapters_draw_the_same_tokens(worker, monkeypatch):
    requests = [("pa", PROMPTS[:5], 1), ("pb", PROMPTS[5:9], 2), (None, PROMPTS[9:12], 3)]

    def mixed():
        jobs = [worker.engine.start(p, SETTINGS[0], seed=seed, policy=pol) for pol, p, seed in requests]
        return drive(worker.engine.batcher, [_Member(j, r[0], j.prompt_width + 30) for j, r in zip(jobs, requests)])

    stacked = worker.engine.batcher.stacked
    builds = stacked.builds
    grouped = run(worker, mixed, 4)
    assert stacked.builds > builds or stacked.key == ("pa", "pb")
    monkeypatch.setenv("TINKERLESS_GROUPED_LORA", "0")
    through_peft = run(worker, mixed, 4)
    for mine, theirs in zip(grouped, through_peft):
        assert_same(mine, theirs, tolerance=1e-4)


def test_multi_turn_sessions_keep_exactly_the_rows_keys_and_values(worker):
    """A row that stops mid-chunk keeps in its session the keys/values of its real tokens only: the next turn
    continues from them and equals the one-step loop's turns (which equal a full re-prefill)."""
    def conversation():
        sessions = [KVSession() for _ in range(5)]
        prompts = [list(p) for p in PROMPTS[:5]]
        turns = []
        for turn in range(3):
            out = worker.engine.generate(prompts, SETTINGS[0], policy="pa", seed=turn, sessions=sessions)
            turns.append(out)
            prompts = [p + g.tokens + [20 + turn, 21] for p, g in zip(prompts, out)]
        for session in sessions:
            session.close()
        return turns

    want = run(worker, conversation, 1)
    for steps, pooled in ((4, False), (8, True)):
        got = run(worker, conversation, steps, pooled)
        for mine, theirs in zip(got, want):
            assert_same(mine, theirs)
            assert [g.cached_tokens for g in mine] == [g.cached_tokens for g in theirs]
        assert sum(g.cached_tokens for turn in got[1:] for g in turn) > 0


def test_one_adapter_through_the_stacked_path_draws_its_own_tokens(worker, monkeypatch):
    """TINKERLESS_GROUPED_LORA_SINGLE=1: a one-policy block replays the stacked (grouped shrink) graph, same tokens."""
    def call():
        return worker.engine.generate(PROMPTS[:8], SETTINGS[2], policy="pb", seed=6)

    want = run(worker, call, 1)
    monkeypatch.setenv("TINKERLESS_GROUPED_LORA_SINGLE", "1")
    got = run(worker, call, 4, pooled=True)
    assert_same(got, want, tolerance=1e-4)
    assert any(adapter == "mixed:pb" for adapter, _, _ in last_decoder[0]._graphs)


def test_a_job_that_needs_the_host_each_step_keeps_its_block_on_the_one_step_loop(worker):
    outliving = SamplingParams(max_tokens=40, temperature=1.0, stop_token_ids=[])  # in the block to the end
    jobs = [worker.engine.start(PROMPTS[:3], SETTINGS[0], seed=1, policy="pa"),
            worker.engine.start(PROMPTS[3:5], outliving, seed=2, policy="pa")]
    jobs[1].needs_host_each_step = True  # e.g. a grammar that masks each step's logits
    batcher = worker.engine.batcher
    chunks = batcher.chunks
    batcher.decode_steps = 4
    try:
        drive(batcher, [_Member(j, "pa", j.prompt_width + 40) for j in jobs])
    finally:
        batcher.decode_steps = 1
    assert batcher.chunks == chunks and all(j.done for j in jobs)


def test_top_logprobs_come_from_the_chunks_as_from_single_steps(worker):
    sampling = SamplingParams(max_tokens=11, temperature=0.9, top_p=0.95)
    want = run(worker, lambda: worker.engine.generate(PROMPTS[:6], sampling, policy="pb", seed=4, top_logprobs=3), 1)
    got = run(worker, lambda: worker.engine.generate(PROMPTS[:6], sampling, policy="pb", seed=4, top_logprobs=3), 4)
    assert_same(got, want)
    for mine, theirs in zip(got, want):
        assert [[t for t, _ in top] for top in mine.top_logprobs] == [[t for t, _ in top] for top in theirs.top_logprobs]
        assert [v for top in mine.top_logprobs for _, v in top] == pytest.approx(
            [v for top in theirs.top_logprobs for _, v in top], abs=1e-5)


def test_chunks_sample_the_weights_after_an_update(tiny_model):
    worker = make_worker(tiny_model)
    tokens = np.arange(5, 25, dtype=np.int32)
    ones = np.ones(len(tokens), np.float32)

    def sample():
        return worker.engine.generate(PROMPTS[:8], SETTINGS[0], policy="pa", seed=2)

    before = run(worker, sample, 1)
    assert_same(run(worker, sample, 5, pooled=True), before)
    worker.update(UpdateRequest("pa", [Datum(tokens, ones, advantages=ones, sampler_logprobs=-ones)],
                                LossConfig(), AdamParams(learning_rate=0.5)))
    after = run(worker, sample, 1)
    assert [g.tokens for g in after] != [g.tokens for g in before]
    assert_same(run(worker, sample, 5), after)
    assert_same(run(worker, sample, 5, pooled=True), after)


def test_a_diverged_policy_is_refused_in_a_chunk_as_in_a_step(tiny_model):
    worker = make_worker(tiny_model)
    randomize(worker, "pb", 3)
    with torch.no_grad():
        for p in worker.policies["pb"].params:
            p.fill_(float("nan"))
    for steps in (1, 4):
        with pytest.raises(UserError, match="not finite"):
            run(worker, lambda: worker.engine.generate(PROMPTS[:3], SETTINGS[0], policy="pb", seed=0), steps)
    # the shared batch is not wedged: the next call decodes
    assert len(run(worker, lambda: worker.engine.generate(PROMPTS[:3], SETTINGS[1], policy="pa", seed=0), 4)) == 3


def test_steps_per_host_read_default_to_one_on_a_cpu_and_follow_the_environment(monkeypatch):
    monkeypatch.delenv("TINKERLESS_DECODE_STEPS", raising=False)
    assert default_steps(torch.device("cpu")) == 1
    assert default_steps(torch.device("cuda")) == 8
    monkeypatch.setenv("TINKERLESS_DECODE_STEPS", "16")
    assert default_steps(torch.device("cpu")) == 16
    monkeypatch.setenv("TINKERLESS_DECODE_STEPS", "0")
    assert default_steps(torch.device("cuda")) == 1
