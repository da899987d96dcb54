"""vLLM engine: the same `Engine` interface, used when vllm and a GPU are present.

vLLM serves the frozen base model and hot-loads each policy's LoRA adapter
from the directory the worker last saved it to, so weight sync moves only
adapter bytes. Imported lazily: vllm is an optional, GPU-only extra.

Multi-turn rollouts reuse KV caches across turns through vLLM's automatic prefix
caching (`enable_prefix_caching`), not through `KVSession` handles (which this
engine ignores). It hits when a turn's prompt starts with the previous turn's
exact token ids (the agent loops append sampled and observation tokens and never
re-tokenize) under the same LoRA id: a block's hash covers its tokens, its prefix
and the LoRA id, so each policy version keeps one stable id (`_lora_request`) and a
new version gets a new one (a cache of old weights is never reused). Each
`Generation` reports vLLM's `num_cached_tokens` as `cached_tokens`, so a multi-turn
rollout's `cached_prompt_tokens` stat shows whether it hits: a check only a GPU with
vllm installed can run (not run in this project's CI).
"""

from __future__ import annotations

import math
from typing import Callable

from tinkerless.errors import ConfigError
from tinkerless.functions.handoff import ENGINE_TOLERANCE, compare_probe
from tinkerless.functions.sampling.engine import Generation, row_seed
from tinkerless.wire.messages import GREEDY_BELOW, SamplingParams


def vllm_available() -> bool:
    try:
        import torch
        import vllm  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


class VLLMEngine:
    name = "vllm"

    def __init__(
        self,
        model_path: str,
        adapter_dir: Callable[[str], tuple[str, str] | None],
        *,
        max_lora_rank: int = 64,
        gpu_memory_utilization: float = 0.5,
        tensor_parallel_size: int = 1,
        expected_probe: Callable[[str], tuple[list[int], list[float]]] | None = None,
    ):
        """`tensor_parallel_size`: sample from a model split over that many GPUs (one too large for one GPU).
        `expected_probe(policy)`: the probe tokens and the log-probs the policy's current version gives them (the
        worker's own copy); each adapter version is checked against them the first time vLLM loads it."""
        if not vllm_available():
            raise ConfigError(
                "the vLLM engine needs the vllm package and a CUDA GPU",
                hint="pip install 'tinkerless[vllm]' on a GPU machine, or use engine='transformers'",
            )
        from vllm import LLM

        self.adapter_dir = adapter_dir  # policy -> (directory of its latest PEFT adapter, version tag), or None
        self._lora_ids: dict[str, int] = {}
        self.expected_probe = expected_probe
        self.probe_gaps: dict[str, float] = {}  # adapter version -> the largest probe difference found
        self.llm = LLM(
            model=model_path,
            enable_lora=True,
            max_lora_rank=max_lora_rank,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=True,
            tensor_parallel_size=tensor_parallel_size,
        )

    def _lora_request(self, policy: str | None):
        found = self.adapter_dir(policy) if policy is not None else None
        if found is None:
            return None
        path, version_tag = found
        from vllm.lora.request import LoRARequest

        # A new integer id per adapter version makes vLLM load the fresh weights.
        key = f"{policy}@{version_tag}"
        if key in self._lora_ids:
            return LoRARequest(key, self._lora_ids[key], path)
        lora_id = len(self._lora_ids) + 1
        request = LoRARequest(key, lora_id, path)
        if self.expected_probe is not None:
            # Hot-loading can fail silently (an old id's weights kept, an adapter not applied): the first use of a
            # version proves what vLLM computes with it. A mismatch raises, and the version is not kept, so no
            # rollout samples from it and the next call checks again.
            tokens, expected = self.expected_probe(policy)
            ours = self.prompt_logprobs(tokens, request)
            self.probe_gaps[key] = compare_probe(policy, version_tag, ours, expected, ENGINE_TOLERANCE,
                                                 who="the vLLM engine", against="the worker's copy", precision="vLLM")
        self._lora_ids[key] = lora_id
        return request

    def prompt_logprobs(self, tokens: list[int], lora_request) -> list[float]:
        """vLLM's log-probs of `tokens[1:]`, each given the tokens before it, under `lora_request`'s adapter."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        output = self.llm.generate([TokensPrompt(prompt_token_ids=list(tokens))],
                                   VSamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0),
                                   lora_request=lora_request, use_tqdm=False)[0]
        # Entry 0 is None (no prefix); each later one holds the prompt's own token among its top ids.
        return [float(step[token].logprob) for step, token in zip(output.prompt_logprobs[1:], tokens[1:])]

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, *, policy: str | None, seed: int,
        sessions: list | None = None, row_seeds: list[int] | None = None,
    ) -> list[Generation]:
        """`sessions` are ignored: vLLM's prefix cache finds a conversation's earlier turns by their tokens."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        # One seed per row, as the transformers engine does: a request's repeated prompts (its
        # num_samples) must not all draw the same sequence from one shared seed.
        params = [
            VSamplingParams(
                max_tokens=sampling.max_tokens,
                temperature=0.0 if sampling.temperature < GREEDY_BELOW else sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k if sampling.top_k > 0 else -1,
                seed=row_seeds[index] if row_seeds is not None else row_seed(seed, index),
                logprobs=0,  # the sampled token's log-prob
                **(
                    {}
                    if sampling.stop_token_ids is None
                    else {"stop_token_ids": list(sampling.stop_token_ids), "ignore_eos": True}
                ),
            )
            for index in range(len(prompts))
        ]
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompts],  # the exact ids: prefix caching hashes them
            params,
            lora_request=self._lora_request(policy),
            use_tqdm=False,
        )
        generations = []
        for prompt, output in zip(prompts, outputs):
            completion = output.outputs[0]
            cached = min(int(getattr(output, "num_cached_tokens", 0) or 0), len(prompt))
            tokens = list(completion.token_ids)
            logprobs = [
                step[token].logprob if step and token in step else -math.inf
                for step, token in zip(completion.logprobs or [], tokens)
            ]
            generations.append(Generation(tokens, logprobs, "stop" if completion.finish_reason == "stop" else "length",
                                          prefill_tokens=len(prompt) - cached, cached_tokens=cached))
        return generations
