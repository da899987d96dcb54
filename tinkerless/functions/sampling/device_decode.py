"""Several decode steps per host read: the draws, stops and token buffer stay on the device.

The one-step loop (`Batcher._forward`) reads every step's tokens back to the host to record them and
decide which rows go on: on a GPU that read waits for the whole step, so the next step's launches
cannot overlap it, and a graph replay is followed by idle time. `run_chunk` runs `steps` decode steps
of a block with no host read in between:

* each step's forward (a graph replay where the engine has one, else eager), then the draw on the
  device (`device_sampling.sample`: per-row settings and counter-based uniforms, so the tokens are the
  one-step loop's);
* stop tokens and the max-token budget are checked on the device: a row that stops stays in the batch
  until the chunk ends, masked from then on (its attention column is 0, so its later steps count for no
  row and its kept keys/values end where the one-step loop's end);
* tokens, log-probs (and top log-probs when asked) go to device buffers, read once at the chunk's end
  together with each row's finiteness and KV length; then every job records its rows' tokens step by step
  exactly as the one-step loop would have (streams receive them then), finished rows leave, and the block
  carries on (or takes joining rows at the batcher's next step).

A job whose draws need the host between steps (a logits processor over the tokens drawn so far, such as a
structured-output grammar) says so with a true `needs_host_each_step` attribute: a block holding one runs the
one-step loop (`eligible`).

What it costs: a row that stops mid-chunk is computed until the chunk ends (at most steps-1 wasted
forwards of its row), and rows waiting to join wait up to a chunk. `steps` is the batcher's
`decode_steps` (TINKERLESS_DECODE_STEPS; 8 on CUDA, 1, the one-step loop, elsewhere): what a GPU gains
is measured by bench/gpu_shapes.py.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from tinkerless.functions.sampling.blocks import block_settings
from tinkerless.functions.sampling.device_sampling import check_finite, counter_uniforms, sample

if TYPE_CHECKING:
    from tinkerless.functions.sampling.batcher import Batcher
    from tinkerless.functions.sampling.blocks import _Block

ENV_STEPS = "TINKERLESS_DECODE_STEPS"
CUDA_STEPS = 8


def default_steps(device: torch.device) -> int:
    """Decode steps per host read for an engine on `device` (TINKERLESS_DECODE_STEPS overrides)."""
    configured = os.environ.get(ENV_STEPS, "").strip()
    if configured:
        return max(1, int(configured))
    return CUDA_STEPS if device.type == "cuda" else 1


def eligible(block: _Block) -> bool:
    """Whether every job of the block can draw several steps without the host (see the module docstring)."""
    return not any(getattr(m.job, "needs_host_each_step", False) for m in block.members)


def run_chunk(batcher: Batcher, block: _Block, steps: int, logits_of) -> _Block | None:
    """Decode up to `steps` tokens for every row of `block` with one host read; record them in the jobs.
    `logits_of(block, policies)`: one forward's last-position logits (float32, rows x vocab). Returns the
    block of the rows that go on (None when none does), as `Batcher._draw` does."""
    members = block.members
    device = block.input.device
    counts = [m.job.active_rows for m in members]
    rows = sum(counts)
    budgets = [m.job.sampling.max_tokens - p for m in members for p in m.job.positions()]
    steps = max(1, min(steps, max(budgets)))
    policies = [m.policy for m, count in zip(members, counts) for _ in range(count)]
    settings = block_settings(members, device)
    positions = torch.tensor([p for m in members for p in m.job.positions()], dtype=torch.long, device=device)
    budget = torch.tensor(budgets, dtype=torch.long, device=device)
    stop_table = _stop_table(members, counts, device)
    top_k = max((m.job.top_logprobs for m in members), default=0)

    alive = torch.ones(rows, dtype=torch.bool, device=device)
    finite = torch.ones(rows, dtype=torch.bool, device=device)
    tokens = torch.zeros((rows, steps), dtype=torch.long, device=device)
    logprobs = torch.zeros((rows, steps), dtype=torch.float32, device=device)
    tops = None
    # every step's uniforms at once (a hash of (row, position) only): one batch of small integer ops per chunk
    uniforms = None if settings.all_greedy else counter_uniforms(
        settings.keys, positions[:, None] + torch.arange(steps, device=device)[None, :])
    for step in range(steps):
        logits = logits_of(block, policies)
        draw = sample(logits, settings, None, uniforms[:, step] if uniforms is not None else None)
        tokens[:, step] = draw.tokens
        logprobs[:, step] = draw.logprobs
        if top_k:
            top = torch.log_softmax(logits, dim=-1).topk(min(top_k, logits.shape[-1]), dim=-1)
            if tops is None:
                tops = (top.indices.new_zeros((rows, steps, top.indices.shape[1])),
                        top.values.new_zeros((rows, steps, top.values.shape[1])))
            tops[0][:, step], tops[1][:, step] = top.indices, top.values
        finite &= draw.finite | ~alive  # a stopped row's later (masked) steps are never recorded
        stopped = (step + 1 >= budget)
        if stop_table is not None:
            stopped |= (draw.tokens[:, None] == stop_table).any(dim=1)
        alive = alive & ~stopped
        block.input = draw.tokens[:, None]
        block.attention = torch.cat([block.attention, alive[:, None].to(block.attention.dtype)], dim=1)
        block.positions = block.positions + 1
        batcher.decoded_tokens += rows
    batcher.most_jobs = max(batcher.most_jobs, len(members))
    batcher.chunks += 1

    # The one host read of the chunk (tokens are exact in float64, log-probs are float32 values).
    summary = torch.stack([finite.double(), alive.double(), block.attention.sum(dim=1).double()], dim=1)
    host = torch.cat([tokens.double(), logprobs.double(), summary], dim=1).tolist()
    check_finite(torch.tensor([row[-3] == 1.0 for row in host]))
    host_tops = (tops[0].tolist(), tops[1].tolist()) if tops is not None else None
    return _record(block, members, counts, host, steps, host_tops)


def _stop_table(members, counts: list[int], device: torch.device) -> torch.Tensor | None:
    """(rows, most stop ids of a member) int64: each row's stop token ids, padded with -1 (never a token)."""
    widest = max((len(m.job.stop_ids) for m in members), default=0)
    if not widest:
        return None
    table = []
    for member, count in zip(members, counts):
        ids = sorted(member.job.stop_ids)
        table.extend([ids + [-1] * (widest - len(ids))] * count)
    return torch.tensor(table, dtype=torch.long, device=device)


def _record(block: _Block, members, counts: list[int], host: list[list[float]], steps: int, tops) -> _Block | None:
    """Each job records its rows' tokens step by step (as the one-step loop would); rows that finished leave
    the block (a row with a session leaves its keys/values there first)."""
    from tinkerless.functions.sampling.batcher import _row_layers

    keep: list[int] = []
    offset = 0
    for member, count in zip(members, counts):
        job = member.job
        live = list(range(offset, offset + count))  # block rows of the job's active rows, in its order
        for step in range(steps):
            if not live:
                break
            kept, _ = job.record([int(host[r][step]) for r in live], [host[r][steps + step] for r in live],
                                 [list(zip(tops[0][r][step], tops[1][r][step])) for r in live] if tops else None)
            for position in sorted(set(range(len(live))) - set(kept)):
                row = live[position]
                job.finished(position, int(host[row][-1]),
                             lambda row=row: _row_layers(block.cache, row, block.attention[row]))
            live = [live[k] for k in kept]
        if live and any(host[r][-2] != 1.0 for r in live):
            raise RuntimeError("the device decode and the job disagree on which rows stopped (a bug)")
        keep.extend(live)
        offset += count
    block.members = [m for m in members if not m.job.done]
    if not keep:
        return None  # the KV cache goes now, not when the block is dropped
    if len(keep) < offset:
        index = torch.tensor(keep, device=block.input.device)
        block.cache.batch_select_indices(index)
        block.attention = block.attention[index]
        block.positions = block.positions[index]
        block.input = block.input[index]
    return block
