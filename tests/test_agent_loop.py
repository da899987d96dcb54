"""The agent loop: token masks, token-in/token-out, multi-turn envs, limits, sampler log-probs."""

from __future__ import annotations

import numpy as np
import pytest

import tinkerless
from tinkerless.wire import pack_code
from tinkerless.wire.messages import CreatePolicyRequest, Datum, EpisodeLimits, ForwardRequest, RolloutRequest, SamplingParams


@pytest.fixture(scope="module")
def policy_worker(worker):
    worker.create_policy(CreatePolicyRequest("loop"))
    return worker


@tinkerless.env
class CountdownEnv:
    """Three turns; the env answers with the turn number and rewards each turn with 0.25."""

    def reset(self, start: int) -> str:
        self.turn = 0
        self.start = start
        return f"count from {start}"

    def step(self, action: str) -> tinkerless.StepResult:
        self.turn += 1
        done = self.turn >= 3
        return tinkerless.StepResult(observation=None if done else f"turn {self.turn}", reward=0.25, done=done)


def _rollout(worker, **overrides):
    request = RolloutRequest(
        policy="loop",
        tasks=overrides.pop("tasks", [{"prompt": "hello"}]),
        group_size=overrides.pop("group_size", 2),
        sampling=overrides.pop("sampling", SamplingParams(max_tokens=6, temperature=1.0)),
        limits=overrides.pop("limits", EpisodeLimits(max_turns=1, max_episode_tokens=512)),
        seed=overrides.pop("seed", 3),
        **overrides,
    )
    return worker.rollout(request).episodes


def test_single_turn_masks_cover_exactly_the_sampled_tokens(policy_worker):
    episodes = _rollout(policy_worker, reward=pack_code(lambda completion, task: 1.0))
    for episode in episodes:
        n = len(episode.tokens)
        assert episode.mask.shape == (n,) and episode.sampler_logprobs.shape == (n,)
        assert episode.mask[: episode.prompt_length].sum() == 0  # prompt never trained
        assert episode.mask[episode.prompt_length :].all()  # every later token was sampled
        assert 1 <= n - episode.prompt_length <= 6
        assert (episode.sampler_logprobs[episode.mask == 0] == 0).all()
        assert (episode.sampler_logprobs[episode.mask == 1] < 0).all()
        assert episode.reward == 1.0 and episode.num_turns == 1 and episode.status == "ok"


def test_group_size_gives_that_many_episodes_per_task(policy_worker):
    episodes = _rollout(policy_worker, tasks=[{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}], group_size=3)
    assert [e.task_index for e in episodes] == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_sampled_tokens_are_never_retokenized(policy_worker):
    episodes = _rollout(policy_worker, group_size=4)
    chat = policy_worker.chat
    prompt = chat.prompt_tokens([{"role": "user", "content": "hello"}])
    for episode in episodes:
        assert episode.tokens[: episode.prompt_length].tolist() == prompt
        sampled = episode.tokens[episode.prompt_length :].tolist()
        # The random tiny model emits arbitrary bytes; the episode keeps the exact ids it sampled.
        assert all(0 <= t < len(policy_worker.tokenizer) for t in sampled)


def test_multi_turn_env_interleaves_sampled_and_observation_tokens(policy_worker):
    episodes = _rollout(
        policy_worker,
        tasks=[{"start": 5}],
        env=pack_code(CountdownEnv),
        limits=EpisodeLimits(max_turns=5, max_episode_tokens=1024),
    )
    chat = policy_worker.chat
    for episode in episodes:
        assert episode.num_turns == 3 and episode.status == "ok"
        assert episode.turn_rewards == [0.25, 0.25, 0.25] and episode.reward == pytest.approx(0.75)
        roles = [m["role"] for m in episode.transcript]
        assert roles[-5:] == ["assistant", "user", "assistant", "user", "assistant"]
        # Observation tokens (mask 0) appear between sampled turns, and equal the chat frame of the env's text.
        mask = episode.mask.astype(int).tolist()
        runs = [mask[0]]
        for a, b in zip(mask, mask[1:]):
            if a != b:
                runs.append(b)
        assert runs == [0, 1, 0, 1, 0, 1]
        text = chat.tokenizer.decode(episode.tokens[episode.prompt_length :].tolist())
        assert "turn 1" in text and "turn 2" in text


def test_turn_limit_truncates(policy_worker):
    episodes = _rollout(
        policy_worker, tasks=[{"start": 1}], env=pack_code(CountdownEnv), limits=EpisodeLimits(max_turns=2)
    )
    assert all(e.status == "truncated" and e.num_turns == 2 for e in episodes)


def test_token_limit_bounds_the_episode(policy_worker):
    limits = EpisodeLimits(max_turns=5, max_episode_tokens=70)
    episodes = _rollout(policy_worker, tasks=[{"start": 1}], env=pack_code(CountdownEnv), limits=limits)
    for episode in episodes:
        assert len(episode.tokens) <= 70
        assert episode.status in ("ok", "truncated")


def test_sampler_logprobs_match_the_trainer_forward(policy_worker):
    """The recorded behaviour log-probs are what the trainer recomputes (left- vs right-padded batches)."""
    episodes = _rollout(
        policy_worker, tasks=[{"prompt": "x"}, {"prompt": "a longer prompt"}], group_size=2,
        sampling=SamplingParams(max_tokens=8, temperature=0.7),
    )
    data = [Datum(tokens=e.tokens, mask=e.mask) for e in episodes]
    forward = policy_worker.forward(ForwardRequest("loop", data))
    for episode, logprobs in zip(episodes, forward.logprobs):
        sampled = episode.mask == 1
        np.testing.assert_allclose(logprobs[sampled], episode.sampler_logprobs[sampled], atol=1e-4)


def test_same_seed_same_episodes_different_seed_differs(policy_worker):
    a = _rollout(policy_worker, group_size=4, seed=11)
    b = _rollout(policy_worker, group_size=4, seed=11)
    c = _rollout(policy_worker, group_size=4, seed=12)
    assert [e.tokens.tolist() for e in a] == [e.tokens.tolist() for e in b]
    assert [e.tokens.tolist() for e in a] != [e.tokens.tolist() for e in c]


def test_reward_sees_completion_for_single_turn_and_transcript_for_envs(policy_worker):
    single = _rollout(policy_worker, reward=pack_code(lambda c, t: float(isinstance(c, str))), group_size=1)
    multi = _rollout(
        policy_worker, tasks=[{"start": 2}], env=pack_code(CountdownEnv), group_size=1,
        reward=pack_code(lambda c, t: float(isinstance(c, list) and c[-1]["role"] == "assistant")),
        limits=EpisodeLimits(max_turns=5),
    )
    assert single[0].reward == 1.0
    assert multi[0].reward == pytest.approx(0.75 + 1.0)
