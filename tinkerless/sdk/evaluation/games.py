"""Held-out games for multi-agent runs: the seatings of `eval_agents` play the held-out tasks, nothing trains.

    config = TrainConfig(env=TicTacToe, agents=tinkerless.self_play(TicTacToe.agents, policy="player"),
                         eval_every=5, eval_tasks=[{"seed": s} for s in range(8)],
                         eval_agents=[tinkerless.versus(role, random_opponent, roles=TicTacToe.agents, policy="player")
                                      for role in TicTacToe.agents])

`eval_every` on a multi-agent run plays every seating of `eval_agents` (default: the run's own `agents`) on
`eval_tasks`, each task `group_size` times, with the policies as they are at that step, and logs for each of the
run's policies its mean reward and its win, draw and loss rates over finished games (`eval_reward_mean/<policy>`,
`eval_win_rate/<policy>`, ...). Self-play against itself always "wins" half its games, so a win rate that says
something needs another seat: a scripted opponent, `Frozen()` (the base model) or a frozen checkpoint.

The games are seeded by the run's seed alone, not its step, so every eval of a run meets the same openings and,
for a scripted opponent, the same draws of its generator: the curve moves with the policy only.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from tinkerless.sdk.run.agents import seatings
from tinkerless.sdk.run.multi_agent import build_seats
from tinkerless.sdk.run.step_metrics import agent_metrics
from tinkerless.wire import pack_code
from tinkerless.wire.messages import EpisodeLimits, MultiAgentRolloutRequest, SamplingParams

EVAL_SEED_OFFSET = 7_919  # held-out games draw apart from every training step's seeds (step_seed(seed, step) + index)


def eval_seatings(config: Any) -> list[dict]:
    """The seatings a held-out eval plays: `eval_agents`, else the run's `agents`."""
    return seatings(config.eval_agents if config.eval_agents is not None else config.agents)


def play_games(rollout_multi: Callable[[MultiAgentRolloutRequest], Any], config: Any, tasks: list[dict], *,
               policies: list[str], frozen: dict[str, str]) -> dict[str, float]:
    """Play every eval seating on `tasks` (no seat trains); the `eval_*` columns of the run's policies.

    `frozen` maps each frozen adapter path to the worker policy it is loaded as (the run loads every path that
    `agents` or `eval_agents` seats, `agents.frozen_adapters`)."""
    started = time.perf_counter()
    env = pack_code(config.env, name=getattr(config.env, "__qualname__", None))
    sampling = SamplingParams(max_tokens=config.max_tokens, temperature=config.temperature, top_p=config.top_p)
    limits = EpisodeLimits(max_turns=config.turn_limit(), max_episode_tokens=config.max_episode_tokens)
    episodes = []
    for index, seats in enumerate(build_seats(eval_seatings(config), frozen)):
        held = {role: dataclasses.replace(seat, trainable=False) for role, seat in seats.items()}
        result = rollout_multi(MultiAgentRolloutRequest(
            tasks=tasks, group_size=config.group_size, env=env, seats=held, sampling=sampling, limits=limits,
            seed=config.seed + EVAL_SEED_OFFSET + index, protocol_timeout=config.protocol_timeout,
        ))
        episodes.extend(result.episodes)
    columns = {f"eval_{key}": value for key, value in agent_metrics(episodes, policies).items()}
    own = [e for e in episodes if e.info.get("policy") in policies]
    columns.update({"eval_episodes": len(own), "eval_errors": sum(e.status == "error" for e in own),
                    "eval_s": time.perf_counter() - started})
    return columns
