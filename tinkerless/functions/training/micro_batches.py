"""How a training batch is cut into micro-batches, and when a micro-batch recomputes its layers in backward.

Backward keeps every layer's activations: about `activation_bytes_per_token` bytes per token of a
micro-batch. Long multi-turn episodes (thousands of tokens) would need gigabytes per row, so:
- rows are sorted by length (longest first) and cut into micro-batches of similar lengths, so little
  compute goes into padding, each holding at most a budget of padded tokens (by tokens, not rows);
- a micro-batch whose activations would still exceed the budget (one very long row) keeps only each
  layer's input and recomputes the layer in backward (activation checkpointing: one extra forward).
Results equal the unsplit batch's up to float rounding: the loss of each micro-batch is re-weighted
to its share of the batch normalizer (`training.forward_backward`).
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import torch

from tinkerless.errors import ConfigError

# Activation memory one micro-batch may keep for backward (an estimate, see below) before it recomputes
# layers instead; $TINKERLESS_ACTIVATION_MB overrides it (a GPU with room to spare trains faster with a
# larger budget: fewer, larger matmuls). Measured peaks: BENCHMARKS.md, "Training memory". On a GPU the
# budget is a share of the memory still free to this process (`gpu_activation_budget`), at most the figure here.
DEFAULT_ACTIVATION_MB = {"cpu": 1024, "cuda": 65536}
# What share of the free GPU memory activations may take: the rest holds the logits of the micro-batch,
# gradients, the optimizer's step and the allocator's fragmentation.
GPU_FREE_SHARE = 0.4
MIN_ACTIVATION_MB = 256
ACTIVATION_ENV = "TINKERLESS_ACTIVATION_MB"
# Floats backward keeps per token per layer, per unit of hidden and intermediate size (a LoRA
# all-linear decoder layer: norms, q/k/v/o inputs and outputs, attention output, MLP inputs,
# gate/up/act products). Measured on SmolLM2 with bench/train_memory.py; an estimate, not a bound.
_HIDDEN_FLOATS, _INTERMEDIATE_FLOATS = 12, 6
# A model whose config does not give its sizes: a token budget as before this module.
FALLBACK_TOKEN_BUDGET = 4096


@dataclass(frozen=True)
class MicroBatch:
    rows: list[int]  # indices into the batch, longest first
    width: int  # padded length
    recompute: bool  # activation checkpointing for this micro-batch


def activation_budget_bytes(device: torch.device | str = "cpu") -> int:
    raw = os.environ.get(ACTIVATION_ENV)
    if raw is None:
        kind = torch.device(device).type
        ceiling = DEFAULT_ACTIVATION_MB.get(kind, DEFAULT_ACTIVATION_MB["cpu"]) * 2**20
        if kind == "cuda" and torch.cuda.is_available():
            return min(ceiling, gpu_activation_budget(torch.device(device)))
        return ceiling
    try:
        mb = float(raw)
    except ValueError:
        mb = -1.0
    if not mb > 0:
        raise ConfigError(f"${ACTIVATION_ENV}={raw!r} is not a positive number of megabytes", hint="e.g. 1024, or unset it")
    return int(mb * 2**20)


def gpu_activation_budget(device: torch.device) -> int:
    """A share of the GPU memory this process may still take: the device's free memory, or less under a cap set
    with `torch.cuda.set_per_process_memory_fraction` (a 24 GB card's worth on an 80 GB one), whichever is
    smaller. So the same run cuts smaller micro-batches (and recomputes more) on a smaller card."""
    return max(MIN_ACTIVATION_MB * 2**20, int(GPU_FREE_SHARE * gpu_available_bytes(device)))


def gpu_available_bytes(device: torch.device) -> int:
    """GPU memory this process may still take: the device's free memory, or less under a cap set with
    `torch.cuda.set_per_process_memory_fraction`, plus what torch has reserved but does not use."""
    free, total = torch.cuda.mem_get_info(device)
    capped = torch.cuda.get_per_process_memory_fraction(device) * total - torch.cuda.memory_reserved(device)
    return max(0, int(min(free, capped)) + _reusable(device))


def _reusable(device: torch.device) -> int:
    """Memory torch has reserved but is not using: the allocator hands it out again before asking for more."""
    return max(0, torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def activation_bytes_per_token(model) -> int | None:
    """Bytes of activations backward keeps per token (None when the config does not say the sizes)."""
    config = getattr(model, "config", None)
    config = getattr(config, "get_text_config", lambda: config)()
    try:
        layers = int(config.num_hidden_layers)
        hidden = int(config.hidden_size)
        intermediate = int(getattr(config, "intermediate_size", None) or 4 * hidden)
    except (AttributeError, TypeError, ValueError):
        return None
    element = next(model.parameters()).element_size()
    return layers * (_HIDDEN_FLOATS * hidden + _INTERMEDIATE_FLOATS * intermediate) * element


def model_token_budget(model) -> int:
    """Padded tokens one micro-batch of `model` may hold within the activation budget without recompute."""
    per_token = activation_bytes_per_token(model)
    if per_token is None:
        return FALLBACK_TOKEN_BUDGET
    return max(1, activation_budget_bytes(next(model.parameters()).device) // per_token)


def plan_micro_batches(
    lengths: list[int], micro_batch_size: int, model=None, *, token_budget: int | None = None
) -> list[MicroBatch]:
    """Rows grouped by similar length, each group within `micro_batch_size` rows and the token budget.

    The token budget is what fits the activation budget (`token_budget` overrides it); a row longer
    than the budget goes alone and recomputes its layers in backward.
    """
    if micro_batch_size < 1:
        raise ConfigError(f"micro_batch_size={micro_batch_size} must be >= 1", hint="e.g. 16")
    if token_budget is None:
        token_budget = model_token_budget(model) if model is not None else FALLBACK_TOKEN_BUDGET
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    plan: list[MicroBatch] = []
    current: list[int] = []
    for index in order:
        width = lengths[current[0]] if current else lengths[index]  # the first row is the longest
        if current and (len(current) >= micro_batch_size or (len(current) + 1) * width > token_budget):
            plan.append(_micro(current, lengths, token_budget))
            current = []
        current.append(index)
    if current:
        plan.append(_micro(current, lengths, token_budget))
    return plan


def _micro(rows: list[int], lengths: list[int], token_budget: int) -> MicroBatch:
    width = max(lengths[i] for i in rows)
    return MicroBatch(list(rows), width, recompute=len(rows) * width > token_budget)


@contextlib.contextmanager
def recompute_in_backward(model, enabled: bool = True):
    """Activation checkpointing for the decoder layers of `model` while the body runs (forward and backward).

    transformers' own switch works only in train mode, which would also turn dropout on (the worker keeps
    the model in eval mode so training and sampling see one function). So only the checkpointed layers
    themselves are flagged as training: their submodules, dropout included, stay in eval mode.
    """
    if not enabled:
        yield
        return
    from transformers.modeling_layers import GradientCheckpointingLayer
    from torch.utils.checkpoint import checkpoint

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    saved = [(m, m.training, m.__dict__.get("gradient_checkpointing"), m.__dict__.get("_gradient_checkpointing_func")) for m in layers]
    func = functools.partial(checkpoint, use_reentrant=False)
    try:
        for m in layers:
            m.training = True  # this module only: nn.Module.train() would recurse into dropout
            m.gradient_checkpointing = True
            m._gradient_checkpointing_func = func
        yield
    finally:
        for m, training, flag, old_func in saved:
            m.training = training
            for name, value in (("gradient_checkpointing", flag), ("_gradient_checkpointing_func", old_func)):
                if value is None:
                    m.__dict__.pop(name, None)
                else:
                    setattr(m, name, value)
