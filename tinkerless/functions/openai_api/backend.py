"""What the OpenAI routes need from whoever samples: validated token-level requests in, sampled tokens out.

The router (`router.py`) owns everything OpenAI-shaped: request bodies, chat templates, tools, stop
strings, SSE. A `CompletionBackend` owns the model: which `model` names exist for a caller, and how
to sample token ids. Two backends implement it: `tinkerless serve` (`serve_backend.ServeBackend`:
base model + the caller's trained adapters) and the rollout worker's per-rollout endpoint of agent
functions (the current policy; it records every call for training).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from tinkerless.errors import UserError
from tinkerless.functions.sampling.token_stream import Cancellation


@dataclass(frozen=True)
class TokenSampling:
    """One validated request, already rendered to token ids by the router."""

    prompt_ids: list[int]
    n: int
    max_tokens: int
    temperature: float
    top_p: float
    stop_strings: list[str]  # applied by the router on the decoded text; a backend may ignore them
    stop_token_ids: list[int]  # the template's end-of-turn / EOS ids: a drawn one ends the choice (and is kept)
    seed: int | None
    top_logprobs: int  # 0 = none; else the k most likely tokens at each sampled position
    images: tuple = ()  # a vision-language prompt's processed images (`VisionInput`), in the order of their tokens
    top_k: int = 0  # 0 = off; else draw among the k most likely tokens only (Anthropic's top_k)
    grammar: Any = None  # a `sampling.constraints.Grammar` each choice's tokens must follow (structured outputs)


@dataclass(frozen=True)
class SampledChoice:
    token_ids: list[int]  # exactly what the sampler drew (a stop token it drew is the last one; nothing appended)
    logprobs: list[float]  # the sampler's log-probs of those tokens (the untempered log-softmax)
    top_logprobs: list[list[tuple[int, float]]] | None  # per token: [(token id, log-prob)], most likely first
    stopped: bool  # ended by a stop token (vs the max_tokens limit)


class CompletionBackend(Protocol):
    def tokenizer(self) -> Any:
        """The HF tokenizer of the base model (chat template rendering, decoding)."""
        ...

    def models(self, caller: str) -> list[str]:
        """The model names `caller` may use, for /v1/models."""
        ...

    async def sample(
        self, caller: str, model: str, request: TokenSampling, cancel: Cancellation | None = None
    ) -> list[SampledChoice]:
        """`request.n` choices. Raises `OpenAIError`s (or other tinkerless errors: a UserError becomes a 400,
        `ModelNotFoundError` a 404) that the router answers with an OpenAI-style error body. Once `cancel` is
        cancelled (the caller hung up) the job may end early: its rows stop with what they have drawn."""
        ...


class OpenAIError(UserError):
    """A caller's mistake with the OpenAI-style fields of its error body: HTTP status, type, param, code."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        hint: str | None = None,
    ):
        super().__init__(message, hint=hint)
        self.status = status
        self.type = type
        self.param = param
        # Every 4xx body carries a code a client can branch on: the generic one unless the raiser names another.
        self.code = code if code is not None else ("invalid_value" if status == 400 else None)


def unknown_model(model: str, available: list[str]) -> OpenAIError:
    """The one answer for a model the caller cannot use: a name that does not exist and another tenant's
    run read the same, so an error never tells whether someone else's run exists."""
    shown = ", ".join(repr(m) for m in available[:8]) or "none"
    return OpenAIError(
        f"the model {model[:200]!r} does not exist or you do not have access to it",
        status=404, param="model", code="model_not_found",
        hint=f"GET /v1/models lists yours ({shown}); a trained adapter is named <run_id>@<step> or <run_id>@latest",
    )
