"""A rollout request served: the episode loop it asks for, the code its client shipped, and the call's stats.

A `RolloutRequest` runs either the built-in episode loop with the client's env class and reward function
(`rollout.agent_loop`) or copies of an @tinkerless.agent function against the worker's OpenAI endpoint
(`hosting.agent_functions`; on a shared server in the tenant's sandbox, `hosting.hosted_agents`). A
`MultiAgentRolloutRequest` plays games seat by seat (`rollout.multi_agent_loop`). These functions keep no state:
the worker hands them its engine, chat format and user-code hosts on each call, and keeps what outlives a call
(the unpickled-code cache, releasing the tenant's code host once the rollout is done).
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Callable

from tinkerless.errors import UserError
from tinkerless.functions.companions.judge import meter_judge
from tinkerless.functions.rollout.agent_loop import TokenCounts, run_episodes
from tinkerless.functions.rollout.recording import stamp_versions
from tinkerless.functions.rollout.chat import ChatFormat
from tinkerless.functions.rollout.multi_agent_loop import run_games
from tinkerless.functions.rollout.rollout_clock import TimedEngine, rollout_clock
from tinkerless.wire import unpack_code
from tinkerless.wire.code import CodeBlob
from tinkerless.wire.messages import BASE_POLICY, MultiAgentRolloutRequest, RolloutRequest, RolloutResult


def load_code(blob: CodeBlob | None, hosts: Any, cache: dict[str, Any]) -> Any:
    """The env class, reward function, agent or opponent a client shipped; unpickled once per payload."""
    if blob is None:
        return None
    if hosts is not None:  # never unpickled in this process: proxies to the tenant's sandbox
        return hosts.load(blob)
    key = hashlib.sha256(blob.payload).hexdigest()
    if key not in cache:
        cache[key] = unpack_code(blob)
    return cache[key]


def rollout(
    request: RolloutRequest,
    *,
    engine: Any,
    chat: ChatFormat,
    tokenizer: Any,
    hosts: Any,
    code_cache: dict[str, Any],
    check_policy: Callable[[str], Any],
    vision: Any = None,
    judge: Callable[[list, Any], dict] | None = None,
) -> RolloutResult:
    """`judge(episodes, spec)`: grades the episodes with `request.judge` (the worker's `judge`), after they are
    played, in the same call: the step's verdicts in one batch on the same model."""
    started = time.perf_counter()
    # The version of the weights that sample this rollout (a policy cannot change while its rollout runs):
    # stamped on every sampled token, which the update checks against its staleness bound.
    version = check_policy(request.policy).version if request.policy != BASE_POLICY else 0
    if request.agent is not None:
        if request.judge is not None:
            raise UserError("a judge grades env/reward episodes; an agent returns its own reward",
                            hint="call the judge from the agent function, or drop judge=")
        result = _agent_rollout(request, started, engine=engine, tokenizer=tokenizer, hosts=hosts,
                                code_cache=code_cache, vision=vision)
        stamp_versions(result.episodes, version)
        return result
    judged: dict = {}
    with rollout_clock() as clock:
        episodes = run_episodes(
            TimedEngine(engine),
            chat,
            policy=request.policy,
            tasks=request.tasks,
            group_size=request.group_size,
            sampling=request.sampling,
            limits=request.limits,
            seed=request.seed,
            env_cls=load_code(request.env, hosts, code_cache),
            reward_fn=load_code(request.reward, hosts, code_cache),
            system_prompt=request.system_prompt,
            counts=(counts := TokenCounts()),
        )
        if request.judge is not None:
            if judge is None:
                raise UserError("this worker runs no judge", hint="drop judge= from the rollout")
            started_judge = time.perf_counter()
            judged = {**judge(episodes, request.judge), "judge_s": time.perf_counter() - started_judge}
            meter_judge(judged)  # a server charges the judge's part of the call apart from the policy's
    stamp_versions(episodes, version)
    sampled = float(sum(e.sampled_tokens() for e in episodes))
    stats = {"sampled_tokens": sampled, "seconds": time.perf_counter() - started, **counts.as_stats(), **clock.as_stats(),
             **judged}
    return RolloutResult(episodes, stats)


def _agent_rollout(
    request: RolloutRequest, started: float, *, engine: Any, tokenizer: Any, hosts: Any, code_cache: dict[str, Any],
    vision: Any = None,
) -> RolloutResult:
    """Copies of an @tinkerless.agent function against this worker's OpenAI endpoint (agent_functions.py)."""
    from tinkerless.functions.hosting.agent_functions import run_agent_episodes

    if request.env is not None or request.reward is not None:
        raise UserError("a rollout takes an agent or an env/reward, not both", hint="send only `agent`")
    agent = load_code(request.agent, hosts, code_cache)
    options = dict(policy=request.policy, tasks=request.tasks, group_size=request.group_size, sampling=request.sampling,
                   limits=request.limits, seed=request.seed, timeout=request.agent_timeout)
    stats: dict = {}
    with rollout_clock() as clock:
        if hosts is not None and getattr(agent, "__tinkerless_loopback__", False):
            raise UserError("an external agent (tinkerless.external_agent) cannot run on a shared server: tenants' "
                            "programs run sandboxed there, with no loopback to the worker",
                            hint="train it with backend='local' or against `tinkerless serve --single-user`")
        if hosts is not None:  # a shared server: the copies run in the tenant's sandbox
            from tinkerless.functions.hosting.hosted_agents import run_hosted_agent_episodes

            episodes, stats = run_hosted_agent_episodes(engine, tokenizer, agent=agent, vision=vision, **options)
        else:
            episodes = run_agent_episodes(engine, tokenizer, agent=agent, transport=request.agent_transport, vision=vision,
                                          **options)
    sampled = float(sum(e.sampled_tokens() for e in episodes))
    return RolloutResult(episodes, {"sampled_tokens": sampled, "seconds": time.perf_counter() - started, **stats,
                                    **clock.as_stats()})


def rollout_multi(
    request: MultiAgentRolloutRequest,
    *,
    engine: Any,
    chat: ChatFormat,
    hosts: Any,
    code_cache: dict[str, Any],
    check_policy: Callable[[str], Any],
) -> RolloutResult:
    """Multi-agent games; one episode per game and model-played role."""
    started = time.perf_counter()
    versions: dict[str, int] = {}  # each model-played seat's policy version (stamped on its episodes' tokens)
    for seat in request.seats.values():
        if seat.opponent is None and seat.policy not in (None, BASE_POLICY):
            versions[seat.policy] = check_policy(seat.policy).version
    opponents = {role: load_code(seat.opponent, hosts, code_cache) for role, seat in request.seats.items() if seat.opponent}
    with rollout_clock() as clock:
        episodes = run_games(
            TimedEngine(engine),
            chat,
            env_cls=load_code(request.env, hosts, code_cache),
            tasks=request.tasks,
            group_size=request.group_size,
            seats=request.seats,
            opponents=opponents,
            sampling=request.sampling,
            limits=request.limits,
            seed=request.seed,
            timeout=request.protocol_timeout,
            counts=(counts := TokenCounts()),
        )
    for episode in episodes:
        stamp_versions([episode], versions.get(episode.info.get("policy"), 0))
    sampled = float(sum(e.sampled_tokens() for e in episodes))
    return RolloutResult(episodes, {"sampled_tokens": sampled, "seconds": time.perf_counter() - started,
                                    **counts.as_stats(), **clock.as_stats()})
