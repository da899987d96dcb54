"""The output head runs on exactly the trained tokens (`functions/training/picked_logits.py`), and nothing changes.

Against the whole model's path (`logits_to_keep`: every column any row of a micro-batch trains), on batches whose
rows train at different places (multi-turn rows, ragged prompts), plain and prompt-sharing micro-batches alike:
the same loss, gradients and log-probs up to float rounding, with the head fed one row per trained token. A model
whose logits are more than its head's output (a soft cap) is found out and takes the whole model's path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinkerless.functions.losses import LossConfig
from tinkerless.functions.training import forward_backward as training
from tinkerless.functions.training import picked_logits
from tinkerless.wire.messages import Datum
from tests.test_shared_prefix import rl_batch
from tests.test_training_memory import CONFIGS, assert_grads_close, episodes, grads, lora_worker  # noqa: F401


def whole_model_path(monkeypatch) -> None:
    monkeypatch.setattr(picked_logits, "decoder_and_head", lambda model: None)


def run(worker, data, config, micro_batch_size=3):
    metrics, logprobs = training.forward_backward(worker.model, data, config, worker.pad_id, micro_batch_size)
    return metrics, logprobs, grads(worker)


def assert_same_training(got, want, data) -> None:
    (metrics, logprobs, gradients), (want_metrics, want_logprobs, want_gradients) = got, want
    for key, value in want_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    assert_grads_close(gradients, want_gradients)
    for datum, values, expected in zip(data, logprobs, want_logprobs):
        trained = np.asarray(datum.mask) > 0
        trained[0] = False  # the first token has no prefix
        np.testing.assert_allclose(values[trained], expected[trained], rtol=1e-4, atol=1e-5)
        assert not values[~trained].any()  # only the trained tokens are scored


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.name}-{c.normalization}-tis{c.tis_cap}")
@pytest.mark.parametrize("make_batch", [episodes, rl_batch], ids=["multi-turn rows", "prompt-sharing groups"])
def test_the_head_on_trained_tokens_trains_as_the_whole_model(lora_worker, monkeypatch, config, make_batch):  # noqa: F811
    data = make_batch()
    assert picked_logits.decoder_and_head(lora_worker.model) is not None  # the tiny Qwen2's logits are its head's
    got = run(lora_worker, data, config)
    with monkeypatch.context() as patch:
        whole_model_path(patch)
        want = run(lora_worker, data, config)
    assert_same_training(got, want, data)


@pytest.mark.parametrize("make_batch", [episodes, rl_batch], ids=["multi-turn rows", "prompt-sharing groups"])
def test_the_head_sees_one_row_per_trained_token(lora_worker, make_batch):  # noqa: F811
    data = make_batch()
    picked_logits.decoder_and_head(lora_worker.model)  # its one check runs the head on a few tokens: not counted
    head = lora_worker.model.get_output_embeddings()
    rows_seen: list[int] = []
    hook = head.register_forward_hook(lambda module, args, out: rows_seen.append(args[0].reshape(-1, args[0].shape[-1]).shape[0]))
    try:
        run(lora_worker, data, LossConfig())
    finally:
        hook.remove()
    assert sum(rows_seen) == sum(int((np.asarray(d.mask)[1:] > 0).sum()) for d in data)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_any_layout_of_turns_trains_alike(lora_worker, data):  # noqa: F811
    """Rows of random lengths with trained spans at random places, some sharing a prompt, some not."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    prompt = rng.integers(0, 256, size=int(rng.integers(8, 20)))
    batch = []
    for _ in range(data.draw(st.integers(1, 7), label="rows")):
        shared = rng.random() < 0.5
        head = prompt if shared else rng.integers(0, 256, size=int(rng.integers(1, 20)))
        tokens = np.concatenate([head, rng.integers(0, 256, size=int(rng.integers(1, 30)))])
        mask = (rng.random(len(tokens)) < 0.4).astype(np.float32)
        mask[: len(head)] = 0.0
        if shared:
            mask[len(head)] = 1.0  # a sharing row trains right after the prompt
        sampler = np.where(mask > 0, rng.normal(-2.0, 0.3, size=len(tokens)), 0.0).astype(np.float32)
        batch.append(Datum(tokens, mask, advantages=mask * float(rng.normal()), sampler_logprobs=sampler))
    micro_batch_size = data.draw(st.integers(1, 4), label="micro_batch_size")
    config = LossConfig(name="ppo")
    got = run(lora_worker, batch, config, micro_batch_size)
    with pytest.MonkeyPatch.context() as patch:
        whole_model_path(patch)
        want = run(lora_worker, batch, config, micro_batch_size)
    assert_same_training(got, want, batch)


def test_a_soft_capped_model_takes_the_whole_models_path():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8)
    capped = Gemma2ForCausalLM(Gemma2Config(**config, final_logit_softcapping=0.01)).eval()
    assert picked_logits.decoder_and_head(capped) is None  # its logits are tanh-capped after the head
    plain = Gemma2ForCausalLM(Gemma2Config(**config, final_logit_softcapping=None)).eval()
    assert picked_logits.decoder_and_head(plain) is not None


def test_a_decoder_that_cannot_run_alone_takes_the_whole_models_path(lora_worker):  # noqa: F811
    """A model whose `get_decoder()` is not a callable decoder (some multimodal wrappers) is not split."""

    class Wrapped(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, **kwargs):
            return self.inner(**kwargs)

        def get_decoder(self):
            return torch.nn.Identity()  # takes no input_ids

        def get_output_embeddings(self):
            return self.inner.get_output_embeddings()

    assert picked_logits.decoder_and_head(Wrapped(lora_worker.model)) is None
