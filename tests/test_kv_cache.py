"""KV caches kept across turns: a new turn prefills only what the env appended, and nothing else changes.

The class of bug: a kept cache that changes a token or a log-prob (a cache of another conversation,
of a prefix the conversation no longer has, of weights that have since changed, misaligned positions
or padding after a merge); a cache that is never used (every turn still re-prefills the whole
conversation); caches that outlive their episodes or grow past their budget; a prefill that
computes padding. Each check compares against the uncached path (`TINKERLESS_KV_CACHE=0`, the
store's `enabled` switch), which re-prefills every prompt from scratch.

Tolerance: tokens must be exactly equal; log-probs within 1e-5 (absolute) of the uncached path's,
and within 1e-4 of a fresh full forward over the episode (the sampling-integrity bar): a cached
key/value was computed in a decode step rather than a prefill, which changes only float rounding.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest
import torch
from test_sampling_integrity import END_OF_TURN, declare_end_of_turn

import tinkerless
from tinkerless.envs.base import MultiStepResult
from tinkerless.functions.sampling.kv_cache import KVSession, length_buckets
from tinkerless.functions.sampling.slicing import slice_host
from tinkerless.functions.worker import Worker
from tinkerless.wire import pack_code
from tinkerless.wire.messages import (
    CreatePolicyRequest,
    Datum,
    EpisodeLimits,
    ForwardRequest,
    LoraConfig,
    MultiAgentRolloutRequest,
    RolloutRequest,
    SamplingParams,
    Seat,
)

LOGPROB_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def kv_worker(tiny_model):
    worker = declare_end_of_turn(Worker(tiny_model), END_OF_TURN)  # rows stop at different times
    for name, seed in (("pa", 1), ("pb", 2)):
        worker.create_policy(CreatePolicyRequest(name, LoraConfig(rank=4, seed=seed)))
        with torch.no_grad():  # visibly different policies, from each other and from the base model
            for p in worker.policies[name].params:
                torch.nn.init.normal_(p, std=0.2, generator=torch.Generator().manual_seed(seed))
    return worker


@contextlib.contextmanager
def kv_cache(worker: Worker, enabled: bool):
    store = worker.engine.sessions
    saved, store.enabled = store.enabled, enabled
    try:
        yield store
    finally:
        store.enabled = saved


@tinkerless.env
class GuessLetter:
    """guess_number's shape: the env answers each guess; a game ends when the secret is named or patience runs out."""

    def reset(self, secret: str, patience: int) -> str:
        self.secret, self.patience, self.turn = secret, patience, 0
        return f"I picked a letter. You have {patience} tries."

    def step(self, action: str) -> tinkerless.StepResult:
        self.turn += 1
        if self.secret in action or self.turn >= self.patience:
            return tinkerless.StepResult(None, reward=float(self.secret in action), done=True)
        return tinkerless.StepResult(f"No, not {action[:4]!r}. Try again.", reward=0.0)


# One game ends after its first turn; the others go on for up to five.
TASKS = [{"secret": "e", "patience": 5}, {"secret": "q", "patience": 1}, {"secret": "a", "patience": 5}]


def rollout(worker, policy="pa", seed=3, tasks=TASKS, max_tokens=6):
    request = RolloutRequest(
        policy=policy, tasks=tasks, group_size=2, env=pack_code(GuessLetter), seed=seed,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=1.0),
        limits=EpisodeLimits(max_turns=5, max_episode_tokens=400),
    )
    return worker.rollout(request)


def assert_same_episodes(got, want):
    assert [e.tokens.tolist() for e in got] == [e.tokens.tolist() for e in want]
    assert [e.mask.tolist() for e in got] == [e.mask.tolist() for e in want]
    assert [(e.num_turns, e.status, e.reward) for e in got] == [(e.num_turns, e.status, e.reward) for e in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.sampler_logprobs, w.sampler_logprobs, atol=LOGPROB_TOLERANCE, rtol=0)


def assert_true_logprobs(worker, policy, episodes):
    """The sampler's log-probs are what one fresh forward over the whole episode gives (the trainer's view)."""
    forward = worker.forward(ForwardRequest(policy, [Datum(tokens=e.tokens, mask=e.mask) for e in episodes]))
    for episode, logprobs in zip(episodes, forward.logprobs):
        sampled = episode.mask == 1
        np.testing.assert_allclose(logprobs[sampled], episode.sampler_logprobs[sampled], atol=1e-4, rtol=0)


def test_a_cached_multi_turn_rollout_equals_the_uncached_one_and_prefills_only_what_was_appended(kv_worker):
    with kv_cache(kv_worker, False):
        uncached = rollout(kv_worker)
    with kv_cache(kv_worker, True) as store:
        hits = store.hits
        cached = rollout(kv_worker)
        assert store.hits > hits
        assert store.used_bytes == 0, "finished episodes left their caches behind"
    turns = [e.num_turns for e in cached.episodes]
    assert max(turns) >= 3 and min(turns) == 1, "the check needs long episodes and one that ended early"
    assert_same_episodes(cached.episodes, uncached.episodes)
    assert_true_logprobs(kv_worker, "pa", cached.episodes)
    before, after = uncached.stats, cached.stats
    assert before["cached_prompt_tokens"] == 0 and after["cached_prompt_tokens"] > 0
    # The same prompt tokens in all, but the cached run computed only the tokens appended since each row's last turn.
    assert after["prefill_tokens"] + after["cached_prompt_tokens"] == before["prefill_tokens"]
    assert after["prefill_tokens"] < before["prefill_tokens"] / 2
    assert after["decoded_tokens"] == before["decoded_tokens"] == sum(e.mask.sum() for e in cached.episodes)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_more_seeds_and_lengths_give_the_same_rollout_cached_or_not(kv_worker, seed):
    tasks = [{"secret": "xyz"[seed], "patience": 2 + seed}, {"secret": "t", "patience": 4}]
    with kv_cache(kv_worker, False):
        uncached = rollout(kv_worker, policy="pb", seed=seed, tasks=tasks, max_tokens=3 + 4 * seed)
    cached = rollout(kv_worker, policy="pb", seed=seed, tasks=tasks, max_tokens=3 + 4 * seed)
    assert_same_episodes(cached.episodes, uncached.episodes)


class Duel:
    """Two model-played roles take turns, each seeing the other's last move; the game ends after `moves` moves."""

    agents = ("x", "o")

    def reset(self, moves: int):
        self.moves, self.log = moves, []

    def turn(self):
        return None if len(self.log) >= self.moves else self.agents[len(self.log) % 2]

    def observation(self, agent):
        last = self.log[-1][1][:6] if self.log else "nothing yet"
        return f"{agent} to move; last move: {last}"

    def response_prefix(self, agent):
        return "move: "

    def step(self, agent, action):
        self.log.append((agent, action))
        done = len(self.log) >= self.moves
        return MultiStepResult(rewards={agent: 0.1}, done=done, info={"winner": "draw"} if done else {})


def play(worker, seats):
    request = MultiAgentRolloutRequest(
        tasks=[{"moves": 6}, {"moves": 2}], group_size=2, env=pack_code(Duel), seats=seats,
        sampling=SamplingParams(max_tokens=5, temperature=1.0),
        limits=EpisodeLimits(max_turns=8, max_episode_tokens=600), seed=7, protocol_timeout=60.0,
    )
    return worker.rollout_multi(request)


@pytest.mark.parametrize("seats", [{"x": Seat("pa"), "o": Seat("pb")}, {"x": Seat("pa"), "o": Seat("pa")}],
                         ids=["two policies", "self-play"])
def test_multi_agent_roles_keep_their_own_caches_and_results_do_not_change(kv_worker, seats):
    with kv_cache(kv_worker, False):
        uncached = play(kv_worker, seats)
    cached = play(kv_worker, seats)
    assert cached.stats["cached_prompt_tokens"] > 0 and uncached.stats["cached_prompt_tokens"] == 0
    assert cached.stats["prefill_tokens"] + cached.stats["cached_prompt_tokens"] == uncached.stats["prefill_tokens"]
    assert_same_episodes(cached.episodes, uncached.episodes)
    for policy in {s.policy for s in seats.values()}:
        assert_true_logprobs(kv_worker, policy, [e for e in cached.episodes if e.info["policy"] == policy])
    assert kv_worker.engine.sessions.used_bytes == 0


def test_concurrent_rollouts_of_other_adapters_and_samples_share_the_batch_and_change_nothing(kv_worker):
    """Two multi-turn rollouts (two adapters) and a plain sample call at once: rows join and leave one batch."""
    calls = {
        "pa": lambda: rollout(kv_worker, policy="pa", seed=5).episodes,
        "pb": lambda: rollout(kv_worker, policy="pb", seed=6).episodes,
        "sample": lambda: kv_worker.engine.generate([[3, 4, 5]] * 3, SamplingParams(max_tokens=30, temperature=1.0),
                                                    policy=None, seed=2),
    }
    with kv_cache(kv_worker, False):
        alone = {name: call() for name, call in calls.items()}
    together: dict = {}
    batcher = kv_worker.engine.batcher
    batcher.most_jobs = 0
    threads = [threading.Thread(target=lambda n=n, c=c: together.__setitem__(n, c())) for n, c in calls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert batcher.most_jobs >= 2, "the calls never shared a forward"
    assert_same_episodes(together["pa"], alone["pa"])
    assert_same_episodes(together["pb"], alone["pb"])
    assert [g.tokens for g in together["sample"]] == [g.tokens for g in alone["sample"]]


class InterleavingHost:
    """A slice host that pauses a call after every step and, in every other pause, runs another policy's
    generation (which steps the shared batch, the paused call's rows included) with a session of its own."""

    def __init__(self, worker: Worker):
        self.worker, self.pauses, self.busy, self.session = worker, 0, False, KVSession()

    def due(self) -> bool:
        return not self.busy

    def pause(self) -> None:
        self.pauses += 1
        if self.pauses % 2 == 0:
            self.busy = True
            try:
                self.worker.engine.generate([[1, 2, 3 + self.pauses % 5]], SamplingParams(max_tokens=3), policy="pb",
                                            seed=self.pauses, sessions=[self.session])
            finally:
                self.busy = False


def test_a_sliced_cached_rollout_equals_the_unsliced_uncached_one(kv_worker):
    """Time slicing on a server: the rollout pauses between steps while other calls use the model and the batch."""
    with kv_cache(kv_worker, False):
        expected = rollout(kv_worker, seed=9)
    host = InterleavingHost(kv_worker)
    with slice_host(host):
        got = rollout(kv_worker, seed=9)
    host.session.close()
    assert host.pauses > 10 and got.stats["cached_prompt_tokens"] > 0
    assert_same_episodes(got.episodes, expected.episodes)


# -- the engine's rules for taking a kept cache --------------------------------------------------

SAMPLING = SamplingParams(max_tokens=8, temperature=1.0, stop_token_ids=[])
PROMPTS = [[3, 4, 5, 6], [10, 11], [7, 8, 9, 10, 11, 12, 13]]


def first_turn(engine, policy="pa"):
    sessions = [KVSession() for _ in PROMPTS]
    generations = engine.generate(PROMPTS, SAMPLING, policy=policy, seed=1, sessions=sessions)
    assert all(s.held for s in sessions)
    return sessions, [p + g.tokens + [40, 41] for p, g in zip(PROMPTS, generations)]


def assert_same_generations(got, want):
    assert [g.tokens for g in got] == [g.tokens for g in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=LOGPROB_TOLERANCE, rtol=0)


def test_a_continuation_reuses_the_cache_of_its_prefix_only(kv_worker):
    engine = kv_worker.engine
    sessions, follow_ups = first_turn(engine)
    # Row 1's conversation was edited: only its first tokens still match the kept cache.
    follow_ups[1] = follow_ups[1][:3] + [99, 98] + follow_ups[1][3:]
    expected = engine.generate(follow_ups, SAMPLING, policy="pa", seed=2)
    got = engine.generate(follow_ups, SAMPLING, policy="pa", seed=2, sessions=sessions)
    assert_same_generations(got, expected)
    assert [g.cached_tokens for g in got] == [len(PROMPTS[0]) + 7, 3, len(PROMPTS[2]) + 7]
    assert [g.prefill_tokens + g.cached_tokens for g in got] == [len(p) for p in follow_ups]


def test_a_cache_of_other_weights_is_not_reused(kv_worker):
    """An optimizer step (any in-place change of the policy's weights) between turns invalidates its caches."""
    engine = kv_worker.engine
    sessions, follow_ups = first_turn(engine, policy="pb")
    params = kv_worker.policies["pb"].params
    saved = [p.detach().clone() for p in params]
    try:
        with torch.no_grad():
            for p in params:
                p.mul_(1.5)
        misses = engine.sessions.misses
        got = engine.generate(follow_ups, SAMPLING, policy="pb", seed=2, sessions=sessions)
        expected = engine.generate(follow_ups, SAMPLING, policy="pb", seed=2)
        assert engine.sessions.misses == misses + len(PROMPTS) and all(g.cached_tokens == 0 for g in got)
        assert_same_generations(got, expected)
        # Another policy's cache is not this policy's either.
        sessions, follow_ups = first_turn(engine, policy="pa")
        got = engine.generate(follow_ups, SAMPLING, policy="pb", seed=2, sessions=sessions)
        assert all(g.cached_tokens == 0 for g in got)
    finally:
        with torch.no_grad():
            for p, value in zip(params, saved):
                p.copy_(value)


def test_caches_beyond_the_budget_fall_back_to_a_full_prefill(kv_worker):
    engine = kv_worker.engine
    saved = engine.sessions.max_bytes
    try:
        engine.sessions.max_bytes = 1  # nothing fits
        sessions = [KVSession() for _ in PROMPTS]
        engine.generate(PROMPTS, SAMPLING, policy="pa", seed=1, sessions=sessions)
        assert not any(s.held for s in sessions) and engine.sessions.used_bytes == 0
        with kv_cache(kv_worker, False):
            uncached = rollout(kv_worker)
        assert_same_episodes(rollout(kv_worker).episodes, uncached.episodes)
    finally:
        engine.sessions.max_bytes = saved


def test_the_budget_holds_while_episodes_run(kv_worker):
    engine = kv_worker.engine
    sessions = [KVSession() for _ in PROMPTS]
    engine.generate(PROMPTS, SAMPLING, policy="pa", seed=1, sessions=sessions)
    one_row = max(s.nbytes for s in sessions)
    for s in sessions:
        s.close()
    saved = engine.sessions.max_bytes
    try:
        engine.sessions.max_bytes = 2 * one_row  # room for about two conversations' caches
        sessions = [KVSession() for _ in PROMPTS]
        engine.generate(PROMPTS, SAMPLING, policy="pa", seed=1, sessions=sessions)
        assert engine.sessions.used_bytes <= 2 * one_row and sum(s.held for s in sessions) in (1, 2)
    finally:
        engine.sessions.max_bytes = saved
        for s in sessions:
            s.close()


# -- no prefill of padding -----------------------------------------------------------------------

def test_prompts_are_prefilled_in_length_groups_with_bounded_padding_and_the_same_results(kv_worker):
    engine, batcher = kv_worker.engine, kv_worker.engine.batcher
    prompts = [list(range(3, 3 + n)) for n in (30, 2, 17, 29, 5, 31, 16, 1)]  # distinct: no two share a prefill
    sampling = SamplingParams(max_tokens=6, temperature=1.0, stop_token_ids=[])
    results, padding = {}, {}
    saved = engine.max_prefill_padding
    try:
        for ratio in (1e9, 0.125, 0.0):  # one left-padded forward (the old prefill), groups, equal lengths only
            engine.max_prefill_padding = ratio
            batcher.prefilled_tokens = batcher.padding_tokens = 0
            results[ratio] = engine.generate(prompts, sampling, policy="pa", seed=4)
            padding[ratio] = batcher.padding_tokens
            assert batcher.prefilled_tokens == sum(map(len, prompts))
    finally:
        engine.max_prefill_padding = saved
    assert padding[1e9] == 8 * 31 - sum(map(len, prompts))
    assert padding[0.125] <= 0.125 * sum(map(len, prompts)) and padding[0.0] == 0
    assert_same_generations(results[0.125], results[1e9])
    assert_same_generations(results[0.0], results[1e9])


def test_length_buckets_bound_the_padding_of_every_group():
    rng = np.random.default_rng(0)
    for _ in range(200):
        lengths = rng.integers(1, 60, size=rng.integers(1, 20)).tolist()
        ratio = float(rng.choice([0.0, 0.125, 0.5]))
        groups = length_buckets(lengths, ratio)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        for group in groups:
            real = sum(lengths[i] for i in group)
            assert len(group) * max(lengths[i] for i in group) - real <= ratio * real


# -- what vLLM's prefix cache needs (vLLM itself runs only on a GPU) ------------------------------

def test_each_turns_prompt_extends_the_last_turns_exact_tokens(kv_worker):
    """vLLM's prefix cache hashes token blocks: a turn hits only if its prompt starts with the previous
    prompt and the tokens sampled from it, id for id (no re-rendered chat template, no re-tokenizing)."""
    engine, prompts = kv_worker.engine, []
    real = engine.generate

    def recording(batch, sampling, **kwargs):
        generations = real(batch, sampling, **kwargs)
        prompts.append([(list(p), list(g.tokens)) for p, g in zip(batch, generations)])
        return generations

    engine.generate = recording
    try:
        rollout(kv_worker)
    finally:
        del engine.generate
    assert len(prompts) >= 3
    for earlier, later in zip(prompts, prompts[1:]):
        continued = 0
        for prompt, _ in later:
            previous = [p + t for p, t in earlier if prompt[: len(p) + len(t)] == p + t]
            continued += bool(previous)
        assert continued == len(later), "a turn's prompt does not extend its conversation's previous turn"


def test_the_vllm_engine_keeps_one_lora_id_per_policy_version(monkeypatch):
    """Same id across a rollout's turns (the prefix cache's blocks carry it), a new one after an update."""
    import sys
    import types

    from tinkerless.functions.sampling.vllm_engine import VLLMEngine

    lora = types.ModuleType("vllm.lora.request")
    lora.LoRARequest = lambda name, int_id, path: (name, int_id, path)
    for name, module in (("vllm", types.ModuleType("vllm")), ("vllm.lora", types.ModuleType("vllm.lora")),
                         ("vllm.lora.request", lora)):
        monkeypatch.setitem(sys.modules, name, module)
    version = {"p": 1}
    engine = object.__new__(VLLMEngine)  # no GPU here: only the request-building half
    engine.adapter_dir, engine._lora_ids = (lambda policy: (f"/adapters/{policy}/v{version[policy]}", str(version[policy]))), {}
    engine.expected_probe = None  # (proving a hot-loaded version: tests/test_async_pipeline.py)
    first, again = engine._lora_request("p"), engine._lora_request("p")
    version["p"] = 2
    updated = engine._lora_request("p")
    assert first == again and updated[1] != first[1] and updated[2].endswith("v2")


# -- one prefill for a group's identical prompts -------------------------------------------------

def alone_rows(worker, prompts, sampling, seed, policy):
    """Each row sampled by a job of its own (row i keeps its generator, seeded by (seed, i))."""
    out = []
    for i, prompt in enumerate(prompts):
        job = worker.engine.start([prompt], sampling, seed=seed, first_index=i)
        with torch.no_grad(), worker._activate(policy):
            while not job.done:
                job.advance(worker.model)
        out.append(job.results()[0])
    return out


def test_identical_prompts_of_one_policy_are_prefilled_once_and_still_sample_their_own_tokens(kv_worker):
    p, q = [3, 4, 5, 6, 7], [9, 8]
    prompts = [p, p, q, p, q, [3, 4, 5, 6]]
    sampling = SamplingParams(max_tokens=10, temperature=1.0, stop_token_ids=[])
    batcher = kv_worker.engine.batcher
    batcher.prefilled_tokens = 0
    got = kv_worker.engine.generate(prompts, sampling, policy="pa", seed=8)
    assert batcher.prefilled_tokens == len(p) + len(q) + 4
    assert [g.prefill_tokens for g in got] == [5, 0, 2, 0, 0, 4]
    assert_same_generations(got, alone_rows(kv_worker, prompts, sampling, 8, "pa"))
    assert len({tuple(g.tokens) for g in got[:2]}) == 2, "copies of one prompt drew the same tokens"


def test_the_same_prompt_under_two_policies_is_prefilled_for_each(kv_worker):
    """Two calls joining one prefill with the same prompt: each row goes through its own adapter."""
    from tinkerless.functions.sampling.batcher import _Member

    engine, sampling, prompt = kv_worker.engine, SamplingParams(max_tokens=6, temperature=1.0, stop_token_ids=[]), [5, 6, 7]
    jobs = {policy: engine.start([prompt], sampling, seed=3) for policy in ("pa", "pb")}
    engine.batcher._waiting.extend(_Member(job, policy, len(prompt) + 6) for policy, job in jobs.items())
    with torch.no_grad():
        while not all(job.done for job in jobs.values()):
            engine.batcher.step()
    for policy, job in jobs.items():
        assert_same_generations(job.results(), alone_rows(kv_worker, [prompt], sampling, 3, policy))
    assert jobs["pa"].results()[0].prefill_tokens == jobs["pb"].results()[0].prefill_tokens == 3
