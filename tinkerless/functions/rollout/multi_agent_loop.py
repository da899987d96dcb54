"""Multi-agent games: several roles share one env; each role keeps its own conversation.

Every turn, each unfinished game is asked whose turn it is (through a
`TurnKeeper`, the intra-game barrier); the games waiting on the same policy
are sampled together in one batch, scripted opponents answer directly, and
the env steps. A role's episode holds only its own sampled tokens at mask 1;
what the other roles did reaches it as observation text (mask 0), so no
agent is ever trained on an opponent's tokens. Each role earns its own rewards.
"""

from __future__ import annotations

import sys
import random
import traceback as tb
from dataclasses import dataclass, field
from typing import Any, Callable

from tinkerless.coordinator.protocol import TurnKeeper
from tinkerless.envs.base import MultiStepResult, check_reward
from tinkerless.errors import ConfigError, EnvError, infra_cause
from tinkerless.functions.rollout.agent_loop import EpisodeState, TokenCounts, _Run, _to_episode, close_sessions
from tinkerless.functions.rollout.chat import ChatFormat
from tinkerless.functions.sampling.engine import Engine
from tinkerless.functions.sampling.kv_cache import KVSession
from tinkerless.functions.rollout.rollout_clock import measure
from tinkerless.wire.messages import BASE_POLICY, Episode, EpisodeLimits, SamplingParams, Seat


@dataclass
class _Game:
    index: int
    task_index: int
    task: dict
    env: Any = None
    keeper: TurnKeeper | None = None
    runs: dict[str, _Run] = field(default_factory=dict)  # model-played roles
    rewards: dict[str, float] = field(default_factory=dict)
    rng: random.Random | None = None
    prefixes: dict[str, str] = field(default_factory=dict)
    done: bool = False
    status: str = "ok"
    error: str | None = None
    traceback: str | None = None
    info: dict = field(default_factory=dict)
    infra_cause: str | None = None

    def fail(self, message: str) -> None:
        """End the game on the exception being handled (called inside `except`): an `error`, or `infra_failed`
        when a service the env needed failed (`errors.infra_cause`)."""
        handled = sys.exc_info()[1]
        self.infra_cause = infra_cause(handled) if handled is not None else None
        self.done, self.error, self.traceback = True, message, tb.format_exc()
        self.status = "error" if self.infra_cause is None else "infra_failed"


def check_seats(env_cls: Any, seats: dict[str, Seat]) -> tuple[str, ...]:
    agents = tuple(getattr(env_cls, "agents", ()))
    name = getattr(env_cls, "__qualname__", "env")
    missing, unknown = [a for a in agents if a not in seats], [r for r in seats if r not in agents]
    if missing or unknown:
        raise ConfigError(
            f"seats do not match {name}.agents {list(agents)}: missing {missing}, unknown {unknown}",
            hint="give every role of the env exactly one seat (a policy name, a frozen policy or an opponent)",
        )
    return agents


def run_games(
    engine: Engine,
    chat: ChatFormat,
    *,
    env_cls: Any,
    tasks: list[dict],
    group_size: int,
    seats: dict[str, Seat],
    opponents: dict[str, Callable],
    sampling: SamplingParams,
    limits: EpisodeLimits,
    seed: int,
    timeout: float,
    counts: TokenCounts | None = None,
) -> list[Episode]:
    """Play every game to its end; `counts` (if given) adds up the generation work."""
    games: list[_Game] = []
    try:
        return _run_games(engine, chat, games, env_cls=env_cls, tasks=tasks, group_size=group_size, seats=seats,
                          opponents=opponents, sampling=sampling, limits=limits, seed=seed, timeout=timeout,
                          counts=counts if counts is not None else TokenCounts())
    finally:
        close_sessions(run for game in games for run in game.runs.values())


def _run_games(engine, chat, games, *, env_cls, tasks, group_size, seats, opponents, sampling, limits, seed, timeout, counts):
    agents = check_seats(env_cls, seats)
    env_name = getattr(env_cls, "__qualname__", "env")
    games.extend(
        _Game(index=t * group_size + g, task_index=t, task=task)
        for t, task in enumerate(tasks)
        for g in range(group_size)
    )
    for game in games:
        game.rng = random.Random(f"{seed}:{game.index}")
        game.keeper = TurnKeeper.start(env_name, agents, limits.max_turns, timeout)
        game.rewards = {a: 0.0 for a in agents}
        game.runs = {a: _Run(task_index=game.task_index, task=game.task) for a, s in seats.items() if s.opponent is None}
        try:
            game.env = env_cls()
            with measure("env"):
                game.env.reset(**game.task)
        except Exception as exc:
            game.fail(f"{env_name}.reset: {type(exc).__name__}: {exc}")

    turn = 0
    while True:
        waiting: dict[str, list[tuple[_Game, str]]] = {}
        for game in (g for g in games if not g.done):
            role = _whose_turn(game, env_name)
            if role is None:
                continue
            seat = seats[role]
            if seat.opponent is not None:
                _scripted_turn(game, role, opponents[role], env_name)
            elif _prepare_context(game, role, chat, limits, env_name):
                waiting.setdefault(seat.policy or BASE_POLICY, []).append((game, role))
        if not waiting and all(g.done for g in games):
            break
        for policy, items in waiting.items():
            budget = max(limits.max_episode_tokens - len(game.runs[role].tokens) for game, role in items)
            generations = engine.generate(
                [game.runs[role].tokens for game, role in items],
                SamplingParams(min(sampling.max_tokens, max(budget, 0)), sampling.temperature, sampling.top_p, sampling.top_k),
                policy=policy,
                seed=seed * 1_000_003 + turn,
                sessions=[game.runs[role].session for game, role in items],
            )
            counts.add(generations)
            for (game, role), generation in zip(items, generations):
                run = game.runs[role]
                room = max(limits.max_episode_tokens - len(run.tokens), 0)
                run.append(generation.tokens[:room], sampled=True, logprobs=generation.logprobs[:room])
                text = game.prefixes.get(role, "") + chat.decode(generation.tokens[:room])
                run.transcript.append({"role": "assistant", "content": text})
                _apply_step(game, role, text, env_name)
        close_sessions(run for game in games if game.done for run in game.runs.values())  # ended: free their caches
        turn += 1

    return [_episode(game, role, seats[role]) for game in games for role in game.runs]


def _whose_turn(game: _Game, env_name: str) -> str | None:
    try:
        role = game.keeper.declare(game.env.turn())
    except Exception as exc:
        game.fail(f"{type(exc).__name__}: {getattr(exc, 'message', exc)}")
        return None
    if role is None:
        game.done = True
    return role


def _scripted_turn(game: _Game, role: str, opponent: Callable, env_name: str) -> None:
    try:
        text = opponent(game.env, role, game.rng)
    except Exception as exc:
        game.fail(f"{env_name}: the opponent playing {role!r} raised at turn {game.keeper.turn_number}: {type(exc).__name__}: {exc}")
        return
    _apply_step(game, role, str(text), env_name)


def _prepare_context(game: _Game, role: str, chat: ChatFormat, limits: EpisodeLimits, env_name: str) -> bool:
    """Append what `role` sees now to its own context; False if the game had to end."""
    run = game.runs[role]
    try:
        observation = str(game.env.observation(role))
        system = game.env.system_prompt(role) if hasattr(game.env, "system_prompt") else None
    except Exception as exc:
        game.fail(f"{env_name}.observation({role!r}) at turn {game.keeper.turn_number}: {type(exc).__name__}: {exc}")
        return False
    if not run.tokens:
        run.session = KVSession()  # the role's own KV cache, kept between its turns
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": observation}]
        run.append(chat.prompt_tokens(messages), sampled=False)
        run.prompt_length = len(run.tokens)
        run.transcript = messages
    else:
        tokens = chat.observation_tokens(observation, last_token=run.tokens[-1] if run.tokens else None)
        if len(run.tokens) + len(tokens) >= limits.max_episode_tokens:
            game.done, game.status = True, "truncated"
            return False
        run.append(tokens, sampled=False)
        run.transcript.append({"role": "user", "content": observation})
    # An env may start the agent's reply for it (e.g. "move: "); those tokens are not sampled (mask 0).
    prefix = str(game.env.response_prefix(role)) if hasattr(game.env, "response_prefix") else ""
    if prefix:
        run.append(chat.encode(prefix), sampled=False)
    game.prefixes[role] = prefix
    run.state = EpisodeState.GENERATING
    return True


def _apply_step(game: _Game, role: str, text: str, env_name: str) -> None:
    where = f"{env_name}.step({role!r}) at turn {game.keeper.turn_number}"
    try:
        game.keeper.acted(role)
        with measure("env"):
            result = game.env.step(role, text)
        if not isinstance(result, MultiStepResult):
            raise EnvError(f"{where} returned {type(result).__name__}, not a MultiStepResult")
        for agent, reward in (result.rewards or {}).items():
            if agent not in game.rewards:
                raise EnvError(f"{where} gave a reward to unknown agent {agent!r}")
            game.rewards[agent] += check_reward(reward, where)
            if agent in game.runs:
                game.runs[agent].turn_rewards.append(float(reward))
    except Exception as exc:
        game.fail(f"{where}: {type(exc).__name__}: {getattr(exc, 'message', exc)}")
        return
    game.info.update(result.info or {})
    if result.done:
        game.done = True


def _episode(game: _Game, role: str, seat: Seat) -> Episode:
    run = game.runs[role]
    run.status, run.error, run.traceback, run.infra_cause = game.status, game.error, game.traceback, game.infra_cause
    run.turn_rewards = [game.rewards[role]] if game.status not in ("error", "infra_failed") else []
    run.info = {**game.info, "role": role, "policy": seat.policy or BASE_POLICY, "trainable": seat.trainable, "game": game.index}
    episode = _to_episode(run)
    episode.info["outcome"] = _outcome(game, role)
    return episode


def _outcome(game: _Game, role: str) -> str:
    winner = game.info.get("winner")
    if game.status in ("error", "infra_failed") or winner is None:
        return "unfinished"
    if winner == "draw":
        return "draw"
    return "win" if winner == role else "loss"
