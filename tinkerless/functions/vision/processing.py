"""Images to what the model takes: processed pixels, image-token counts, chat turns with images in token space.

`VisionProcessor` holds a VLM's image processor and knows its family's image tokens:
- LLaVA-style (CLIP / SigLIP towers): one `<image>` placeholder becomes (image_size / patch)^2 image tokens;
- Gemma 3: `<image_soft_token>` becomes `mm_tokens_per_image` tokens (its projector pools the tower's patches);
- Qwen2.5-VL: `<|image_pad|>` between `<|vision_start|>` and `<|vision_end|>` becomes grid_t * grid_h * grid_w /
  merge^2 tokens, the grid coming from the image processor.

`VisionChat` renders a conversation whose messages hold content parts with the model's own chat template (the
template writes one placeholder per image), then expands each placeholder to the image's token count: what the
model's full processor would give. Later turns are appended in token space (`ChatFormat.observation_tokens`), so
sampled tokens are never re-tokenized; an observation's images are expanded the same way.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tinkerless.errors import UserError
from tinkerless.functions.rollout.chat import ChatFormat
from tinkerless.wire.content import ImagePart, TextPart, VisionInput, open_rgb, to_parts

_MARK_A, _MARK_B = "\u2063vision-a\u2063", "\u2063vision-b\u2063"


class VisionProcessor:
    def __init__(self, config: Any, image_processor: Any):
        self.config = config
        self.image_processor = image_processor
        self.family = "qwen" if config.model_type.startswith("qwen") else "gemma3" if config.model_type == "gemma3" else "llava"
        self.image_token_id = int(config.image_token_id)
        self._cache: dict[str, VisionInput] = {}  # processed images by content hash (the processor is deterministic)

    def process(self, part: ImagePart) -> VisionInput:
        """The image's pixel values and grid as the tower takes them (computed once per distinct image)."""
        key = part.sha256
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        image = open_rgb(part)
        out = self.image_processor(images=[image], return_tensors="np")
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        if self.family == "qwen":
            grid = [int(g) for g in np.asarray(out["image_grid_thw"])[0]]
            merge = int(self.config.vision_config.spatial_merge_size)
            tokens = grid[0] * grid[1] * grid[2] // (merge * merge)
        elif self.family == "gemma3":  # the projector pools the tower's patches to a fixed count per image
            pixels, grid, tokens = pixels[0], [], int(self.config.mm_tokens_per_image)
        else:
            pixels, grid = pixels[0], []
            vision = self.config.vision_config
            tokens = (vision.image_size // vision.patch_size) ** 2
            if getattr(self.config, "vision_feature_select_strategy", "default") == "full" and vision.model_type == "clip_vision_model":
                tokens += 1  # CLIP's class token is kept with the "full" strategy
        processed = VisionInput(key, pixels, grid, tokens)
        if len(self._cache) > 4096:  # a bounded memo: drop the oldest half
            for stale in list(self._cache)[:2048]:
                del self._cache[stale]
        self._cache[key] = processed
        return processed

    def check_input(self, image: VisionInput, where: str) -> None:
        """A processed image sent by a client (a datum's) must be what this model's processor gives: the shape,
        grid and token count its tower takes, else the tower fails deep inside (a 500)."""
        pixels = image.pixel_values
        if self.family == "qwen":
            merge = int(self.config.vision_config.spatial_merge_size)
            patch = int(self.config.vision_config.patch_size)
            temporal = int(self.config.vision_config.temporal_patch_size)
            t, h, w = image.grid_thw if len(image.grid_thw) == 3 else (0, 0, 0)
            ok = (pixels.ndim == 2 and pixels.shape == (t * h * w, 3 * temporal * patch * patch)
                  and h % merge == 0 and w % merge == 0 and image.num_tokens == t * h * w // (merge * merge))
        else:
            size = int(self.config.vision_config.image_size)
            expected = (size // int(self.config.vision_config.patch_size)) ** 2
            counts = (int(self.config.mm_tokens_per_image),) if self.family == "gemma3" else (expected, expected + 1)
            ok = pixels.shape == (3, size, size) and not image.grid_thw and image.num_tokens in counts
        if not ok:
            raise UserError(f"{where}: a processed image of shape {pixels.shape}, grid {image.grid_thw} and "
                            f"{image.num_tokens} tokens is not what this model's processor gives",
                            hint="send the images of the episode the datum came from, unchanged")

    def expand(self, tokens: list[int], images: list[VisionInput]) -> list[int]:
        """Each image's single placeholder token repeated to the image's token count, in order."""
        out: list[int] = []
        pending = iter(images)
        for token in tokens:
            if token == self.image_token_id:
                image = next(pending, None)
                if image is None:
                    raise UserError("the text holds more image placeholders than the message has images",
                                    hint="do not write the model's image token in text; send image parts")
                out.extend([token] * image.num_tokens)
            else:
                out.append(token)
        if next(pending, None) is not None:
            raise UserError("the chat template wrote fewer image placeholders than the messages hold images",
                            hint="use a chat template that renders image content parts")
        return out


def load_processor(model: str) -> VisionProcessor | None:
    """The VisionProcessor of a model spec read from its files (a client rendering data), or None for a text model."""
    from transformers import AutoConfig

    from tinkerless.functions.models import resolve_model
    from tinkerless.functions.vision.models import is_vision_model, load_image_processor

    source = resolve_model(model)
    if not is_vision_model(source):
        return None
    return VisionProcessor(AutoConfig.from_pretrained(source), load_image_processor(source))


class VisionChat:
    """A conversation with images in token space: the first prompt by the template, later turns appended."""

    def __init__(self, chat: ChatFormat, processor: VisionProcessor):
        self.chat, self.processor = chat, processor
        self.placeholder = self._probe_placeholder()
        self._image_sequence = self._gemma3_image_sequence()

    def _gemma3_image_sequence(self) -> tuple[str, str] | None:
        """Gemma 3's template writes an image as `<start_of_image>` alone; its processor then replaces each one
        in the text with "\n\n<start_of_image>" + the soft image tokens + "<end_of_image>\n\n". This is that
        replacement, with one soft token, expanded as any placeholder (None: the template writes it whole)."""
        config = self.processor.config
        if self.processor.family != "gemma3":
            return None
        boi, eoi, image = self.chat.tokenizer.convert_ids_to_tokens(
            [int(config.boi_token_index), int(config.eoi_token_index), self.processor.image_token_id])
        if image in self.placeholder:
            return None
        return boi, f"\n\n{boi}{image}{eoi}\n\n"

    def _with_image_sequences(self, text: str) -> str:
        return text.replace(*self._image_sequence) if self._image_sequence else text

    def _probe_placeholder(self) -> str:
        message = {"role": "user", "content": [{"type": "text", "text": _MARK_A}, {"type": "image"},
                                               {"type": "text", "text": _MARK_B}]}
        text = self.chat.tokenizer.apply_chat_template([message], tokenize=False)
        if _MARK_A not in text or _MARK_B not in text:
            raise UserError("this model's chat template does not render content parts",
                            hint="use a VLM whose template writes text and image parts")
        return text[text.index(_MARK_A) + len(_MARK_A) : text.index(_MARK_B)]

    def prompt(self, messages: list[dict]) -> tuple[list[int], list[ImagePart]]:
        """The first prompt's tokens (placeholders expanded) and its images in token order."""
        rendered, images = [], []
        for message in messages:
            content = to_parts(message["content"], "message content")
            if isinstance(content, list):
                images += [p for p in content if isinstance(p, ImagePart)]
                content = [{"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"} for p in content]
            rendered.append({**message, "content": content})
        text = self.chat.tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False)
        text = self._with_image_sequences(text)
        return self.processor.expand(self.chat.encode(text), [self.processor.process(p) for p in images]), images

    def observation(self, content: Any, *, last_token: int | None) -> tuple[list[int], list[ImagePart]]:
        """The tokens that follow a sampled turn for a user message of text or parts, and its images."""
        parts = to_parts(content, "observation")
        if isinstance(parts, str):
            return self.chat.observation_tokens(parts, last_token=last_token), []
        text = self._with_image_sequences("".join(p.text if isinstance(p, TextPart) else self.placeholder for p in parts))
        images = [p for p in parts if isinstance(p, ImagePart)]
        tokens = self.chat.observation_tokens(text, last_token=last_token)
        return self.processor.expand(tokens, [self.processor.process(p) for p in images]), images
