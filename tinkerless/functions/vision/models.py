"""Vision-language models: knowing one, loading it with its image processor, LoRA targets, tiny test models.

A model directory whose config is an image-text-to-text model (LLaVA-style, Qwen2.5-VL, ...) loads through
`AutoModelForImageTextToText`. The image processor is loaded on its own (its `Pil` variant where there is one):
a full `AutoProcessor` needs torchvision for several families (Qwen2.5-VL's video processor), and the engine
expands image tokens itself (`processing.py`), as the model's template defines them.

`build_tiny_llava` / `build_tiny_qwen25_vl` / `build_tiny_qwen3_vl` / `build_tiny_gemma3` save tiny random models built from configs, offline, for tests;
`build_smollm2_llava` is the demo's model: SmolLM2-135M's real weights as the language model, a freshly
initialized small SigLIP tower and projector, cached like the converted SmolLM2.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tinkerless.wire.messages import LoraConfig

TINY_LLAVA = "tiny-llava"
TINY_QWEN_VL = "tiny-qwen2.5-vl"
TINY_GEMMA3 = "tiny-gemma3"
TINY_QWEN3_VL = "tiny-qwen3-vl"
SMOLLM2_LLAVA = "smollm2-llava"
VISION_MODELS = (TINY_LLAVA, TINY_QWEN_VL, TINY_QWEN3_VL, TINY_GEMMA3, SMOLLM2_LLAVA)  # the built-in vision-language model names
# A chat template that renders content parts: text as is, each image as the model's image placeholder.
_PARTS_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- else -%}{{- IMAGE -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
_CONNECTOR = re.compile(r"model\.(?:multi_modal_projector|visual\.merger)\.")
_VISION_ARCHITECTURES = ("ForConditionalGeneration", "ImageTextToText")


def is_vision_model(source: str) -> bool:
    """Whether a resolved model directory holds an image-text-to-text model (read from its config.json only)."""
    try:
        config = json.loads((Path(source) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return "vision_config" in config and any(a.endswith(_VISION_ARCHITECTURES) for a in config.get("architectures") or [])


def vision_source(spec: str) -> str | None:
    """The directory of a built-in vision model name (tiny ones and the demo's), built on first use; else None."""
    from tinkerless.functions.models import cache_dir

    if spec == TINY_LLAVA:
        return build_tiny_llava(cache_dir() / "models" / "tiny-llava-s0")
    if spec == TINY_QWEN_VL:
        return build_tiny_qwen25_vl(cache_dir() / "models" / "tiny-qwen2.5-vl-s0")
    if spec == TINY_QWEN3_VL:
        return build_tiny_qwen3_vl(cache_dir() / "models" / "tiny-qwen3-vl-s0")
    if spec == TINY_GEMMA3:
        return build_tiny_gemma3(cache_dir() / "models" / "tiny-gemma3-s0")
    if spec == SMOLLM2_LLAVA:
        return build_smollm2_llava(cache_dir() / "models" / "SmolLM2-135M-llava-siglip-s0")
    return None


def load_vision_model(source: str, *, dtype, device: str):
    """(model, tokenizer, image processor) of a vision-language model directory."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    image_processor = load_image_processor(source)  # first: a processor that cannot run fails before the weights load
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForImageTextToText.from_pretrained(source, dtype=dtype)
    return model, tokenizer, image_processor


def load_image_processor(source: str):
    """The image processor of `source`, as its `Pil` class where transformers has one (no torchvision needed)."""
    import transformers

    config = json.loads((Path(source) / "preprocessor_config.json").read_text())
    name = str(config.get("image_processor_type", "")).removesuffix("Fast")
    try:
        cls = getattr(transformers, name + "Pil", None) or getattr(transformers, name.removesuffix("Pil") + "Pil", None) \
            or getattr(transformers, name)
        return cls.from_pretrained(source)
    except ImportError as exc:  # Idefics3's and SmolVLM's image processors need torchvision, even their Pil variants
        from tinkerless.errors import ConfigError

        missing = "torchvision" if "torchvision" in str(exc).lower() else "a library it needs"
        raise ConfigError(f"the image processor of {source} ({name}) needs {missing}, which is not installed here: "
                          f"{str(exc).splitlines()[0][:200]}",
                          hint="install torchvision built for this torch (docs/vision.md), or use a model whose image "
                               "processor runs without it (LLaVA-style, Qwen2.5-VL, Gemma 3)") from None


def lora_targets(model: Any, lora: LoraConfig) -> LoraConfig:
    """`lora` with 'all-linear' put where a VLM trains: the language model's linear layers (never its output
    head), plus the connector's with vision='connector', plus the tower's with vision='tower'."""
    import dataclasses

    import torch

    if lora.target_modules != "all-linear":
        return lora
    scopes = [r"model\.language_model\."]
    if lora.vision in ("connector", "tower"):
        scopes.append(_CONNECTOR.pattern)
    if lora.vision == "tower":
        scopes.append(r"model\.(?:vision_tower|visual\.(?:blocks|patch_embed))\.")
    pattern = re.compile("^(?:" + "|".join(scopes) + ")")
    # The original linear layers: once a first adapter is in, each is peft's `<name>.base_layer` beside its
    # `lora_A/B.<adapter>` linears, and the next adapter goes on `<name>` again.
    names = sorted({name.removesuffix(".base_layer") for name, module in model.named_modules()
                    if isinstance(module, torch.nn.Linear) and pattern.match(name) and ".lora_" not in name})
    if lora.vision in ("connector", "tower") and not any(_CONNECTOR.match(n) for n in names):
        from tinkerless.errors import ConfigError

        raise ConfigError(
            f"lora_vision={lora.vision!r}: this model's connector has no linear layer for LoRA to go on "
            f"(Gemma 3's projector is a bare weight matrix)", hint="use lora_vision='none' with this model")
    if not names:
        return lora
    leaves = sorted({re.escape(n) for n in names})
    return dataclasses.replace(lora, target_modules="^(?:" + "|".join(leaves) + ")$")


# ---- tiny random models, built from configs -----------------------------------------------------


def _tiny_vision_tokenizer(specials: list[str], image_placeholder: str):
    from tinkerless.functions.models import _tiny_tokenizer

    tokenizer = _tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.chat_template = _PARTS_TEMPLATE.replace("IMAGE", repr(image_placeholder))
    return tokenizer




def _qwen_vision_tokenizer() -> tuple[Any, dict[str, int]]:
    """The tiny tokenizer with Qwen-VL's vision tokens (an image is <|vision_start|><|image_pad|><|vision_end|>), and
    their ids."""
    specials = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer = _tiny_vision_tokenizer(specials, "<|vision_start|><|image_pad|><|vision_end|>")
    return tokenizer, {t: tokenizer.convert_tokens_to_ids(t) for t in specials}

def _seeded_model(model_class: Any, config: Any, tokenizer: Any, seed: int) -> Any:
    """A random `model_class(config)` drawn from `seed` alone (the caller's RNG untouched), generating to the tiny
    tokenizer's end of sequence."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    return model

def _save(path: Path, model, tokenizer, processor) -> str:
    from tinkerless.functions.models import _atomic_dir

    with _atomic_dir(path) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        processor.save_pretrained(tmp)
    return str(path)


def build_tiny_llava(path: str | Path, *, seed: int = 0, hidden_size: int = 64, image_size: int = 32,
                     initializer_range: float = 0.02) -> str:
    """A tiny random LLaVA-style model: a Llama LM, a SigLIP tower (patch 8: 16 image tokens) and a projector."""
    import torch
    from transformers import LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, SiglipImageProcessorPil, \
        SiglipVisionConfig

    path = Path(path)
    if (path / "config.json").is_file():
        return str(path)
    tokenizer = _tiny_vision_tokenizer(["<image>"], "<image>")
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    config = LlavaConfig(
        text_config=LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
            initializer_range=initializer_range, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
            bos_token_id=None),
        vision_config=SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                         image_size=image_size, patch_size=8, vision_use_head=False),
        image_token_id=image_token, vision_feature_select_strategy="full", vision_feature_layer=-1,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    processor = SiglipImageProcessorPil(size={"height": image_size, "width": image_size})
    return _save(path, model, tokenizer, processor)


def build_tiny_qwen25_vl(path: str | Path, *, seed: int = 0, hidden_size: int = 64,
                         initializer_range: float = 0.02) -> str:
    """A tiny random Qwen2.5-VL: multimodal rotary positions, a 2-block windowed tower, patch 14 merged 2 x 2."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    path = Path(path)
    if (path / "config.json").is_file():
        return str(path)
    tokenizer, ids = _qwen_vision_tokenizer()
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]}, initializer_range=initializer_range,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                         tie_word_embeddings=True),
        vision_config=dict(depth=2, hidden_size=32, out_hidden_size=hidden_size, intermediate_size=64, num_heads=2,
                           patch_size=14, spatial_merge_size=2, fullatt_block_indexes=[1], window_size=56,
                           temporal_patch_size=2, initializer_range=initializer_range),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        tie_word_embeddings=True,
    )
    model = _seeded_model(Qwen2_5_VLForConditionalGeneration, config, tokenizer, seed)
    processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14, merge_size=2,
                                         temporal_patch_size=2)
    return _save(path, model, tokenizer, processor)


def build_tiny_qwen3_vl(path: str | Path, *, seed: int = 0, hidden_size: int = 64,
                        initializer_range: float = 0.02) -> str:
    """A tiny random Qwen3-VL: interleaved multimodal rotary positions, a 2-block tower (patch 16 merged 2 x 2) whose
    first block's features are also added to the first LM layer's image positions (DeepStack)."""
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    path = Path(path)
    if (path / "config.json").is_file():
        return str(path)
    tokenizer, ids = _qwen_vision_tokenizer()
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=4096, initializer_range=initializer_range,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                          "mrope_interleaved": True},
                         pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(depth=2, hidden_size=32, out_hidden_size=hidden_size, intermediate_size=64, num_heads=2,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                           deepstack_visual_indexes=[0], initializer_range=initializer_range),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    model = _seeded_model(Qwen3VLForConditionalGeneration, config, tokenizer, seed)
    processor = Qwen2VLImageProcessorPil(min_pixels=64 * 64, max_pixels=128 * 128, patch_size=16, merge_size=2,
                                         temporal_patch_size=2)
    return _save(path, model, tokenizer, processor)


def build_tiny_gemma3(path: str | Path, *, seed: int = 0, hidden_size: int = 64, image_size: int = 32,
                      initializer_range: float = 0.02) -> str:
    """A tiny random Gemma 3: a SigLIP tower (patch 8: 16 patches) whose projector pools to 4 image tokens, a
    Gemma 3 LM (scaled embeddings, sliding and global layers), bidirectional attention within an image."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil

    path = Path(path)
    if (path / "config.json").is_file():
        return str(path)
    specials = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
    # As Gemma 3's own template, an image is `<start_of_image>` (its processor, and processing.VisionChat, expand it).
    tokenizer = _tiny_vision_tokenizer(specials, "<start_of_image>")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in specials}
    config = Gemma3Config(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         sliding_window=64, max_position_embeddings=4096, initializer_range=initializer_range,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=image_size, patch_size=8, vision_use_head=False),
        mm_tokens_per_image=4, image_token_index=ids["<image_soft_token>"], boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"], initializer_range=initializer_range, tie_word_embeddings=True,
    )
    model = _seeded_model(Gemma3ForConditionalGeneration, config, tokenizer, seed)
    processor = Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size})
    return _save(path, model, tokenizer, processor)


def build_smollm2_llava(path: str | Path, *, seed: int = 0, image_size: int = 32, patch_size: int = 8) -> str:
    """SmolLM2-135M-Instruct's weights as the language model of a LLaVA-style VLM whose SigLIP tower (2 layers,
    hidden 96) and projector are freshly initialized: no pretrained VLM weights can be had offline."""
    import torch
    from transformers import (AutoModelForCausalLM, AutoTokenizer, LlavaConfig, LlavaForConditionalGeneration,
                              SiglipImageProcessorPil, SiglipVisionConfig)

    from tinkerless.functions.models import _smollm2_local_dir

    path = Path(path)
    if (path / "config.json").is_file():
        return str(path)
    source = _smollm2_local_dir()
    tokenizer = AutoTokenizer.from_pretrained(source)
    text = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.chat_template = _PARTS_TEMPLATE.replace("IMAGE", repr("<image>"))
    text_config = text.config
    text_config.vocab_size = len(tokenizer)
    config = LlavaConfig(
        text_config=text_config,
        vision_config=SiglipVisionConfig(hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                                         image_size=image_size, patch_size=patch_size, vision_use_head=False),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_select_strategy="full",
        vision_feature_layer=-1, tie_word_embeddings=text_config.tie_word_embeddings,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(config)
    text.resize_token_embeddings(len(tokenizer))
    state = {k.removeprefix("model."): v for k, v in text.state_dict().items() if k.startswith("model.")}
    missing, unexpected = model.model.language_model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"SmolLM2 into LLaVA: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.lm_head.weight.data.copy_(text.lm_head.weight.data)
    model.generation_config = text.generation_config
    processor = SiglipImageProcessorPil(size={"height": image_size, "width": image_size})
    return _save(path, model, tokenizer, processor)
