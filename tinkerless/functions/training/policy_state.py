"""A policy's state on the worker: reading one someone sent, and rebuilding the fresh init.

`parse_policy_state` (for `load_state`) parses and checks every file before any is applied.

A state arrives from a client (or a checkpoint a client may have edited), so nothing in it
is trusted: a file that does not parse, a config of the wrong shape, weights that do not fit
the model or an optimizer state for other parameters is a `UserError` naming the file, and
the policy is left untouched (no half-loaded adapter).
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass
from typing import Any

import torch

from tinkerless.errors import InvalidRequest, UserError
from tinkerless.wire.messages import LoraConfig
from tinkerless.wire.validate import validate

ADAPTER_CONFIG = "adapter/adapter_config.json"
ADAPTER_WEIGHTS = "adapter/adapter_model.safetensors"
OPTIMIZER = "optimizer.pt"
RNG = "worker_rng.pt"
_HINT = "load a state written by save_state (or a PEFT adapter directory's files under adapter/)"


@dataclass
class ParsedState:
    lora: LoraConfig  # the adapter's shape, for a policy that does not exist yet
    weights: dict[str, torch.Tensor]
    optimizer: dict | None
    rng: torch.Tensor | None


def _bad(policy: str, name: str, why: Any) -> UserError:
    return UserError(f"policy state for {policy!r}: {name} is not usable ({why})", hint=_HINT)


def canonical_adapter_config(data: bytes) -> bytes:
    """peft's adapter_config.json with its module lists sorted: peft writes `target_modules` from a set, in an
    order that changes with each process's hash seed, so the same adapter would not be the same bytes twice."""
    config = json.loads(data)
    for key in ("target_modules", "modules_to_save", "exclude_modules"):
        if isinstance(config.get(key), list):
            config[key] = sorted(config[key])
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()


def parse_policy_state(policy: str, files: dict[str, bytes], include_optimizer: bool) -> ParsedState:
    from safetensors.torch import load as load_safetensors

    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if name not in files:
            raise UserError(f"policy state for {policy!r} has no {name}", hint=_HINT)
    try:
        config = json.loads(files[ADAPTER_CONFIG])
    except (ValueError, RecursionError) as exc:
        raise _bad(policy, ADAPTER_CONFIG, exc) from None
    if not isinstance(config, dict):
        raise _bad(policy, ADAPTER_CONFIG, f"a JSON object is expected, got {type(config).__name__}")
    modules = config.get("target_modules") or "all-linear"
    lora = LoraConfig(
        rank=config.get("r", 16),
        alpha=config.get("lora_alpha", 32),
        dropout=config.get("lora_dropout", 0.0),
        target_modules=sorted(modules) if isinstance(modules, list) else modules,
    )
    try:
        validate(lora)
    except InvalidRequest as exc:
        raise _bad(policy, ADAPTER_CONFIG, exc.message) from None
    try:
        weights = load_safetensors(files[ADAPTER_WEIGHTS])
    except Exception as exc:  # safetensors raises its own SafetensorError on garbage
        raise _bad(policy, ADAPTER_WEIGHTS, f"{type(exc).__name__}: {exc}") from None
    optimizer = _torch_file(policy, files, OPTIMIZER) if include_optimizer else None
    if optimizer is not None and not (isinstance(optimizer, dict) and {"state", "param_groups"} <= set(optimizer)):
        raise _bad(policy, OPTIMIZER, "not an optimizer state_dict")
    rng = _torch_file(policy, files, RNG)
    if rng is not None:
        rng = rng.get("torch") if isinstance(rng, dict) else None
        reference = torch.get_rng_state()
        if not (isinstance(rng, torch.Tensor) and rng.dtype == reference.dtype and rng.shape == reference.shape):
            raise _bad(policy, RNG, "not a torch RNG state")
    return ParsedState(lora, weights, optimizer, rng)


def _torch_file(policy: str, files: dict[str, bytes], name: str) -> Any:
    if name not in files:
        return None
    try:
        return torch.load(io.BytesIO(files[name]), weights_only=True)  # weights_only: no code from the wire
    except Exception as exc:  # unpickling garbage raises many types
        raise _bad(policy, name, f"{type(exc).__name__}: {str(exc)[:200]}") from None


def check_weights_fit(policy: str, weights: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """The adapter's tensors must be exactly the policy's own: same names and shapes, nothing else."""
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        raise _bad(policy, ADAPTER_WEIGHTS, f"weights for parameters this adapter lacks: {unexpected[:3]}")
    wrong = [k for k, v in weights.items() if tuple(v.shape) != tuple(expected[k].shape)]
    if wrong:
        k = wrong[0]
        raise _bad(policy, ADAPTER_WEIGHTS, f"{k} has shape {tuple(weights[k].shape)}, the adapter's is "
                   f"{tuple(expected[k].shape)} (another LoRA rank or model?)")
    diverged = next((k for k, v in weights.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())), None)
    if diverged is not None:  # NaN or inf weights would make every sample of the policy garbage
        raise _bad(policy, ADAPTER_WEIGHTS, f"{diverged} holds NaN or infinite values")


def peft_config(lora: LoraConfig):
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=lora.target_modules,
        task_type="CAUSAL_LM",
    )


def reinit_adapter(model: Any, name: str, lora: LoraConfig) -> None:
    """Put adapter `name`'s weights back to what `lora.seed` gave them at creation (`reset_policy`).

    A run resumed without a usable checkpoint must start from the fresh init, not from whatever
    the server still holds from an earlier attempt. The init is rebuilt by creating a scratch
    adapter under the same seed (peft's init draws the same numbers whatever the adapter's name)
    and copying it over, so it needs no stored copy and is the same after a server restart."""
    scratch = "zzreset" + hashlib.sha256(name.encode()).hexdigest()[:8]
    active = model.active_adapter
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(lora.seed)
        model.add_adapter(scratch, peft_config(lora))
    try:
        fresh = {n.replace(f".{scratch}.", f".{name}."): p for n, p in model.named_parameters() if f".{scratch}." in n}
        with torch.no_grad():
            for n, p in model.named_parameters():
                if f".{name}." in n and "lora_" in n:
                    p.copy_(fresh[n])
                    p.grad = None
    finally:
        model.delete_adapter(scratch)
        model.set_adapter(active)
