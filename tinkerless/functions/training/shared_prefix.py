"""Training on rows that share a prompt: the prompt's forward runs once per group, not once per row.

An RL batch holds `group_size` samples of every prompt, and in a short-answer job the prompt is
most of each row (SmolLM2's chat header + a question: ~40 tokens, for 12 sampled ones). Every
row's forward and backward through those shared tokens is the same computation, repeated. So the
rows of a group that agree on every token before their first trained one are split there:

    prefix  [groups, L]    one forward per group, keeping its keys/values (with their autograd graph)
    suffix  [rows, S]      one forward per row, attending to its group's prefix keys/values

and the loss reads the prefix's last logits (which predict the first trained token) and the
suffix's. Backward flows through the shared keys/values into the prefix once per group, summing
its rows' gradients, which is exactly what the per-row computation sums: the loss, gradients and
log-probs equal the plain path's up to float rounding (`tests/test_shared_prefix.py`), in
~(L + group_size * S) / (group_size * (L + S)) of the tokens (0.4 for the example above).

A group too large for one micro-batch (a multi-turn batch: every row opens with the same system prompt and
first message) runs as several sub-groups, each sharing the prefix. Rows with no partner, whose shared part is
short, or that fit no sub-group of two within the activation budget go through the plain path
(`training.forward_backward`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache

from tinkerless.functions.training import picked_logits
from tinkerless.functions.training.chunked_logprobs import head_logprobs

# Below this many shared tokens a group is not worth its own two forwards.
MIN_SHARED_TOKENS = 8


@dataclass(frozen=True)
class PrefixGroup:
    rows: list[int]  # indices into the batch
    prefix: int  # L: tokens every row has in common, none of them trained


@dataclass(frozen=True)
class SharedMicroBatch:
    groups: list[PrefixGroup]

    @property
    def rows(self) -> list[int]:
        return [i for g in self.groups for i in g.rows]


def first_trained(mask: np.ndarray) -> int:
    hits = np.flatnonzero(mask)
    return int(hits[0]) if len(hits) else len(mask)


def find_prefix_groups(tokens: list[list[int]], masks: list[np.ndarray]) -> tuple[list[PrefixGroup], list[int]]:
    """Rows grouped by their untrained prefix (every token before the first trained one); the rest alone.

    The key is the prefix itself, so a group's rows agree on it token for token. A row needs at least
    one trained token after the prefix, and the prefix must be long enough to be worth sharing.
    """
    by_prefix: dict[tuple[int, ...], list[int]] = {}
    alone: list[int] = []
    for index, (ids, mask) in enumerate(zip(tokens, masks)):
        start = first_trained(mask)
        if start < MIN_SHARED_TOKENS or start >= len(ids):
            alone.append(index)
            continue
        by_prefix.setdefault(tuple(ids[:start]), []).append(index)
    groups = []
    for prefix, rows in by_prefix.items():
        if len(rows) < 2:
            alone.extend(rows)
        else:
            groups.append(PrefixGroup(rows, len(prefix)))
    return groups, sorted(alone)


def plan_shared(groups: list[PrefixGroup], lengths: list[int], micro_batch_size: int, token_budget: int
                ) -> tuple[list[SharedMicroBatch], list[int]]:
    """Groups packed into micro-batches within `micro_batch_size` rows and `token_budget` padded tokens.

    A group over either limit is cut into sub-groups of similar lengths that fit, each running the prefix once
    (a multi-turn batch whose rows all open with the same system prompt and first message is one group of
    every row); rows that fit no sub-group of two are handed back (they go the plain way, which can split them
    and recompute). Groups are sorted by size so that little goes into padding.
    """
    def cost(members: list[PrefixGroup]) -> int:
        width = max(g.prefix for g in members)
        suffix = max(lengths[i] - g.prefix for g in members for i in g.rows)
        return len(members) * width + sum(len(g.rows) for g in members) * suffix

    plan: list[SharedMicroBatch] = []
    rejected: list[int] = []
    fitting: list[PrefixGroup] = []
    for group in groups:
        parts, left_out = _split_to_fit(group, lengths, micro_batch_size, token_budget)
        fitting.extend(parts)
        rejected.extend(left_out)
    current: list[PrefixGroup] = []
    for group in sorted(fitting, key=lambda g: (-g.prefix, -max(lengths[i] for i in g.rows), g.rows[0])):
        trial = current + [group]
        if current and (sum(len(g.rows) for g in trial) > micro_batch_size or cost(trial) > token_budget):
            plan.append(SharedMicroBatch(current))
            trial = [group]
        current = trial
    if current:
        plan.append(SharedMicroBatch(current))
    return plan, sorted(rejected)


def _split_to_fit(group: PrefixGroup, lengths: list[int], micro_batch_size: int, token_budget: int
                  ) -> tuple[list[PrefixGroup], list[int]]:
    """`group` as sub-groups within `micro_batch_size` rows and `token_budget` tokens (longest rows first, so
    each sub-group pads little), and the rows left alone: a sub-group of one saves nothing over the plain way."""
    parts: list[PrefixGroup] = []
    left_out: list[int] = []
    chunk: list[int] = []

    def close() -> None:
        if len(chunk) >= 2:
            parts.append(PrefixGroup(list(chunk), group.prefix))
        else:
            left_out.extend(chunk)

    for row in sorted(group.rows, key=lambda i: (-lengths[i], i)):
        widest = lengths[chunk[0]] if chunk else lengths[row]  # the first row is the longest
        if chunk and (len(chunk) + 1 > micro_batch_size or group.prefix + (len(chunk) + 1) * (widest - group.prefix) > token_budget):
            close()
            chunk = []
        chunk.append(row)
    close()
    return parts, left_out


@dataclass
class SuffixFrame:
    """A micro-batch's rows from their group's prefix on: column c holds token `prefix + c`."""

    tokens: torch.Tensor  # [R, S] the suffix tokens, right-padded
    group_of_row: torch.Tensor  # [R] index of the row's group in the micro-batch
    starts: list[int]  # [R] the row's prefix length
    lengths: list[int]  # [R] real suffix lengths

    def field(self, values: list) -> torch.Tensor | None:
        """A per-token datum field (mask, advantages, ...) in this frame; None where any row lacks it."""
        if any(v is None for v in values):
            return None
        out = torch.zeros(self.tokens.shape, dtype=torch.float32)
        for row, (v, start) in enumerate(zip(values, self.starts)):
            part = np.asarray(v, dtype=np.float32)[start:]
            out[row, : len(part)] = torch.as_tensor(part)
        return out.to(self.tokens.device)


def suffix_frame(micro: SharedMicroBatch, tokens: list[list[int]], pad_id: int, device: torch.device) -> SuffixFrame:
    starts, groups_of, lengths = [], [], []
    for g_index, group in enumerate(micro.groups):
        for i in group.rows:
            starts.append(group.prefix)
            groups_of.append(g_index)
            lengths.append(len(tokens[i]) - group.prefix)
    out = torch.full((len(starts), max(lengths)), pad_id, dtype=torch.long)
    for row, (i, start) in enumerate(zip(micro.rows, starts)):
        out[row, : lengths[row]] = torch.as_tensor(np.asarray(tokens[i][start:], dtype=np.int64))
    return SuffixFrame(out.to(device), torch.tensor(groups_of, device=device), starts, lengths)


def suffix_logprobs(model, micro: SharedMicroBatch, tokens: list[list[int]], frame: SuffixFrame, mask: torch.Tensor,
                    *, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [R, S] of the frame's trained tokens (`mask` [R, S]; others 0), through shared prefixes.

    Column 0's token is predicted by the prefix's last position; column c > 0's by suffix position c - 1.
    Where the model's logits are its head's output (`picked_logits`) the head runs on the trained tokens only;
    otherwise on every column any row trains.
    """
    split = picked_logits.decoder_and_head(model)
    if split is None:
        return _logprobs_at_columns(model, micro, tokens, frame, trained_columns(mask), with_entropy=with_entropy)
    decoder, head = split
    device = frame.tokens.device
    prefixes = torch.tensor([g.prefix for g in micro.groups], device=device)
    prefix = decoder(input_ids=_prefix_ids(micro, tokens, device), use_cache=True)
    prefix_last = prefix.last_hidden_state[torch.arange(len(prefixes), device=device), prefixes - 1]  # [G, H]
    rows, columns = picked_logits.trained_pairs(mask, first=0)
    # hidden[r, c]: the state that predicts column c of row r
    hidden = prefix_last.index_select(0, frame.group_of_row).unsqueeze(1)
    if bool((columns > 0).any()):
        cache, attention, positions = _suffix_inputs(prefix.past_key_values, frame, int(prefixes.max()))
        body = decoder(input_ids=frame.tokens[:, :-1], attention_mask=attention[:, :-1], position_ids=positions[:, :-1],
                       past_key_values=cache, use_cache=False)
        hidden = torch.cat([hidden, body.last_hidden_state], dim=1)
    picked, entropy = head_logprobs(hidden[rows, columns], head, frame.tokens[rows, columns], with_entropy=with_entropy)
    shape = frame.tokens.shape
    return picked_logits.scattered(picked, rows, columns, shape), picked_logits.scattered(entropy, rows, columns, shape)


def _prefix_ids(micro: SharedMicroBatch, tokens: list[list[int]], device: torch.device) -> torch.Tensor:
    """[G, L] every group's prefix, right-padded to the longest."""
    prefix_ids = torch.zeros((len(micro.groups), max(g.prefix for g in micro.groups)), dtype=torch.long)
    for g_index, group in enumerate(micro.groups):
        prefix_ids[g_index, : group.prefix] = torch.as_tensor(np.asarray(tokens[group.rows[0]][: group.prefix], dtype=np.int64))
    return prefix_ids.to(device)


def _suffix_inputs(prefix_cache, frame: SuffixFrame, width: int) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
    """Each row's copy of its group's prefix keys/values, its attention mask and its positions.

    Each row attends to its own group's real prefix tokens (not the pads of a shorter prefix) and causally to
    its suffix; positions continue from its own prefix length.
    """
    device = frame.tokens.device
    cache = DynamicCache(ddp_cache_data=[
        (layer.keys.index_select(0, frame.group_of_row), layer.values.index_select(0, frame.group_of_row))
        for layer in prefix_cache.layers
    ])
    count, suffix_width = frame.tokens.shape
    attention = torch.zeros((count, width + suffix_width), dtype=torch.long)
    positions = torch.zeros((count, suffix_width), dtype=torch.long)
    for row, start in enumerate(frame.starts):
        attention[row, :start] = 1
        attention[row, width: width + frame.lengths[row]] = 1
        positions[row] = torch.arange(start, start + suffix_width)
    return cache, attention.to(device), positions.to(device)


def _logprobs_at_columns(model, micro: SharedMicroBatch, tokens: list[list[int]], frame: SuffixFrame,
                         columns: torch.Tensor, *, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The whole model's path: logits at every one of `columns` (sorted) in every row."""
    device = frame.tokens.device
    prefixes = [g.prefix for g in micro.groups]
    # Right-padded and causal, so a prefix's real tokens never see its pads: no mask, SDPA's fused kernel.
    last = sorted(set(p - 1 for p in prefixes))
    head = model(input_ids=_prefix_ids(micro, tokens, device), use_cache=True, logits_to_keep=torch.tensor(last, device=device))
    pick = torch.tensor([last.index(p - 1) for p in prefixes], device=device)
    prefix_logits = head.logits[torch.arange(len(prefixes), device=device), pick]  # [G, V]
    suffix_columns = columns[columns > 0] - 1
    logits_parts = []
    if bool((columns == 0).any()):
        logits_parts.append(prefix_logits.index_select(0, frame.group_of_row).unsqueeze(1))
    if len(suffix_columns):
        cache, attention, positions = _suffix_inputs(head.past_key_values, frame, max(prefixes))
        body = model(input_ids=frame.tokens, attention_mask=attention, position_ids=positions,
                     past_key_values=cache, use_cache=False, logits_to_keep=suffix_columns)
        logits_parts.append(body.logits)
    logits = torch.cat(logits_parts, dim=1)  # [R, len(columns), V]
    picked, picked_entropy = picked_logits.target_logprobs(logits, frame.tokens[:, columns], with_entropy=with_entropy)
    logprobs = torch.zeros(frame.tokens.shape, dtype=picked.dtype, device=device).index_copy(1, columns, picked)
    entropy = None
    if picked_entropy is not None:
        entropy = torch.zeros(frame.tokens.shape, device=device)
        entropy[:, columns] = picked_entropy
    return logprobs, entropy


def trained_columns(mask: torch.Tensor) -> torch.Tensor:
    """Sorted frame columns where any row has a trained token."""
    columns = torch.nonzero(mask.sum(0) > 0).squeeze(-1)
    return columns if len(columns) else torch.zeros(1, dtype=torch.long, device=mask.device)


def full_row(values: torch.Tensor, start: int, length: int) -> np.ndarray:
    """A row's frame values back in its own frame (zeros over the prefix)."""
    out = np.zeros(length, dtype=np.float32)
    out[start:] = values[: length - start].detach().cpu().numpy()
    return out
