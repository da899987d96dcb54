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
* **Resumable.** A job keeps its KV cache and per-row random generators between steps, so a
  server can pause it between slices and run other tenants' calls (`slicing`), and the
  continuous batcher (`batcher`) decodes the rows of every concurrent call's jobs in one batch.
* **Reproducible.** Row i of a request draws from its own generator seeded by (seed, i): the
  same seed gives the same tokens whether the job is paused or not, whatever runs in between,
  and however the request is split into batches (up to floating-point differences of
  batched matrix products).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
from transformers import DynamicCache
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from tinkerless.errors import UserError
from tinkerless.functions.batcher import BASE_ADAPTER, Batcher
from tinkerless.wire.messages import SamplingParams

# Rows x (prompt + max_tokens) positions one batch may hold in its KV cache (~3 GB for SmolLM2-135M in fp32).
DEFAULT_MAX_BATCH_POSITIONS = 65536


@dataclass
class Generation:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" (a stop token was drawn, and is the last token) | "length"


class Engine(Protocol):
    name: str

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, *, policy: str | None, seed: int
    ) -> list[Generation]:
        """Sample one continuation per prompt (repeat a prompt for several samples)."""
        ...


def row_seed(seed: int, index: int) -> int:
    """The seed of row `index` of a request seeded with `seed` (any int; a 63-bit result)."""
    return (seed * 6364136223846793005 + (index + 1) * 1442695040888963407) % (1 << 63)


@dataclass
class _Row:
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: str | None = None


class GenerationJob:
    """A batch of sequences mid-decode: KV cache, per-row generators, what each row has drawn.

    `advance(model)` runs one step (the prefill first) with whatever adapter the caller
    activated; between steps the job holds no reference to the model, so the caller may
    deactivate its adapter and let other work use the model.
    """

    def __init__(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        *,
        stop_ids: list[int],
        seed: int,
        first_index: int,
        pad_id: int,
        device: torch.device,
    ):
        if any(not prompt for prompt in prompts):
            raise UserError("a prompt to sample from is empty", hint="send at least one token per prompt")
        self.sampling = sampling
        self.stop_ids = set(stop_ids)
        self.device = device
        self.rows = [
            _Row(torch.Generator(device=device).manual_seed(row_seed(seed, first_index + i))) for i in range(len(prompts))
        ]
        width = max(len(p) for p in prompts)
        self._input = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        self._attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, prompt in enumerate(prompts):  # left padding: every row continues from the right edge
            self._input[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            self._attention[i, width - len(prompt) :] = 1
        self._input, self._attention = self._input.to(device), self._attention.to(device)
        self._positions = (self._attention.cumsum(-1) - 1).clamp(min=0)
        self._active = list(range(len(prompts)))  # job rows still decoding, in KV-cache batch order
        self.error: Exception | None = None
        self._cache: DynamicCache | None = None
        self._warpers = []
        if sampling.temperature > 0:
            if sampling.top_k and sampling.top_k > 0:
                self._warpers.append(TopKLogitsWarper(sampling.top_k))
            if sampling.top_p < 1.0:
                self._warpers.append(TopPLogitsWarper(sampling.top_p))
        if sampling.max_tokens <= 0:
            for row in self.rows:
                row.stop_reason = "length"
            self._active = []

    @property
    def done(self) -> bool:
        return not self._active

    def advance(self, model) -> None:
        """One decoding step for every active row (call under torch.no_grad with the policy active)."""
        if self.done:
            return
        if self._cache is None:
            self._cache = DynamicCache()
        out = model(
            input_ids=self._input,
            attention_mask=self._attention,
            position_ids=self._positions,
            past_key_values=self._cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self._cache = out.past_key_values
        self._draw(out.logits[:, -1, :].float())

    def _draw(self, logits: torch.Tensor) -> None:
        keep, picks = self.choose(logits)
        if len(keep) < self._attention.shape[0]:  # finished rows leave the batch: nothing is decoded (or padded) after them
            if keep:
                self._cache.batch_select_indices(torch.tensor(keep, device=self.device))
            self._attention = self._attention[keep]
            self._positions = self._positions[keep]
        if not keep:
            self._cache = None  # free the KV cache now, not when the job is dropped
            return
        self._input = torch.tensor(picks, dtype=torch.long, device=self.device)[:, None]
        self._attention = torch.cat([self._attention, self._attention.new_ones((len(keep), 1))], dim=1)
        self._positions = self._positions[:, -1:] + 1

    def choose(self, logits: torch.Tensor) -> tuple[list[int], list[int]]:
        """Draw one token for each active row from `logits` (one line per active row, in order) and record it.

        Returns (keep, picks): the positions among the active rows that go on decoding, and the
        token each of them drew (its next input). Rows that stopped leave `active`.
        """
        logprobs = torch.log_softmax(logits, dim=-1)  # of the untempered distribution: what training recomputes
        if self.sampling.temperature > 0:
            scores = logits / self.sampling.temperature
            for warper in self._warpers:
                scores = warper(None, scores)
            picks = self._sample(torch.softmax(scores, dim=-1))
        else:
            picks = logits.argmax(dim=-1)
        picked_logprobs = logprobs.gather(1, picks[:, None]).squeeze(1).tolist()
        picks = picks.tolist()
        keep: list[int] = []
        for b, r in enumerate(self._active):
            row, token = self.rows[r], picks[b]
            row.tokens.append(token)
            row.logprobs.append(picked_logprobs[b])
            if token in self.stop_ids:
                row.stop_reason = "stop"
            elif len(row.tokens) >= self.sampling.max_tokens:
                row.stop_reason = "length"
            else:
                keep.append(b)
        self._active = [self._active[b] for b in keep]
        return keep, [picks[b] for b in keep]

    @property
    def active_rows(self) -> int:
        return len(self._active)

    @property
    def prompt_width(self) -> int:
        return self._attention.shape[1] if self._cache is None else 0

    def fail(self, error: Exception) -> None:
        """End the job with `error` (its shared batch's forward raised): no row decodes further."""
        self.error = error
        self._active = []
        self._cache = None

    def prompt_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input ids, attention mask and positions of the (left-padded) prompts, for a shared batch that
        prefills and decodes this job's rows from now on, calling `choose` with their logits."""
        if self._cache is not None:
            raise RuntimeError("this job has started decoding on its own; a shared batch cannot take it over")
        return self._input, self._attention, self._positions

    def _sample(self, probs: torch.Tensor) -> torch.Tensor:
        """One token per active row by inverse CDF, with one uniform draw from each row's own generator
        (a vectorized pick: per-row `torch.multinomial` calls cost more than the tiny model's forward)."""
        uniforms = torch.stack(
            [torch.rand((), generator=self.rows[r].generator, device=self.device) for r in self._active]
        )
        cdf = probs.cumsum(dim=-1)
        # right=True: the first token whose cumulative mass exceeds u, so a zero-probability token
        # (filtered by top_k / top_p) is never picked; u < total mass, clamped against rounding.
        targets = torch.minimum(uniforms * cdf[:, -1], cdf[:, -1] * (1 - 1e-6))
        return torch.searchsorted(cdf, targets[:, None], right=True).squeeze(1)

    def results(self) -> list[Generation]:
        return [Generation(r.tokens, r.logprobs, r.stop_reason or "length") for r in self.rows]


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
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.activate_policy = activate_policy  # returns a context manager
        self.max_batch_size = max_batch_size
        self.max_batch_positions = max_batch_positions
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_token_ids[0]
        self.adapter_of = adapter_of  # policy -> peft adapter name, for batches that mix policies
        self.batcher = Batcher(self)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def stop_ids(self, sampling: SamplingParams) -> list[int]:
        """None: the model's end-of-turn tokens; a list (even empty) is taken as given."""
        return list(self.eos_token_ids) if sampling.stop_token_ids is None else list(sampling.stop_token_ids)

    def start(
        self, prompts: list[list[int]], sampling: SamplingParams, *, seed: int, first_index: int = 0
    ) -> GenerationJob:
        """A job for `prompts`, whose rows are rows first_index.. of a request seeded with `seed`."""
        return GenerationJob(prompts, sampling, stop_ids=self.stop_ids(sampling), seed=seed,
                             first_index=first_index, pad_id=self.pad_id, device=self.device)

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
        self, prompts: list[list[int]], sampling: SamplingParams, *, policy: str | None, seed: int
    ) -> list[Generation]:
        """Sample, in one batch with every other generate call running at the time (`batcher`)."""
        return self.batcher.generate(prompts, sampling, policy=policy, seed=seed)
