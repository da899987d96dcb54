"""Forward and forward_backward on datums that carry images: the same images as the rollout, encoded once.

`training.forward_backward` hands a batch here when any datum holds images. Micro-batches are right-padded rows
of similar length, as on the text path; the difference is the model's input: token embeddings with each
image's features merged at its image tokens (and Qwen-VL's multimodal positions), by the same `inputs` functions
the sampler's prefill uses, so the update's log-prob of a sampled token equals the sampler's.

The vision tower runs once per distinct image per call: with the tower and connector frozen (LoRA on the language
model only, the default) their features are computed once, without a graph, and shared by every micro-batch;
with a trainable connector or tower each micro-batch encodes its own distinct images (a graph cannot be shared
across backward passes), still once per image within it.
"""

from __future__ import annotations

import numpy as np
import torch

from tinkerless.functions.losses import LossConfig
from tinkerless.functions.training import picked_logits
from tinkerless.functions.training.micro_batches import plan_micro_batches
from tinkerless.functions.vision.inputs import (attention_inputs, deepstack, encode_images, merged_embeddings, placeholder_ids, position_ids, unwrap,
                                               without_placeholders)
from tinkerless.wire.messages import Datum


def _vision_trains(model) -> bool:
    """Whether any trainable parameter sits in the tower or the connector (then features need their graph)."""
    return any(p.requires_grad and ("vision_tower" in n or "visual" in n or "multi_modal_projector" in n)
               for n, p in model.named_parameters())


def _logprobs(model, data: list[Datum], rows: list[int], pad_id: int, features: dict, image_token_id: int,
              trained_only: bool = False):
    """Log-probs of every token of the rows (0 at column 0); with `trained_only`, the output head runs only on
    the positions some row trains (as the text path's `picked_logits`), the others left 0."""
    from tinkerless.functions.training.forward_backward import make_batch, trained_positions

    device = next(model.parameters()).device
    chunk = [data[i] for i in rows]
    batch = make_batch(chunk, pad_id, device)
    images = [list(d.images or []) for d in chunk]
    embeds = merged_embeddings(model, batch.input_ids, images, features, image_token_id)
    positions = position_ids(model, batch.input_ids, images, batch.attention)
    width = batch.input_ids.shape[1]
    targets = torch.arange(1, width, device=device)
    if trained_only:
        mask = batch.field([d.mask for d in chunk])
        targets = trained_positions(mask * ~torch.isin(batch.input_ids, torch.tensor(placeholder_ids(model),
                                                                                      device=device)))
    # No attention mask, as on the text path: rows are right-padded and attention is causal.
    with deepstack(model, batch.input_ids, images, features):
        logits = model(inputs_embeds=embeds, position_ids=positions, logits_to_keep=targets - 1, use_cache=False,
                       **attention_inputs(model, batch.input_ids)).logits
    # The sampler never draws an image placeholder: score under that same distribution. A placeholder itself is
    # never a sampled token, so its (impossible) log-prob is reported as 0 (and forward_backward never trains it).
    banned = placeholder_ids(model)
    logits = without_placeholders(logits, banned)
    picked, entropy = picked_logits.target_logprobs(logits, batch.input_ids[:, targets], with_entropy=True)
    is_placeholder = torch.isin(batch.input_ids[:, targets], torch.tensor(banned, device=device))
    picked = torch.where(is_placeholder, torch.zeros_like(picked), picked)
    logprobs = torch.zeros(batch.input_ids.shape, dtype=picked.dtype, device=device).index_copy(1, targets, picked)
    full_entropy = torch.zeros(batch.input_ids.shape, device=device)
    full_entropy[:, targets] = entropy
    return batch, chunk, logprobs, full_entropy


def forward(model, data: list[Datum], pad_id: int, micro_batch_size: int) -> list[np.ndarray]:
    image_token_id = int(unwrap(model).config.image_token_id)
    out: list[np.ndarray | None] = [None] * len(data)
    with torch.no_grad():
        features = encode_images(model, [i for d in data for i in (d.images or [])])
        for micro in plan_micro_batches([len(d.tokens) for d in data], micro_batch_size, model):
            batch, _, logprobs, _ = _logprobs(model, data, micro.rows, pad_id, features, image_token_id)
            for row, index in enumerate(micro.rows):
                out[index] = logprobs[row, : batch.lengths[row]].float().cpu().numpy()
    return out  # type: ignore[return-value]


def forward_backward(model, data: list[Datum], config: LossConfig, pad_id: int, micro_batch_size: int):
    from tinkerless.functions.training.forward_backward import _normalizer, _Totals

    config.validate()
    image_token_id = int(unwrap(model).config.image_token_id)
    masks = [np.asarray(d.mask, dtype=np.float32) for d in data]
    totals = _Totals(config, _normalizer(config, masks))
    all_logprobs: list[np.ndarray | None] = [None] * len(data)
    shared = None
    if not _vision_trains(model):
        with torch.no_grad():
            shared = encode_images(model, [i for d in data for i in (d.images or [])])
    for micro in plan_micro_batches([len(m) for m in masks], micro_batch_size, model):
        rows = micro.rows
        share = totals.share([masks[i] for i in rows])
        features = shared if shared is not None else encode_images(model, [i for r in rows for i in (data[r].images or [])])
        batch, chunk, logprobs, entropy = _logprobs(model, data, rows, pad_id, features, image_token_id,
                                                    trained_only=True)
        mask = batch.field([d.mask for d in chunk])
        mask = mask * ~torch.isin(batch.input_ids, torch.tensor(placeholder_ids(model), device=mask.device))  # never trained
        totals.add(share, logprobs, entropy, mask, chunk, batch.field)
        for row, index in enumerate(rows):
            all_logprobs[index] = logprobs[row, : batch.lengths[row]].detach().float().cpu().numpy()
    return totals.metrics(), all_logprobs
