"""Episodes that failed for an infrastructure reason: played again, then dropped from their groups, never scored.

An env server or judge that is unreachable or timed out, a sandbox or hosted-agent process that died: the
worker marks such an episode `infra_failed` with its cause (`errors.InfrastructureFailure`, `errors.infra_cause`),
instead of an `error` of the user's env or reward. Scoring it 0 would teach the policy something false
(open-instruct PR #1887 measured 5-15% of episodes under spot preemption), so `play` asks for it again, up to
`TrainConfig.infra_retries` times, as a fresh draw of the same task; one that still fails is left out of its
group: the group's advantages are computed over the episodes that remain (`split`), and the step counts it as
`episodes_infra_failed` with its cause in episodes.jsonl. A rollout call that itself failed for such a reason
(the worker's env host died under it) is made again the same number of times.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Callable

from tinkerless.errors import InfrastructureFailure, ServerUnreachable, infra_cause
from tinkerless.wire.messages import Episode, RolloutRequest, RolloutResult

INFRA_FAILED = "infra_failed"


def retry_seed(seed: int, attempt: int) -> int:
    """The seed of the `attempt`-th replay of a step's failed episodes: a fresh draw, the same on every run."""
    return (seed * 1_000_003 + attempt * 104_729 + 17) % (2**31 - 1)


def play(rollout: Callable[[RolloutRequest], RolloutResult], request: RolloutRequest, retries: int) -> RolloutResult:
    """`rollout(request)`, with every `infra_failed` episode played again (a fresh draw of its task) up to
    `retries` times; episodes keep their places and task indices. `stats` adds `episodes_infra_retried`."""
    result = _call(rollout, request, retries)
    episodes, stats = list(result.episodes), dict(result.stats)
    replayed = 0
    for attempt in range(1, retries + 1):
        failed = [i for i, e in enumerate(episodes) if e.status == INFRA_FAILED]
        if not failed:
            break
        replayed += len(failed)
        again = dataclasses.replace(request, tasks=[request.tasks[episodes[i].task_index] for i in failed], group_size=1,
                                    seed=retry_seed(request.seed, attempt))
        try:
            redone = rollout(again)
        except Exception as exc:  # noqa: BLE001 - only an infrastructure failure is another try; the rest is raised
            if infra_cause(exc) is None or isinstance(exc, ServerUnreachable):
                raise
            continue  # the failed episodes stay failed; the next attempt (if any) asks again
        if len(redone.episodes) != len(failed):
            raise InfrastructureFailure(f"a replay of {len(failed)} episodes came back with {len(redone.episodes)}",
                                        cause="worker_protocol", hint="the worker answered a rollout wrongly; retry the run")
        for i, episode in zip(failed, redone.episodes):
            episode.task_index = episodes[i].task_index  # its place in the step's tasks, not in the replay's
            episodes[i] = episode
        _add_stats(stats, redone.stats)
    stats["episodes_infra_retried"] = float(replayed)
    return RolloutResult(episodes, stats)


def _call(rollout: Callable[[RolloutRequest], RolloutResult], request: RolloutRequest, retries: int) -> RolloutResult:
    for attempt in range(retries + 1):
        try:
            return rollout(request)
        except Exception as exc:  # noqa: BLE001 - only an infrastructure failure is made again
            # A lost server is not retried call by call: its policies went with it (the run reconnects, `reconnect`).
            if infra_cause(exc) is None or isinstance(exc, ServerUnreachable) or attempt == retries:
                raise
    raise AssertionError("unreachable")


def _add_stats(total: dict, more: dict) -> None:
    """A replay's work adds to the step's (tokens and seconds are sums)."""
    for key, value in more.items():
        if isinstance(value, (int, float)) and math.isfinite(value) and isinstance(total.get(key, 0.0), (int, float)):
            total[key] = float(total.get(key, 0.0)) + float(value)


def split(episodes: list[Episode], step: int | None = None, retries: int = 0) -> tuple[list[Episode], list[Episode]]:
    """(the episodes that count, those dropped for an infrastructure failure). Only the first go into groups,
    advantages, rewards and the env-error policy: a dropped episode is not a 0. With `step`, raises when every
    episode of the step was dropped: there is nothing to train on, and the service the episodes need is down
    (the run stops, resumable, instead of training on nothing)."""
    kept = [e for e in episodes if e.status != INFRA_FAILED]
    dropped = [e for e in episodes if e.status == INFRA_FAILED]
    if step is not None and dropped and not kept:
        causes = Counter(e.infra_cause or "unknown" for e in dropped)
        raise InfrastructureFailure(
            f"all {len(dropped)} episodes of step {step} failed for infrastructure reasons after {retries} retries "
            f"({', '.join(f'{c}: {n}' for c, n in causes.most_common())}); first: {dropped[0].error}",
            cause=causes.most_common(1)[0][0],
            hint="the env server, judge or sandbox the episodes need is down: bring it back and resume the run "
            "(`--resume`), or raise infra_retries",
        )
    return kept, dropped


def columns(dropped: list[Episode], stats: dict) -> dict:
    """The step's metrics: `episodes_infra_failed`, `episodes_infra_retried`, and the first few failures."""
    record: dict = {"episodes_infra_failed": len(dropped),
                    "episodes_infra_retried": int(stats.get("episodes_infra_retried", 0))}
    if dropped:
        record["infra_failures"] = [{"task_index": e.task_index, "cause": e.infra_cause, "error": e.error} for e in dropped[:5]]
    return record


def describe(record: dict, retries: int) -> str | None:
    """The line a user sees for a step that dropped episodes (None when it dropped none)."""
    if not record.get("episodes_infra_failed"):
        return None
    first = record["infra_failures"][0]
    return (f"step {record['step']}: {record['episodes_infra_failed']} episodes dropped after {retries} retries "
            f"(infrastructure: {first['cause']}): {first['error']}")
