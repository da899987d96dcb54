"""One draw per decoding block: the rows of every job in a batch are drawn together, and each row still
draws exactly what it would alone.

The class of bug: a row whose token or log-prob changes because other jobs' rows were drawn with it
(a uniform taken from the wrong generator, rows of another temperature or top-k/top-p sharing its draw,
an offset between jobs); a temperature so near 0 that dividing by it overflows into a draw outside the
vocabulary (a 500) instead of the greedy token.
"""

from __future__ import annotations

import pytest
import torch

from tinkerless.functions.sampling.batcher import _draw_block, _Member
from tinkerless.functions.sampling.engine import GenerationJob
from tinkerless.wire.messages import SamplingParams

VOCAB = 50


def job(rows: int, seed: int, first_index: int = 0, **sampling) -> GenerationJob:
    params = SamplingParams(max_tokens=8, stop_token_ids=[], **{"temperature": 1.0, **sampling})
    return GenerationJob([[1, 2]] * rows, params, stop_ids=[], seed=seed, first_index=first_index,
                         device=torch.device("cpu"))


# Each case: the jobs (rows, seed, first row index, sampling) of one block, in row order.
BLOCKS = {
    "16 single-row calls": [(1, seed, 0, {}) for seed in range(16)],
    "one call's rows split in jobs": [(3, 7, 0, {}), (2, 7, 3, {}), (4, 7, 5, {})],
    "mixed settings": [(2, 1, 0, {}), (1, 2, 0, {"temperature": 0.7}), (2, 3, 0, {"temperature": 0.0}),
                       (1, 4, 0, {"top_k": 5}), (2, 5, 0, {}), (1, 6, 0, {"temperature": 1e-300}),
                       (2, 8, 0, {"top_p": 0.8, "temperature": 0.7}), (1, 9, 0, {"temperature": 0.7})],
}


@pytest.mark.parametrize("block", BLOCKS.values(), ids=BLOCKS.keys())
def test_a_block_drawn_at_once_gives_every_row_its_own_draw(block):
    together = [job(rows, seed, first, **s) for rows, seed, first, s in block]
    apart = [job(rows, seed, first, **s) for rows, seed, first, s in block]
    logits_source = torch.Generator().manual_seed(0)
    for _ in range(3):  # several steps: every generator must advance exactly as it would alone
        logits = torch.randn(sum(j.active_rows for j in together), VOCAB, generator=logits_source) * 3
        picks, picked = _draw_block([_Member(j, None, 10) for j in together], logits)
        offset = 0
        for mine, alone in zip(together, apart):
            count = alone.active_rows
            want_picks, want_picked = alone.draw(logits[offset : offset + count])
            assert picks[offset : offset + count] == want_picks.tolist()
            assert picked[offset : offset + count] == want_picked.tolist()  # bit for bit, not approximately
            mine.record(picks[offset : offset + count], picked[offset : offset + count])
            alone.record(want_picks.tolist(), want_picked.tolist())
            offset += count
    assert all(0 <= t < VOCAB for j in together for row in j.rows for t in row.tokens)


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-40, 1e-5, 9.99e-5])
def test_a_temperature_near_zero_is_greedy(temperature):
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    near_zero = job(4, 0, temperature=temperature, top_k=3, top_p=0.5)
    picks, picked = near_zero.draw(logits)
    assert picks.tolist() == logits.argmax(dim=-1).tolist()
    assert torch.equal(picked, torch.log_softmax(logits, dim=-1).max(dim=-1).values)
