"""Hand-computed checks of tinkerless.sdk.run.advantages.

Shared example: 7 episodes in 3 interleaved groups.

    rewards   = [1.0, 2.0, 0.0, 5.0, 4.0, 0.0, 0.0]
    group_ids = ["a", "b", "a", "c", "b", "a", "a"]

    group a = [1, 0, 0, 0]: mean 0.25, population var = (0.75^2 + 3 * 0.25^2) / 4 = 0.1875,
              std = 0.433013 -> grpo: 0.75 / 0.433013 = 1.732051 (sqrt 3), -0.25 / 0.433013 = -0.577350
    group b = [2, 4]:       mean 3, population std 1 -> grpo: -1, +1 (ddof=1 would give -0.707107, +0.707107)
    group c = [5]:          size 1 -> 0
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tinkerless.errors import ConfigError, RewardError, UserError
from tinkerless.sdk.run.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    drop_constant_groups,
    group_advantages,
)

REWARDS = [1.0, 2.0, 0.0, 5.0, 4.0, 0.0, 0.0]
GROUPS = ["a", "b", "a", "c", "b", "a", "a"]


def test_estimator_names():
    assert ADVANTAGE_ESTIMATORS == ("grpo", "dr_grpo")


def test_grpo_population_std_hand_example():
    adv = group_advantages(REWARDS, GROUPS, AdvantageConfig(estimator="grpo", eps=0.0))
    expected = [1.732051, -1.0, -0.577350, 0.0, 1.0, -0.577350, -0.577350]
    assert adv == pytest.approx(expected, abs=1e-6)


def test_grpo_eps_in_denominator():
    # group b with eps=0.5: (2 - 3) / (1 + 0.5) = -0.666667, +0.666667
    adv = group_advantages([2.0, 4.0], ["b", "b"], AdvantageConfig(eps=0.5))
    assert adv == pytest.approx([-2 / 3, 2 / 3], abs=1e-9)


def test_grpo_default_config():
    adv = group_advantages(REWARDS, GROUPS)  # eps=1e-6 moves values by ~1e-6 relative
    assert adv == pytest.approx([1.732051, -1.0, -0.577350, 0.0, 1.0, -0.577350, -0.577350], abs=1e-5)


def test_dr_grpo_no_std_division():
    # group a: r - 0.25 -> 0.75, -0.25, -0.25, -0.25; group b: r - 3 -> -1, +1; group c: 0
    adv = group_advantages(REWARDS, GROUPS, AdvantageConfig(estimator="dr_grpo"))
    assert adv == pytest.approx([0.75, -1.0, -0.25, 0.0, 1.0, -0.25, -0.25], abs=1e-12)


@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS)
def test_constant_group_is_exactly_zero(estimator):
    # 0.1 * 3 / 3 != 0.1 in floats; a constant group must still give exact zeros, not noise / eps
    adv = group_advantages([0.1, 0.1, 0.1], [7, 7, 7], AdvantageConfig(estimator=estimator))
    assert adv == [0.0, 0.0, 0.0]


def test_hashable_group_ids_and_numpy_rewards():
    rewards = [np.float32(1.0), np.float64(3.0), 2]  # numpy scalars and ints are numbers too
    adv = group_advantages(rewards, [("p", 0), ("p", 0), ("q", 1)], AdvantageConfig(estimator="dr_grpo"))
    assert adv == pytest.approx([-1.0, 1.0, 0.0])


def test_empty_input():
    assert group_advantages([], []) == []


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), None, "1.0"])
def test_non_finite_reward_raises_reward_error(bad):
    with pytest.raises(RewardError, match="episode 1"):
        group_advantages([1.0, bad], ["a", "a"])


def test_length_mismatch_raises():
    with pytest.raises(UserError, match="2 rewards but 3 group_ids"):
        group_advantages([1.0, 2.0], ["a", "a", "b"])


@pytest.mark.parametrize(
    "config, field",
    [(AdvantageConfig(estimator="rloo"), "estimator"), (AdvantageConfig(eps=-1.0), "eps")],
)
def test_validate_names_the_bad_field(config, field):
    with pytest.raises(ConfigError, match=field):
        config.validate()


def test_drop_constant_groups():
    # a and b vary, c has one episode, d is all equal -> keep indices of a and b only
    rewards = REWARDS + [1.0, 1.0]
    groups = GROUPS + ["d", "d"]
    assert drop_constant_groups(rewards, groups) == [0, 1, 2, 4, 5, 6]


def test_module_is_light():
    # load the file on its own (not via tinkerless.sdk/__init__, which others own) and check no torch/numpy
    path = Path(__file__).resolve().parents[1] / "tinkerless" / "sdk" / "run" / "advantages.py"
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('adv', {str(path)!r})\n"
        "mod = sys.modules['adv'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
        "assert mod.group_advantages([0.0, 1.0], [0, 0]) is not None\n"
        "heavy = [m for m in ('torch', 'numpy') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=path.parents[2])


def test_mean_zero_per_group():
    adv = group_advantages(REWARDS, GROUPS)
    assert math.fsum(a for a, g in zip(adv, GROUPS) if g == "a") == pytest.approx(0.0, abs=1e-9)
