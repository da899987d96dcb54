"""The rollout phase of a multi-agent step: every seating plays its games, the global barrier closes.

Each seating is one rollout call (on remote backends, a separate container);
they run concurrently. A trained policy's rollouts count as in once every
seating it plays in has returned; the coordinator then holds all updates
until every policy's rollouts are in.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from tinkerless.coordinator import Coordinator
from tinkerless.sdk.run.agents import Frozen, frozen_adapters, seatings
from tinkerless.wire import pack_code
from tinkerless.wire.messages import BASE_POLICY, Episode, MultiAgentRolloutRequest, Seat


def build_seats(agents: Any, frozen: dict[str, str] | None = None) -> list[dict[str, Seat]]:
    """Turn the user's seatings into wire `Seat`s (opponent functions packed by value); `frozen` names the worker
    policy each frozen adapter path is loaded as (default: `frozen_adapters(agents)`)."""
    frozen = frozen_adapters(agents) if frozen is None else frozen
    out = []
    for seating in seatings(agents):
        seats = {}
        for role, seat in seating.items():
            if isinstance(seat, str):
                seats[role] = Seat(policy=seat)
            elif isinstance(seat, Frozen):
                seats[role] = Seat(policy=frozen[seat.adapter] if seat.adapter else BASE_POLICY, trainable=False)
            else:
                seats[role] = Seat(opponent=pack_code(seat, name=getattr(seat, "__qualname__", role)), trainable=False)
        out.append(seats)
    return out


def play_step(
    seat_list: list[dict[str, Seat]],
    make_request: Callable[[dict[str, Seat], int], MultiAgentRolloutRequest],
    rollout: Callable[[MultiAgentRolloutRequest], Any],
    coordinator: Coordinator | None,
    step: int,
    on_event: Callable[[str, str], None],
) -> tuple[list[Episode], dict[str, float]]:
    """Play every seating; submit each trained policy to the barrier once all its seatings are done.

    Without a coordinator (rollouts played ahead of their step, `pipeline`) nothing is submitted: the loop submits
    them when it takes them. Returns the episodes and the rollouts' own stats (`RolloutResult.stats`: seconds generating, in the env,
    tokens prefilled, ...) summed over the seatings, so a multi-agent step accounts for its time like any other."""
    owed = {p: {i for i, s in enumerate(seat_list) if any(x.policy == p and x.trainable for x in s.values())}
            for p in {x.policy for s in seat_list for x in s.values() if x.trainable}}
    episodes: list[Episode] = []
    stats: dict[str, float] = {}

    def play(index: int):
        result = rollout(make_request(seat_list[index], index))
        for episode in result.episodes:
            episode.info["seating"] = index
        return result

    with ThreadPoolExecutor(max_workers=max(1, len(seat_list))) as pool:
        futures = {pool.submit(play, i): i for i in range(len(seat_list))}
        for future, index in futures.items():
            result = future.result()
            episodes.extend(result.episodes)
            for key, value in result.stats.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    stats[key] = stats.get(key, 0.0) + float(value)
            for policy, pending in owed.items() if coordinator is not None else ():
                pending.discard(index)
                if not pending and policy not in _submitted(coordinator):
                    coordinator.submit_rollout(step, policy)
                    on_event("rollouts_in", policy)
    return episodes, stats


def _submitted(coordinator: Coordinator) -> set[str]:
    return set(coordinator.state.rollouts_submitted)
