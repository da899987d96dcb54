"""Multi-agent protocol: turn order, reward attribution, masks, stuck protocols, out-of-turn actions."""

from __future__ import annotations

import pytest

from tinkerless.coordinator.protocol import TurnKeeper
from tinkerless.envs.base import MultiStepResult
from tinkerless.errors import BarrierTimeout, ConfigError, EnvError, PhaseError
from tinkerless.wire import pack_code
from tinkerless.wire.messages import (
    CreatePolicyRequest,
    EpisodeLimits,
    LoraConfig,
    MultiAgentRolloutRequest,
    SamplingParams,
    Seat,
)


class RelayEnv:
    """Three roles act in a declared, non-alphabetical order for two rounds; the last actor of each round (b) wins 1 from the first (c)."""

    agents = ("a", "b", "c")
    order = ("c", "a", "b")

    def reset(self, rounds: int = 2):
        self.rounds, self.log = rounds, []

    def turn(self):
        return None if len(self.log) >= self.rounds * 3 else self.order[len(self.log) % 3]

    def observation(self, agent):
        return f"you are {agent}; so far: {' | '.join(text for _, text in self.log)[-200:]}"

    def step(self, agent, action):
        self.log.append((agent, action))
        done = len(self.log) >= self.rounds * 3
        rewards = {self.order[2]: 1.0, self.order[0]: -1.0} if len(self.log) % 3 == 0 else {}
        return MultiStepResult(rewards=rewards, done=done, info={"winner": self.order[2]} if done else {})


class StuckEnv(RelayEnv):
    """Never hands the turn on and never ends."""

    def turn(self):
        return "a"

    def step(self, agent, action):
        return MultiStepResult()


class UnknownAgentEnv(RelayEnv):
    def turn(self):
        return "zed"


def scripted_b(env, role, rng):
    return f"b-move-{rng.randint(0, 9)}"


def crashing_opponent(env, role, rng):
    raise RuntimeError("opponent crashed")


@pytest.fixture(scope="module")
def ma_worker(worker):
    for name, seed in (("alice", 1), ("carol", 2)):
        worker.create_policy(CreatePolicyRequest(name, LoraConfig(rank=4, seed=seed)))
    return worker


def _play(worker, env, seats, *, group_size=2, max_turns=4, timeout=60.0, tasks=None):
    request = MultiAgentRolloutRequest(
        tasks=tasks or [{"rounds": 2}],
        group_size=group_size,
        env=pack_code(env),
        seats=seats,
        sampling=SamplingParams(max_tokens=5, temperature=1.0),
        limits=EpisodeLimits(max_turns=max_turns, max_episode_tokens=1024),
        seed=5,
        protocol_timeout=timeout,
    )
    return worker.rollout_multi(request).episodes


SEATS = {"a": Seat("alice"), "b": Seat(opponent=pack_code(scripted_b), trainable=False), "c": Seat("carol")}


def test_turns_follow_the_declared_order_and_rewards_are_attributed(ma_worker):
    episodes = _play(ma_worker, RelayEnv, SEATS)
    assert sorted({e.info["role"] for e in episodes}) == ["a", "c"]  # the scripted seat yields no episode
    for e in episodes:
        assert e.status == "ok" and e.num_turns == 2
        assert e.info["policy"] == {"a": "alice", "c": "carol"}[e.info["role"]]
        assert e.reward == {"a": 0.0, "c": -2.0}[e.info["role"]]  # c acts first each round and loses 1 to b
    # c acts first, so c's first prompt saw no moves yet, while a's first prompt already shows c's move.
    first_prompt = {e.info["role"]: e.transcript[0]["content"] for e in episodes if e.info["game"] == 0}
    assert first_prompt["c"].endswith("so far: ")
    assert first_prompt["a"] != "you are a; so far: " and "b-move" not in first_prompt["a"]


def test_each_agent_is_trained_only_on_its_own_tokens(ma_worker):
    episodes = [e for e in _play(ma_worker, RelayEnv, SEATS) if e.info["game"] == 0]
    by_role = {e.info["role"]: e for e in episodes}
    a, c = by_role["a"], by_role["c"]
    c_moves = [m["content"] for m in c.transcript if m["role"] == "assistant"]
    a_sampled = ma_worker.tokenizer.decode(a.tokens[a.mask == 1].tolist(), skip_special_tokens=True)
    a_context = ma_worker.tokenizer.decode(a.tokens[a.mask == 0].tolist(), skip_special_tokens=True)
    for move in c_moves:  # the opponent's move reaches `a` only as observation text (mask 0)
        if move.strip():
            assert move[-20:] in a_context
    sampled_a_turns = "".join(m["content"] for m in a.transcript if m["role"] == "assistant")
    assert a_sampled == sampled_a_turns
    assert (a.sampler_logprobs[a.mask == 0] == 0).all() and (a.sampler_logprobs[a.mask == 1] < 0).all()


def test_zero_sum_terminal_rewards(ma_worker):
    class ZeroSum(RelayEnv):
        agents = ("a", "c")
        order = ("a", "c", "a")

        def turn(self):
            return None if len(self.log) >= 4 else ("a", "c")[len(self.log) % 2]

        def step(self, agent, action):
            self.log.append((agent, action))
            if len(self.log) < 4:
                return MultiStepResult()
            a_wins = len(self.log[0][1]) >= len(self.log[1][1])
            return MultiStepResult({"a": 1.0 if a_wins else -1.0, "c": -1.0 if a_wins else 1.0}, True,
                                   {"winner": "a" if a_wins else "c"})

    episodes = _play(ma_worker, ZeroSum, {"a": Seat("alice"), "c": Seat("carol")}, group_size=4)
    for game in range(4):
        pair = [e for e in episodes if e.info["game"] == game]
        assert len(pair) == 2 and sum(e.reward for e in pair) == 0.0
        assert sorted(e.info["outcome"] for e in pair) == ["loss", "win"]


def test_self_play_with_one_policy(ma_worker):
    episodes = _play(ma_worker, RelayEnv, {"a": Seat("alice"), "b": Seat("alice"), "c": Seat("alice")})
    assert {e.info["policy"] for e in episodes} == {"alice"} and len(episodes) == 6


def test_stuck_protocol_ends_with_an_error_naming_env_and_turn(ma_worker):
    episodes = _play(ma_worker, StuckEnv, SEATS, max_turns=3)
    assert all(e.status == "error" for e in episodes)
    assert "StuckEnv" in episodes[0].error and "turn 4" in episodes[0].error and "never hands the turn on" in episodes[0].error


def test_wall_clock_timeout_ends_a_stuck_game(ma_worker):
    episodes = _play(ma_worker, StuckEnv, SEATS, max_turns=10_000, timeout=0.0)
    assert all(e.status == "error" and "timeout" in e.error for e in episodes)


def test_unknown_agent_and_crashing_opponent_are_named(ma_worker):
    unknown = _play(ma_worker, UnknownAgentEnv, SEATS)
    assert "UnknownAgentEnv.turn() declared unknown agent 'zed' at turn 1" in unknown[0].error
    crash = _play(ma_worker, RelayEnv, {**SEATS, "b": Seat(opponent=pack_code(crashing_opponent), trainable=False)})
    assert all(e.status == "error" for e in crash)
    assert "opponent playing 'b' raised at turn 3" in crash[0].error and "opponent crashed" in crash[0].error


def test_seats_must_match_the_env_roles(ma_worker):
    with pytest.raises(ConfigError, match="missing \\['c'\\]"):
        _play(ma_worker, RelayEnv, {"a": Seat("alice"), "b": Seat("alice")})


def test_turn_keeper_refuses_out_of_turn_actions():
    keeper = TurnKeeper.start("Env", ("x", "y"), max_turns_per_agent=2, timeout=10)
    assert keeper.declare("x") == "x"
    with pytest.raises(PhaseError, match="'y' tried to act at turn 1, but it is 'x'"):
        keeper.acted("y")
    with pytest.raises(PhaseError, match="before 'x' finished"):
        keeper.declare("y")
    keeper.acted("x")
    keeper.declare("x")
    keeper.acted("x")
    with pytest.raises(BarrierTimeout, match="more than 2 times"):
        keeper.declare("x")
    with pytest.raises(EnvError, match="unknown agent 'q' at turn 3"):
        keeper.declare("q")


def test_games_are_deterministic_for_a_seed(ma_worker):
    first = _play(ma_worker, RelayEnv, SEATS, group_size=3)
    again = _play(ma_worker, RelayEnv, SEATS, group_size=3)
    assert [(e.info["game"], e.info["role"], e.tokens.tolist(), e.reward) for e in first] == [
        (e.info["game"], e.info["role"], e.tokens.tolist(), e.reward) for e in again
    ]
