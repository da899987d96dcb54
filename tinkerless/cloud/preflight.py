"""Memory preflight: the model fits the GPUs each role asks for, checked before anything is launched or billed.

`functions/memory_plan` estimates from the model's config alone. On Modal every GPU role is checked against
its class (`ModalConfig`: the update and forward roles shard over their GPUs, the rollout role samples on one
GPU with the transformers engine or over all of them with vLLM's tensor parallelism); on SkyPilot each GPU
option of the task is checked for the server's update (over all the node's GPUs) and its sampler (one GPU),
options that cannot fit are dropped, and none left is a refusal. A refusal is a `ConfigError` naming the model's
size, the GPU's memory and the smallest count or class that fits. A model whose config cannot be read here (no
hub access) is not planned: its load is the check.
"""

from __future__ import annotations

import logging
from typing import Any

from tinkerless.cloud.modal_config import GPU_ROLES, ModalConfig
from tinkerless.errors import ConfigError
from tinkerless.functions.memory_plan import GPU_MEMORY_GIB, SHAPES, ModelShape, check_fits
from tinkerless.functions.models import SMOLLM2_ALIASES

logger = logging.getLogger(__name__)
_MODAL_MAX = {"A10": 4, "A10G": 4}


def model_shape(model: str) -> ModelShape | None:
    """The shape to plan with; SmolLM2 by name (reading its config would convert its GGUF first)."""
    if model in SMOLLM2_ALIASES:
        return SHAPES["135M"]
    shape = ModelShape.of(model)
    if shape is None:
        logger.info("memory preflight skipped: the config of %r cannot be read here", model)
    return shape


def check_modal(model: str, settings: ModalConfig, *, engine: str = "auto", dtype: str = "auto", lora_rank: int = 16,
                tokens: int = 512, shape: ModelShape | None = None) -> None:
    """ConfigError when a GPU role of `settings` cannot hold `model`'s function."""
    shape = shape or model_shape(model)
    if shape is None:
        return
    sampler = "vllm" if engine == "vllm" or (engine == "auto" and "vllm" in settings.extras) else "transformers"
    for role in GPU_ROLES:
        spec = getattr(settings, role)
        if spec.gpu is None:
            continue
        try:
            check_fits(shape, spec.gpu, spec.gpu_count, role=role, model=model, engine=sampler, dtype=dtype,
                       lora_rank=lora_rank, tokens=tokens, max_count=_MODAL_MAX.get(spec.gpu, 8))  # fmt: skip
        except ConfigError as exc:
            raise ConfigError(f"modal {role} (gpu={spec.gpu_request()!r}): {exc.message}", hint=exc.hint) from None


def parse_accelerators(value: Any) -> dict[str, int]:
    """SkyPilot's `accelerators` ("H100:4", "H100", {"L4": 1, "A10G": 1}, or a list of such) as {type: count}."""
    if value is None:
        return {}
    if isinstance(value, dict):
        return {str(k): int(v or 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        out: dict[str, int] = {}
        for item in value:
            out.update(parse_accelerators(item))
        return out
    kind, _, count = str(value).partition(":")
    return {kind.strip(): int(count) if count.strip() else 1}


def check_sky(model: str, accelerators: Any, *, engine: str = "auto", dtype: str = "auto", lora_rank: int = 16,
              tokens: int = 512, shape: ModelShape | None = None) -> dict[str, int]:
    """The task's GPU options that can hold `model` (the server: its update over all the node's GPUs, its sampler
    on one); a ConfigError when none can. Options of unknown GPU types are kept."""
    options = parse_accelerators(accelerators)
    shape = shape or model_shape(model)
    if shape is None or not options:
        return options
    sampler = "vllm" if engine == "vllm" else "transformers"
    kept, refusals = {}, []
    for gpu, count in options.items():
        try:
            check_fits(shape, gpu, count, role="update", model=model, dtype=dtype, lora_rank=lora_rank, tokens=tokens)
            check_fits(shape, gpu, count, role="rollout", model=model, engine=sampler, dtype=dtype, lora_rank=lora_rank,
                       tokens=tokens)  # fmt: skip
            kept[gpu] = count
        except ConfigError as exc:
            refusals.append((gpu, count, exc))
    if not kept:
        gpu, count, exc = refusals[-1]  # the largest option's reason (options are listed smallest first)
        listed = ", ".join(f"{g}:{c}" for g, c, _ in refusals)
        raise ConfigError(f"no GPU option of the task ({listed}) can hold {model}: on {gpu}:{count}, {exc.message}",
                          hint=exc.hint)  # fmt: skip
    for gpu, count, exc in refusals:
        logger.warning("dropping %s:%d (%d GiB) from the task's GPU options: %s", gpu, count, GPU_MEMORY_GIB[gpu], exc.message)
    return kept
