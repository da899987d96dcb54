"""Continuous batching: every concurrent generate call on one engine decodes in one shared batch.

Each call (a Tinker `sample`, `/v1/call/sample`, a rollout's turn) registers its rows as
`GenerationJob`s and then drives the shared batch until its own rows are done:

* **Join at the next step.** Registered jobs wait for the driving thread's next step, where
  they are prefilled in forwards of their own (so a prompt never changes the running rows'
  results) and their KV cache is merged into the running batch, left-padded to the longer
  cache; padding is masked and every row carries its own positions, so it takes no part in any
  row's result.
* **Little prefill of padding.** The joining rows are prefilled in groups of similar length
  (`kv_cache.length_buckets`), each left-padded only to its own longest row, so the padding
  computed stays within `max_prefill_padding` of the real tokens (0: none at all).
* **Only what is new.** A row that continues a `KVSession` starts from its kept keys/values
  and prefills only the prompt tokens after them; when it finishes, its keys/values go back
  into the session for the conversation's next turn.
* **Leave when finished.** A row that stops is dropped from the cache at once.
* **Mixed policies in one forward.** Rows of different LoRA adapters (and of the base model)
  go through one forward with the adapters' weights stacked and grouped matmuls (`multi_lora`;
  peft's per-row `adapter_names` where a layer is not a plain LoRA linear); a batch of one
  policy simply activates it.
* **Any call drives.** The server runs one model call at a time (`tinkerless.server.scheduler`).
  Whichever generate call holds the model steps every row, its own and the others'; after each
  step it pauses (`yield_slice`) when a not-yet-started call is queued (`join_due`: so that call
  can start and join) or when its time slice is up. A call whose rows another call finished
  returns at its next turn.
* **Reproducible.** A row's draws hash its seed (from the request's seed and row index) and its
  token position only (`device_sampling`), so a request gives the same tokens alone or batched
  with any others (up to floating-point differences of batched matrix products).

Outside a server several threads may call `generate` at once (a local thread pool): a lock
makes each step atomic, so they batch too.

The batch's tensors between forwards (rows merged, assembled, replicated; the draw across members)
are `blocks`' work: this module decides who joins and runs the forwards.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING

import torch

from tinkerless.functions.sampling.blocks import _assemble, _Block, _draw_block, _Member, _replicate, _top_block
from tinkerless.functions.sampling.device_decode import default_steps, eligible, run_chunk
from tinkerless.functions.sampling.graphed_decode import PooledCache
from tinkerless.functions.sampling.kv_cache import KVSession, growing_cache, length_buckets, row_layers, stack_left_padded
from tinkerless.functions.sampling.multi_lora import StackedAdapters, grouped_single
from tinkerless.functions.sampling.slicing import join_due, slice_due, yield_slice
from tinkerless.wire.messages import SamplingParams

if TYPE_CHECKING:
    from tinkerless.functions.sampling.engine import Generation, GenerationJob, TransformersEngine, _Row
    from tinkerless.functions.sampling.token_stream import TokenStream

BASE_ADAPTER = "__base__"  # peft's name for "no adapter" in a mixed batch


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
        # Decode steps per host read (`device_decode`): 1 is the one-step loop (the CPU's default).
        self.decode_steps = default_steps(engine.device)
        self.stacked = StackedAdapters()  # mixed-adapter blocks' stacked LoRA weights (`multi_lora`)
        # Statistics for tests and benchmarks.
        self.steps = 0  # forwards run, prefills included
        self.widest = 0  # the most rows one forward has decoded together
        self.most_jobs = 0  # the most jobs (parts of requests) one forward has decoded together
        self.prefilled_tokens = 0  # prompt tokens computed by prefills
        self.padding_tokens = 0  # padding positions computed by prefills (left-padding within a length group)
        self.cached_tokens = 0  # prompt tokens not prefilled: their keys/values came from a kept session
        self.decoded_tokens = 0  # tokens fed by decode steps
        self.chunks = 0  # runs of several decode steps read back at once (`device_decode`)

    @property
    def rows(self) -> int:
        return self._running.rows if self._running is not None else 0

    def policies_in_use(self) -> set[str | None]:
        """Policies of the generations not finished yet (running, waiting, or paused between time slices)."""
        with self._lock:
            members = [*self._waiting, *(self._running.members if self._running is not None else [])]
        return {m.policy for m in members if not m.job.done}

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, *, policy: str | None, seed: int,
        sessions: list[KVSession] | None = None, stream: TokenStream | None = None, top_logprobs: int = 0,
        row_seeds: list[int] | None = None, constraints: list | None = None,
    ) -> list[Generation]:
        engine = self.engine
        if sessions is not None and len(sessions) != len(prompts):
            raise ValueError(f"{len(sessions)} sessions for {len(prompts)} prompts")
        if row_seeds is not None and len(row_seeds) != len(prompts):
            raise ValueError(f"{len(row_seeds)} row seeds for {len(prompts)} prompts")
        jobs = [engine.start(prompts[start:end], sampling, seed=seed, first_index=start, policy=policy,
                             sessions=sessions[start:end] if sessions is not None else None,
                             stream=stream, top_logprobs=top_logprobs,
                             row_seeds=row_seeds[start:end] if row_seeds is not None else None,
                             constraints=constraints[start:end] if constraints is not None else None)
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
        """Decode one token for every running row, then prefill the waiting jobs that fit (grouped by length)."""
        with self._lock:
            if self._running is not None:
                self._running = self._guarded(self._running.members, self._forward, self._running)
            joining = self._take_waiting()
            if joining:
                block = self._guarded(joining, self._prefill, joining)
                if block is not None and self._running is None:
                    self._running = block
                elif block is not None:
                    self._running.extend(block, _reserve(self._running.members + block.members))

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

    def _guarded(self, members: list[_Member], forward, *args) -> _Block | None:
        """`forward(*args)`; if it raises, every job of `members` fails with that error (each caller raises it),
        so one bad step cannot wedge the shared batch for the others."""
        try:
            return forward(*args)
        except Exception as exc:  # noqa: BLE001 - handed to the calls whose rows were in the block
            for member in members:
                member.job.fail(exc)
            return None

    def _run_model(self, policies: list[str | None], **inputs):
        """One forward of rows whose policies are `policies` (one per row)."""
        engine, kwargs = self.engine, {}
        adapters = {policy: engine.adapter_name(policy) for policy in set(policies)}
        names = [adapters[p] for p in policies]
        if len(set(adapters.values())) == 1:
            context = engine.activate_policy(policies[0])
        else:  # rows of several adapters: one forward, each row through its own
            # peft honours adapter_names only with adapters enabled (after a base-model forward they are off):
            # activating one of the batch's adapters enables them (once: a switch to the active one is skipped).
            context = engine.activate_policy(next(p for p, name in zip(policies, names) if name != BASE_ADAPTER))
            grouped = self.stacked.rows(engine.model, names)  # stacked adapters, grouped matmuls (`multi_lora`)
            if grouped is not None:
                context = _both(context, grouped)
            else:
                kwargs["adapter_names"] = names
        # Only the last position's logits. A prefill's last column as a slice is a strided view, for which
        # torch's linear expands the LM head's weight per row (bmm): an index tensor gathers it contiguous first.
        width = inputs["input_ids"].shape[1]
        keep = 1 if width == 1 else torch.tensor([width - 1], device=inputs["input_ids"].device)
        with context:
            out = engine.model(**inputs, use_cache=True, logits_to_keep=keep, **kwargs)
        self.steps += 1
        self.widest = max(self.widest, inputs["input_ids"].shape[0])
        return out

    def _prefill(self, members: list[_Member]) -> _Block | None:
        """Prefill the members' rows, grouped by the length left to prefill so that padding stays within
        `max_prefill_padding` (one forward per group, each left-padded to its longest row; a row continuing
        a kept session starts from its cached keys/values), then draw each row's first token."""
        rows = [(m, row) for m in members for row in m.job.prefill_rows()]
        # Rows with the same prompt and policy and nothing cached (a group's samples of one task) are prefilled
        # once; each copy then decodes on its own, with its own seed.
        unique: list[tuple[_Member, _Row]] = []
        source: list[int] = []  # for each row, the unique row that computes its prefill
        seen: dict[object, int] = {}
        for i, (member, row) in enumerate(rows):
            key = (member.policy, tuple(row.prompt)) if row.start is None else i
            if key not in seen:
                seen[key] = len(unique)
                unique.append((member, row))
            else:
                row.shared_prefill = True
            source.append(seen[key])
        groups = length_buckets([len(row.to_prefill) for _, row in unique], self.engine.max_prefill_padding)
        parts = [self._prefill_group([unique[i] for i in group]) for group in groups]
        self.most_jobs = max(self.most_jobs, len(members))
        order = [i for group in groups for i in group]
        if len(parts) == 1 and order == sorted(order):
            block, logits = parts[0]
        else:
            block, logits = _assemble(parts, groups, len(unique))
        if len(unique) < len(rows):
            block, logits = _replicate(block, logits, source)
        block.members = members
        return self._draw(block, logits)

    def _prefill_group(self, rows: list[tuple[_Member, _Row]]) -> tuple[_Block, torch.Tensor]:
        device = self.engine.device
        width = max(len(row.to_prefill) for _, row in rows)
        past = max(row.cached for _, row in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)  # pads are masked: any id does
        attention = torch.zeros((len(rows), past + width), dtype=torch.long)
        positions = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (_, row) in enumerate(rows):
            suffix, cached = row.to_prefill, row.cached
            ids[i, width - len(suffix):] = torch.tensor(suffix, dtype=torch.long)
            attention[i, past - cached : past] = 1
            attention[i, past + width - len(suffix):] = 1
            positions[i, width - len(suffix):] = torch.arange(cached, cached + len(suffix))
        reserve = _reserve([m for m, _ in rows])
        cache = growing_cache(reserve=reserve)  # decode steps write into room allocated now, not a torch.cat per token
        if past:  # the kept caches, copied once into the batch's buffers, left-padded to the longest (zeros: masked)
            template = next(row.start.layers for _, row in rows if row.start is not None)
            capacity = past + width + reserve

            def stacked(layer: int, which: int) -> torch.Tensor:
                like = template[layer][which]
                empty = like.new_empty((1, like.shape[0], 0, like.shape[2]))  # a row without a kept cache: all padding
                return stack_left_padded([row.start.layers[layer][which][None] if row.start is not None else empty
                                          for _, row in rows], past, capacity)

            cache = growing_cache([(stacked(layer, 0), stacked(layer, 1)) for layer in range(len(template))], past)
        for _, row in rows:
            row.start = None  # the keys/values now live in the batch
        real = sum(len(row.to_prefill) for _, row in rows)
        self.prefilled_tokens += real
        self.padding_tokens += len(rows) * width - real
        self.cached_tokens += sum(row.cached for _, row in rows)
        out = self._run_model([m.policy for m, _ in rows], input_ids=ids.to(device), attention_mask=attention.to(device),
                              position_ids=positions.to(device), past_key_values=cache)
        block = _Block([], out.past_key_values, ids[:, -1:].to(device), attention.to(device), positions[:, -1:].to(device))
        return block, out.logits[:, -1, :].float()

    def _forward(self, block: _Block) -> _Block | None:
        """One decode step over the running block, one token drawn per row (or `decode_steps` of them with one
        host read: `device_decode`); finished rows leave. None when no row is left."""
        if self.decode_steps > 1 and eligible(block):
            return run_chunk(self, block, self.decode_steps, self._logits)
        logits = self._logits(block, [m.policy for m in block.members for _ in range(m.job.active_rows)])
        self.decoded_tokens += block.input.shape[0]
        self.most_jobs = max(self.most_jobs, len(block.members))
        return self._draw(block, logits)

    def _logits(self, block: _Block, policies: list[str | None]) -> torch.Tensor:
        """One forward of the block's next step, replayed from a graph where possible: its last-position logits."""
        logits = self._replayed(block, policies)
        if logits is None:
            if isinstance(block.cache, PooledCache):
                block.cache = block.cache.to_growing()
            out = self._run_model(policies, input_ids=block.input, attention_mask=block.attention,
                                  position_ids=block.positions, past_key_values=block.cache)
            block.cache = out.past_key_values
            logits = out.logits[:, -1, :].float()
        return logits

    def _replayed(self, block: _Block, policies: list[str | None]) -> torch.Tensor | None:
        """The step's logits from the engine's graphed decoder (`graphed_decode`), or None where it has none or
        cannot take this block (the step then runs eagerly, with the same result)."""
        graphs = getattr(self.engine, "graphs", None)
        if graphs is None:
            return None
        adapters = {self.engine.adapter_name(policy) for policy in set(policies)}
        logits, mixed, first = None, None, policies[0]
        if len(adapters) > 1 or (grouped_single() and BASE_ADAPTER not in adapters):
            # several adapters (or one, opted in): a graph of them stacked, where `multi_lora` can stack them
            names = [self.engine.adapter_name(policy) for policy in policies]
            multi = self.stacked.prepare(self.engine.model, names)
            mixed = (multi, names) if multi is not None else None
            first = next(p for p, name in zip(policies, names) if name != BASE_ADAPTER)
        if graphs.takes(block, adapters, stacked=mixed is not None):
            logits = graphs.decode(block, next(iter(adapters)), self.engine.activate_policy(first), mixed)
        if logits is None:
            graphs.eager_steps += 1
            return None
        self.steps += 1
        self.widest = max(self.widest, len(policies))
        return logits

    def _draw(self, block: _Block, logits: torch.Tensor) -> _Block | None:
        """Draw every row's next token from `logits` (`_draw_block`) and record each member's; finished rows
        leave the batch (a row with a session leaves its keys/values there first)."""
        picks_all, picked_all = _draw_block(block.members, logits)
        tops_all = _top_block(block.members, logits)
        keep: list[int] = []
        picks: list[int] = []
        offset = 0
        for member in block.members:
            count = member.job.active_rows
            kept, drawn = member.job.record(picks_all[offset : offset + count], picked_all[offset : offset + count],
                                            tops_all[offset : offset + count] if tops_all is not None else None)
            for position in sorted(set(range(count)) - set(kept)):
                row = offset + position
                member.job.finished(position, int(block.attention[row].sum()),
                                    lambda row=row: _row_layers(block.cache, row, block.attention[row]))
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


@contextlib.contextmanager
def _both(first, second):
    with first, second:
        yield


def _row_layers(cache, row: int, mask: torch.Tensor):
    """One row's keys/values at its real positions, from a growing cache or the graphed decoder's pool."""
    if isinstance(cache, PooledCache):
        return cache.row_layers(row, mask)
    return row_layers(cache.layers, row, mask)


def solo_batcher(job: GenerationJob) -> Batcher:
    """A private batcher that runs `job` alone with the model its caller activated (`GenerationJob.advance`)."""
    engine = _SoloEngine(job.device)
    batcher = Batcher(engine)  # type: ignore[arg-type]
    batcher.decode_steps = 1  # `advance` is one step
    batcher._waiting.append(_Member(job, None, job.prompt_width + job.sampling.max_tokens))
    return batcher


class _SoloEngine:
    """What a `Batcher` needs of an engine, for one job whose caller has activated the policy already."""

    max_batch_size = 1 << 30
    max_batch_positions = 1 << 62
    max_prefill_padding = 0.0

    def __init__(self, device: torch.device):
        self.device = device
        self.model = None

    def activate_policy(self, _policy):
        return contextlib.nullcontext()

    def adapter_name(self, policy):
        return policy or BASE_ADAPTER


# Room a batch's KV cache is allocated with beyond its prompt, at most (positions): enough for an RL turn's
# max_tokens; a chat call's large max_tokens (usually not reached) grows by doubling instead of preallocating.
MAX_RESERVE = 256


def _reserve(members: list[_Member]) -> int:
    """Positions to allocate a KV cache of these members' rows with, beyond what it holds: their longest
    max_tokens (the most it may grow by), up to MAX_RESERVE."""
    return min(max((m.job.sampling.max_tokens for m in members), default=0), MAX_RESERVE)

