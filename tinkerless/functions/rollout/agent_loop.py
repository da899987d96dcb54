"""The agent loop: one state machine per episode, batched across episodes.

PENDING → GENERATING ↔ INTERACTING → TERMINATED. Each turn, every episode
that is GENERATING is sampled in one batch; the env then reacts to each
sampled turn. Sampled tokens are kept exactly as sampled (mask 1, with the
sampler's log-probs); the chat frame and env observations are appended as
tokens with mask 0. An env or reward that raises ends only its own episode,
which is marked `error` with the traceback and dropped from training; one that
raises an `InfrastructureFailure` (its env server, judge or sandbox failed) is
marked `infra_failed` with the cause, for the client to retry (never a reward).
"""

from __future__ import annotations

import enum
import math
import traceback as tb
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from tinkerless.envs.base import StepResult, as_step_result, check_reward
from tinkerless.errors import DatasetError, TinkerlessError, infra_cause
from tinkerless.functions.rollout.chat import ChatFormat
from tinkerless.functions.sampling.engine import Engine, Generation
from tinkerless.functions.sampling.kv_cache import KVSession
from tinkerless.functions.rollout.rollout_clock import measure
from tinkerless.functions.hosting.user_code import call_each
from tinkerless.wire.messages import Episode, EpisodeLimits, SamplingParams


class EpisodeState(enum.Enum):
    PENDING = "pending"
    GENERATING = "generating"
    INTERACTING = "interacting"
    TERMINATED = "terminated"


@dataclass
class _Run:
    task_index: int
    task: dict
    env: Any = None
    state: EpisodeState = EpisodeState.PENDING
    tokens: list[int] = field(default_factory=list)
    mask: list[float] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_length: int = 0
    transcript: list[dict] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    status: str = "ok"
    error: str | None = None
    traceback: str | None = None
    info: dict = field(default_factory=dict)
    session: KVSession | None = None  # its KV cache between turns, in the engine that keeps one
    infra_cause: str | None = None

    def fail(self, where: str, exc: BaseException) -> None:
        self.infra_cause = infra_cause(exc)
        self.status = "error" if self.infra_cause is None else "infra_failed"
        self.error = f"{where}: {type(exc).__name__}: {exc}"
        self.traceback = _traceback_of(exc)
        self.state = EpisodeState.TERMINATED

    def append(self, tokens: list[int], *, sampled: bool, logprobs: list[float] | None = None) -> None:
        self.tokens.extend(tokens)
        self.mask.extend([1.0 if sampled else 0.0] * len(tokens))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(tokens))


@dataclass
class TokenCounts:
    """A rollout's generation work: prompt tokens prefilled and reused from kept caches, tokens decoded."""

    prefill_tokens: int = 0
    cached_tokens: int = 0
    decoded_tokens: int = 0

    def add(self, generations: list[Generation]) -> None:
        for generation in generations:
            self.prefill_tokens += generation.prefill_tokens
            self.cached_tokens += generation.cached_tokens
            self.decoded_tokens += len(generation.tokens)

    def as_stats(self) -> dict[str, float]:
        return {"prefill_tokens": float(self.prefill_tokens), "cached_prompt_tokens": float(self.cached_tokens),
                "decoded_tokens": float(self.decoded_tokens)}


def close_sessions(runs) -> None:
    """Free the kept caches of conversations that will not continue (all of them when `runs` is every run)."""
    for run in runs:
        if run.session is not None:
            run.session.close()
            run.session = None


def _traceback_of(exc: BaseException) -> str:
    # Code that ran in a tenant's sandbox (user_code.py) brings the traceback from there: the useful one.
    hosted = getattr(exc, "traceback", None)
    return hosted if isinstance(hosted, str) and hosted else tb.format_exc()


def _env_name(env_cls: Any) -> str:
    return getattr(env_cls, "__qualname__", type(env_cls).__name__)


def _first_messages(run: _Run, env_cls: Any, system_prompt: str | None) -> list[dict]:
    messages: list[dict] = []
    if env_cls is None:
        task = run.task
        if "messages" in task:
            return list(task["messages"])
        if "prompt" not in task:
            raise DatasetError(
                f"task {run.task_index} has no 'prompt' (keys: {sorted(task)})",
                hint="single-turn tasks need a 'prompt' string or a 'messages' list; multi-turn tasks need an env",
            )
        if system_prompt:
            messages.append({"role": "system", "content": system_prompt})
        messages.append({"role": "user", "content": str(task["prompt"])})
        return messages
    env = run.env
    system = env.system_prompt() if hasattr(env, "system_prompt") else system_prompt
    if system:
        messages.append({"role": "system", "content": system})
    with measure("env"):
        first = env.reset(**run.task)
    parts = [env.initial_user_message()] if hasattr(env, "initial_user_message") else []
    parts.append(first)
    content = "\n\n".join(str(p) for p in parts if p)
    messages.append({"role": "user", "content": content})
    return messages


def run_episodes(
    engine: Engine,
    chat: ChatFormat,
    *,
    policy: str | None,
    tasks: list[dict],
    group_size: int,
    sampling: SamplingParams,
    limits: EpisodeLimits,
    seed: int,
    env_cls: Any = None,
    reward_fn: Callable | None = None,
    system_prompt: str | None = None,
    counts: TokenCounts | None = None,
) -> list[Episode]:
    """Run every episode to its end; `counts` (if given) adds up the generation work."""
    runs = [_Run(task_index=i, task=task) for i, task in enumerate(tasks) for _ in range(group_size)]
    try:
        return _run_episodes(engine, chat, runs, policy=policy, sampling=sampling, limits=limits, seed=seed,
                             env_cls=env_cls, reward_fn=reward_fn, system_prompt=system_prompt,
                             counts=counts if counts is not None else TokenCounts())
    finally:
        close_sessions(runs)


def _run_episodes(engine, chat, runs, *, policy, sampling, limits, seed, env_cls, reward_fn, system_prompt, counts):
    env_name = _env_name(env_cls) if env_cls is not None else None

    for run in runs:  # PENDING → GENERATING
        try:
            if env_cls is not None:
                run.env = env_cls()
            messages = _first_messages(run, env_cls, system_prompt)
        except DatasetError:
            raise
        except Exception as exc:
            run.fail(f"{env_name}.reset" if env_name else "prompt", exc)
            continue
        run.transcript = list(messages)
        run.append(chat.prompt_tokens(messages), sampled=False)
        run.prompt_length = len(run.tokens)
        run.state = EpisodeState.GENERATING
        if env_cls is not None and limits.max_turns > 1:  # a conversation that may continue keeps its KV cache
            run.session = KVSession()

    turn = 0
    while True:
        active = [r for r in runs if r.state is EpisodeState.GENERATING]
        if not active:
            break
        budgets = [limits.max_episode_tokens - len(r.tokens) for r in active]
        turn_sampling = SamplingParams(
            max_tokens=max(0, min(sampling.max_tokens, max(budgets))),
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
        )
        sessions = [r.session for r in active]
        generations = engine.generate(
            [r.tokens for r in active], turn_sampling, policy=policy, seed=seed * 1_000_003 + turn,
            sessions=sessions if all(s is not None for s in sessions) else None,
        )
        counts.add(generations)
        turn += 1
        texts, last_tokens = [], []
        for run, generation, budget in zip(active, generations, budgets):
            tokens, logprobs = generation.tokens[: max(budget, 0)], generation.logprobs[: max(budget, 0)]
            run.append(tokens, sampled=True, logprobs=logprobs)
            last_tokens.append(tokens[-1] if tokens else None)
            texts.append(chat.decode(tokens))
            run.transcript.append({"role": "assistant", "content": texts[-1]})
            run.state = EpisodeState.INTERACTING
        # Envs in a tenant's sandbox (user_code.py) take the whole turn's steps in one round trip.
        stepped = call_each([r.env for r in active], "step", [(t,) for t in texts]) if env_cls is not None else None
        for i, run in enumerate(active):
            _interact(run, texts[i], last_tokens[i], env_name, chat, limits, stepped[i] if stepped is not None else _NOT_STEPPED)
        close_sessions(r for r in active if r.state is not EpisodeState.GENERATING)  # finished: free their caches

    scored = [r for r in runs if r.status not in ("error", "infra_failed")] if reward_fn is not None else []
    rewards = call_each([reward_fn] * len(scored), "", [(_completion(r, env_cls is None), r.task) for r in scored])
    for run, value in zip(scored, rewards if rewards is not None else [_NOT_STEPPED] * len(scored)):
        _final_reward(run, reward_fn, env_cls is None, value)
    return [_to_episode(run) for run in runs]


_NOT_STEPPED = object()  # no result computed ahead: call the env (or reward) here


def _outcome(value: Any, call: Callable[[], Any]) -> Any:
    """A result computed ahead in a batch (re-raised if it was an error), or the call made now."""
    if value is _NOT_STEPPED:
        with measure("env"):
            return call()
    if isinstance(value, BaseException):
        raise value
    return value


def _interact(
    run: _Run, text: str, last_token: int | None, env_name: str | None, chat: ChatFormat, limits: EpisodeLimits, stepped: Any = _NOT_STEPPED
) -> None:
    turns = sum(1 for m in run.transcript if m["role"] == "assistant")
    if run.env is None:
        run.state = EpisodeState.TERMINATED
        return
    try:
        result: StepResult = as_step_result(_outcome(stepped, lambda: run.env.step(text)), env_name or "env")
    except Exception as exc:
        run.fail(f"{env_name}.step (turn {turns})", exc)
        return
    run.turn_rewards.append(result.reward)
    run.info.update(result.info or {})
    if result.done or result.observation is None:
        run.state = EpisodeState.TERMINATED
        return
    if turns >= limits.max_turns:
        run.status = "truncated"
        run.state = EpisodeState.TERMINATED
        return
    observation = chat.observation_tokens(str(result.observation), last_token=last_token)
    if len(run.tokens) + len(observation) >= limits.max_episode_tokens:
        run.status = "truncated"
        run.state = EpisodeState.TERMINATED
        return
    run.append(observation, sampled=False)
    run.transcript.append({"role": "user", "content": str(result.observation)})
    run.state = EpisodeState.GENERATING


def _completion(run: _Run, single_turn: bool) -> Any:
    return run.transcript[-1]["content"] if single_turn else run.transcript


def _final_reward(run: _Run, reward_fn: Callable, single_turn: bool, computed: Any = _NOT_STEPPED) -> None:
    name = getattr(reward_fn, "__qualname__", "reward")
    completion = _completion(run, single_turn)
    try:
        value = check_reward(_outcome(computed, lambda: reward_fn(completion, run.task)), name)
    except TinkerlessError as exc:
        run.fail(name, exc)
        run.error = f"{name}: {type(exc).__name__}: {exc.message}"
        return
    except Exception as exc:
        run.fail(name, exc)
        return
    run.turn_rewards.append(value)


def _to_episode(run: _Run) -> Episode:
    reward = float(sum(run.turn_rewards)) if run.status not in ("error", "infra_failed") else math.nan
    return Episode(
        task_index=run.task_index,
        tokens=np.asarray(run.tokens, dtype=np.int32),
        mask=np.asarray(run.mask, dtype=np.float32),
        sampler_logprobs=np.asarray(run.logprobs, dtype=np.float32),
        prompt_length=run.prompt_length,
        reward=reward,
        turn_rewards=list(run.turn_rewards),
        num_turns=sum(1 for m in run.transcript if m["role"] == "assistant"),
        status=run.status,
        error=run.error,
        traceback=run.traceback,
        transcript=run.transcript,
        info=run.info,
        infra_cause=run.infra_cause,
    )
