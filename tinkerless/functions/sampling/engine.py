"""Generation engines behind one interface.

`TransformersEngine` runs anywhere torch runs (CPU, one GPU). `VLLMEngine`
(in `vllm_engine.py`) is chosen when vllm and a GPU are present. Both take
token ids in and give token ids out with the sampler's per-token log-probs
(of the untempered distribution, which is what the trainer recomputes).

The transformers engine decodes with its own loop over a `GenerationJob` rather than
`model.generate`, for three reasons:

* **Every returned token was drawn by the sampler.** A row that stops leaves the batch
  (its KV cache rows are dropped); nothing is padded after it, and stop tokens are exactly
  the ones asked for: `stop_token_ids=[]` means no token ends a sample early, not even EOS
  (`generate` falls back to the model's EOS when given none).
* **Resumable.** A job keeps its KV cache and its rows' tokens between steps, so a
  server can pause it between slices and run other tenants' calls (`slicing`), and the
  continuous batcher (`batcher`) decodes the rows of every concurrent call's jobs in one batch.
* **Conversations keep their KV cache across turns.** A call may pass one `KVSession` per prompt
  (the agent loops do, one per episode or role): a row that finishes leaves its keys/values
  there, and the conversation's next turn prefills only the tokens appended since (`kv_cache`).
* **Reproducible.** Row i of a request draws its token at position t with a uniform that is a hash of
  (its seed `row_seed(seed, i)`, t) only (`device_sampling`): the same seed gives the same tokens whether
  the job is paused or not, whatever runs in between, however the request is split into batches, and
  however many steps run between host reads (`device_decode`), up to floating-point differences of
  batched matrix products.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from tinkerless.errors import UserError
from tinkerless.functions.sampling.batcher import BASE_ADAPTER, Batcher
from tinkerless.functions.sampling.device_sampling import DrawSettings, draw_rows, row_keys
from tinkerless.functions.sampling.graphed_decode import graphed_decoder
from tinkerless.functions.sampling.kv_cache import DEFAULT_MAX_SESSION_BYTES, Continuation, KVSession, KVSessionStore
from tinkerless.functions.sampling.token_stream import TokenEvent, TokenStream
from tinkerless.wire.messages import SamplingParams

# Rows x (prompt + max_tokens) positions one batch may hold in its KV cache (~3 GB for SmolLM2-135M in fp32).
DEFAULT_MAX_BATCH_POSITIONS = 65536
# Prompts are prefilled in groups of similar length, each left-padded to its longest: at most this much padding
# per real token (a prefill of padding costs as much as one of real tokens; more groups cost more forwards).
DEFAULT_MAX_PREFILL_PADDING = 0.125


@dataclass
class Generation:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" (a stop token was drawn, and is the last token) | "length" | "cancelled" (its stream's)
    prefill_tokens: int = 0  # prompt tokens this call computed for this row (0: a row with the same prompt did)
    cached_tokens: int = 0  # prompt tokens whose keys/values were reused (a kept session, a prefix cache)
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token, when the job was asked for them


class Engine(Protocol):
    name: str

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, *, policy: str | None, seed: int,
        sessions: list[KVSession] | None = None, row_seeds: list[int] | None = None,
    ) -> list[Generation]:
        """Sample one continuation per prompt (repeat a prompt for several samples).

        `sessions` (one per prompt): the conversations the prompts continue, whose KV caches an engine
        may keep between calls (`kv_cache`); an engine without that (vLLM caches prefixes itself) ignores them.
        Row i draws from `row_seed(seed, i)`, or from `row_seeds[i]` when given: calls gathered into one
        batch keep the draws each would make alone.
        """
        ...


def row_seed(seed: int, index: int) -> int:
    """The seed of row `index` of a request seeded with `seed` (any int; a 63-bit result)."""
    return (seed * 6364136223846793005 + (index + 1) * 1442695040888963407) % (1 << 63)


@dataclass
class _Row:
    key: tuple[int, int]  # `device_sampling.row_keys` of the row's seed: its draws hash (key, token position)
    prompt: list[int]
    start: Continuation | None = None  # cached keys/values of the prompt's first tokens, until the prefill takes them
    cached: int = 0  # how many prompt tokens `start` covered
    shared_prefill: bool = False  # another row of the same prefill had the same prompt and computed it
    session: KVSession | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: str | None = None
    top: list[list[tuple[int, float]]] = field(default_factory=list)  # per token, with `top_logprobs`

    @property
    def to_prefill(self) -> list[int]:
        return self.prompt[self.cached :]


class GenerationJob:
    """A batch of sequences to decode: per-row prompts (and cached starts), draw keys, what each row has drawn.

    A `Batcher` prefills and decodes its rows, alone or with other jobs' rows: one `draw` over the rows of
    the block (`blocks._draw_block`), then `record` per job. `advance(model)` runs one step of the job
    alone (the prefill first) with whatever adapter the caller activated; between steps the job holds no
    reference to the model.
    """

    def __init__(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        *,
        stop_ids: list[int],
        seed: int,
        first_index: int,
        device: torch.device,
        sessions: list[KVSession | None] | None = None,
        store: KVSessionStore | None = None,
        weights: object = None,
        stream: TokenStream | None = None,
        top_logprobs: int = 0,
        row_seeds: list[int] | None = None,
        constraints: list | None = None,
    ):
        if any(not prompt for prompt in prompts):
            raise UserError("a prompt to sample from is empty", hint="send at least one token per prompt")
        if sessions is not None and len(sessions) != len(prompts):
            raise ValueError(f"{len(sessions)} sessions for {len(prompts)} prompts")
        self.sampling = sampling
        self.stop_ids = set(stop_ids)
        self.device = device
        self.store, self.weights = store, weights
        self.stream, self.first_index = stream, first_index  # each recorded token goes to `stream` as it is drawn
        self.top_logprobs = top_logprobs  # k: record the k most likely tokens at each position (0: none)
        if row_seeds is not None and len(row_seeds) != len(prompts):
            raise ValueError(f"{len(row_seeds)} row seeds for {len(prompts)} prompts")
        keys = row_keys([row_seeds[i] if row_seeds is not None else row_seed(seed, first_index + i)
                         for i in range(len(prompts))]).tolist()
        self.rows = [
            _Row(tuple(keys[i]), list(prompt), session=sessions[i] if sessions is not None and store is not None else None)
            for i, prompt in enumerate(prompts)
        ]
        if constraints is not None and len(constraints) != len(prompts):
            raise ValueError(f"{len(constraints)} constraints for {len(prompts)} prompts")
        # Per row: a `constraints.TokenConstraint` masking what it may draw next, or None (functions/sampling/constraints.py)
        self.constraints = constraints if constraints is not None and any(c is not None for c in constraints) else None
        # A constrained row's mask depends on its last token (the grammar's host-side state): its block draws one
        # token per host step (`device_decode` keeps such blocks on the one-step loop).
        self.needs_host_each_step = self.constraints is not None
        self.prompt_width = max((len(p) for p in prompts), default=0)  # KV positions of the longest prompt
        self._active = list(range(len(prompts)))  # job rows still decoding, in batch order
        self._finished: list[int] = []  # the rows active at the last draw
        self.error: Exception | None = None
        self._solo = None  # the private batcher of `advance`
        if sampling.max_tokens <= 0:
            for row in self.rows:
                row.stop_reason = "length"
            self._active = []
            return
        for row in self.rows:  # a session's cache moves into the job (the session is empty until the row ends)
            if row.session is not None:
                row.start = store.take(row.session, row.prompt, weights)
                row.cached = row.start.length if row.start is not None else 0

    @property
    def done(self) -> bool:
        return not self._active

    def advance(self, model) -> None:
        """One decoding step of this job alone (call under torch.no_grad with the policy active)."""
        if self.done:
            return
        if self._solo is None:
            from tinkerless.functions.sampling.batcher import solo_batcher

            self._solo = solo_batcher(self)
        self._solo.engine.model = model
        self._solo.step()
        if self._solo.rows == 0:
            self._solo = None  # free the KV cache now, not when the job is dropped
        if self.error is not None:
            raise self.error

    def prefill_rows(self) -> list[_Row]:
        """The rows to prefill, in batch order (before any decoding: every row is active)."""
        return [self.rows[r] for r in self._active]

    def finished(self, position: int, covered: int, layers: Callable[[], list]) -> None:
        """The row at `position` among the rows active before the last `record` has ended, with `covered` KV
        positions (prompt and drawn tokens but the last); keep its cache in its session, if it has one."""
        row = self.rows[self._finished[position]]
        if row.session is None or self.store is None or covered != len(row.prompt) + len(row.tokens) - 1:
            return
        self.store.keep(row.session, row.prompt + row.tokens[:-1], layers(), self.weights)

    def draw(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The next tokens of this job's active rows and their log-probs, drawn from `logits` by its sampling
        (a `Batcher` draws several jobs' rows at once: `blocks._draw_block`, with the same result per row)."""
        return draw_rows(logits, DrawSettings.of(self.keys(), [self.sampling] * self.active_rows, logits.device),
                         torch.tensor(self.positions(), device=logits.device))

    def keys(self) -> list[tuple[int, int]]:
        """The active rows' hash keys, in batch order."""
        return [self.rows[r].key for r in self._active]

    def positions(self) -> list[int]:
        """The token position each active row draws next (the count it has drawn), in batch order."""
        return [len(self.rows[r].tokens) for r in self._active]

    def row_constraints(self) -> list:
        """The active rows' constraints (None for an unconstrained row), in batch order."""
        return [None] * len(self._active) if self.constraints is None else [self.constraints[r] for r in self._active]

    def record(
        self, picks: list[int], picked_logprobs: list[float], tops: list[list[tuple[int, float]]] | None = None,
    ) -> tuple[list[int], list[int]]:
        """Record the token each active row drew (and its log-prob, and with `top_logprobs` the most likely
        tokens); rows that stopped leave `active`. With a stream, each token is sent as it is recorded; once the
        stream is cancelled (its reader hung up) every row ends with stop reason "cancelled".

        Returns (keep, picks): the positions among the active rows that go on decoding, and the
        token each of them drew (its next input).
        """
        keep: list[int] = []
        cancelled = self.stream is not None and self.stream.cancelled
        for b, r in enumerate(self._active):
            row, token = self.rows[r], picks[b]
            row.tokens.append(token)
            row.logprobs.append(picked_logprobs[b])
            if self.constraints is not None and self.constraints[r] is not None:
                self.constraints[r].advance(token)
            top = tops[b][: self.top_logprobs] if tops is not None and self.top_logprobs else None
            if top is not None:
                row.top.append(top)
            if token in self.stop_ids:
                row.stop_reason = "stop"
            elif len(row.tokens) >= self.sampling.max_tokens:
                row.stop_reason = "length"
            elif cancelled:
                row.stop_reason = "cancelled"
            else:
                keep.append(b)
            if self.stream is not None:
                self.stream.put(TokenEvent(self.first_index + r, token, picked_logprobs[b], top, row.stop_reason))
        self._finished = self._active  # `finished` reads the rows that were active at this draw
        self._active = [self._active[b] for b in keep]
        return keep, [picks[b] for b in keep]

    @property
    def active_rows(self) -> int:
        return len(self._active)

    def fail(self, error: Exception) -> None:
        """End the job with `error` (its shared batch's forward raised): no row decodes further."""
        self.error = error
        self._active = []
        self._solo = None

    def results(self) -> list[Generation]:
        return [Generation(r.tokens, r.logprobs, r.stop_reason or "length",
                           prefill_tokens=len(r.to_prefill) if r.tokens and not r.shared_prefill else 0,
                           cached_tokens=r.cached, top_logprobs=r.top if self.top_logprobs else None)
                for r in self.rows]


class TransformersEngine:
    """Sampling with a resumable decode loop; the active LoRA adapter is the policy."""

    name = "transformers"

    def __init__(
        self,
        model,
        tokenizer,
        eos_token_ids: list[int],
        activate_policy: Callable[[str | None], object],
        max_batch_size: int = 64,
        max_batch_positions: int = DEFAULT_MAX_BATCH_POSITIONS,
        adapter_of: Callable[[str | None], str] | None = None,
        max_session_bytes: int = DEFAULT_MAX_SESSION_BYTES,
        max_prefill_padding: float = DEFAULT_MAX_PREFILL_PADDING,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.activate_policy = activate_policy  # returns a context manager
        self.max_batch_size = max_batch_size
        self.max_batch_positions = max_batch_positions
        self.max_prefill_padding = max_prefill_padding
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_token_ids[0]
        self.adapter_of = adapter_of  # policy -> peft adapter name, for batches that mix policies
        self.sessions = KVSessionStore(max_session_bytes)  # conversations' caches kept between turns
        self.graphs = graphed_decoder(model, self.device)  # decode steps replayed from CUDA graphs (None on a CPU)
        self.batcher = Batcher(self)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def stop_ids(self, sampling: SamplingParams) -> list[int]:
        """None: the model's end-of-turn tokens; a list (even empty) is taken as given."""
        return list(self.eos_token_ids) if sampling.stop_token_ids is None else list(sampling.stop_token_ids)

    def start(
        self, prompts: list[list[int]], sampling: SamplingParams, *, seed: int, first_index: int = 0,
        sessions: list[KVSession] | None = None, policy: str | None = None,
        stream: TokenStream | None = None, top_logprobs: int = 0, row_seeds: list[int] | None = None,
        constraints: list | None = None,
    ) -> GenerationJob:
        """A job for `prompts`, whose rows are rows first_index.. of a request seeded with `seed` (or seeded
        with `row_seeds`, one each); with `sessions`, rows continue their conversations' kept caches (computed
        by `policy`'s weights)."""
        use_sessions = sessions is not None and self.sessions.enabled
        return GenerationJob(prompts, sampling, stop_ids=self.stop_ids(sampling), seed=seed, first_index=first_index,
                             device=self.device, sessions=sessions if use_sessions else None,
                             store=self.sessions if use_sessions else None,
                             weights=self.weights_tag(policy) if use_sessions else None,
                             stream=stream, top_logprobs=top_logprobs, row_seeds=row_seeds, constraints=constraints)

    def weights_tag(self, policy: str | None) -> object:
        """What identifies the weights `policy` samples with now: its adapter and the storage and in-place
        version of each of its LoRA tensors (an optimizer step, a load or a reset bumps them). A kept cache
        is reused only under the same tag: keys/values of other weights would not be this policy's."""
        adapter = self.adapter_name(policy)
        if adapter == BASE_ADAPTER:
            return (adapter,)
        marker = f".{adapter}."
        return (adapter, *((p.data_ptr(), p._version) for n, p in self.model.named_parameters()
                           if "lora_" in n and marker in n))

    def batches(self, prompts: list[list[int]], max_tokens: int) -> list[tuple[int, int]]:
        """(start, end) of consecutive batches within max_batch_size rows and max_batch_positions KV positions."""
        spans, start = [], 0
        while start < len(prompts):
            end, width = start, 0
            while end < len(prompts) and end - start < self.max_batch_size:
                width_then = max(width, len(prompts[end]) + max(max_tokens, 0))
                if end > start and (end - start + 1) * width_then > self.max_batch_positions:
                    break
                width, end = width_then, end + 1
            spans.append((start, end))
            start = end
        return spans

    def adapter_name(self, policy: str | None) -> str:
        """The peft adapter that holds `policy`'s weights in a mixed batch (peft's "__base__": no adapter)."""
        return self.adapter_of(policy) if self.adapter_of is not None else (policy or BASE_ADAPTER)

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, *, policy: str | None, seed: int,
        sessions: list[KVSession] | None = None, stream: TokenStream | None = None, top_logprobs: int = 0,
        row_seeds: list[int] | None = None, constraints: list | None = None,
    ) -> list[Generation]:
        """Sample, in one batch with every other generate call running at the time (`batcher`). With `stream`,
        every token goes to it as it is drawn (and cancelling it ends the rows); with `top_logprobs` k, each token
        also carries the k most likely tokens of the distribution it was drawn from. Row i draws from
        `row_seed(seed, i)`, or from `row_seeds[i]` when given (rows gathered from separate calls)."""
        return self.batcher.generate(prompts, sampling, policy=policy, seed=seed, sessions=sessions, stream=stream,
                                     top_logprobs=top_logprobs, row_seeds=row_seeds, constraints=constraints)
