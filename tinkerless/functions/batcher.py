"""Continuous batching: every concurrent generate call on one engine decodes in one shared batch.

Each call (a Tinker `sample`, `/v1/call/sample`, a rollout's turn) registers its rows as
`GenerationJob`s and then drives the shared batch until its own rows are done:

* **Join at the next step.** Registered jobs wait for the driving thread's next step, where
  they are prefilled together in a forward of their own (so a prompt never changes the running
  rows' results) and their KV cache is merged into the running batch, left-padded to the longer
  cache; padding is masked and every row carries its own positions, so it takes no part in any
  row's result.
* **Leave when finished.** A row that stops is dropped from the cache at once.
* **Mixed policies in one forward.** Rows of different LoRA adapters (and of the base model)
  go through one forward with peft's per-row `adapter_names`; a batch of one policy simply
  activates it.
* **Any call drives.** The server runs one model call at a time (`tinkerless.server.scheduler`).
  Whichever generate call holds the model steps every row, its own and the others'; after each
  step it pauses (`yield_slice`) when a not-yet-started call is queued (`join_due`: so that call
  can start and join) or when its time slice is up. A call whose rows another call finished
  returns at its next turn.
* **Reproducible.** Rows draw from their own generators seeded by (seed, row index), so a
  request gives the same tokens alone or batched with any others (up to floating-point
  differences of batched matrix products).

Outside a server several threads may call `generate` at once (a local thread pool): a lock
makes each step atomic, so they batch too.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from tinkerless.functions.slicing import join_due, slice_due, yield_slice
from tinkerless.wire.messages import SamplingParams

if TYPE_CHECKING:
    from tinkerless.functions.engine import Generation, GenerationJob, TransformersEngine

BASE_ADAPTER = "__base__"  # peft's name for "no adapter" in a mixed batch


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

    def extend(self, other: _Block) -> None:
        """Append `other`'s rows; the shorter KV cache is left-padded (masked: it counts for no row)."""
        width = max(self.attention.shape[1], other.attention.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys = torch.cat([_left_pad(mine.keys, width - 1, -2), _left_pad(theirs.keys, width - 1, -2)])
            mine.values = torch.cat([_left_pad(mine.values, width - 1, -2), _left_pad(theirs.values, width - 1, -2)])
        self.attention = torch.cat([_left_pad(self.attention, width, -1), _left_pad(other.attention, width, -1)])
        self.input = torch.cat([self.input, other.input])
        self.positions = torch.cat([self.positions, other.positions])
        self.members += other.members


class Batcher:
    """The shared running batch of one `TransformersEngine` (see the module docstring)."""

    def __init__(self, engine: TransformersEngine):
        self.engine = engine
        self._lock = threading.RLock()
        self._waiting: list[_Member] = []  # registered, to be prefilled at the next step
        self._running: _Block | None = None
        # False: a generation does not pause for queued calls to join it (they wait for it to end or for
        # a time slice), so calls decode one after another: the "before" of bench/batching.py.
        self.join_queued_calls = True
        self.steps = 0  # forwards run, prefills included (a statistic for tests and benchmarks)
        self.widest = 0  # the most rows one forward has decoded together
        self.most_jobs = 0  # the most jobs (parts of requests) one forward has decoded together

    @property
    def rows(self) -> int:
        return self._running.rows if self._running is not None else 0

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, *, policy: str | None, seed: int
    ) -> list[Generation]:
        engine = self.engine
        jobs = [engine.start(prompts[start:end], sampling, seed=seed, first_index=start)
                for start, end in engine.batches(prompts, sampling.max_tokens)]
        with self._lock:
            self._waiting.extend(_Member(job, policy, job.prompt_width + sampling.max_tokens)
                                 for job in jobs if not job.done)
        if self.join_queued_calls and join_due():
            yield_slice()  # let the calls queued with this one register too: one prefill admits them all
        while not all(job.done for job in jobs):
            with torch.no_grad():
                while True:
                    self.step()
                    if all(job.done for job in jobs) or slice_due() or (self.join_queued_calls and join_due()):
                        break
            if not all(job.done for job in jobs):
                yield_slice()
        for job in jobs:
            if job.error is not None:
                raise job.error
        return [generation for job in jobs for generation in job.results()]

    # -- one shared step -------------------------------------------------------------

    def step(self) -> None:
        """Decode one token for every running row, then prefill (in one forward) the waiting jobs that fit."""
        with self._lock:
            if self._running is not None:
                self._running = self._forward_or_fail(self._running)
            joining = self._take_waiting()
            if joining:
                block = self._forward_or_fail(self._prefill_block(joining))
                if block is not None and self._running is None:
                    self._running = block
                elif block is not None:
                    self._running.extend(block)

    def _take_waiting(self) -> list[_Member]:
        """The waiting jobs that fit in max_batch_size rows and max_batch_positions KV positions (rows x the
        longest reach: shorter rows are left-padded to it), in arrival order; at least one into an empty batch."""
        engine, taken = self.engine, []
        members = self._running.members if self._running is not None else []
        rows, reach = self.rows, max((m.reach for m in members), default=0)
        while self._waiting:
            member = self._waiting[0]
            grown_rows, grown_reach = rows + member.job.active_rows, max(reach, member.reach)
            if rows and (grown_rows > engine.max_batch_size or grown_rows * grown_reach > engine.max_batch_positions):
                break
            taken.append(self._waiting.pop(0))
            rows, reach = grown_rows, grown_reach
        return taken

    def _forward_or_fail(self, block: _Block) -> _Block | None:
        """`_forward`; if it raises, every job of the block fails with that error (each caller raises it),
        so one bad step cannot wedge the shared batch for the others."""
        try:
            return self._forward(block)
        except Exception as exc:  # noqa: BLE001 - handed to the calls whose rows were in the block
            for member in block.members:
                member.job.fail(exc)
            return None

    def _prefill_block(self, members: list[_Member]) -> _Block:
        inputs = [m.job.prompt_inputs() for m in members]
        width = max(ids.shape[1] for ids, _, _ in inputs)
        return _Block(
            members, None,
            torch.cat([_left_pad(ids, width, -1) for ids, _, _ in inputs]),  # pads are masked: any id does
            torch.cat([_left_pad(mask, width, -1) for _, mask, _ in inputs]),
            torch.cat([_left_pad(pos, width, -1) for _, _, pos in inputs]),
        )

    def _forward(self, block: _Block) -> _Block | None:
        """One forward over `block` (a prefill when it has no cache yet), one token drawn per row;
        finished rows leave. None when no row is left."""
        engine = self.engine
        kwargs = {}
        policies = {m.policy for m in block.members}
        if len(policies) == 1:
            context = engine.activate_policy(next(iter(policies)))
        else:  # rows of several adapters: one forward, each row through its own
            context = contextlib.nullcontext()
            kwargs["adapter_names"] = [engine.adapter_name(m.policy) for m in block.members
                                       for _ in range(m.job.active_rows)]
        with context:
            out = engine.model(
                input_ids=block.input, attention_mask=block.attention, position_ids=block.positions,
                past_key_values=block.cache if block.cache is not None else DynamicCache(),
                use_cache=True, logits_to_keep=1, **kwargs,
            )
        block.cache = out.past_key_values
        self.steps += 1
        self.widest = max(self.widest, block.input.shape[0])
        self.most_jobs = max(self.most_jobs, len(block.members))
        logits = out.logits[:, -1, :].float()
        keep: list[int] = []
        picks: list[int] = []
        offset = 0
        for member in block.members:
            count = member.job.active_rows
            kept, drawn = member.job.choose(logits[offset : offset + count])
            keep.extend(offset + k for k in kept)
            picks.extend(drawn)
            offset += count
        block.members = [m for m in block.members if not m.job.done]
        if not keep:
            return None  # the KV cache goes now, not when the block is dropped
        if len(keep) < offset:  # finished rows leave the batch: nothing is decoded (or padded) after them
            index = torch.tensor(keep, device=block.input.device)
            block.cache.batch_select_indices(index)
            block.attention = block.attention[index]
            block.positions = block.positions[index]
        block.input = torch.tensor(picks, dtype=torch.long, device=block.attention.device)[:, None]
        block.attention = torch.cat([block.attention, block.attention.new_ones((len(keep), 1))], dim=1)
        block.positions = block.positions[:, -1:] + 1
        return block


def _left_pad(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """`tensor` padded with zeros on the left of `dim` to `width` (masked positions: their values never count)."""
    missing = width - tensor.shape[dim]
    if missing <= 0:
        return tensor
    pad = [0, 0] * (-dim - 1) + [missing, 0]
    return F.pad(tensor, pad)
