"""Supervised fine-tuning of a LoRA adapter with cross-entropy, through the same functions and runs as RL.

- `loop`: `sft()`; `config`: `SFTConfig`; `data`: chat JSONL read, checked and rendered; `plot`: its NLL plot.
"""

from tinkerless.sdk.sft.loop import SFT_LOSS, datum, nll, nll_summary, sft

__all__ = ["SFT_LOSS", "datum", "nll", "nll_summary", "sft"]
