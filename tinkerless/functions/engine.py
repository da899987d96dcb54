"""Generation engines behind one interface.

`TransformersEngine` runs anywhere torch runs (CPU, one GPU). `VLLMEngine`
(in `vllm_engine.py`) is chosen when vllm and a GPU are present. Both take
token ids in and give token ids out with the sampler's per-token log-probs
(of the untempered distribution, which is what the trainer recomputes).
"""

from __future__ import annotations

import copy

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from tinkerless.wire.messages import SamplingParams


@dataclass
class Generation:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" (end-of-turn token) | "length"


class Engine(Protocol):
    name: str

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, *, policy: str | None, seed: int
    ) -> list[Generation]:
        """Sample one continuation per prompt (repeat a prompt for several samples)."""
        ...


class TransformersEngine:
    """Batched sampling with `model.generate`; the active LoRA adapter is the policy."""

    name = "transformers"

    def __init__(
        self,
        model,
        tokenizer,
        eos_token_ids: list[int],
        activate_policy: Callable[[str | None], object],
        max_batch_size: int = 64,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.activate_policy = activate_policy  # returns a context manager
        self.max_batch_size = max_batch_size
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_token_ids[0]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, *, policy: str | None, seed: int
    ) -> list[Generation]:
        results: list[Generation] = []
        # One seed per request keeps sampling reproducible no matter what ran before;
        # fork_rng leaves the process's global RNG untouched.
        with torch.random.fork_rng(devices=[]), torch.no_grad(), self.activate_policy(policy):
            torch.manual_seed(seed)
            for start in range(0, len(prompts), self.max_batch_size):
                results.extend(self._generate_batch(prompts[start : start + self.max_batch_size], sampling))
        return results

    def _generate_batch(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Generation]:
        if sampling.max_tokens <= 0:
            return [Generation([], [], "length") for _ in prompts]
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding: generation continues from the right edge
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention[row, width - len(prompt) :] = 1
        stop_ids = self.eos_token_ids if sampling.stop_token_ids is None else list(sampling.stop_token_ids)
        # One complete generation config (the model's, overridden): transformers warns when a config
        # and loose arguments are mixed, and "no stop tokens" needs eos_token_id=None in the config itself.
        config = copy.deepcopy(self.model.generation_config)
        settings: dict = dict(
            max_new_tokens=sampling.max_tokens,
            eos_token_id=stop_ids or None,  # None: only max_new_tokens ends generation
            pad_token_id=self.pad_id,
            do_sample=sampling.temperature > 0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        if sampling.temperature > 0:
            settings.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None)
        config.update(**settings)
        out = self.model.generate(
            input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device), generation_config=config
        )
        new_tokens = out.sequences[:, width:].cpu()
        logits = torch.stack(out.logits, dim=1).float().cpu()
        logprobs = torch.gather(logits, 2, new_tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)
        eos = set(stop_ids)
        generations = []
        for row in range(len(prompts)):
            tokens = new_tokens[row].tolist()
            stop = next((i for i, t in enumerate(tokens) if t in eos), None)
            end = stop + 1 if stop is not None else len(tokens)
            generations.append(
                Generation(tokens[:end], logprobs[row, :end].tolist(), "stop" if stop is not None else "length")
            )
        return generations
