"""The language model's inputs with images: image features merged into the token embeddings, and positions.

Both the sampler's prefill and the update's forward call these, so both see the same images the same way:
- `encode_images` runs the vision tower (and connector) once per distinct image (by content hash);
- `merged_embeddings` puts each image's features at its image tokens, in order;
- `deepstack` adds Qwen3-VL's DeepStack features (tower layers' outputs) to the LM's first layers;
- `position_ids` are Qwen2.5-VL's multimodal rotary positions over the whole sequence (None for LLaVA-style
  models, whose positions are plain), so a continuation prefilled on a kept cache takes its slice of the same
  positions a full forward computes.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from tinkerless.wire.content import VisionInput


def unwrap(model: Any) -> Any:
    """The transformers VLM inside a PeftModel (LoRA layers injected), or the model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def encode_images(model: Any, images: list[VisionInput]) -> dict[str, torch.Tensor]:
    """sha256 -> the image's features [num_tokens, hidden]: the tower runs once per distinct image."""
    vlm = unwrap(model)
    device = next(vlm.parameters()).device
    distinct: dict[str, VisionInput] = {}
    for image in images:
        distinct.setdefault(image.sha256, image)
    if not distinct:
        return {}
    order = list(distinct.values())
    dtype = vlm.get_input_embeddings().weight.dtype
    if order[0].grid_thw:  # Qwen-VL: every image's patches in one tensor, with their grids
        pixels = torch.cat([torch.as_tensor(i.pixel_values) for i in order]).to(device, dtype)
        grid = torch.tensor([i.grid_thw for i in order], device=device)
        out = vlm.model.get_image_features(pixels, grid)
    else:
        pixels = torch.stack([torch.as_tensor(i.pixel_values) for i in order]).to(device, dtype)
        out = vlm.model.get_image_features(pixel_values=pixels)
    features = out.pooler_output if hasattr(out, "pooler_output") else out
    features = [f.reshape(-1, f.shape[-1]) for f in features]
    for image, feature in zip(order, features):
        if feature.shape[0] != image.num_tokens:
            raise ValueError(f"image {image.sha256[:12]} gave {feature.shape[0]} features for {image.num_tokens} tokens")
    encoded = {image.sha256: feature for image, feature in zip(order, features)}
    stacks = getattr(out, "deepstack_features", None)
    if stacks:  # Qwen3-VL: per tower layer it taps, features of every image's tokens, in order
        per_image = torch.stack(list(stacks)).split([i.num_tokens for i in order], dim=1)
        encoded.update({image.sha256 + DEEPSTACK: stack for image, stack in zip(order, per_image)})
    return encoded


DEEPSTACK = "/deepstack"  # encode_images' key suffix for an image's DeepStack features [layers, tokens, hidden]


@contextlib.contextmanager
def deepstack(model: Any, input_ids: torch.Tensor, rows_images: list[list[VisionInput]], features: dict):
    """While in it, Qwen3-VL's language model adds each image's DeepStack features to its first layers' hidden
    states at the image tokens, as its own forward with pixel values does (other families: nothing). Its top
    forward only computes them from pixel values, so they go in through a hook on the language model."""
    images = [i for row in rows_images for i in row]
    if not images or images[0].sha256 + DEEPSTACK not in features:
        yield
        return
    mask = input_ids == int(unwrap(model).config.image_token_id)
    stacks = torch.cat([features[i.sha256 + DEEPSTACK] for i in images], dim=1)  # row by row, in token order

    def add_deepstack(module, args, kwargs):
        return args, {**kwargs, "visual_pos_masks": mask, "deepstack_visual_embeds": list(stacks.to(mask.device))}

    hook = unwrap(model).model.language_model.register_forward_pre_hook(add_deepstack, with_kwargs=True)
    try:
        yield
    finally:
        hook.remove()


def merged_embeddings(model: Any, input_ids: torch.Tensor, rows_images: list[list[VisionInput]],
                      features: dict[str, torch.Tensor], image_token_id: int) -> torch.Tensor:
    """Token embeddings [B, T, H] with each row's images' features at its image tokens, in order."""
    vlm = unwrap(model)
    embeds = vlm.get_input_embeddings()(input_ids)
    for row, images in enumerate(rows_images):
        if not images:
            continue
        slots = torch.nonzero(input_ids[row] == image_token_id).squeeze(-1)
        stacked = torch.cat([features[i.sha256] for i in images]).to(embeds.dtype)
        if len(slots) != stacked.shape[0]:
            raise ValueError(f"row {row}: {len(slots)} image tokens for {stacked.shape[0]} image features")
        embeds = embeds.index_put((torch.full_like(slots, row), slots), stacked)
    return embeds


def position_ids(model: Any, input_ids: torch.Tensor, rows_images: list[list[VisionInput]],
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor | None:
    """Qwen-VL's [3, B, T] multimodal positions of whole sequences (right-padded); None for plain positions."""
    vlm = unwrap(model)
    inner = getattr(vlm, "model", None)
    if not hasattr(inner, "get_rope_index"):
        return None
    image_token = int(vlm.config.image_token_id)
    grids = [i.grid_thw for images in rows_images for i in images]
    types = (input_ids == image_token).to(torch.int32)
    if not grids:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return positions.view(1, 1, -1).expand(3, input_ids.shape[0], -1)
    grid = torch.tensor(grids, device=input_ids.device)
    positions, _ = inner.get_rope_index(input_ids, types, image_grid_thw=grid, attention_mask=attention_mask)
    return positions


def attention_inputs(model: Any, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """What the model's attention needs beyond positions. Gemma 3 attends bidirectionally within each image, as
    its own forward with pixel values does: its `token_type_ids` mark the image tokens. Other families: nothing.
    The sampler's prefill and the update's forward both pass these, so both attend alike."""
    config = unwrap(model).config
    if config.model_type != "gemma3":
        return {}
    return {"token_type_ids": (input_ids == int(config.image_token_id)).long()}


def placeholder_ids(model: Any) -> list[int]:
    """Token ids that stand for image (and video) features: never sampled, so that a sampled turn cannot open an
    image slot. The sampler draws from, and the update scores under, the same distribution with them masked."""
    config = unwrap(model).config
    return sorted({int(i) for i in (getattr(config, "image_token_id", None), getattr(config, "video_token_id", None))
                   if i is not None})


def without_placeholders(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """`logits` with the placeholder ids' entries so low that their probability is exactly 0 (a copy: the model's
    output is left as it is). Finite, not -inf: an entropy's p * log p must be 0 there, not NaN."""
    if not ids:
        return logits
    logits = logits.clone()
    logits[..., ids] = -1e30
    return logits
