"""A policy's update data for one step: its episodes → group-relative advantages (plus, with a teacher, the
per-token distillation term) → `Datum`s, with the loss they are trained with and the log-probs that loss
needs beyond the sampler's (a forward pass for KL)."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from tinkerless.functions.losses import LossConfig
from tinkerless.sdk.backends.client import TrainingClient
from tinkerless.sdk.config import TrainConfig
from tinkerless.sdk.run.accounting import RunUsage
from tinkerless.sdk.run.advantages import AdvantageConfig, group_advantages
from tinkerless.sdk.run.distillation import SequenceScores, Teacher, opd_advantages, teacher_columns, topk_batch
from tinkerless.wire.messages import Datum, Episode


def update_batch(
    client: TrainingClient, episodes: list[Episode], config: TrainConfig, usage: RunUsage, timings: dict,
    teacher: Teacher | None = None,
) -> tuple[list[Datum], LossConfig]:
    """The `Datum`s `client`'s policy trains on for `episodes` and the loss to train them with (no data: no signal).
    With a `teacher`, its forward runs first (the run's `teacher` phase) and its metrics join `timings` (the
    step's record takes them from there)."""
    scores = None
    if teacher is not None and episodes and config.distill_loss == "topk_forward_kl":
        t = time.perf_counter()
        with usage.phase("teacher"):
            data, columns = topk_batch(episodes, teacher, config.distill_topk)
        timings.update({"teacher_s": time.perf_counter() - t, **columns})
        return data, LossConfig(name="topk_forward_kl")
    if teacher is not None and episodes:
        t = time.perf_counter()
        with usage.phase("teacher"):
            scores = teacher.score(episodes)
        timings["teacher_s"] = timings.get("teacher_s", 0.0) + time.perf_counter() - t
        timings.update(teacher_columns(episodes, scores))
    data = datums(episodes, config.advantage_config(), scores, config.distill_coef)
    loss = config.loss_config()
    if config.tis_cap is not None:
        # One update per rollout: the policy is still the one that sampled, so the update's own
        # log-probs are TIS's old log-probs and no separate forward is needed for them.
        loss = dataclasses.replace(loss, old_logprobs_current=True)
    if data and config.kl_coef > 0:  # the reference (base model) log-probs still need their own pass
        t = time.perf_counter()
        with usage.phase("forward"):
            forward = client.forward(data, with_reference=config.kl_coef > 0)
        for i, datum in enumerate(data):
            datum.old_logprobs = forward.logprobs[i]
            if forward.ref_logprobs is not None:
                datum.ref_logprobs = forward.ref_logprobs[i]
        timings["forward_s"] += time.perf_counter() - t
    return data, loss


def datums(episodes: list[Episode], advantage_config: AdvantageConfig,
           teacher_scores: list[list[SequenceScores]] | None = None, distill_coef: float = 1.0) -> list[Datum]:
    if not episodes:
        return []
    # Groups: the same task played from the same seat (role and seating) by this policy.
    groups = [(e.task_index, e.info.get("role"), e.info.get("seating")) for e in episodes]
    advantages = group_advantages([e.reward for e in episodes], groups, advantage_config)
    data = []
    for index, (episode, advantage) in enumerate(zip(episodes, advantages)):
        # An agent that rewrote its context has several sequences: each is trained with the episode's advantage.
        for j, sequence in enumerate(episode.sequences()):
            mask, token_advantages = sequence.mask, (sequence.mask * advantage).astype(np.float32)
            if teacher_scores is not None:  # distillation: the teacher's term on the tokens it aligned
                token_advantages, mask = opd_advantages(sequence.sampler_logprobs, sequence.mask,
                                                        teacher_scores[index][j], distill_coef, advantage)
            elif advantage == 0.0:
                continue  # contributes no gradient
            if mask.sum() == 0:
                continue
            data.append(
                Datum(
                    tokens=sequence.tokens,
                    mask=mask,
                    advantages=token_advantages,
                    sampler_logprobs=sequence.sampler_logprobs,
                    images=list(sequence.images) or None,  # a vision-language episode's images, in token order
                    sampled_versions=sequence.sampled_versions,  # checked against max_staleness at the update
                )
            )
    return data
