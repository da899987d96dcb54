"""Agent calls gathered into one generate call sample exactly what each would sample alone.

The gather (functions/hosting/agent_functions._Gather) batches the calls of concurrent agent copies. Which calls
meet in a batch, and in what order, depends on timing; a call's tokens and log-probs must not.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from tinkerless.functions.hosting.agent_functions import _Gather
from tinkerless.functions.worker import Worker
from tinkerless.wire.messages import SamplingParams

PROMPTS = [[5, 9, 12, 7], [3, 4], [8, 8, 8], [21, 2, 30, 4, 11]]
SEEDS = [101, 7, 55555, 2**40 + 3]


@pytest.fixture(scope="module")
def engine(tiny_model):
    return Worker(tiny_model).engine


def _gathered(engine, order: list[int], sampling: list[SamplingParams]) -> dict[int, tuple]:
    """Send the calls `order` names concurrently through one gather; their results by call index."""

    async def main():
        with ThreadPoolExecutor(2) as executor:
            gather = _Gather(
                lambda prompts, s, seeds, constraints: engine.generate(prompts, s, policy=None, seed=seeds[0], row_seeds=seeds),
                executor, live=len(order),
            )  # fmt: skip
            results = await asyncio.gather(*(gather.generate(PROMPTS[i], sampling[i], seed=SEEDS[i]) for i in order))
            return gather.flushes, results

    flushes, results = asyncio.run(main())
    return flushes, {i: (g.tokens, g.logprobs) for i, g in zip(order, results)}


def _same(a: tuple, b: tuple) -> bool:
    """Same tokens; log-probs equal up to float rounding (a batch's shape changes the matmuls' summation order)."""
    return a[0] == b[0] and len(a[1]) == len(b[1]) and all(abs(x - y) <= 1e-5 for x, y in zip(a[1], b[1]))


def test_a_call_samples_the_same_alone_or_gathered_in_any_order(engine):
    sampling = [SamplingParams(max_tokens=8, temperature=1.0, stop_token_ids=[])] * len(PROMPTS)
    alone = {i: _gathered(engine, [i], sampling)[1][i] for i in range(len(PROMPTS))}
    for order in ([0, 1, 2, 3], [3, 1, 0, 2], [2, 0]):
        flushes, together = _gathered(engine, order, sampling)
        assert flushes == 1  # they did meet in one generate call
        for i in order:
            assert _same(together[i], alone[i]), f"call {i} sampled differently in the batch {order}"
    assert len({tuple(alone[i][0]) for i in alone}) > 1  # the seeds differ, and so do the draws


def test_calls_with_other_sampling_settings_are_not_sampled_with_the_first_calls(engine):
    """Gathered calls share a generate call only when they share every sampling setting."""
    greedy = SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[])
    hot = SamplingParams(max_tokens=6, temperature=1.0, stop_token_ids=[])
    default_stop = SamplingParams(max_tokens=6, temperature=1.0, stop_token_ids=None)
    sampling = [hot, greedy, default_stop, hot]
    alone = {i: _gathered(engine, [i], sampling)[1][i] for i in range(len(PROMPTS))}
    flushes, together = _gathered(engine, [0, 1, 2, 3], sampling)
    assert flushes == 3  # hot (0 and 3), greedy (1), the model's own stop tokens (2)
    assert all(_same(together[i], alone[i]) for i in alone)
