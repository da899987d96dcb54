"""Log-probs through the output head in chunks equal the whole logits' log-probs, values and gradients.

The class of bug: a chunk boundary that drops or repeats a token (an uneven last chunk), a backward that
forgets the softmax term or the incoming gradient's scale, a head bias or a trained head weight whose
gradient is lost, entropies of the wrong tokens, and an update whose loss or gradients move when its
trained tokens no longer fit one chunk.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tinkerless.functions.training import chunked_logprobs
from tinkerless.functions.training.chunked_logprobs import chunk_rows, head_logprobs
from tinkerless.functions.training.picked_logits import target_logprobs
from tests.test_picked_logits import assert_same_training, run
from tests.test_shared_prefix import rl_batch
from tests.test_training_memory import CONFIGS, episodes, lora_worker  # noqa: F401


def case(tokens: int, vocab: int, *, bias: bool, train_head: bool, dtype=torch.float32, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    head = nn.Linear(24, vocab, bias=bias).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * 0.5)
        if bias:
            head.bias.copy_(torch.randn(vocab, generator=generator))
    head.weight.requires_grad_(train_head)
    if bias:
        head.bias.requires_grad_(train_head)
    hidden = (torch.randn(tokens, 24, generator=generator) * 2).to(dtype).requires_grad_(True)
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    upstream = torch.randn(tokens, generator=generator)  # a loss's per-token weights
    return head, hidden, targets, upstream


def outcome(head, hidden, targets, upstream, **chunking):
    for p in (hidden, *head.parameters()):
        p.grad = None
    if chunking:
        picked, entropy = head_logprobs(hidden, head, targets, with_entropy=True, **chunking)
    else:
        picked, entropy = target_logprobs(head(hidden), targets, with_entropy=True)
    (picked * upstream).sum().backward()
    grads = [p.grad.clone() if p is not None and p.grad is not None else None for p in (hidden, head.weight, head.bias)]
    return picked.detach(), entropy, grads


@pytest.mark.parametrize("tokens, vocab, chunk", [(37, 50, 5), (64, 50, 8), (9, 1000, 1), (33, 7, 32)])
@pytest.mark.parametrize("bias, train_head", [(False, False), (True, True), (False, True)])
def test_chunks_give_the_whole_logits_values_and_gradients(tokens, vocab, chunk, bias, train_head):
    head, hidden, targets, upstream = case(tokens, vocab, bias=bias, train_head=train_head)
    assert chunk_rows(vocab, chunk * 4 * vocab) == chunk and tokens > chunk  # several chunks, an uneven last one
    picked, entropy, grads = outcome(head, hidden, targets, upstream, chunk_bytes=chunk * 4 * vocab)
    want_picked, want_entropy, want_grads = outcome(head, hidden, targets, upstream)
    torch.testing.assert_close(picked, want_picked, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, want_entropy, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, want_grads):
        assert (got is None) == (want is None)
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_bf16_chunks_match_the_bf16_whole_logits():
    head, hidden, targets, upstream = case(40, 300, bias=False, train_head=False, dtype=torch.bfloat16)
    picked, entropy, grads = outcome(head, hidden, targets, upstream, chunk_bytes=7 * 4 * 300)
    want_picked, want_entropy, want_grads = outcome(head, hidden, targets, upstream)
    assert picked.dtype == want_picked.dtype == torch.float32
    torch.testing.assert_close(picked, want_picked, rtol=0, atol=1e-5)  # the same bf16 logits, upcast alike
    torch.testing.assert_close(entropy, want_entropy, rtol=0, atol=1e-4)
    torch.testing.assert_close(grads[0].float(), want_grads[0].float(), rtol=2e-2, atol=2e-2)


def test_a_batch_within_one_chunk_and_a_wrapped_head_take_the_plain_path(monkeypatch):
    head, hidden, targets, _ = case(10, 50, bias=False, train_head=False)
    calls = []
    monkeypatch.setattr(chunked_logprobs._ChunkedHeadLogprobs, "apply", lambda *a: calls.append(a))
    head_logprobs(hidden, head, targets, with_entropy=False, chunk_bytes=10 * 4 * 50)  # fits one chunk
    head_logprobs(hidden, nn.Sequential(head), targets, with_entropy=False, chunk_bytes=4)  # not a plain Linear
    assert calls == []


@pytest.mark.parametrize("config", CONFIGS[:3], ids=lambda c: f"{c.name}-{c.normalization}")
@pytest.mark.parametrize("make_batch", [episodes, rl_batch], ids=["multi-turn rows", "prompt-sharing groups"])
def test_an_update_in_chunks_trains_as_with_the_whole_logits(lora_worker, monkeypatch, config, make_batch):  # noqa: F811
    data = make_batch()
    want = run(lora_worker, data, config)
    vocab = lora_worker.model.get_output_embeddings().weight.shape[0]
    monkeypatch.setattr(chunked_logprobs, "CHUNK_BYTES", 5 * 4 * vocab)  # 5 tokens a chunk
    calls = []
    apply = chunked_logprobs._ChunkedHeadLogprobs.apply
    monkeypatch.setattr(chunked_logprobs._ChunkedHeadLogprobs, "apply", lambda *a: calls.append(1) or apply(*a))
    got = run(lora_worker, data, config)
    assert calls, "the update must have run the chunked path"
    assert_same_training(got, want, data)
