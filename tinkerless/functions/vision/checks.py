"""What a worker checks of a request's images beyond the wire's checks: that its model takes images at all, and
that a datum's processed images are what this model's processor gives (else the tower fails deep inside)."""

from __future__ import annotations

from typing import Any

from tinkerless.errors import UserError
from tinkerless.wire.content import ImagePart


def check_images_fit(worker: Any, request: Any) -> None:
    """Processed images only for a vision-language model, and only as many features as the datum has image
    tokens (else the merge fails deep in the model)."""
    data = [d for d in getattr(request, "data", None) or [] if getattr(d, "images", None)]
    if data and worker.vision is None:
        raise UserError(f"model {worker.model_name!r} takes no images: a datum of this request holds some",
                        hint="use a vision-language model (docs/vision.md), or send datums without images")
    for i, datum in enumerate(data):
        slots = int((datum.tokens == worker.vision.processor.image_token_id).sum())
        wanted = sum(image.num_tokens for image in datum.images)
        if slots != wanted:
            raise UserError(f"data[{i}] has {slots} image tokens for images of {wanted} tokens",
                            hint="send each datum with the images its tokens were rendered with (an episode's)")
        for image in datum.images:
            worker.vision.processor.check_input(image, f"data[{i}].images")


def has_images(value: Any, depth: int = 0) -> bool:
    """Whether plain data (a rollout's tasks) holds an image anywhere: an image part, or an `images` list."""
    if depth > 8:
        return False
    if isinstance(value, ImagePart):
        return True
    if isinstance(value, dict):
        if value.get("type") in ("image_url", "image") or value.get("images"):
            return True
        return any(has_images(v, depth + 1) for v in value.values())
    if isinstance(value, list):
        return any(has_images(v, depth + 1) for v in value)
    return False
