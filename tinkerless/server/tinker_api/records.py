"""What the Tinker service keeps about its training models and samplers, and the replies it builds.

Plain records (no behaviour beyond describing themselves to clients), shared by the service's
training, sampling and listing parts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tinkerless.server.tinker_api.checkpoints import now_iso
from tinkerless.wire.messages import PolicyState



@dataclass
class Proto:
    """A result the SDK expects as protobuf bytes."""

    data: bytes


@dataclass
class TrainingModel:
    model_id: str
    tenant: str
    policy: str  # the worker's adapter name
    base_model: str
    lora_rank: int
    user_metadata: dict | None
    created_at: str = field(default_factory=now_iso)
    last_request_time: str = field(default_factory=now_iso)
    last_checkpoint: dict | None = None
    last_sampler_checkpoint: dict | None = None
    lora_flags: dict = field(default_factory=dict)  # train_attn / train_mlp / train_unembed, for weights_info

    def record(self) -> dict:
        return {
            "training_run_id": self.model_id,
            "base_model": self.base_model,
            "model_owner": self.tenant or "local",
            "is_lora": True,
            "corrupted": False,
            "lora_rank": self.lora_rank,
            "last_request_time": self.last_request_time,
            "last_checkpoint": self.last_checkpoint,
            "last_sampler_checkpoint": self.last_sampler_checkpoint,
            "user_metadata": self.user_metadata,
            "created_at": self.created_at,
        }


@dataclass
class Sampler:
    sampler_id: str
    tenant: str
    base_model: str
    model_path: str | None = None
    live: tuple[str, int] | None = None  # (training model id, policy version) the weights were taken at
    state: PolicyState | None = None  # the adapter, when it may differ from the live model's


def public_checkpoint(meta: dict) -> dict:
    """A checkpoint's registry metadata as the SDK's `Checkpoint` record (nothing about where it is stored)."""
    keys = ("checkpoint_id", "checkpoint_type", "time", "tinker_path", "size_bytes")
    return {**{k: meta[k] for k in keys}, "public": False, "user_metadata": meta.get("user_metadata"),
            "expires_at": meta.get("expires_at")}

