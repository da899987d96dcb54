"""Declaring who plays a multi-agent env, in a few lines.

A seating maps each role of the env to one of:
- a policy name (a LoRA adapter trained by this run; two roles may share one: self-play);
- `Frozen()` (the base model) or `Frozen("path/to/peft_adapter")`: played, never trained;
- a function `opponent(env, role, rng) -> str`: a scripted opponent.

`agents=` takes one seating (a dict) or a list of seatings, all played every step
(`round_robin` builds such a list).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable

from tinkerless.errors import ConfigError


@dataclass(frozen=True)
class Frozen:
    """A role played by a policy that is not trained: the base model, or a saved PEFT adapter."""

    adapter: str | None = None


def self_play(roles: tuple[str, ...] | list[str], policy: str = "policy") -> dict[str, str]:
    """Every role played by the same trained policy."""
    return {role: policy for role in roles}


def versus(learner: str, opponent: Any, roles: tuple[str, str], *, policy: str = "policy") -> dict[str, Any]:
    """`learner` role trained as `policy`, the other role played by `opponent` (a function or `Frozen`)."""
    if learner not in roles:
        raise ConfigError(f"learner role {learner!r} is not one of {list(roles)}")
    return {role: policy if role == learner else opponent for role in roles}


def round_robin(policies: list[str], roles: tuple[str, str]) -> list[dict[str, str]]:
    """Every ordered pairing of distinct policies, so each plays each role against every other."""
    if len(policies) < 2:
        raise ConfigError("round_robin needs at least two policies")
    return [dict(zip(roles, pair)) for pair in itertools.permutations(policies, len(roles))]


def seatings(agents: Any) -> list[dict[str, Any]]:
    seating_list = agents if isinstance(agents, list) else [agents]
    if not seating_list or not all(isinstance(s, dict) and s for s in seating_list):
        raise ConfigError(
            "agents must be a dict role -> seat, or a list of such dicts",
            hint="e.g. agents={'black': 'policy', 'white': tinkerless.Frozen()}",
        )
    for seating in seating_list:
        for role, seat in seating.items():
            if not (isinstance(seat, (str, Frozen)) or callable(seat)):
                raise ConfigError(
                    f"seat for role {role!r} is a {type(seat).__name__}",
                    hint="a seat is a policy name, tinkerless.Frozen(...) or an opponent(env, role, rng) function",
                )
    return seating_list


def check_roles(env_cls: Any, seating: dict[str, Any]) -> None:
    roles = list(getattr(env_cls, "agents", ()))
    missing, unknown = [r for r in roles if r not in seating], [r for r in seating if r not in roles]
    if missing or unknown:
        raise ConfigError(
            f"agents for {env_cls.__qualname__} (roles {roles}) miss {missing} and name unknown roles {unknown}",
            hint="give every role exactly one seat",
        )


def trainable_policies(agents: Any) -> list[str]:
    names: list[str] = []
    for seating in seatings(agents):
        for seat in seating.values():
            if isinstance(seat, str) and seat not in names:
                names.append(seat)
    return names


def frozen_adapters(agents: Any) -> dict[str, str]:
    """Each distinct frozen adapter path -> the worker policy name it is loaded under."""
    paths = sorted({seat.adapter for s in seatings(agents) for seat in s.values() if isinstance(seat, Frozen) and seat.adapter})
    return {path: f"frozen-{i}" for i, path in enumerate(paths)}


def every_frozen_adapter(agents: Any, eval_agents: Any = None) -> dict[str, str]:
    """`frozen_adapters` over the training seatings and the held-out eval's: one worker policy per path."""
    return frozen_adapters(seatings(agents) + (seatings(eval_agents) if eval_agents is not None else []))


OpponentFn = Callable[[Any, str, Any], str]
