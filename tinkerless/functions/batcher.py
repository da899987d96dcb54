"""Continuous batching: every concurrent generate call on one engine decodes in one shared batch.

Each call (a Tinker `sample`, `/v1/call/sample`, a rollout's turn) registers its rows as
`GenerationJob`s and then drives the shared batch until its own rows are done:

* **Join at the next step.** A registered job waits until the driving thread's next step,
  where it is prefilled on its own (so its prompt never changes other rows' results) and its
  KV cache is merged into the running batch, left-padded to the longer cache; padding is
  masked and every row carries its own positions, so it takes no part in any row's result.
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

from tinkerless.functions.slicing import join_due, slice_due, yield_slice
from tinkerless.wire.messages import SamplingParams

if TYPE_CHECKING:
    from tinkerless.functions.engine import Generation, GenerationJob, TransformersEngine

BASE_ADAPTER = "__base__"  # peft's name for "no adapter" in a mixed batch


@dataclass
class _Member:
    job: GenerationJob
    policy: str | None


class Batcher:
    """The shared running batch of one `TransformersEngine` (see the module docstring)."""

    def __init__(self, engine: TransformersEngine):
        self.engine = engine
        self._lock = threading.RLock()
        self._waiting: list[_Member] = []  # registered, to be prefilled at the next step
        self._running: list[_Member] = []  # in the batch; their active rows in this order
        self._cache = None
        self._input: torch.Tensor | None = None
        self._attention: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self.steps = 0  # shared decode steps run (a statistic for tests and benchmarks)
        self.widest = 0  # the most rows one step has decoded together
        self.most_jobs = 0  # the most jobs (parts of requests) one step has decoded together

    @property
    def rows(self) -> int:
        return sum(m.job.active_rows for m in self._running)

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, *, policy: str | None, seed: int
    ) -> list[Generation]:
        engine = self.engine
        jobs = [engine.start(prompts[start:end], sampling, seed=seed, first_index=start)
                for start, end in engine.batches(prompts, sampling.max_tokens)]
        with self._lock:
            self._waiting.extend(_Member(job, policy) for job in jobs if not job.done)
        while not all(job.done for job in jobs):
            with torch.no_grad():
                while True:
                    self.step()
                    if all(job.done for job in jobs) or slice_due() or join_due():
                        break
            if not all(job.done for job in jobs):
                yield_slice()
        return [generation for job in jobs for generation in job.results()]

    # -- one shared step -------------------------------------------------------------

    def step(self) -> None:
        """Decode one token for every running row, then prefill and merge the jobs that fit."""
        with self._lock:
            if self._running:
                self._decode()
            self._admit()

    def _admit(self) -> None:
        limit = self.engine.max_batch_size
        rows = self.rows
        while self._waiting and (rows == 0 or rows + self._waiting[0].job.active_rows <= limit):
            member = self._waiting.pop(0)
            with self.engine.activate_policy(member.policy):
                member.job.advance(self.engine.model)  # prefill alone: the first token is drawn here
            if member.job.done:
                continue
            self._merge(member)
            rows += member.job.active_rows

    def _merge(self, member: _Member) -> None:
        cache, next_input, attention, positions = member.job.take_state()
        if not self._running:
            self._cache, self._input, self._attention, self._positions = cache, next_input, attention, positions
        else:
            width = max(self._attention.shape[1], attention.shape[1])
            for mine, theirs in zip(self._cache.layers, cache.layers):
                mine.keys = torch.cat([_left_pad(mine.keys, width - 1, -2), _left_pad(theirs.keys, width - 1, -2)])
                mine.values = torch.cat([_left_pad(mine.values, width - 1, -2), _left_pad(theirs.values, width - 1, -2)])
            self._attention = torch.cat([_left_pad(self._attention, width, -1), _left_pad(attention, width, -1)])
            self._input = torch.cat([self._input, next_input])
            self._positions = torch.cat([self._positions, positions])
        self._running.append(member)
        self.widest = max(self.widest, self.rows)

    def _decode(self) -> None:
        engine = self.engine
        kwargs = {}
        policies = {m.policy for m in self._running}
        if len(policies) == 1:
            context = engine.activate_policy(next(iter(policies)))
        else:  # rows of several adapters: one forward, each row through its own
            context = contextlib.nullcontext()
            kwargs["adapter_names"] = [engine.adapter_name(m.policy) for m in self._running
                                       for _ in range(m.job.active_rows)]
        with context:
            out = engine.model(
                input_ids=self._input, attention_mask=self._attention, position_ids=self._positions,
                past_key_values=self._cache, use_cache=True, logits_to_keep=1, **kwargs,
            )
        self._cache = out.past_key_values
        self.steps += 1
        self.widest = max(self.widest, self._input.shape[0])
        self.most_jobs = max(self.most_jobs, len(self._running))
        logits = out.logits[:, -1, :].float()
        keep: list[int] = []
        picks: list[int] = []
        offset = 0
        for member in self._running:
            count = member.job.active_rows
            kept, drawn = member.job.choose(logits[offset : offset + count])
            keep.extend(offset + k for k in kept)
            picks.extend(drawn)
            offset += count
        self._running = [m for m in self._running if not m.job.done]
        if not keep:
            self._cache = self._input = self._attention = self._positions = None
            return
        if len(keep) < offset:  # finished rows leave the batch
            index = torch.tensor(keep, device=self._input.device)
            self._cache.batch_select_indices(index)
            self._attention = self._attention[index]
            self._positions = self._positions[index]
        self._input = torch.tensor(picks, dtype=torch.long, device=self._attention.device)[:, None]
        self._attention = torch.cat([self._attention, self._attention.new_ones((len(keep), 1))], dim=1)
        self._positions = self._positions[:, -1:] + 1


def _left_pad(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """`tensor` padded with zeros on the left of `dim` to `width` (masked positions: their values never count)."""
    missing = width - tensor.shape[dim]
    if missing <= 0:
        return tensor
    pad = [0, 0] * (-dim - 1) + [missing, 0]
    return F.pad(tensor, pad)
