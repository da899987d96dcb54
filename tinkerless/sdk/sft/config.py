"""SFT run configuration: one dataclass, validated before anything expensive starts (docs/sft.md)."""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import re
from dataclasses import dataclass
from typing import Any

from tinkerless.functions.precision import check_dtype
from tinkerless.errors import ConfigError
from tinkerless.sdk.config import check_gpus
from tinkerless.sdk.run.accounting import PriceTable
from tinkerless.sdk.tracking.base import check_report_to


@dataclass
class SFTConfig:
    """Every setting of an SFT run (`tinkerless.sft(...)`, `tinkerless sft DATA.jsonl`)."""

    def __new__(cls, *args: Any, **settings: Any) -> "SFTConfig":
        check_sft_setting_names(settings)
        return super().__new__(cls)

    # what to train
    model: str = "smollm2"
    data: Any = None  # chat JSONL path, or a list of {"messages": [...]} / {"prompt", "completion"} dicts
    eval_data: Any = None  # a held-out set in the same form; None: hold out `eval_fraction` of `data`
    eval_fraction: float = 0.1  # share of `data` held out for eval NLL when eval_data is None (0 = none)
    init_from: str | None = None  # warm start: "<run_id>@<step>", "<run_id>@latest", or a PEFT adapter directory
    name: str = "sft"
    # optimisation
    steps: int | None = None  # None: `epochs` passes over the training examples
    epochs: int = 1
    batch_size: int = 8  # examples per step
    learning_rate: float = 2e-4
    weight_decay: float = 0.0
    grad_clip_norm: float = 1.0
    lora_rank: int = 16
    lora_alpha: int = 32
    lora_vision: str = "none"  # a vision-language model's parts trained beside its LM: none | connector | tower
    max_length: int = 2048  # tokens per rendered conversation; a longer one is an error naming its line
    eval_every: int = 5  # steps between eval-NLL measurements (the last step is always measured)
    # run management (as in TrainConfig)
    seed: int = 0
    backend: str = "local"
    engine: str = "auto"
    dtype: str = "auto"  # base weights: auto (bf16 on a GPU that supports it, else fp32) | bf16 | fp32
    threads: int | None = None
    gpus: int = 1  # local backend: train over this many GPUs of this machine as FSDP2 ranks (docs/scaling.md)
    storage: str = "."
    storage_options: dict | None = None
    run_id: str | None = None
    resume: bool = False
    checkpoint_every: int = 5
    keep_checkpoints: int | None = 3
    micro_batch_size: int = 16
    progress: bool = True
    prices: dict[str, float] | None = None
    price_per_hour: float | None = None
    report_to: list[str] = dataclasses.field(default_factory=list)  # experiment trackers, as in TrainConfig (docs/tracking.md)

    def validate(self) -> None:
        if self.data is None:
            raise ConfigError("an SFT run needs data", hint='data="train.jsonl" or data=[{"messages": [...]}, ...]')
        check_dtype(self.dtype)
        if self.lora_vision not in ("none", "connector", "tower"):
            raise ConfigError(f"lora_vision must be 'none', 'connector' or 'tower', got {self.lora_vision!r}")
        for name in ("epochs", "batch_size", "lora_rank", "max_length", "eval_every", "checkpoint_every", "micro_batch_size", "steps", "threads", "keep_checkpoints"):
            value = getattr(self, name)
            if value is None and name in ("steps", "threads", "keep_checkpoints"):
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ConfigError(f"{name} must be an integer of at least 1, got {value!r}")
        for name in ("learning_rate", "weight_decay", "grad_clip_norm", "eval_fraction"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.learning_rate <= 0:
            raise ConfigError(f"learning_rate must be > 0, got {self.learning_rate!r}", hint="e.g. 2e-4 for a LoRA")
        if self.eval_fraction >= 1:
            raise ConfigError(f"eval_fraction must be below 1, got {self.eval_fraction}", hint="e.g. 0.1, or 0 for no eval split")
        if self.init_from is not None and (not isinstance(self.init_from, str) or not self.init_from.strip()):
            raise ConfigError(f"init_from must be '<run_id>@<step>' or an adapter directory, got {self.init_from!r}")
        if self.run_id is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}", str(self.run_id)):
            raise ConfigError(f"invalid run_id {self.run_id!r}", hint="letters, digits, '.', '_' and '-'")
        check_gpus(self.gpus, self.backend)
        check_report_to(self.report_to)  # before any model loads
        self.price_table()

    def price_table(self) -> PriceTable:
        if self.prices is not None and not isinstance(self.prices, dict):
            raise ConfigError(f"prices must be a dict of device name -> $/hour, got {self.prices!r}")
        return PriceTable(self.prices, price_per_hour=self.price_per_hour)

    def replace(self, **changes: Any) -> "SFTConfig":
        check_sft_setting_names(changes)
        return dataclasses.replace(self, **changes)

    def summary(self) -> dict:
        """The plain-data config kept in the run's state; `kind` tells SFT runs from RL ones."""
        out: dict[str, Any] = {"kind": "sft"}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "storage_options":
                continue
            if f.name in ("data", "eval_data") and value is not None and not isinstance(value, str):
                value = f"<{len(value)} examples>" if isinstance(value, (list, tuple)) else str(value)
            out[f.name] = value
        return out


def check_sft_setting_names(settings: dict) -> None:
    fields = [f.name for f in dataclasses.fields(SFTConfig)]
    unknown = [name for name in settings if name not in fields]
    if unknown:
        guesses = []
        for name in unknown:
            close = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
            guesses.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
        raise ConfigError(f"unknown SFT setting{'s' if len(unknown) > 1 else ''}: {', '.join(guesses)}", hint="see docs/sft.md")


__all__ = ["SFTConfig"]
