"""Log-probs of exactly the tokens a loss trains on: the output head runs on their positions only.

A causal LM's logits are its output head applied to the decoder's last hidden states, and a loss reads one
log-prob per trained token. The head (hidden × vocabulary: a fifth of SmolLM2's forward, and as much again in
backward) and the log-softmax over the vocabulary are only needed at those (row, position) pairs. The model's
own `logits_to_keep` keeps the same positions in every row, so a micro-batch of multi-turn rows, whose turns
sit at different places, would compute the union of every row's turns: three to four times the pairs the loss
reads. Here the decoder runs once and the head runs on the gathered pairs.

A model whose logits are more than the head's output (a soft cap, a scale) or that a sharding wrapper owns
takes the whole model's path: `decoder_and_head` checks each model once, on a few tokens.
"""

from __future__ import annotations

import weakref

import torch

_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def decoder_and_head(model) -> tuple | None:
    """(decoder, head) such that `model(ids).logits` is `head(decoder(ids).last_hidden_state)`, else None."""
    if model not in _CHECKED:
        _CHECKED[model] = _split(model)
    return _CHECKED[model]


def _split(model) -> tuple | None:
    get_decoder, get_head = getattr(model, "get_decoder", None), getattr(model, "get_output_embeddings", None)
    if not (callable(get_decoder) and callable(get_head)):
        return None
    decoder, head = get_decoder(), get_head()
    if decoder is None or head is None or decoder is model:
        return None
    # A sharded model (FSDP2's DTensors) gathers its parameters in hooks of the whole model's forward.
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        return None
    device = next(model.parameters()).device
    ids = torch.tensor([[0, 1, 2, 3]], device=device)
    try:
        with torch.no_grad():
            whole = model(input_ids=ids, use_cache=False).logits.float()
            split = head(decoder(input_ids=ids, use_cache=False).last_hidden_state).float()
    except Exception:  # a capability probe: a decoder that cannot be called alone means the whole model's path
        return None
    if whole.shape != split.shape or not torch.allclose(whole, split, rtol=1e-3, atol=1e-3):
        return None
    return decoder, head


def trained_pairs(mask: torch.Tensor, *, first: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, columns) of the trained entries of `mask` [B, T] from column `first` on, in row-major order."""
    found = torch.nonzero(mask[:, first:] > 0)
    return found[:, 0], found[:, 1] + first


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, with_entropy: bool
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of `targets` [...] under `logits` [..., V] (upcast to fp32), and each distribution's entropy."""
    logits = logits.float()
    normalizer = torch.logsumexp(logits, dim=-1)
    picked = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1) - normalizer
    entropy = None
    if with_entropy:
        with torch.no_grad():
            logp = logits.detach() - normalizer.detach().unsqueeze(-1)
            entropy = -(logp.exp() * logp).sum(-1)
    return picked, entropy


def scattered(values: torch.Tensor | None, rows: torch.Tensor, columns: torch.Tensor, shape) -> torch.Tensor | None:
    """`values` [N] placed at (rows, columns) of a zero [B, T] (differentiable)."""
    if values is None:
        return None
    return torch.zeros(shape, dtype=values.dtype, device=values.device).index_put((rows, columns), values)


def row_logprobs(split: tuple, input_ids: torch.Tensor, mask: torch.Tensor, *, with_entropy: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, T] of right-padded rows' trained tokens (others 0), through `split`'s decoder and head.

    No attention mask, as in `forward_backward.token_logprobs`: rows are right-padded and attention causal.
    """
    decoder, head = split
    rows, columns = trained_pairs(mask)
    hidden = decoder(input_ids=input_ids, use_cache=False).last_hidden_state
    from tinkerless.functions.training.chunked_logprobs import head_logprobs

    picked, entropy = head_logprobs(hidden[rows, columns - 1], head, input_ids[rows, columns], with_entropy=with_entropy)
    return scattered(picked, rows, columns, input_ids.shape), scattered(entropy, rows, columns, input_ids.shape)
