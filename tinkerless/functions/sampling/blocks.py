"""The rows one forward decodes (`_Block`), and the work on them that runs no model.

`batcher` decides who joins the shared batch and runs the forwards; this module keeps the batch's
tensors in order around them:

* **Layout.** A block's rows are its members' rows in order (`_Member`: one `GenerationJob` each),
  with one KV cache, next input, attention mask and positions. Rows that joined later are merged in
  left-padded to the longer cache (`_Block.extend`); the per-length-group prefills become one block
  (`_assemble`), and rows that shared one prefill get their own copies (`_replicate`). Padding is
  masked (zeros, so finite), so it counts for no row.
* **The draw across members.** Every row's next token is drawn in one draw over the block, with
  per-row settings and each row's own counter-based uniform (`_draw_block`); the top log-probs are
  computed once for the block (`_top_block`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from tinkerless.functions.sampling.device_sampling import DrawSettings, draw_rows
from tinkerless.functions.sampling.constraints import mask_logits
from tinkerless.functions.sampling.graphed_decode import PooledCache
from tinkerless.functions.sampling.kv_cache import growing_cache, stack_left_padded

if TYPE_CHECKING:
    from tinkerless.functions.sampling.engine import GenerationJob


@dataclass
class _Member:
    job: GenerationJob
    policy: str | None
    reach: int  # KV positions its rows may need: longest prompt + max_tokens


@dataclass
class _Block:
    """Rows decoded by one forward: their members (in row order), KV cache, next input, mask, positions."""
    members: list[_Member]
    cache: DynamicCache | None
    input: torch.Tensor
    attention: torch.Tensor
    positions: torch.Tensor

    @property
    def rows(self) -> int:
        return sum(m.job.active_rows for m in self.members)

    def extend(self, other: _Block, reserve: int) -> None:
        """Append `other`'s rows; the shorter KV cache is left-padded (masked: it counts for no row). `reserve`:
        the room to allocate beyond it (the batcher's `_reserve` of both blocks' members, which owns that policy)."""
        width = max(self.attention.shape[1], other.attention.shape[1])
        capacity = width - 1 + reserve  # one copy into buffers with room to decode
        if isinstance(self.cache, PooledCache):  # out of the graphed decoder's pool: its next step re-pools the block
            self.cache = self.cache.to_growing()
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.adopt(stack_left_padded([mine.keys, theirs.keys], width - 1, capacity),
                       stack_left_padded([mine.values, theirs.values], width - 1, capacity), width - 1)
        self.attention = torch.cat([_left_pad(self.attention, width, -1), _left_pad(other.attention, width, -1)])
        self.input = torch.cat([self.input, other.input])
        self.positions = torch.cat([self.positions, other.positions])
        self.members += other.members


def _draw_block(members: list[_Member], logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """Each row's token and its log-prob, in row order: one draw over the whole block, whatever the members'
    settings (they are per-row tensors: `device_sampling.DrawSettings`), each row with the uniform of its own
    (key, position), so it draws exactly what it would alone. Rows go to Python lists once per block. A constrained
    row's disallowed tokens are masked first (`constraints.mask_logits`), in the same batch."""
    logits = mask_logits(logits, [c for member in members for c in member.job.row_constraints()])
    picks, picked = draw_rows(logits, block_settings(members, logits.device),
                              torch.tensor([p for m in members for p in m.job.positions()], device=logits.device))
    return picks.tolist(), picked.tolist()


def block_settings(members: list[_Member], device: torch.device) -> DrawSettings:
    """The draw settings of the members' active rows, in row order."""
    return DrawSettings.of([k for m in members for k in m.job.keys()],
                           [m.job.sampling for m in members for _ in range(m.job.active_rows)], device)


def _top_block(members: list[_Member], logits: torch.Tensor) -> list[list[tuple[int, float]]] | None:
    """Per row, the most likely tokens and their log-probs (untempered, as the drawn tokens' log-probs), as
    many as the block's members ask for at most (each job keeps its own k); None when none asks."""
    k = max((m.job.top_logprobs for m in members), default=0)
    if not k:
        return None
    top = torch.log_softmax(logits, dim=-1).topk(min(k, logits.shape[-1]), dim=-1)
    return [list(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]


def _assemble(parts: list[tuple[_Block, torch.Tensor]], groups: list[list[int]], count: int) -> tuple[_Block, torch.Tensor]:
    """One block (and logits) of `count` rows from per-group prefills: group g's rows go to the indices
    `groups[g]`, every row's cache left-padded to the widest (masked)."""
    width = max(block.attention.shape[1] for block, _ in parts)
    first, first_logits = parts[0]
    device = first_logits.device
    attention = first.attention.new_zeros((count, width))
    positions = first.positions.new_zeros((count, 1))
    logits = first_logits.new_empty((count, first_logits.shape[1]))
    capacity = width + max(layer.capacity - layer.length for block, _ in parts for layer in block.cache.layers[:1])
    layers = [(layer.keys.new_empty((count, layer.keys.shape[1], capacity, layer.keys.shape[3])),
               layer.values.new_empty((count, layer.values.shape[1], capacity, layer.values.shape[3])))
              for layer in first.cache.layers]
    for (block, part_logits), group in zip(parts, groups):
        index = torch.tensor(group, device=device)
        own = block.attention.shape[1]
        attention[index, width - own :] = block.attention
        positions[index] = block.positions[:, -1:]
        logits[index] = part_logits
        for (keys, values), layer in zip(layers, block.cache.layers):
            keys[index, :, : width - own] = 0  # padding: masked, but must be finite
            values[index, :, : width - own] = 0
            keys[index, :, width - own : width] = layer.keys
            values[index, :, width - own : width] = layer.values
    block = _Block([], growing_cache(layers, width), first.input.new_zeros((count, 1)), attention, positions)
    return block, logits


def _replicate(block: _Block, logits: torch.Tensor, source: list[int]) -> tuple[_Block, torch.Tensor]:
    """The block with row i a copy of row source[i] (rows that share one prefill)."""
    index = torch.tensor(source, device=logits.device)
    cache = block.cache
    cache.batch_select_indices(index)  # GrowingLayer: the copies keep their room to decode into
    block = _Block([], cache, block.input[index], block.attention[index], block.positions[index])
    return block, logits[index]


def _left_pad(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """`tensor` padded with zeros on the left of `dim` to `width` (masked positions: their values never count)."""
    missing = width - tensor.shape[dim]
    if missing <= 0:
        return tensor
    pad = [0, 0] * (-dim - 1) + [missing, 0]
    return F.pad(tensor, pad)
