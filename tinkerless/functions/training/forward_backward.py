"""Forward (per-token log-probs) and forward_backward (loss + gradients) on a batch of datums.

Datums are grouped by length into micro-batches sized by tokens (`micro_batches`),
right-padded; gradients accumulate across micro-batches and across calls until the
optimizer step. Each micro-batch loss is rescaled so the sum equals the loss
normalized over the whole batch. Results come back in the caller's order.

On a sharded model (`functions/sharding`, `rank`/`world_size`) every rank gets the whole batch and runs
every `world_size`-th micro-batch of the one plan all ranks compute alike; each micro-batch keeps its share
of the whole batch's normalizer, so the ranks' gradients sum to the unsharded batch's. Every layer's weights
are all-gathered in each pass, so every rank makes the same number of passes: a rank out of micro-batches
makes an idle pass that changes nothing (`_idle_pass`).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import numpy as np
import torch

from tinkerless.functions.losses import LossConfig, compute_loss
from tinkerless.functions.training import packing, picked_logits, shared_prefix
from tinkerless.functions.training.micro_batches import model_token_budget, plan_micro_batches, recompute_in_backward
from tinkerless.wire.messages import Datum

# "0" turns prompt sharing off (the plain path for every row), for comparisons.
SHARED_PREFIX_ENV = "TINKERLESS_SHARED_PREFIX"


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T]
    attention: torch.Tensor  # [B, T]
    lengths: list[int]

    def field(self, values: list) -> torch.Tensor | None:
        """A per-token datum field (mask, advantages, ...) as a padded tensor; None where any row lacks it."""
        if any(v is None for v in values):
            return None
        out = torch.zeros(self.input_ids.shape, dtype=torch.float32)
        for row, v in enumerate(values):
            out[row, : len(v)] = torch.as_tensor(np.asarray(v, dtype=np.float32))
        return out.to(self.input_ids.device)


def make_batch(data: list[Datum], pad_id: int, device: torch.device) -> Batch:
    lengths = [len(d.tokens) for d in data]
    width = max(lengths)
    input_ids = torch.full((len(data), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(data), width), dtype=torch.long)
    for row, d in enumerate(data):
        input_ids[row, : len(d.tokens)] = torch.as_tensor(np.asarray(d.tokens, dtype=np.int64))
        attention[row, : len(d.tokens)] = 1
    return Batch(input_ids.to(device), attention.to(device), lengths)


def token_logprobs(
    model, batch: Batch, *, positions: torch.Tensor | None = None, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of every token given its prefix, aligned with the tokens (column 0 is 0).

    `positions` (sorted target positions) limits the vocabulary projection to the
    tokens that need it: logits are [B, T, V] and dominate memory for long
    episodes, while a loss only reads the sampled tokens. Other entries are 0.
    """
    width = batch.input_ids.shape[1]
    if positions is None:
        positions = torch.arange(1, width, device=batch.input_ids.device)
    # The logits at position p - 1 predict token p. No attention mask: rows are right-padded and
    # attention is causal, so a real token never sees a pad (pads come after it) and the mask would
    # only change the pads' own outputs, which no loss reads. Without a mask SDPA takes its fused
    # kernel (on CPU too) instead of materializing [B, heads, T, T] scores per layer for backward.
    logits = model(input_ids=batch.input_ids, logits_to_keep=positions - 1, use_cache=False).logits
    picked, picked_entropy = picked_logits.target_logprobs(logits, batch.input_ids[:, positions], with_entropy=with_entropy)
    logprobs = torch.zeros(batch.input_ids.shape, dtype=picked.dtype, device=picked.device)
    logprobs = logprobs.index_copy(1, positions, picked)
    entropy = None
    if picked_entropy is not None:
        entropy = torch.zeros(batch.input_ids.shape, device=picked.device)
        entropy[:, positions] = picked_entropy
    return logprobs, entropy


def trained_positions(mask: torch.Tensor) -> torch.Tensor:
    """Sorted positions where any row has a trained token (never 0: it has no prefix)."""
    positions = torch.nonzero(mask[:, 1:].sum(0) > 0).squeeze(-1) + 1
    return positions if len(positions) else torch.ones(1, dtype=torch.long, device=mask.device)


def gradient_norm(tensors: list[torch.Tensor]) -> float:
    """The 2-norm of all of `tensors` together; sharded ones (DTensors) count every rank's part."""
    total = torch.linalg.vector_norm(torch.stack([t.norm() for t in tensors]))
    return float(total.full_tensor() if hasattr(total, "full_tensor") else total)


def rank_micro_batch_size(rows: int, micro_batch_size: int, world_size: int) -> int:
    """Sharded, a micro-batch holds at most a rank's share of the rows, so that every rank gets work."""
    return micro_batch_size if world_size == 1 else max(1, min(micro_batch_size, -(-rows // world_size)))


def rank_rounds(plan: list, rank: int, world_size: int) -> list:
    """This rank's micro-batches, one per round (None: none left): every rank runs the same number of rounds."""
    rounds = -(-len(plan) // world_size)
    return [plan[k * world_size + rank] if k * world_size + rank < len(plan) else None for k in range(rounds)]


def _idle_pass(model, pad_id: int, device: torch.device, *, backward: bool) -> None:
    """A pass over one 2-token row that changes nothing: a rank with no micro-batch left in a round still joins
    the sharded model's collectives (each layer all-gathered, each gradient reduce-scattered, as zeros)."""
    ids = torch.full((1, 2), pad_id, dtype=torch.long, device=device)
    logits = model(input_ids=ids, use_cache=False).logits
    if backward:
        (logits.float().sum() * 0.0).backward()


def forward(
    model, data: list[Datum], pad_id: int, micro_batch_size: int, *, rank: int = 0, world_size: int = 1,
    token_budget: int | None = None,
) -> list[np.ndarray | None]:
    """Per-token log-probs of every datum (with `world_size` > 1: of this rank's datums, None for the others).
    `token_budget`: the micro-batches' padded tokens (default: what the activation budget allows); ranks pass
    one agreed figure, since free GPU memory, which the default follows, differs between them."""
    if any(d.images for d in data):  # a vision-language batch: the images merged into the inputs
        from tinkerless.functions.vision import training as vision_training

        return vision_training.forward(model, data, pad_id, micro_batch_size)
    device = next(model.parameters()).device
    out: list[np.ndarray | None] = [None] * len(data)
    micro_batch_size = rank_micro_batch_size(len(data), micro_batch_size, world_size)
    plan = plan_micro_batches([len(d.tokens) for d in data], micro_batch_size, model, token_budget=token_budget)
    with torch.no_grad():
        for micro in rank_rounds(plan, rank, world_size):
            if micro is None:
                _idle_pass(model, pad_id, device, backward=False)
                continue
            batch = make_batch([data[i] for i in micro.rows], pad_id, device)
            logprobs, _ = token_logprobs(model, batch)
            for row, index in enumerate(micro.rows):
                out[index] = logprobs[row, : batch.lengths[row]].cpu().numpy().astype(np.float32)
    return out


def _normalizer(config: LossConfig, masks: list[np.ndarray]) -> float:
    """The denominator `compute_loss` uses for one batch, so micro-batch losses can be re-weighted."""
    if config.normalization == "token":
        return float(sum(m.sum() for m in masks))
    if config.normalization == "sequence":
        return float(sum(1 for m in masks if m.sum() > 0))
    return 1.0  # "constant": already batch-independent


def forward_backward(
    model, data: list[Datum], config: LossConfig, pad_id: int, micro_batch_size: int, *, rank: int = 0,
    world_size: int = 1, token_budget: int | None = None,
) -> tuple[dict[str, float], list[np.ndarray | None]]:
    """Accumulate gradients of the batch loss into the trainable parameters.

    Rows that share their untrained prompt run it once per group (`shared_prefix.py`); the rest are
    right-padded micro-batches of similar lengths. Both give the same loss up to float rounding.
    With `world_size` > 1 (a sharded model) this rank's share of the micro-batches; the metrics are this rank's
    part (`sharding.ranks.merge_metrics` adds the parts up) and other ranks' rows' log-probs are None.
    """
    config.validate()
    if any(d.images for d in data):  # a vision-language batch: the images merged into the inputs
        from tinkerless.functions.vision import training as vision_training

        return vision_training.forward_backward(model, data, config, pad_id, micro_batch_size)
    device = next(model.parameters()).device
    masks = [np.asarray(d.mask, dtype=np.float32) for d in data]
    totals = _Totals(config, _normalizer(config, masks))
    all_logprobs: list[np.ndarray | None] = [None] * len(data)
    lengths = [len(m) for m in masks]
    # Sharded: no prompt sharing (a shared group's passes differ from a plain micro-batch's, and the ranks'
    # passes must line up one for one).
    shared_plan, plain_rows = (
        _shared_plan(model, data, masks, micro_batch_size) if world_size == 1 else ([], list(range(len(data))))
    )
    for shared in shared_plan:
        chunk = [data[i] for i in shared.rows]
        frame = shared_prefix.suffix_frame(shared, [d.tokens for d in data], pad_id, device)
        mask = frame.field([d.mask for d in chunk])
        share = totals.share([masks[i] for i in shared.rows])
        packed = packing.enabled() and picked_logits.decoder_and_head(model)
        if packed:  # the prompt once, then each suffix, unpadded (`packing`)
            logprobs, entropy = packing.shared_logprobs(packed, shared, [d.tokens for d in data], frame, mask,
                                                        with_entropy=True)
        else:
            logprobs, entropy = shared_prefix.suffix_logprobs(model, shared, [d.tokens for d in data], frame, mask,
                                                              with_entropy=True)
        totals.add(share, logprobs, entropy, mask, chunk, frame.field)
        for row, index in enumerate(shared.rows):
            all_logprobs[index] = shared_prefix.full_row(logprobs[row], frame.starts[row], lengths[index])
    plan = []
    micro_batch_size = rank_micro_batch_size(len(plain_rows), micro_batch_size, world_size)
    for micro in plan_micro_batches([lengths[i] for i in plain_rows], micro_batch_size, model, token_budget=token_budget):
        rows = [plain_rows[i] for i in micro.rows]
        if totals.share([masks[i] for i in rows]) == 0.0 and config.normalization != "constant":
            for i in rows if rank == 0 else ():  # nothing trainable here: no forward, and no log-probs to report
                all_logprobs[i] = np.zeros(len(masks[i]), dtype=np.float32)
            continue
        plan.append((micro, rows))
    split = picked_logits.decoder_and_head(model)  # None for a sharded model: its ranks keep the whole model's path
    for planned in rank_rounds(plan, rank, world_size):
        if planned is None:
            _idle_pass(model, pad_id, device, backward=True)
            continue
        micro, rows = planned
        share = totals.share([masks[i] for i in rows])
        chunk = [data[i] for i in rows]
        batch = make_batch(chunk, pad_id, device)
        mask = batch.field([d.mask for d in chunk])
        with recompute_in_backward(model, micro.recompute):
            if split is not None and packing.enabled():  # the rows end to end, unpadded (`packing`)
                logprobs, entropy = packing.plain_logprobs(split, batch.input_ids, batch.lengths, mask, with_entropy=True)
            elif split is not None:  # the head on the trained tokens only (`picked_logits`)
                logprobs, entropy = picked_logits.row_logprobs(split, batch.input_ids, mask, with_entropy=True)
            else:
                logprobs, entropy = token_logprobs(model, batch, positions=trained_positions(mask), with_entropy=True)
            totals.add(share, logprobs, entropy, mask, chunk, batch.field)
        for row, index in enumerate(rows):
            all_logprobs[index] = logprobs[row, : batch.lengths[row]].detach().cpu().numpy()
    for i, value in enumerate(all_logprobs if world_size == 1 else ()):  # rows of a shared group with nothing trainable
        if value is None:
            all_logprobs[i] = np.zeros(lengths[i], dtype=np.float32)
    return totals.metrics(), all_logprobs


def _shared_plan(model, data: list[Datum], masks: list[np.ndarray], micro_batch_size: int):
    """Micro-batches of prompt-sharing groups, and the rows left for the plain path."""
    if os.environ.get(SHARED_PREFIX_ENV, "1") == "0":
        return [], list(range(len(data)))
    groups, alone = shared_prefix.find_prefix_groups([d.tokens for d in data], masks)
    if not groups:
        return [], alone
    plan, rejected = shared_prefix.plan_shared(groups, [len(m) for m in masks], micro_batch_size, model_token_budget(model))
    return plan, sorted(alone + rejected)


class _Totals:
    """Loss metrics summed over micro-batches, each re-weighted to its share of the batch normalizer."""

    def __init__(self, config: LossConfig, normalizer: float):
        self.config, self.normalizer = config, normalizer
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.entropy_sum, self.token_count = 0.0, 0.0

    def share(self, masks: list[np.ndarray]) -> float:
        return _normalizer(self.config, masks) / self.normalizer if self.normalizer > 0 else 0.0

    def add(self, share: float, logprobs, entropy, mask, chunk: list[Datum], field) -> None:
        """The micro-batch's loss, backward, and its metrics (`field` puts a datum field in the logprobs' frame)."""
        loss, metrics = compute_loss(
            self.config,
            logprobs,
            mask,
            advantages=field([d.advantages for d in chunk]),
            sampler_logprobs=field([d.sampler_logprobs for d in chunk]),
            old_logprobs=field([d.old_logprobs for d in chunk]),
            ref_logprobs=field([d.ref_logprobs for d in chunk]),
        )
        (loss * share).backward()
        for key, value in metrics.items():  # token-weighted means across micro-batches
            w = float(mask.sum()) if key != "loss" else 1.0
            self.sums[key] = self.sums.get(key, 0.0) + (value * share if key == "loss" else value * w)
            self.weights[key] = self.weights.get(key, 0.0) + w
        self.entropy_sum += float((entropy * mask).sum())
        self.token_count += float(mask.sum())

    def metrics(self) -> dict[str, float]:
        sums, weights = self.sums, self.weights
        out = {k: (sums[k] if k in ("loss", "tokens") else sums[k] / max(weights[k], 1e-9)) for k in sums}
        out["tokens"] = self.token_count
        out["entropy"] = self.entropy_sum / self.token_count if self.token_count else 0.0
        return out


@contextlib.contextmanager
def no_adapter(model):
    """The reference model: the same weights with the LoRA adapter switched off (no second copy)."""
    if hasattr(model, "disable_adapter"):
        with model.disable_adapter():
            yield
    else:
        yield
