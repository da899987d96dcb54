"""The largest model each GPU class can train with LoRA, by GPU count: docs/scaling.md's table, from the planner.

    .venv/bin/python -m tinkerless.functions.scaling_table     # prints the table

A model "fits" when its update's smallest footprint (`memory_plan.smallest_update`: one row of 2048 tokens a
micro-batch, recomputing its layers; LoRA r16 on every linear layer; bf16, fp32 on a T4) is within the card's
nominal memory on each of the ranks. The models are common open shapes (`LADDER`).
"""

from __future__ import annotations

from tinkerless.functions.memory_plan import GPU_COUNTS, GPU_MEMORY_GIB, SHAPES, ModelShape, fits_update

TABLE_GPUS = ("T4", "L4", "A10G", "L40S", "A100-40GB", "A100-80GB", "H100", "H200", "B200")
# Common open shapes, smallest to largest (Qwen2.5 / Llama 3 style; untied embeddings from 8B on).
LADDER = {
    "0.5B": ModelShape(896, 24, 14, 2, 4864, 151936, tied=True),
    "1.7B": SHAPES["1.7B"],
    "3B": ModelShape(3072, 28, 24, 8, 8192, 128256, tied=True),
    "8B": ModelShape(4096, 32, 32, 8, 14336, 128256, tied=False),
    "14B": ModelShape(5120, 48, 40, 8, 13824, 152064, tied=False),
    "32B": ModelShape(5120, 64, 40, 8, 27648, 152064, tied=False),
    "70B": ModelShape(8192, 80, 64, 8, 28672, 128256, tied=False),
}


def largest_trainable(gpu: str, count: int, *, lora_rank: int = 16, tokens: int = 2048) -> str | None:
    """The largest model of `LADDER` whose update fits `count` x `gpu` (one row of `tokens`, recompute)."""
    fitting = [name for name, shape in LADDER.items() if fits_update(shape, gpu, count, lora_rank=lora_rank, tokens=tokens)]
    return fitting[-1] if fitting else None


def largest_model_table(gpus: tuple[str, ...] = TABLE_GPUS, counts: tuple[int, ...] = GPU_COUNTS, *, lora_rank: int = 16,
                        tokens: int = 2048) -> str:
    """docs/scaling.md's table: the largest model of `LADDER` each GPU class trains with LoRA, by GPU count."""
    lines = [f"| GPU | {' | '.join(f'{c} GPU' + ('s' if c > 1 else '') for c in counts)} |",
             "|---|" + "---|" * len(counts)]
    for gpu in gpus:
        cells = [largest_trainable(gpu, c, lora_rank=lora_rank, tokens=tokens) or "none" for c in counts]
        lines.append(f"| {gpu} ({GPU_MEMORY_GIB[gpu]} GB) | {' | '.join(cells)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(largest_model_table())
