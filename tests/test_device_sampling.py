"""The draw on the device: counter-based uniforms and per-row top-k/top-p, checked against references.

The class of bug: a uniform that depends on something besides (row seed, token position) (an int64 overflow,
whose wrap-around a CPU and a GPU need not share; a sign-extending shift), uniforms that are not uniform or
are correlated across positions or seeds, and per-row filters that keep other tokens than transformers'
warpers keep for the same settings, so a row's distribution is not the one its caller asked for.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from tinkerless.functions.sampling.device_sampling import (DrawSettings, counter_uniforms, filtered_scores, row_keys,
                                                           sample)
from tinkerless.wire.messages import SamplingParams

M32 = 0xFFFFFFFF


def reference_mix(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def reference_uniform(seed: int, position: int) -> float:
    """The hash in Python's unbounded integers: what the int64 tensor ops must compute bit for bit."""
    seed %= 1 << 64
    first = reference_mix((seed & M32) ^ reference_mix(((seed >> 32) & M32) ^ 0x243F6A88))
    second = reference_mix(first ^ 0x85A308D3)
    bits = reference_mix(reference_mix(((position & M32) * 0x9E3779B9 + first) & M32) ^ second)
    return (bits >> 8) / (1 << 24)


HOSTILE_SEEDS = [0, 1, -1, 2**31 - 1, 2**32, 2**63 - 1, 2**64 - 1, -(2**63), 6364136223846793005, 12345]


def test_uniforms_are_the_integer_hash_exactly_for_hostile_seeds_and_positions():
    positions = [0, 1, 2, 255, 65535, 2**31, 2**32 - 1]
    keys = row_keys(HOSTILE_SEEDS)
    grid = torch.tensor(positions, dtype=torch.long).repeat(len(HOSTILE_SEEDS), 1)
    got = counter_uniforms(keys, grid)
    want = torch.tensor([[reference_uniform(s, p) for p in positions] for s in HOSTILE_SEEDS], dtype=torch.float32)
    assert torch.equal(got, want)
    assert got.dtype == torch.float32 and bool(((got >= 0) & (got < 1)).all())
    # one position per row (the decode step's shape) gives the same values as the grid's columns
    assert torch.equal(counter_uniforms(keys, grid[:, 3]), got[:, 3])
    # a seed and the same seed modulo 2^64 are one seed; different seeds and positions differ
    assert torch.equal(row_keys([-1]), row_keys([2**64 - 1]))
    assert len({tuple(k) for k in keys.tolist()}) == len(HOSTILE_SEEDS) - 1  # -1 and 2**64-1 coincide


def test_uniforms_are_uniform_and_uncorrelated_across_positions_and_seeds():
    rows, steps = 512, 400
    keys = row_keys(list(range(rows)))  # consecutive seeds: the weakest case for a hash
    u = counter_uniforms(keys, torch.arange(steps).repeat(rows, 1)).double()
    n = u.numel()
    counts = torch.histc(u, bins=64, min=0, max=1)
    chi2 = float(((counts - n / 64) ** 2 / (n / 64)).sum())
    assert chi2 < 120, chi2  # 63 degrees of freedom: p < 1e-5 above ~120
    centered = u - 0.5
    by_position = float((centered[:, 1:] * centered[:, :-1]).mean() / centered.var())
    by_seed = float((centered[1:] * centered[:-1]).mean() / centered.var())
    assert abs(by_position) < 5 / math.sqrt(n) and abs(by_seed) < 5 / math.sqrt(n), (by_position, by_seed)
    assert u.unique().numel() > 0.99 * n - n * n / (2 * 2**24)  # 24-bit values: only birthday collisions


CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.5, top_k=12, top_p=0.6),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.0, top_k=10_000),  # over the vocabulary: no filter
    SamplingParams(temperature=2.0, top_p=1e-6),  # keeps only the most likely token
    SamplingParams(temperature=0.0, top_k=3, top_p=0.5),  # greedy: filters ignored
    SamplingParams(temperature=1e-300),
]


def warped(logits: torch.Tensor, s: SamplingParams) -> torch.Tensor:
    scores = logits / s.temperature
    if s.top_k:
        scores = TopKLogitsWarper(s.top_k)(None, scores)
    if s.top_p < 1.0:
        scores = TopPLogitsWarper(s.top_p)(None, scores)
    return scores


@pytest.mark.parametrize("vocab", [7, 50, 1000])
def test_per_row_filters_keep_exactly_what_transformers_warpers_keep(vocab):
    source = torch.Generator().manual_seed(vocab)
    logits = torch.randn(len(CASES) * 3, vocab, generator=source) * 4
    logits[::4, : vocab // 2] = logits[::4, :1]  # ties at the k-th value and in the cumulative mass
    settings = [CASES[i % len(CASES)] for i in range(logits.shape[0])]
    got = filtered_scores(logits, DrawSettings.of(row_keys(range(len(settings))), settings, "cpu"))
    for row, s in enumerate(settings):
        if s.temperature < 1e-4:
            continue  # greedy rows never use their scores
        assert torch.equal(got[row], warped(logits[row : row + 1], s)[0]), (row, s)


def test_a_draw_is_the_inverse_cdf_of_the_warped_softmax_with_the_row_uniform():
    vocab, steps = 40, 6
    source = torch.Generator().manual_seed(3)
    seeds = [7, 7, 8, 2**63 - 1, 0, 123, 5, 9, 11]
    settings = [CASES[i % len(CASES)] for i in range(len(seeds))]
    draw_settings = DrawSettings.of(row_keys(seeds), settings, "cpu")
    for step in range(steps):
        logits = torch.randn(len(seeds), vocab, generator=source) * 3
        positions = torch.full((len(seeds),), step) + torch.arange(len(seeds)) % 2
        draw = sample(logits, draw_settings, positions)
        assert bool(draw.finite.all())
        for row, (seed, s) in enumerate(zip(seeds, settings)):
            logprobs = torch.log_softmax(logits[row], -1)
            if s.temperature < 1e-4:
                want = int(logits[row].argmax())
            else:
                cdf = torch.softmax(warped(logits[row : row + 1], s), -1).cumsum(-1)[0]
                u = torch.tensor(reference_uniform(seed, int(positions[row])), dtype=torch.float32)
                target = torch.minimum(u * cdf[-1], cdf[-1] * (1 - 1e-6))
                want = int(torch.searchsorted(cdf, target[None], right=True))
            assert int(draw.tokens[row]) == want
            assert float(draw.logprobs[row]) == float(logprobs[want])
    # rows 0 and 1 share a seed but draw at different positions; the same (seed, position) draws the same
    again = sample(logits, draw_settings, positions)
    assert torch.equal(again.tokens, draw.tokens)


def test_draws_follow_the_filtered_distribution():
    """Frequencies over many positions of one row match the top-k/top-p distribution (chi-square)."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]])
    s = SamplingParams(temperature=0.9, top_k=6, top_p=0.9)
    probs = torch.softmax(warped(logits, s), -1)[0]
    n = 40_000
    settings = DrawSettings.of(row_keys([42] * n), [s] * n, "cpu")
    tokens = sample(logits.expand(n, -1), settings, torch.arange(n)).tokens
    counts = torch.bincount(tokens, minlength=8).double()
    assert counts[probs == 0].sum() == 0, "a filtered token was drawn"
    live = probs > 0
    expected = probs[live].double() * n
    chi2 = float(((counts[live] - expected) ** 2 / expected).sum())
    assert chi2 < 25, (chi2, counts, expected)  # <= 5 degrees of freedom


def test_non_finite_rows_are_flagged_and_their_picks_stay_in_the_vocabulary():
    logits = torch.randn(6, 9)
    logits[1, 2] = float("nan")
    logits[3] = float("inf")
    logits[4, 0] = float("-inf")  # a -inf logit is a zero-probability token: finite
    settings = [SamplingParams(temperature=t) for t in (1.0, 1.0, 0.0, 0.7, 1.0, 0.0)]
    draw = sample(logits, DrawSettings.of(row_keys(range(6)), settings, "cpu"), torch.zeros(6, dtype=torch.long))
    assert draw.finite.tolist() == [True, False, True, False, True, True]
    assert bool(((draw.tokens >= 0) & (draw.tokens < 9)).all())
    assert int(draw.tokens[4]) != 0
