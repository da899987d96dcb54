"""Group-relative advantage estimators (run on the client, pure Python).

Each episode gets one scalar advantage computed against the other episodes that
share its group_id (the G samples drawn for one prompt):

    grpo     A_i = (R_i - mean(R)) / (std(R) + eps)   (DeepSeekMath GRPO)
    dr_grpo  A_i =  R_i - mean(R)                     (Dr.GRPO: no std division,
                                                       avoids the question-difficulty bias)

std is the *population* std (ddof=0): the group is exactly the set we normalise
over, not a sample of a larger population, so the advantages of a group always
have mean 0 and (for non-constant groups) std ~1. Note torch.std defaults to
ddof=1, which frameworks built on it inherit; the two differ by a factor
sqrt(G / (G - 1)) in advantage scale (1.41x for G=2, 1.07x for G=8).
Groups of size 1 and groups whose rewards are all equal get advantage 0 exactly
(no signal to learn from; avoids 1e-17 / eps noise).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from tinkerless.errors import ConfigError, RewardError, UserError

ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo")


@dataclass(frozen=True)
class AdvantageConfig:
    estimator: str = "grpo"  # "grpo": (r - mean) / (std + eps); "dr_grpo": r - mean (no std division)
    eps: float = 1e-6

    def validate(self) -> None:
        if self.estimator not in ADVANTAGE_ESTIMATORS:
            raise ConfigError(
                f"AdvantageConfig.estimator={self.estimator!r} is not a known estimator",
                hint=f"use one of {ADVANTAGE_ESTIMATORS}",
            )
        eps = self.eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
            raise ConfigError(f"AdvantageConfig.eps={eps!r} must be a finite number >= 0", hint="the default is 1e-6")


def _groups(rewards: Sequence[float], group_ids: Sequence[Hashable]) -> dict[Hashable, list[int]]:
    """Check inputs and map each group_id to the episode indices in it (input order kept)."""
    if len(rewards) != len(group_ids):
        raise UserError(
            f"got {len(rewards)} rewards but {len(group_ids)} group_ids",
            hint="pass exactly one group_id per episode",
        )
    for i, r in enumerate(rewards):
        # numbers.Real covers int/float/bool and numpy scalars (np.float32 is not a float subclass).
        if not isinstance(r, numbers.Real) or not math.isfinite(r):
            raise RewardError(
                f"reward of episode {i} (group {group_ids[i]!r}) is {r!r}, not a finite number",
                hint="make the reward function return a finite float for every episode",
            )
    groups: dict[Hashable, list[int]] = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    return groups


def group_advantages(
    rewards: Sequence[float],
    group_ids: Sequence[Hashable],
    config: AdvantageConfig = AdvantageConfig(),
) -> list[float]:
    """One advantage per episode; mean/std over episodes sharing a group_id.

    Groups of size 1 get 0. std is the population std (ddof=0).
    Raises RewardError if a reward is not finite.
    """
    config.validate()
    advantages = [0.0] * len(rewards)
    for members in _groups(rewards, group_ids).values():
        values = [float(rewards[i]) for i in members]
        if len(values) < 2 or all(v == values[0] for v in values):
            continue  # nothing to compare against: advantage stays exactly 0
        mean = sum(values) / len(values)
        if config.estimator == "grpo":
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
            scale = 1.0 / (std + config.eps)
        else:  # dr_grpo
            scale = 1.0
        for i, v in zip(members, values):
            advantages[i] = (v - mean) * scale
    return advantages


def drop_constant_groups(rewards: Sequence[float], group_ids: Sequence[Hashable]) -> list[int]:
    """Indices of episodes to keep: those whose group has at least two distinct rewards.

    DAPO "dynamic sampling": a group where every reward is equal (all right or all
    wrong, or a single episode) has zero advantage everywhere and only dilutes the batch.
    """
    keep: list[int] = []
    for members in _groups(rewards, group_ids).values():
        if len({float(rewards[i]) for i in members}) > 1:
            keep.extend(members)
    return sorted(keep)
