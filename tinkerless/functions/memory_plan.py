"""Memory planning before launch: what the update and the sampler of a model need per GPU, and the refusal
of a configuration that cannot fit, naming the smallest GPU count (or class) that does.

Estimates come from the model's shape alone (hidden size, layers, heads, kv heads, intermediate size,
vocabulary: a config.json, read with no weights), the dtype, the LoRA rank and the batch:

- update, per GPU of N ranks (`functions/sharding`): base weights / N (plus the layers FSDP2 has gathered:
  two decoder layers and the embeddings when N > 1); LoRA weights, gradients and Adam's two moments, fp32,
  / N; the activations backward keeps (per token and layer: `activation_bytes`, counted from what autograd
  saves in a Llama layer with fp32 LoRA on a bf16 base: the norms' fp32 inputs, the linear layers' inputs,
  SDPA's q/k/v/out, the MLP's products, and peft's fp32 copy of each LoRA input), or with recompute only each
  layer's input plus one layer's; the logits of a micro-batch's trained positions (18 bytes each: bf16, their
  fp32 upcast, the log-softmax temporaries); a fixed workspace;
- sampler (the transformers engine; vLLM with tensor parallelism splits weights and cache over its GPUs):
  weights, LoRA weights and their bf16 copies, and the KV cache twice over (the graphed decoder's pool,
  positions rounded up to 128, beside the growing cache it was copied from).

Checked against measured peaks (tests/test_memory_plan.py: the H200 figures in BENCHMARKS.md, within
0.7x-1.5x, and saved-tensor bytes on the CPU). A refusal uses the smallest footprint a configuration can run
in (one row a micro-batch, recomputing its layers) against the card's nominal memory, so it is never made for
a configuration that would have fit; `docs/scaling.md`'s table comes from `scaling_table`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tinkerless.errors import ConfigError

GIB = 2**30
# Nominal memory per GPU (GiB), by the names Modal and SkyPilot use.
GPU_MEMORY_GIB = {
    "T4": 16, "L4": 24, "A10": 24, "A10G": 24, "L40S": 48, "A100": 40, "A100-40GB": 40, "A100-80GB": 80,
    "RTX-PRO-6000": 96, "H100": 80, "H100!": 80, "H200": 141, "B200": 192, "B200+": 192,
}  # fmt: skip
NO_BF16 = ("T4",)  # dtype "auto" is fp32 on these (precision.py asks the card; a T4 says no)
GPU_COUNTS = (1, 2, 4, 8)
WORKSPACE = GIB // 4  # cuBLAS workspaces, the allocator's rounding, small buffers
LOGIT_BYTES = 18  # per logit of a trained position: bf16 logits, fp32 copy, log-softmax temporaries
POSITION_STEP = 128  # the sampler's KV pool is allocated in multiples of this many positions
# The activation estimate `training/micro_batches.py` plans micro-batches with (floats per token and layer).
_PLAN_HIDDEN, _PLAN_INTERMEDIATE = 12, 6


@dataclass(frozen=True)
class ModelShape:
    """A decoder's sizes: all the planner reads of a model."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool = True
    head_dim: int | None = None
    vision_params: int = 0  # a vision-language model's tower and connector (frozen: weights only, no LoRA states)

    @property
    def q_dim(self) -> int:
        return self.heads * (self.head_dim or self.hidden // self.heads)

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.head_dim or self.hidden // self.heads)

    def layer_params(self) -> int:
        attention = self.hidden * (2 * self.q_dim + 2 * self.kv_dim)
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden

    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def params(self) -> int:
        return self.layers * self.layer_params() + self.embedding_params() + self.vision_params

    def lora_params(self, rank: int) -> int:
        """LoRA on every linear layer of the decoder ("all-linear": q, k, v, o, gate, up, down; not the head)."""
        h, i = self.hidden, self.intermediate
        per_layer = (h + self.q_dim) * 2 + (h + self.kv_dim) * 2 + 3 * (h + i)
        return self.layers * rank * per_layer

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        vision = vision_params(config)
        if isinstance(config, dict):
            config = config.get("text_config") or config
        config = getattr(config, "get_text_config", lambda: config)()
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
        return cls(hidden=hidden, layers=int(get("num_hidden_layers")), heads=heads,
                   kv_heads=int(get("num_key_value_heads") or heads),
                   intermediate=int(get("intermediate_size") or 4 * hidden), vocab=int(get("vocab_size")),
                   tied=bool(get("tie_word_embeddings", False)), head_dim=get("head_dim"),
                   vision_params=vision)  # fmt: skip

    @classmethod
    def of(cls, model: str) -> ModelShape | None:
        """The shape of a model name or directory from its config alone; None when the config cannot be read
        here (no hub access, an unusual architecture): then nothing is planned."""
        try:
            import json
            from pathlib import Path

            from tinkerless.functions.models import resolve_model

            source = resolve_model(model)
            local = Path(source) / "config.json"
            if local.is_file():  # read as JSON: no transformers import on the client for a local model
                return cls.from_config(json.loads(local.read_text()))
            from transformers import AutoConfig

            return cls.from_config(AutoConfig.from_pretrained(source))
        except Exception:  # noqa: BLE001 - planning is advice; a model it cannot read is checked at load
            return None


def vision_params(config: Any) -> int:
    """Parameters of a VLM's vision tower and connector, from its config alone (0 for a text model): per layer
    attention (4 h^2) and MLP (2 or, gated as Qwen-VL's, 3 h x intermediate); the patch embedding; the connector
    (LLaVA's two-layer projector to the text width; Gemma 3's one matrix; Qwen-VL's merger of merge^2 patches)."""
    as_dict = config if isinstance(config, dict) else getattr(config, "to_dict", lambda: {})()
    vision = as_dict.get("vision_config")
    if not isinstance(vision, dict):
        return 0
    text = as_dict.get("text_config") or as_dict
    h = int(vision.get("hidden_size") or vision.get("embed_dim") or 0)
    if not h:
        return 0
    layers = int(vision.get("num_hidden_layers") or vision.get("depth") or 0)
    inter = int(vision.get("intermediate_size") or 4 * h)
    deepstack = len(vision.get("deepstack_visual_indexes") or ())  # Qwen3-VL: a merger per tapped tower layer
    gated = "spatial_merge_size" in vision and "deepstack_visual_indexes" not in vision  # Qwen2/2.5-VL's MLPs
    patch = int(vision.get("patch_size") or 14)
    channels = int(vision.get("num_channels") or vision.get("in_chans") or 3) * int(vision.get("temporal_patch_size") or 1)
    tower = layers * (4 * h * h + (3 if gated else 2) * h * inter) + channels * patch * patch * h
    out = int(vision.get("out_hidden_size") or text.get("hidden_size") or h)
    if "spatial_merge_size" in vision:  # Qwen-VL: a merger of merge^2 patches
        merged = h * int(vision.get("spatial_merge_size") or 2) ** 2
        connector = (merged * merged + merged * out) * (1 + deepstack)
        tower += int(vision.get("num_position_embeddings") or 0) * h  # Qwen3-VL's learned positions
    else:
        # Gemma 3's connector is one h x out matrix (after a norm and pooling); LLaVA's, two linear layers.
        connector = h * out + h if "mm_tokens_per_image" in as_dict else h * out + out * out
        tower += int((int(vision.get("image_size") or 224) // patch) ** 2) * h  # position embeddings
    return tower + connector


# Shapes of bench/gpu_shapes.py (vocab 49152, tied embeddings): the measured points.
SHAPES = {
    "135M": ModelShape(576, 30, 9, 3, 1536, 49152),
    "1.7B": ModelShape(2048, 24, 32, 32, 8192, 49152),
    "8B": ModelShape(4096, 32, 32, 8, 14336, 49152),
}


@dataclass(frozen=True)
class Estimate:
    """Bytes per GPU, by what holds them."""

    parts: dict[str, int] = field(default_factory=dict)
    recompute: bool = False
    micro_rows: int = 0

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def gib(self) -> float:
        return self.total / GIB

    def describe(self) -> str:
        return ", ".join(f"{k} {v / GIB:.1f}" for k, v in self.parts.items() if v >= GIB // 20) + " GiB"


def element_size(dtype: str) -> int:
    return 2 if dtype == "bf16" else 4


def resolve(dtype: str, gpu: str | None = None) -> str:
    """The base weights' dtype on a GPU class: "auto" is bf16 where the card has it."""
    if dtype != "auto":
        return dtype
    return "fp32" if gpu in NO_BF16 else "bf16"


def activation_bytes(shape: ModelShape, dtype: str = "bf16") -> int:
    """Bytes backward keeps per token and decoder layer (no recompute)."""
    e, h, i = element_size(dtype), shape.hidden, shape.intermediate
    kept = 8 * h + 7 * e * h + 4 * e * i  # norms' fp32 inputs; linear inputs, SDPA's q/k/v/out, MLP products
    lora_copies = 4 * (6 * h + i) if e != 4 else 0  # peft's fp32 copy of each LoRA layer's input
    return kept + lora_copies


def _plan_bytes_per_token(shape: ModelShape, dtype: str) -> int:
    """`micro_batches.activation_bytes_per_token`: what the worker cuts micro-batches by."""
    return shape.layers * (_PLAN_HIDDEN * shape.hidden + _PLAN_INTERMEDIATE * shape.intermediate) * element_size(dtype)


def update_memory(
    shape: ModelShape, *, gpus: int = 1, dtype: str = "bf16", lora_rank: int = 16, rows: int = 1, tokens: int = 512,
    trained_tokens: int | None = None, micro_batch_size: int = 16, gpu_gib: float | None = None,
    activation_budget_gib: float | None = None,
) -> Estimate:
    """Peak bytes per GPU of one `forward_backward` + `optim_step` of `rows` x `tokens` over `gpus` ranks.

    Micro-batches are cut as the worker cuts them: `micro_batch_size` rows within a token budget of
    `activation_budget_gib` (default: 0.4 of what the card has left after the weights, at most 64 GiB, as
    `micro_batches.gpu_activation_budget`; unbounded without `gpu_gib`); a row over the budget recomputes."""
    e = element_size(dtype)
    weights = shape.params() * e / gpus
    if gpus > 1:  # gathered while computing: a layer and the next one (prefetch), and the root's embeddings
        weights += (2 * shape.layer_params() + shape.embedding_params()) * e
    lora = 16 * shape.lora_params(lora_rank) / gpus  # weights, gradients, two moments; fp32
    static = weights + lora + WORKSPACE
    if activation_budget_gib is not None:
        budget = activation_budget_gib * GIB
    elif gpu_gib is not None:
        budget = min(64 * GIB, max(256 * 2**20, 0.4 * (gpu_gib * GIB - static)))
    else:
        budget = math.inf
    token_budget = max(1.0, budget / _plan_bytes_per_token(shape, dtype))
    per_rank_rows = max(1, math.ceil(rows / gpus))
    fit = int(token_budget // tokens) if math.isfinite(token_budget) else per_rank_rows
    micro_rows = max(1, min(micro_batch_size, per_rank_rows, fit))
    recompute = micro_rows * tokens > token_budget
    micro_tokens = micro_rows * tokens
    per_layer = activation_bytes(shape, dtype)
    if recompute:  # each layer's input kept, one layer's activations at a time in backward
        activations = micro_tokens * (shape.layers * shape.hidden * e + per_layer)
    else:
        activations = micro_tokens * shape.layers * per_layer
    trained = tokens if trained_tokens is None else trained_tokens
    logits = micro_rows * trained * shape.vocab * LOGIT_BYTES
    return Estimate({"weights": int(weights), "lora states": int(lora), "activations": int(activations),
                     "logits": int(logits), "workspace": WORKSPACE}, recompute, micro_rows)  # fmt: skip


def sampler_memory(
    shape: ModelShape, *, gpus: int = 1, dtype: str = "bf16", lora_rank: int = 16, rows: int = 64, tokens: int = 512
) -> Estimate:
    """Peak bytes per GPU of sampling `rows` sequences of `tokens` (`gpus`: vLLM's tensor parallelism)."""
    e = element_size(dtype)
    weights = shape.params() * e / gpus
    lora = shape.lora_params(lora_rank) * (4 + e)  # fp32 weights and the sampler's bf16 copies
    positions = math.ceil(tokens / POSITION_STEP) * POSITION_STEP
    cache = 2 * 2 * shape.layers * shape.kv_dim * e * rows * positions / gpus  # keys and values, pool + growing
    logits = rows * shape.vocab * 4
    return Estimate({"weights": int(weights), "lora": int(lora), "kv cache": int(cache), "logits": int(logits),
                     "workspace": WORKSPACE})  # fmt: skip


def smallest_update(
    shape: ModelShape, *, gpus: int, dtype: str = "bf16", lora_rank: int = 16, tokens: int = 512, role: str = "update"
) -> Estimate:
    """The least an update of this model can run in: one row a micro-batch, recomputing its layers. The forward
    role (log-probs, no gradients) keeps no LoRA gradients or moments and no activations for backward."""
    floor = update_memory(shape, gpus=gpus, dtype=dtype, lora_rank=lora_rank, rows=1, tokens=tokens,
                          micro_batch_size=1, activation_budget_gib=0.0)  # fmt: skip
    if role != "forward":
        return floor
    parts = {**floor.parts, "lora states": floor.parts["lora states"] // 4,
             "activations": tokens * activation_bytes(shape, dtype)}  # fmt: skip
    return Estimate(parts, False, 1)


def fits_update(
    shape: ModelShape, gpu: str, count: int, *, dtype: str = "auto", lora_rank: int = 16, tokens: int = 512,
    role: str = "update",
) -> bool:
    floor = smallest_update(shape, gpus=count, dtype=resolve(dtype, gpu), lora_rank=lora_rank, tokens=tokens, role=role)
    return floor.total <= GPU_MEMORY_GIB[gpu] * GIB


def fits_sampler(
    shape: ModelShape, gpu: str, count: int, *, dtype: str = "auto", lora_rank: int = 16, tokens: int = 512
) -> bool:
    floor = sampler_memory(shape, gpus=count, dtype=resolve(dtype, gpu), lora_rank=lora_rank, rows=1, tokens=tokens)
    return floor.total <= GPU_MEMORY_GIB[gpu] * GIB


def check_fits(
    shape: ModelShape, gpu: str, count: int, *, role: str, model: str, engine: str = "auto", dtype: str = "auto",
    lora_rank: int = 16, tokens: int = 512, max_count: int = 8,
) -> None:
    """ConfigError when `role` ("update", "forward" or "rollout") cannot run on `count` x `gpu`, naming the
    smallest count of this class that fits, and the smallest class at this count. Unknown GPU names pass."""
    if gpu not in GPU_MEMORY_GIB:
        return
    kind = resolve(dtype, gpu)
    size = f"{model} ({_size(shape, kind)})"
    where = f"{count} x {gpu} ({GPU_MEMORY_GIB[gpu]} GiB each)"
    if role == "rollout":
        if count > 1 and engine != "vllm":
            # The transformers engine samples on one GPU of the container, whatever the count.
            count = 1
        if fits_sampler(shape, gpu, count, dtype=dtype, lora_rank=lora_rank, tokens=tokens):
            return
        need = sampler_memory(shape, gpus=count, dtype=kind, lora_rank=lora_rank, rows=1, tokens=tokens)
        options = {"dtype": dtype, "lora_rank": lora_rank, "tokens": tokens}
        larger = next((c for c in GPU_COUNTS if c <= max_count and fits_sampler(shape, gpu, c, **options)), None)
        if engine != "vllm":
            raise ConfigError(
                f"sampling {size} needs at least {need.gib:.1f} GiB on one GPU ({need.describe()}); a {gpu} has "
                f"{GPU_MEMORY_GIB[gpu]} GiB, and the transformers engine samples on one GPU",
                hint="use the vLLM engine (engine='vllm', extras 'vllm') with several GPUs for the rollout role "
                + (f"(gpu='{gpu}:{larger}': tensor_parallel_size={larger})" if larger else "")
                + f", or a larger GPU class{_class_hint(shape, 1, 'rollout', dtype, lora_rank, tokens)}")
        raise ConfigError(f"sampling {size} on {where} needs {need.gib:.1f} GiB per GPU ({need.describe()})",
                          hint=_hint(gpu, larger, _class_hint(shape, count, role, dtype, lora_rank, tokens)))
    fits = {"dtype": dtype, "lora_rank": lora_rank, "tokens": tokens, "role": role}
    if fits_update(shape, gpu, count, **fits):
        return
    need = smallest_update(shape, gpus=count, dtype=kind, lora_rank=lora_rank, tokens=tokens, role=role)
    larger = next((c for c in GPU_COUNTS if c <= max_count and fits_update(shape, gpu, c, **fits)), None)
    raise ConfigError(
        f"the {role} function of {size} on {where} needs at least {need.gib:.1f} GiB per GPU ({need.describe()}"
        + (", one row at a time with recompute)" if role != "forward" else ")"),
        hint=_hint(gpu, larger, _class_hint(shape, count, role, dtype, lora_rank, tokens)))


def _size(shape: ModelShape, dtype: str) -> str:
    return f"{shape.params() / 1e9:.1f}B parameters, {shape.params() * element_size(dtype) / GIB:.1f} GiB in {dtype}"


def _hint(gpu: str, count: int | None, classes: str) -> str:
    more = f"the smallest count of {gpu} that fits is {count} ('{gpu}:{count}')" if count else f"no count of {gpu} fits"
    return f"{more}{classes}; see docs/scaling.md"


def _class_hint(shape: ModelShape, count: int, role: str, dtype: str, lora_rank: int, tokens: int) -> str:
    ordered = sorted(GPU_MEMORY_GIB, key=lambda g: GPU_MEMORY_GIB[g])
    options = {"dtype": dtype, "lora_rank": lora_rank, "tokens": tokens}

    def fits(g: str) -> bool:
        if role == "rollout":
            return fits_sampler(shape, g, count, **options)
        return fits_update(shape, g, count, role=role, **options)

    found = next((g for g in ordered if fits(g)), None)
    return f"; at {count} GPU{'s' if count > 1 else ''} the smallest class that fits is {found}" if found else ""


def load_device(model: str, device: str, dtype: str, engine: str, tensor_parallel_size: int = 1) -> str:
    """Where a Worker loads `model`: on its device, refused first (ConfigError) when even its weights do not fit
    that GPU; on the CPU when vLLM samples over several GPUs (the Worker's copy then only holds adapters)."""
    import torch

    from tinkerless.functions.sampling.vllm_engine import vllm_available

    if tensor_parallel_size > 1 and (engine == "vllm" or (engine == "auto" and vllm_available())):
        return "cpu"
    if not (device.startswith("cuda") and torch.cuda.is_available()):
        return device
    shape = SHAPES["135M"] if model in _SMALL else ModelShape.of(model)
    if shape is None:
        return device
    total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    need = sampler_memory(shape, dtype=dtype, rows=1, tokens=POSITION_STEP)
    if need.total > total:
        name = torch.cuda.get_device_name(torch.device(device))
        raise ConfigError(
            f"{model} ({_size(shape, dtype)}) does not fit one GPU of {total / GIB:.0f} GiB ({name}), "
            f"and the transformers engine samples on one GPU: it needs at least {need.gib:.1f} GiB",
            hint="sample with vLLM over several GPUs (engine='vllm', tensor_parallel_size=N: on Modal "
            "gpu='H100:N' for the rollout role) and train with the sharded ranks (the update role's GPUs, "
            "`tinkerless serve --gpus N`); docs/scaling.md lists what fits where")
    return device


_SMALL = ("smollm2", "smollm2-135m", "SmolLM2-135M-Instruct", "tiny")


def vllm_parallel(size: int) -> dict[str, int]:
    """The vLLM engine's keyword for sampling over `size` GPUs (tensor parallelism)."""
    return {"tensor_parallel_size": size} if size > 1 else {}