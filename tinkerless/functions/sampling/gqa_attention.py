"""Grouped-query attention without copying keys/values to every head, for no-grad CPU forwards.

SmolLM2 (and the tiny test model) have fewer key/value heads than query heads. transformers' "sdpa"
attention on CPU expands the keys and values to every query head (`repeat_kv`, a copy of the whole
KV cache per layer) whenever there is an attention mask, which the batcher always passes (rows are
left-padded). `torch.nn.functional.scaled_dot_product_attention(..., enable_gqa=True)` reads the
shared heads in place and gives the same numbers (the same kernel, the same reductions: measured
bit-identical on CPU); at SmolLM2's decode shapes it makes attention about 3x faster.

`install(model)` switches a model to the attention function here, under its own name: forwards
without gradients on CPU (generation, log-probs) take the GQA path; on a GPU, decode steps (one
query position) fold each key/value head's query heads into the query length (`folded_decode`: no
copy, any SDPA backend, the pool's mask included, where transformers' sdpa expands K/V whenever a
mask is passed); anything else (training's backward, GPU prefills, position biases, attention-weight
outputs) goes to transformers' own "sdpa" function unchanged.
"""

from __future__ import annotations

import os

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "tinkerless_gqa_sdpa"


def gqa_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query (batch, heads, q, dim), key/value (batch, kv_heads, kv, dim)."""
    groups = getattr(module, "num_key_value_groups", 1)
    if (groups == 1 or torch.is_grad_enabled() or dropout
            or kwargs.get("position_bias") is not None or kwargs.get("output_attentions")):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if query.device.type != "cpu":
        if query.shape[2] == 1 and folded_decode_enabled():
            return folded_decode(query, key, value, attention_mask, scaling, groups)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    # The same causal rule as sdpa_attention_forward: the mask, when given, already holds causality; without
    # one, a multi-token query is causal (a prefill with no cache and no padding).
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(query.shape[2] > 1 and attention_mask is None and causal)
    if causal and key.shape[2] > query.shape[2]:  # sdpa's causal mask is upper-left: align it as transformers does
        key, value = key[:, :, : query.shape[2]], value[:, :, : query.shape[2]]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, is_causal=causal, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def folded_decode_enabled() -> bool:
    """TINKERLESS_GQA_DECODE=0: GPU decode steps take transformers' sdpa (K/V expanded where a mask is passed)."""
    return os.environ.get("TINKERLESS_GQA_DECODE", "1").strip() != "0"


def folded_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                  scaling: float | None, groups: int) -> tuple[torch.Tensor, None]:
    """One decode position's attention with the query heads of each key/value head folded into the query length:
    (batch, kv_heads, groups, dim) against (batch, kv_heads, positions, dim), a plain SDPA that never copies the
    keys/values (query head h reads kv head h // groups, as repeat_kv does) and takes any backend, a padding mask
    included (GPU SDPA with `enable_gqa` and a mask falls back to the math kernel, which expands them)."""
    batch, heads, _, dim = query.shape
    folded = query.reshape(batch, heads // groups, groups, dim)
    mask = attention_mask
    if mask is not None:  # (batch, 1, 1, positions): the same for every folded query row
        mask = mask[..., -1:, : key.shape[-2]].expand(batch, 1, groups, min(mask.shape[-1], key.shape[-2]))
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


def register() -> None:
    """Make NAME a valid `attn_implementation` (idempotent): this function, with sdpa's masks."""
    AttentionInterface.register(NAME, gqa_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def install(model) -> bool:
    """Switch `model` (a transformers model, before any peft wrapping or after) to this attention if it runs
    transformers' "sdpa" and has grouped-query heads; True if it did. Other models are left as they are."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not heads or kv_heads == heads:
        return False
    register()
    model.set_attn_implementation(NAME)
    return config._attn_implementation == NAME
