"""A packed update (rows end to end, no padding) trains exactly as the padded one.

The class of bug: a row that attends to the row packed before it (or a suffix to its sibling's suffix), positions
that do not restart per row or do not continue from a shared prompt, a trained token read from the wrong packed
index (one off at a row's boundary), and log-probs reported in another frame than the padded path's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tinkerless.functions.training import forward_backward as training
from tinkerless.functions.training import packing, picked_logits
from tests.test_picked_logits import assert_same_training, run
from tests.test_shared_prefix import rl_batch
from tests.test_training_memory import CONFIGS, episodes, lora_worker  # noqa: F401


def ragged(seed: int = 1) -> list:
    """Rows of very different lengths (a sample that stopped early beside one that ran long), one token long too."""
    rng = np.random.default_rng(seed)
    data = []
    for n in (2, 30, 5, 17, 3, 41):
        tokens = rng.integers(0, 256, size=n).astype(np.int32)
        mask = np.zeros(n, np.float32)
        mask[max(1, n // 3):] = 1.0
        def logprobs():
            return -np.abs(rng.normal(size=n)).astype(np.float32)

        data.append(training.Datum(tokens, mask, advantages=rng.normal(size=n).astype(np.float32),
                                   sampler_logprobs=logprobs(), old_logprobs=logprobs(), ref_logprobs=logprobs()))
    return data


@pytest.mark.parametrize("config", CONFIGS[:4], ids=lambda c: f"{c.name}-{c.normalization}-tis{c.tis_cap}")
@pytest.mark.parametrize("make_batch", [episodes, rl_batch, ragged], ids=["multi-turn rows", "prompt-sharing groups",
                                                                          "ragged rows"])
def test_the_packed_update_gives_the_padded_loss_gradients_and_log_probs(lora_worker, monkeypatch, config, make_batch):  # noqa: F811
    data = make_batch()
    want = run(lora_worker, data, config)
    monkeypatch.setenv(packing.ENV, "1")
    calls = {"plain": 0, "shared": 0}
    for name, function in (("plain", packing.plain_logprobs), ("shared", packing.shared_logprobs)):
        monkeypatch.setattr(packing, f"{name}_logprobs",
                            lambda *a, name=name, function=function, **k: calls.__setitem__(name, calls[name] + 1)
                            or function(*a, **k))
    got = run(lora_worker, data, config)
    assert calls["plain"] + calls["shared"] > 0
    if make_batch is rl_batch:
        assert calls["shared"] > 0, "the prompt-sharing groups must run packed"
    assert_same_training(got, want, data)


def test_packed_rows_see_nothing_of_each_other(lora_worker):  # noqa: F811
    """Changing one row's tokens changes no other row's log-probs, in a plain pack and in a shared group."""
    split = picked_logits.decoder_and_head(lora_worker.model)
    data = ragged(3)
    batch = training.make_batch(data, lora_worker.pad_id, torch.device("cpu"))
    mask = batch.field([d.mask for d in data])
    with torch.no_grad():
        before, _ = packing.plain_logprobs(split, batch.input_ids, batch.lengths, mask, with_entropy=False)
        changed = batch.input_ids.clone()
        changed[1, : batch.lengths[1]] = (changed[1, : batch.lengths[1]] + 7) % 256
        after, _ = packing.plain_logprobs(split, changed, batch.lengths, mask, with_entropy=False)
    others = [r for r in range(len(data)) if r != 1]
    torch.testing.assert_close(after[others], before[others], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(after[1], before[1])

    from tinkerless.functions.training import shared_prefix

    rows = rl_batch()
    masks = [np.asarray(d.mask, np.float32) for d in rows]
    groups, _ = shared_prefix.find_prefix_groups([list(d.tokens) for d in rows], masks)
    micro = shared_prefix.SharedMicroBatch(groups[:2])
    tokens = [list(d.tokens) for d in rows]

    def shared(tokens):
        frame = shared_prefix.suffix_frame(micro, tokens, lora_worker.pad_id, torch.device("cpu"))
        frame_mask = frame.field([rows[i].mask for i in micro.rows])
        with torch.no_grad():
            return packing.shared_logprobs(split, micro, tokens, frame, frame_mask, with_entropy=False)[0]

    base = shared(tokens)
    victim = micro.groups[0].rows[0]
    edited = [list(t) for t in tokens]
    edited[victim][-3:] = [(t + 5) % 256 for t in edited[victim][-3:]]  # the end of one suffix
    moved = shared(edited)
    untouched = [k for k, i in enumerate(micro.rows) if i != victim]
    torch.testing.assert_close(moved[untouched], base[untouched], rtol=1e-5, atol=1e-6)
