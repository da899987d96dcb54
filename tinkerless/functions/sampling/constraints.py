"""Constrained decoding: a per-row token mask applied to the logits before the draw.

A request may constrain what its rows draw (a JSON schema: Chat Completions' `response_format`, Responses'
`text.format`). The schema is compiled once per request by llguidance (chosen by measurement over
outlines-core: ~2 ms against 100-280 ms to compile a schema on SmolLM2's vocabulary, both well under a
millisecond per token; bench/results/grammar-2026-11-28.md) into a `Grammar`; each row gets its own
`TokenConstraint` (a matcher: its state advances with the row's tokens).

At every draw, `mask_logits` sets the logits of the tokens a constrained row may not draw to -inf, in one
`masked_fill` over the block: unconstrained rows are drawn in the same batch, untouched. The template's
end-of-turn tokens are the grammar's end: a row may stop only once its text is complete under the schema.

The log-prob a constrained row records is that of the distribution it was drawn from: the masked, renormalized
one (the draw's own `log_softmax` of the masked logits). See docs/structured-outputs.md for what that means for
the loss.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np
import torch

from tinkerless.errors import UserError

_tokenizers: dict[tuple, Any] = {}  # (tokenizer id, stop ids, vocab size) -> (tokenizer, its llguidance wrapper)
_lock = threading.Lock()


class GrammarError(UserError):
    """A schema the grammar library cannot compile; its message names the construct."""


def _ll_tokenizer(tokenizer: Any, stop_ids: tuple[int, ...], vocab_size: int) -> Any:
    """The llguidance view of `tokenizer` (about a second for a 50k vocabulary: built once per server)."""
    import llguidance.hf

    key = (id(tokenizer), stop_ids, vocab_size)
    with _lock:
        entry = _tokenizers.get(key)
        if entry is None or entry[0] is not tokenizer:
            entry = (tokenizer, llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(stop_ids)))
            _tokenizers[key] = entry
        return entry[1]


class Grammar:
    """A compiled JSON schema for one request: `constraint()` is a fresh matcher for one row."""

    def __init__(self, tokenizer: Any, schema: dict | None, stop_ids: list[int], vocab_size: int, *,
                 lark: str | None = None):
        """A JSON schema (None: any JSON object), or a Lark grammar (`lark`, which may embed `%json` schemas)."""
        import llguidance

        self.schema = schema if schema is not None else {"type": "object"}  # json_object: any JSON object
        try:
            grammar = llguidance.LLMatcher.grammar_from_lark(lark) if lark is not None else \
                llguidance.LLMatcher.grammar_from_json_schema(json.dumps(self.schema),
                                                              defaults={"whitespace_flexible": False})
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"the JSON schema cannot be compiled: {str(exc)[:300]}") from None
        self._tokenizer = _ll_tokenizer(tokenizer, tuple(stop_ids), vocab_size)
        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise GrammarError(f"the JSON schema cannot be compiled for constrained decoding: {error[:300]}",
                               hint="simplify the schema: the construct named is not supported")
        self._grammar = grammar
        self.stop_ids = list(stop_ids)
        # False for `strict: true` tools under tool_choice auto: where the engine cannot mask (not the transformers
        # engine, or a prompt with images) the request is sampled unconstrained instead of refused.
        self.required = True

    def constraint(self) -> "TokenConstraint":
        return TokenConstraint(self)


class TokenConstraint:
    """One row's matcher: the tokens it may draw next (`allowed`), advanced with each token it drew."""

    def __init__(self, grammar: Grammar):
        import llguidance

        self.matcher = llguidance.LLMatcher(grammar._tokenizer, grammar._grammar)
        self.stop_ids = grammar.stop_ids
        if self.matcher.is_error():
            raise GrammarError(f"the JSON schema cannot be compiled: {self.matcher.get_error()[:300]}")

    def allowed(self, vocab: int) -> np.ndarray:
        """A bool array of `vocab` entries: True where the row may draw the token."""
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        if len(bits) < vocab:
            bits = np.concatenate([bits, np.zeros(vocab - len(bits), dtype=np.uint8)])
        allowed = bits[:vocab].astype(bool)
        if not allowed.any():  # a matcher in its error state allows nothing: the row ends rather than draw from NaN
            allowed[[t for t in self.stop_ids if t < vocab]] = True
        return allowed

    def advance(self, token: int) -> None:
        """The row drew `token` (always an allowed one: the mask made every other impossible)."""
        self.matcher.consume_token(token)


def mask_logits(logits: torch.Tensor, constraints: list[TokenConstraint | None]) -> torch.Tensor:
    """`logits` ([rows, vocab]) with each constrained row's disallowed tokens at -inf (a new tensor); the same
    tensor when no row is constrained."""
    if not any(c is not None for c in constraints):
        return logits
    vocab = logits.shape[-1]
    allowed = np.ones((len(constraints), vocab), dtype=bool)
    for row, constraint in enumerate(constraints):
        if constraint is not None:
            allowed[row] = constraint.allowed(vocab)
    mask = torch.from_numpy(allowed).to(logits.device, non_blocking=True)
    return logits.masked_fill(~mask, float("-inf"))
