"""Policy-gradient and SFT losses on per-token tensors.

Runs inside the GPU "update" function. Every input is a [B, T] tensor aligned
on target tokens; `mask` marks the tokens the policy sampled (the only ones that
train). Definitions follow /work/shared/reference/rl-frameworks-and-losses.md §5:

    r = exp(logprobs - sampler_logprobs)                       per token (with TIS: - old_logprobs)
    importance_sampling   -r * A                                (Tinker)
    ppo                   -min(r * A, clip(r, 1-lo, 1+hi) * A)  (DAPO clip-higher)
    cispo                 -sg(clip(r, 1-lo, 1+hi)) * A * logprobs  (MiniMax-M1)
    dro                   -(A * logprobs - beta/2 * (logprobs - sampler_logprobs)^2)  (Tinker's `dro`)
    cross_entropy         -logprobs, or -A * logprobs with per-token weights A  (SFT; Tinker's weighted CE)

Optional extras, per token, before normalization:
    TIS  r = exp(logprobs - old_logprobs), and the policy term *= sg(min(exp(old_logprobs - sampler_logprobs), tis_cap))
         (old_logprobs: the trainer's log-probs of the sampled tokens before the update; Yao et al.'s decoupled form)
    KL   + kl_coef * k3,  k3 = exp(ref - logprobs) - (ref - logprobs) - 1

Normalization of the masked sum: "token" (DAPO), "sequence" (GRPO),
"constant" (Dr.GRPO).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from tinkerless.errors import ConfigError

LOSS_NAMES = ("importance_sampling", "ppo", "cispo", "dro", "cross_entropy")  # per-token losses (compute_loss)
# A teacher's top-k distributions as targets (on-policy distillation): computed by `training/topk_distillation.py`
# from the rows the datums carry, not by compute_loss; a run asks for it with TrainConfig(distill_loss=...).
DISTILLATION_LOSS_NAMES = ("topk_forward_kl",)
RL_LOSS_NAMES = ("importance_sampling", "ppo", "cispo", "dro")
NORMALIZATIONS = ("token", "sequence", "constant")


@dataclass(frozen=True)
class LossConfig:
    name: str = "importance_sampling"  # one of LOSS_NAMES
    clip_low: float = 0.2  # ratio lower clip: 1 - clip_low (ppo, cispo)
    clip_high: float = 0.28  # ratio upper clip: 1 + clip_high (asymmetric, DAPO clip-higher)
    normalization: str = "token"  # "token" | "sequence" | "constant"
    normalization_constant: float | None = None  # required for "constant" (Dr.GRPO: max_tokens * batch)
    tis_cap: float | None = None  # truncated importance sampling cap C; None = off
    kl_coef: float = 0.0  # beta for k3 KL to reference model; 0 = off
    dro_beta: float = 0.05  # dro: weight of the quadratic penalty on log(pi / sampler); the Tinker docs fix no default
    # TIS with datums that carry no old_logprobs: take them from this very pass (detached). Right only when the
    # policy has not changed since the sampler ran (the first update after an on-policy rollout, as train() does);
    # it saves the separate forward pass that would compute the same numbers.
    old_logprobs_current: bool = False

    def validate(self) -> None:
        if self.name not in LOSS_NAMES + DISTILLATION_LOSS_NAMES:
            raise ConfigError(f"LossConfig.name={self.name!r} is not a known loss", hint=f"use one of {LOSS_NAMES}")
        if self.normalization not in NORMALIZATIONS:
            raise ConfigError(
                f"LossConfig.normalization={self.normalization!r} is not supported",
                hint=f"use one of {NORMALIZATIONS}",
            )
        if not (_finite(self.clip_low) and 0.0 <= self.clip_low <= 1.0):
            raise ConfigError(
                f"LossConfig.clip_low={self.clip_low!r} is out of range",
                hint="use a value in [0, 1]; the lower ratio bound is 1 - clip_low (1 = no lower clip, as in CISPO)",
            )
        if not (_finite(self.clip_high) and self.clip_high >= 0.0):
            raise ConfigError(
                f"LossConfig.clip_high={self.clip_high!r} is out of range",
                hint="use a finite value >= 0; the upper ratio bound is 1 + clip_high",
            )
        if self.normalization == "constant":
            c = self.normalization_constant
            if c is None or not (_finite(c) and c > 0):
                raise ConfigError(
                    f"LossConfig.normalization_constant={c!r} must be a finite number > 0 for normalization='constant'",
                    hint="Dr.GRPO uses max_completion_tokens * batch_size",
                )
        if self.tis_cap is not None and not (_finite(self.tis_cap) and self.tis_cap > 0):
            raise ConfigError(
                f"LossConfig.tis_cap={self.tis_cap!r} must be None (off) or a finite number > 0",
                hint="a typical cap is 2.0",
            )
        if not (_finite(self.dro_beta) and self.dro_beta >= 0.0):
            raise ConfigError(
                f"LossConfig.dro_beta={self.dro_beta!r} must be a finite number >= 0",
                hint="beta weighs the penalty 0.5 * beta * (logprob - sampler_logprob)^2; 0 makes dro plain REINFORCE",
            )
        if not isinstance(self.old_logprobs_current, bool):
            raise ConfigError(
                f"LossConfig.old_logprobs_current={self.old_logprobs_current!r} must be true or false",
                hint="true: TIS uses this pass's own log-probs as old_logprobs (on-policy); false: datums carry them",
            )
        if not (_finite(self.kl_coef) and self.kl_coef >= 0.0):
            raise ConfigError(
                f"LossConfig.kl_coef={self.kl_coef!r} must be a finite number >= 0",
                hint="use 0 to turn the KL term off (DAPO, Dr.GRPO) or e.g. 0.001 (R1)",
            )


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_inputs(config: LossConfig, inputs: dict[str, Tensor | None]) -> None:
    """Required inputs present and every given tensor is [B, T] with the same shape."""
    required = ["logprobs", "mask"]
    if config.name in RL_LOSS_NAMES:
        required += ["advantages", "sampler_logprobs"]
        if config.tis_cap is not None and not config.old_logprobs_current:
            required.append("old_logprobs")
    if config.kl_coef > 0:
        required.append("ref_logprobs")
    missing = [k for k in required if inputs.get(k) is None]
    if missing:
        raise ConfigError(
            f"loss {config.name!r} needs {', '.join(missing)} but got None",
            hint="tis_cap needs old_logprobs, kl_coef > 0 needs ref_logprobs, "
            "RL losses need advantages and sampler_logprobs",
        )
    shape = inputs["logprobs"].shape
    if len(shape) != 2:
        raise ConfigError(f"logprobs must be [B, T], got shape {tuple(shape)}", hint="pad sequences to a common length")
    for key, t in inputs.items():
        if t is not None and t.shape != shape:
            raise ConfigError(
                f"{key} has shape {tuple(t.shape)} but logprobs has {tuple(shape)}",
                hint="all per-token tensors must be [B, T] and aligned on target tokens",
            )


def _normalize(config: LossConfig, per_token: Tensor, mask: Tensor) -> Tensor:
    """Reduce a masked [B, T] per-token loss to a scalar. All-zero mask -> 0 (still in the graph)."""
    weighted = per_token * mask
    if config.normalization == "token":
        return weighted.sum() / mask.sum().clamp(min=1.0)
    if config.normalization == "sequence":
        seq_tokens = mask.sum(dim=1)
        seq_mean = weighted.sum(dim=1) / seq_tokens.clamp(min=1.0)
        has_tokens = (seq_tokens > 0).to(per_token.dtype)  # empty sequences don't dilute the mean
        return (seq_mean * has_tokens).sum() / has_tokens.sum().clamp(min=1.0)
    return weighted.sum() / float(config.normalization_constant)  # "constant", checked by validate()


def _masked_mean(x: Tensor, mask: Tensor) -> float:
    return float((x * mask).sum() / mask.sum().clamp(min=1.0))


def compute_loss(
    config: LossConfig,
    logprobs: Tensor,
    mask: Tensor,
    advantages: Tensor | None = None,
    sampler_logprobs: Tensor | None = None,
    old_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Returns (scalar loss to call .backward() on, metrics).

    logprobs:         [B, T] current policy log-prob of each target token (requires grad)
    mask:             [B, T] 0/1: 1 on tokens the policy sampled (trainable); values > 0 count as 1
    advantages:       [B, T] per-token advantage (RL losses)
    sampler_logprobs: [B, T] log-probs recorded by the sampler (behaviour policy)
    old_logprobs:     [B, T] trainer log-probs of the sampling policy (only for TIS)
    ref_logprobs:     [B, T] reference-model log-probs (only for KL)
    """
    config.validate()
    if config.name == "topk_forward_kl":
        raise ConfigError("topk_forward_kl is computed from the teacher's top-k rows, not from per-token log-probs",
                          hint="the worker's forward_backward runs it (functions/training/topk_distillation.py)")
    _check_inputs(
        config,
        dict(
            logprobs=logprobs,
            mask=mask,
            advantages=advantages,
            sampler_logprobs=sampler_logprobs,
            old_logprobs=old_logprobs,
            ref_logprobs=ref_logprobs,
        ),
    )
    # Loss math in fp32 even when the model runs in bf16; gradients flow back through the cast.
    dtype = torch.float32
    on = mask > 0
    m = on.to(dtype)
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)

    def clean(t: Tensor) -> Tensor:
        # Padding may hold garbage (-inf, NaN); zero it *before* exp so neither the value
        # nor the gradient of masked-out tokens can become NaN.
        return torch.where(on, t.to(dtype), zero)

    lp = clean(logprobs)
    metrics: dict[str, float] = {"tokens": float(m.sum())}

    if config.name == "cross_entropy":
        # Optional per-token weights ride in `advantages` (any real value, as in Tinker's cross_entropy).
        per_token = -lp if advantages is None else -clean(advantages).detach() * lp
    else:
        adv = clean(advantages).detach()
        behaviour = clean(sampler_logprobs).detach()
        # The sampler/trainer gap on the sampled tokens (the cookbook's kl_sample_train): synchronously both
        # score the same policy, so any gap is numerics (bf16, batch shapes, another engine); with max_staleness
        # it also holds the policy's drift since the sampler's version. Large values are what tis_cap corrects.
        gap = (behaviour - lp).detach()
        metrics["logprob_gap"] = _masked_mean(gap.abs(), m)
        metrics["kl_sample_train"] = _masked_mean(gap, m)
        old = None
        if config.tis_cap is not None:
            # Decoupled, as TIS defines it: the policy term's ratio is against the trainer's own log-probs of the
            # sampled tokens (old_logprobs; this pass's own with old_logprobs_current) and the sampler's share is
            # the truncated weight below. A ratio against the sampler would weight each token by exp(old - sampler)
            # once more, uncapped, on top of the capped weight.
            old = clean(old_logprobs if old_logprobs is not None else logprobs).detach()
        log_ratio = lp - (behaviour if old is None else old)
        ratio = torch.exp(log_ratio)
        lo, hi = 1.0 - config.clip_low, 1.0 + config.clip_high
        if config.name == "importance_sampling":
            per_token = -ratio * adv
            clipped = torch.zeros_like(on)
        elif config.name == "dro":
            # A REINFORCE term kept near the sampling policy by a quadratic penalty on the log-ratio.
            per_token = -(adv * lp - 0.5 * config.dro_beta * log_ratio.square())
            clipped = torch.zeros_like(on)
        else:
            clipped_ratio = ratio.clamp(lo, hi)
            clipped = ((ratio < lo) | (ratio > hi)) & on
            if config.name == "ppo":
                per_token = -torch.minimum(ratio * adv, clipped_ratio * adv)
            else:  # cispo: clipped IS weight with no gradient, REINFORCE term keeps every token's gradient
                per_token = -clipped_ratio.detach() * adv * lp
        metrics["ratio_mean"] = _masked_mean(ratio.detach(), m)
        metrics["clip_fraction"] = _masked_mean(clipped.to(dtype), m)

        if config.tis_cap is not None:
            # Correct sampler/trainer mismatch on the policy-gradient term only (not on the KL term).
            # old_logprobs may be absent only with old_logprobs_current (checked above): this pass's own.
            tis_w = torch.exp(old - behaviour).clamp(max=config.tis_cap)
            per_token = per_token * tis_w
            metrics["tis_weight_mean"] = _masked_mean(tis_w, m)

    if config.kl_coef > 0:
        delta = clean(ref_logprobs).detach() - lp
        k3 = torch.exp(delta) - delta - 1.0  # unbiased, always >= 0 estimate of KL(pi || ref)
        per_token = per_token + config.kl_coef * k3
        metrics["kl"] = _masked_mean(k3.detach(), m)

    loss = _normalize(config, per_token, m)
    metrics["loss"] = float(loss.detach())
    return loss, metrics
