"""Warm start: begin a run (RL or SFT) from another run's checkpoint or from a PEFT adapter directory.

    init_from="sft-20260101-120000-ab12@40"      # run id @ checkpoint step
    init_from="sft-20260101-120000-ab12@latest"  # its newest valid checkpoint
    init_from="path/to/adapter"                  # a directory holding adapter_config.json

Only the adapter's weights carry over: the new run starts at step 0 with a fresh optimizer (the
source's Adam moments belong to another loss and learning rate), as practitioners do when an SFT
checkpoint starts RL. The checkpoint is read where the source run lives (the run's storage, or the
server the backend talks to), so adapters never travel through the client except as a PEFT
directory the user gave. A checkpoint of another base model or another LoRA rank is refused
before anything is loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinkerless.errors import ConfigError, TinkerlessError, UserError
from tinkerless.sdk.checkpoints.checkpoint_ref import same_model
from tinkerless.sdk.backends.client import TrainingClient
from tinkerless.wire.messages import PolicyState
from tinkerless.wire.runs import CheckpointPolicy

DRIVER_STATE_FILE = "client.json"  # the trainer's own file in a checkpoint: read by nobody here


@dataclass
class WarmStart:
    source: str  # what was loaded, in words
    run_id: str | None = None
    step: int | None = None


def parse_init_from(init_from: str) -> tuple[str, str | None]:
    """("adapter", directory) or (run_id, "latest" | "<step>")."""
    spec = init_from.strip()
    if Path(spec).expanduser().is_dir():
        return "adapter", str(Path(spec).expanduser())
    run_id, at, step = spec.rpartition("@")
    if not at or not run_id or not (step == "latest" or step.isdigit()):
        raise ConfigError(
            f"init_from={init_from!r} is neither an adapter directory nor '<run_id>@<step>'",
            hint="e.g. init_from='my-sft-run@20', 'my-sft-run@latest' (see `tinkerless runs`), or a directory "
            "holding adapter_config.json",
        )
    return run_id, step


def check_init_from(init_from: str, host: Any, model: str, lora_rank: int) -> tuple[str, str | None]:
    """Every check that needs no worker: the source exists, and has this run's base model and LoRA rank.
    Runs before the new run is created, so a wrong `init_from` leaves nothing behind."""
    kind, where = parse_init_from(init_from)
    if kind == "adapter":
        _adapter_directory(where, model, lora_rank)
        return kind, where
    run_id = kind
    source = _run_config(host, run_id)
    trained_on = str(source.get("model", ""))
    if not same_model(trained_on, model):
        raise ConfigError(
            f"init_from={init_from!r}: run {run_id!r} trained an adapter of base model {trained_on!r}, "
            f"but this run's model is {model!r}",
            hint=f"set model={trained_on!r} to continue from it, or pick a checkpoint of {model!r}",
        )
    source_rank = source.get("lora_rank")
    if source_rank is not None and source_rank != lora_rank:
        raise ConfigError(
            f"init_from={init_from!r}: run {run_id!r} has LoRA rank {source_rank}, this run lora_rank={lora_rank}",
            hint=f"set lora_rank={source_rank} to continue from that adapter",
        )
    return kind, where


def apply_init_from(init_from: str, client: TrainingClient, host: Any, model: str, lora_rank: int) -> WarmStart:
    """Load `init_from`'s adapter weights into `client`'s policy (version 0, fresh optimizer)."""
    kind, where = check_init_from(init_from, host, model, lora_rank)
    if kind == "adapter":
        files = _adapter_directory(where, model, lora_rank)
        client.load_state(PolicyState(client.policy, files, 0), include_optimizer=False)
        return WarmStart(f"adapter {where}")
    run_id, step = kind, where
    wanted = None if step == "latest" else int(step)
    policy = CheckpointPolicy("default", "", client.remote(client.policy), 0)
    try:
        restored = host.checkpoints(run_id).restore([policy], [DRIVER_STATE_FILE], wanted, driver=False)
    except UserError:
        raise
    except TinkerlessError as exc:  # no such step, a corrupt one: say which run and what to pick
        raise UserError(
            f"init_from={init_from!r}: cannot load that checkpoint of run {run_id!r}: {exc.message}",
            hint=f"use '{run_id}@latest' or a step `tinkerless runs` shows a checkpoint for",
        ) from None
    if restored.step is None:
        raise UserError(
            f"init_from={init_from!r}: run {run_id!r} has no valid checkpoint in {host.where}",
            hint="let that run reach its first checkpoint (checkpoint_every), or warm start from another run",
        )
    # The checkpoint brought its optimizer along; keep only the adapter, with a fresh optimizer and version 0.
    weights = client.save_state(include_optimizer=False)
    client.load_state(PolicyState(client.policy, weights.files, 0), include_optimizer=False)
    return WarmStart(f"run {run_id} step {restored.step}", run_id, restored.step)


def _run_config(host: Any, run_id: str) -> dict:
    """The stored config of run `run_id`, read without taking over the run (a reader, not its driver)."""
    store = getattr(host, "store", None)
    if store is not None:
        from tinkerless.coordinator import Coordinator

        try:
            return Coordinator.open(store, run_id).state.config
        except UserError:
            pass
    else:
        for run in host.list():
            if run.run_id == run_id:
                return run.config
    raise UserError(
        f"init_from: there is no run {run_id!r} in {host.where}",
        hint="pick a run id from `tinkerless runs` (with the same --storage or --server), or pass an adapter directory",
    )


def _adapter_directory(directory: str, model: str, lora_rank: int) -> dict[str, bytes]:
    path = Path(directory)
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise UserError(
            f"init_from={directory!r} is a directory without adapter_config.json, so not a PEFT adapter",
            hint="point at a directory written by PeftModel.save_pretrained or `tinkerless export`",
        )
    try:
        config = json.loads(config_file.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise UserError(f"{config_file} is not valid JSON ({exc})", hint="re-export the adapter") from None
    if not isinstance(config, dict):
        raise UserError(f"{config_file} is not a JSON object", hint="re-export the adapter")
    base = config.get("base_model_name_or_path")
    if isinstance(base, str) and base and not same_model(base, model):
        raise ConfigError(
            f"init_from={directory!r} is an adapter of base model {base!r}, but this run's model is {model!r}",
            hint=f"set model={base!r}, or use an adapter trained on {model!r}",
        )
    rank = config.get("r")
    if isinstance(rank, int) and rank != lora_rank:
        raise ConfigError(
            f"init_from={directory!r} has LoRA rank {rank}, this run lora_rank={lora_rank}",
            hint=f"set lora_rank={rank} to continue from that adapter",
        )
    return {f"adapter/{p.name}": p.read_bytes() for p in path.iterdir() if p.is_file()}


__all__ = ["WarmStart", "apply_init_from", "check_init_from", "parse_init_from", "same_model"]
