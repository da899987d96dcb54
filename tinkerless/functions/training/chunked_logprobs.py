"""Log-probs of the trained tokens through the output head, without the whole batch's vocabulary logits.

`picked_logits` already runs the head only on the trained tokens; for a large update that is still
tokens x vocabulary logits (12k tokens x 49k of SmolLM2's vocabulary: 2.4 GB in fp32, plus the model-dtype
copy and their gradient). `head_logprobs` computes the same log-probs (and entropies) in chunks of rows
whose logits stay within `CHUNK_BYTES`: the forward keeps per token only its normalizer; the backward
recomputes each chunk's logits, turns them into the gradient of the hidden states (softmax minus the
one-hot of the target, times the incoming gradient) and drops them. Peak memory is one chunk's logits;
the cost is the head's forward once more, in the backward.

A batch whose logits fit in one chunk takes the plain autograd path (nothing to save, and no recompute:
the CPU's small updates keep their speed). Only a plain `nn.Linear` head (its weight frozen, as under
LoRA, or trained: its gradient is accumulated per chunk too) is chunked; anything else (a LoRA-wrapped
head, a sharded one) takes the plain path. liger-kernel's fused linear cross-entropy does the same in
Triton kernels on CUDA; `TINKERLESS_LIGER=1` would be the place to plug it in, once a GPU run shows it
is faster than this (docs/performance.md).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from tinkerless.functions.training.picked_logits import target_logprobs

# fp32 logits one chunk may hold (the head's output for that many tokens, and its softmax in the backward).
CHUNK_BYTES = int(os.environ.get("TINKERLESS_LOGITS_CHUNK_BYTES", str(256 << 20)))


def chunk_rows(vocab: int, chunk_bytes: int | None = None) -> int:
    """Tokens per chunk: as many as keep one chunk's fp32 logits within `chunk_bytes`."""
    return max(1, (CHUNK_BYTES if chunk_bytes is None else chunk_bytes) // (4 * vocab))


def head_logprobs(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, *, with_entropy: bool,
                  chunk_bytes: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of `targets` [N] under `head(hidden)` [N, V] (fp32), and each distribution's entropy (no grad):
    `picked_logits.target_logprobs(head(hidden), targets)`, in chunks when the logits would not fit one."""
    weight = getattr(head, "weight", None)
    rows = chunk_rows(weight.shape[0] if weight is not None else 1, chunk_bytes)
    if type(head) is not nn.Linear or hidden.shape[0] <= rows:
        return target_logprobs(head(hidden), targets, with_entropy=with_entropy)
    picked, entropy = _ChunkedHeadLogprobs.apply(hidden, head.weight, head.bias, targets, rows, with_entropy)
    return picked, entropy if with_entropy else None


class _ChunkedHeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, rows: int, with_entropy: bool):
        picked = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        normalizer = torch.empty_like(picked)
        entropy = torch.zeros_like(picked)
        for start in range(0, hidden.shape[0], rows):
            end = min(start + rows, hidden.shape[0])
            logits = nn.functional.linear(hidden[start:end], weight, bias).float()
            norm = torch.logsumexp(logits, dim=-1)
            normalizer[start:end] = norm
            picked[start:end] = logits.gather(1, targets[start:end, None]).squeeze(1) - norm
            if with_entropy:
                logp = logits - norm[:, None]
                entropy[start:end] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, normalizer)
        ctx.rows = rows
        ctx.mark_non_differentiable(entropy)
        return picked, entropy

    @staticmethod
    def backward(ctx, grad_picked, _grad_entropy):
        hidden, weight, bias, targets, normalizer = ctx.saved_tensors
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if want_bias and bias is not None else None
        for start in range(0, hidden.shape[0], ctx.rows):
            end = min(start + ctx.rows, hidden.shape[0])
            chunk = hidden[start:end]
            logits = nn.functional.linear(chunk, weight, bias).float()
            # d picked / d logits = onehot(target) - softmax(logits)
            grad_logits = -(logits - normalizer[start:end, None]).exp_()
            grad_logits.scatter_add_(1, targets[start:end, None], torch.ones_like(grad_logits[:, :1]))
            grad_logits.mul_(grad_picked[start:end, None])
            grad_logits = grad_logits.to(hidden.dtype)
            if want_hidden:
                grad_hidden[start:end] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight += (grad_logits.t() @ chunk).float()
            if grad_bias is not None:
                grad_bias += grad_logits.float().sum(0)
        return (grad_hidden,
                grad_weight.to(weight.dtype) if grad_weight is not None else None,
                grad_bias.to(bias.dtype) if grad_bias is not None else None,
                None, None, None)
