"""vLLM's token route, `POST /inference/v1/generate`: token ids and sampling parameters in, token ids and
log-probs out, as outside harnesses drive a policy (verifiers 0.4's training client through `renderers`,
prime-rl, the tinker-cookbook port). The caller renders its prompts itself, so nothing is re-tokenized here.

    request:  {"model": str, "token_ids": [int, ...],
               "sampling_params": {"max_tokens", "temperature", "top_p", "seed", "n", "stop_token_ids",
                                   "logprobs", "skip_special_tokens", "ignore_eos", ...}}
    response: {"request_id": str, "prompt_token_ids": [int, ...],
               "choices": [{"index": i, "token_ids": [int, ...], "finish_reason": "stop" | "length",
                            "logprobs": {"content": [{"token": "token_id:<id>", "logprob": float}, ...]}}],
               "usage": {"prompt_tokens", "completion_tokens", "total_tokens"}}

The log-probs are the sampler's own (the untempered log-softmax of each drawn token), one per token id.
vLLM parameters this sampler has no equivalent of are accepted at their no-op values and refused otherwise,
so a request never silently samples from another distribution than the one it asked for.
"""

from __future__ import annotations

import math
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tinkerless.functions.openai_api.backend import OpenAIError, SampledChoice

# vLLM sampling fields with no equivalent here, and the value at which each does nothing.
NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "top_k": (None, -1, 0), "min_p": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "min_tokens": (None, 0),
    "stop": (None, [], ""), "best_of": (None, 1), "prompt_logprobs": (None, 0), "bad_words": (None, []),
    "logit_bias": (None, {}), "allowed_token_ids": (None,), "guided_decoding": (None,), "structured_outputs": (None,),
}
IGNORED = {"skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output", "detokenize",
           "output_kind", "truncate_prompt_tokens", "extra_args", "routed_experts_prompt_start", "return_token_ids"}


class GenerateSampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    n: int = Field(default=1, ge=1, le=64)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=1024)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    ignore_eos: bool = False

    @field_validator("temperature", "top_p")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    def check_unsupported(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in IGNORED:
                continue
            if name not in NO_OP_VALUES:
                raise OpenAIError(f"sampling_params.{name} is not a sampling parameter this server knows",
                                  param=f"sampling_params.{name}", code="unsupported_parameter",
                                  hint="send vLLM SamplingParams fields; supported: max_tokens, temperature, top_p, "
                                       "seed, n, stop_token_ids, logprobs, ignore_eos")
            if value not in NO_OP_VALUES[name]:
                raise OpenAIError(f"sampling_params.{name}={value!r} is not supported by this sampler",
                                  param=f"sampling_params.{name}", code="unsupported_parameter",
                                  hint=f"leave it out (or at {NO_OP_VALUES[name][1]!r})")


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, max_length=512)
    token_ids: list[int] = Field(min_length=1)
    sampling_params: GenerateSampling = Field(default_factory=GenerateSampling)

    def check_unsupported(self) -> None:
        for name in ("content_parts", "features", "multi_modal_data"):
            if (self.model_extra or {}).get(name):
                raise OpenAIError(f"{name}: multimodal prompts are not supported on this route", param=name,
                                  code="unsupported_parameter", hint="send text-only token ids")
        self.sampling_params.check_unsupported()


def generate_reply(prompt_ids: list[int], choices: list[SampledChoice]) -> dict:
    """vLLM's generate response for the sampled choices (exactly the drawn ids, a stop token it drew included)."""
    completion = sum(len(c.token_ids) for c in choices)
    return {
        "request_id": f"gen-{uuid.uuid4().hex}",
        "prompt_token_ids": list(prompt_ids),
        "choices": [
            {
                "index": i,
                "token_ids": list(c.token_ids),
                "finish_reason": "stop" if c.stopped else "length",
                "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": float(lp)}
                                         for t, lp in zip(c.token_ids, c.logprobs)]},
            }
            for i, c in enumerate(choices)
        ],
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion,
                  "total_tokens": len(prompt_ids) + completion},
    }
