"""The unbiased pass@k estimator against the definition it estimates, and what counts as a pass."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tinkerless.errors import ConfigError
from tinkerless.sdk.evaluation.pass_at_k import PassRule, mean_pass_at_k, pass_at_k


@given(st.integers(1, 9).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_equals_the_share_of_k_subsets_holding_a_pass(case):
    n, c, k = case
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(samples, k))
    exact = sum(any(s) for s in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_known_values():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 4) == 1.0
    assert pass_at_k(4, 1, 1) == 0.25 and pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(200, 10, 1) == pytest.approx(0.05)
    assert pass_at_k(10_000, 1, 5000) == pytest.approx(0.5)  # large n: no overflow, no cancellation
    assert mean_pass_at_k([(4, 0), (4, 4)], 1) == 0.5
    assert math.isnan(mean_pass_at_k([], 1))


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5), (4, 2.0, 1), (True, 1, 1)])
def test_impossible_counts_are_refused(n, c, k):
    with pytest.raises(ConfigError, match="pass@k needs"):
        pass_at_k(n, c, k)


def test_pass_rule():
    default = PassRule()
    assert default.passed(0.01) and not default.passed(0.0) and not default.passed(-1.0)
    assert not default.passed(1.0, errored=True) and not default.passed(math.nan)
    assert default.describe() == "reward > 0"
    strict = PassRule(1.0)
    assert strict.passed(1.0) and not strict.passed(0.99) and strict.describe() == "reward >= 1"
    for bad in (math.inf, math.nan, "1", True):
        with pytest.raises(ConfigError, match="pass threshold"):
            PassRule(bad)
