"""vLLM engine: the same `Engine` interface, used when vllm and a GPU are present.

vLLM serves the frozen base model and hot-loads each policy's LoRA adapter
from the directory the worker last saved it to, so weight sync moves only
adapter bytes. Imported lazily: vllm is an optional, GPU-only extra.
"""

from __future__ import annotations

import math
from typing import Callable

from tinkerless.errors import ConfigError
from tinkerless.functions.engine import Generation, row_seed
from tinkerless.wire.messages import SamplingParams


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
    ):
        if not vllm_available():
            raise ConfigError(
                "the vLLM engine needs the vllm package and a CUDA GPU",
                hint="pip install 'tinkerless[vllm]' on a GPU machine, or use engine='transformers'",
            )
        from vllm import LLM

        self.adapter_dir = adapter_dir  # policy -> (directory of its latest PEFT adapter, version tag), or None
        self._lora_ids: dict[str, int] = {}
        self.llm = LLM(
            model=model_path,
            enable_lora=True,
            max_lora_rank=max_lora_rank,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=True,
        )

    def _lora_request(self, policy: str | None):
        found = self.adapter_dir(policy) if policy is not None else None
        if found is None:
            return None
        path, version_tag = found
        from vllm.lora.request import LoRARequest

        # A new integer id per adapter version makes vLLM load the fresh weights.
        key = f"{policy}@{version_tag}"
        if key not in self._lora_ids:
            self._lora_ids[key] = len(self._lora_ids) + 1
        return LoRARequest(key, self._lora_ids[key], path)

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, *, policy: str | None, seed: int
    ) -> list[Generation]:
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        # One seed per row, as the transformers engine does: a request's repeated prompts (its
        # num_samples) must not all draw the same sequence from one shared seed.
        params = [
            VSamplingParams(
                max_tokens=sampling.max_tokens,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k if sampling.top_k > 0 else -1,
                seed=row_seed(seed, index),
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
            [TokensPrompt(prompt_token_ids=p) for p in prompts],
            params,
            lora_request=self._lora_request(policy),
            use_tqdm=False,
        )
        generations = []
        for output in outputs:
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            logprobs = [
                step[token].logprob if step and token in step else -math.inf
                for step, token in zip(completion.logprobs or [], tokens)
            ]
            generations.append(Generation(tokens, logprobs, "stop" if completion.finish_reason == "stop" else "length"))
        return generations
