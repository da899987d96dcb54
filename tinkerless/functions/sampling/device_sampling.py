"""The draw of each row's next token, as tensor ops on the logits' own device: no host round trip.

Two parts:

* **Counter-based uniforms.** Row r's uniform for its token at position t (0: the first token it draws) is
  a hash of (the row's seed, t) and nothing else (`counter_uniforms`). The hash is integer tensor arithmetic
  that never overflows int64 (32-bit words, products split into 16-bit halves), so a CPU and a GPU compute
  the same bits; the 24 high bits become a float32 in [0, 1) exactly, as `torch.rand` makes one. A row's
  draws therefore depend on neither the other rows of its batch, nor how its steps are grouped, nor the
  device, nor any generator state to carry between steps: a decode loop can run many steps on the device
  and read the tokens back once (`device_decode`).
* **Per-row settings.** Temperature, top-k and top-p are per-row tensors (`DrawSettings`), so rows of
  calls with different settings share one draw; the filters are transformers' `TopKLogitsWarper` and
  `TopPLogitsWarper` computed row-wise (tests/test_device_sampling.py checks them against transformers),
  then the inverse CDF of the softmax with the row's uniform. A row without top-k (or top-p) is left
  bit-for-bit untouched by the filter, so it draws exactly what it would alone.

The finiteness check is returned as a tensor (`Draw.finite`), not read: the caller reads it where it
syncs anyway (every step in the one-step loop, once per chunk in `device_decode`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinkerless.errors import UserError
from tinkerless.wire.messages import GREEDY_BELOW, SamplingParams

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9  # 2^32 / phi: spreads consecutive positions over the 32-bit words
_SEED_SALT = 0x243F6A88  # pi's first hex digits: the seed's words are not hashed raw
_KEY_SALT = 0x85A308D3


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2^32 for int64 x in [0, 2^32): the constant's 16-bit halves keep every product
    under 2^48, so no int64 ever overflows (overflow is where CPU and GPU results could part)."""
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash (Wellons' "lowbias32": xorshift-multiply, xorshift-multiply, xorshift) of
    int64 words in [0, 2^32); shifts of non-negative words are logical shifts."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_keys(seeds: list[int]) -> torch.Tensor:
    """(rows, 2) int64 hash keys of the rows' seeds (any ints, taken modulo 2^64), on the CPU: computed once per
    row, kept with it."""
    words = torch.tensor([[s & _MASK32, (s >> 32) & _MASK32] for s in seeds], dtype=torch.long).view(-1, 2)
    low, high = words[:, 0], words[:, 1]
    first = _mix32(low ^ _mix32(high ^ _SEED_SALT))
    return torch.stack([first, _mix32(first ^ _KEY_SALT)], dim=-1)


def counter_uniforms(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in [0, 1) with 24 random bits: row r's at token position positions[r, ...] (any shape
    whose first dimension is the rows), a function of (keys[r], position) only."""
    keys = keys.view(keys.shape[0], *([1] * (positions.dim() - 1)), 2)
    spread = (_mul32(positions & _MASK32, _GOLDEN) + keys[..., 0]) & _MASK32
    bits = _mix32(_mix32(spread) ^ keys[..., 1])
    return (bits >> 8).to(torch.float32) * (1.0 / (1 << 24))


@dataclass
class DrawSettings:
    """Each row's draw: its hash keys and sampling settings, as tensors on the draw's device; and what the
    host knows of them all (which filters any row uses), so unused work is skipped without a device read."""

    keys: torch.Tensor  # (rows, 2) int64: `row_keys` of the rows' seeds
    greedy: torch.Tensor  # (rows,) bool
    temperature: torch.Tensor  # (rows,) float32; 1 for greedy rows (never divided by ~0)
    top_k: torch.Tensor  # (rows,) int64; 0: off
    top_p: torch.Tensor  # (rows,) float32; 1: off
    all_greedy: bool
    any_greedy: bool
    top_k_max: int  # the largest top_k of any sampled row (0: no row filters by top-k)
    any_top_p: bool

    @classmethod
    def of(cls, keys: list[list[int]] | torch.Tensor, settings: list[SamplingParams],
           device: torch.device | str) -> DrawSettings:
        """The settings of rows with hash keys `keys` (`row_keys`), row i drawing by `settings[i]` (often the same
        object)."""
        greedy = [s.temperature < GREEDY_BELOW for s in settings]
        top_k = [0 if g or not s.top_k or s.top_k <= 0 else int(s.top_k) for s, g in zip(settings, greedy)]
        top_p = [1.0 if g or s.top_p >= 1.0 else float(s.top_p) for s, g in zip(settings, greedy)]
        temperature = [1.0 if g else float(s.temperature) for s, g in zip(settings, greedy)]
        return cls(
            keys=torch.as_tensor(keys, dtype=torch.long).view(-1, 2).to(device),
            greedy=torch.tensor(greedy, dtype=torch.bool).to(device),
            temperature=torch.tensor(temperature, dtype=torch.float32).to(device),
            top_k=torch.tensor(top_k, dtype=torch.long).to(device),
            top_p=torch.tensor(top_p, dtype=torch.float32).to(device),
            all_greedy=all(greedy), any_greedy=any(greedy), top_k_max=max(top_k, default=0), any_top_p=any(p < 1.0 for p in top_p),
        )

    def select(self, index: torch.Tensor) -> DrawSettings:
        """The settings of rows `index` (the host flags kept: a superset of the selected rows' needs)."""
        return DrawSettings(self.keys[index], self.greedy[index], self.temperature[index], self.top_k[index],
                            self.top_p[index], self.all_greedy, self.any_greedy, self.top_k_max, self.any_top_p)


@dataclass
class Draw:
    tokens: torch.Tensor  # (rows,) int64, always within the vocabulary (a non-finite row's pick is clamped)
    logprobs: torch.Tensor  # (rows,) float32: of the untempered distribution (what training recomputes)
    finite: torch.Tensor  # (rows,) bool: the row's distribution was finite (else its pick must not be recorded)


def filtered_scores(logits: torch.Tensor, settings: DrawSettings) -> torch.Tensor:
    """The tempered logits with each row's top-k, then top-p, filter applied (removed tokens at -inf), exactly
    as transformers' TopKLogitsWarper and TopPLogitsWarper do for that row's settings."""
    scores = logits / settings.temperature[:, None]
    vocab = scores.shape[-1]
    if settings.top_k_max:
        width = min(settings.top_k_max, vocab)
        kth = scores.topk(width, dim=-1).values.gather(1, (settings.top_k.clamp(1, width) - 1)[:, None])
        remove = (scores < kth) & (settings.top_k > 0)[:, None]
        scores = scores.masked_fill(remove, float("-inf"))
    if settings.any_top_p:
        ordered, order = scores.sort(dim=-1, descending=False)
        mass = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = mass <= (1 - settings.top_p)[:, None]
        drop[:, -1] = False  # the most likely token always stays (min_tokens_to_keep=1)
        drop &= (settings.top_p < 1)[:, None]
        scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return scores


def sample(logits: torch.Tensor, settings: DrawSettings, positions: torch.Tensor | None,
           uniforms: torch.Tensor | None = None) -> Draw:
    """Each row's token from `logits` (rows, vocab), float32: greedy rows by argmax, the others by the inverse
    CDF of their filtered softmax with their uniform at `positions` (rows,), or with `uniforms` (rows,) computed
    ahead (`counter_uniforms` of several steps at once: one hash per chunk, not per step). No host read."""
    logprobs = torch.log_softmax(logits, dim=-1)
    greedy_tokens = logits.argmax(dim=-1) if settings.any_greedy else None
    if settings.all_greedy:
        picked = logprobs.gather(1, greedy_tokens[:, None]).squeeze(1)
        return Draw(greedy_tokens, picked, torch.isfinite(picked))  # argmax picks something even from NaN logits
    cdf = torch.softmax(filtered_scores(logits, settings), dim=-1).cumsum(dim=-1)
    total = cdf[:, -1]
    # right=True: the first token whose cumulative mass exceeds u, so a zero-probability token (filtered) is never
    # picked; u < total mass, clamped against rounding; a non-finite row's pick is clamped into the vocabulary
    # (it is refused through `finite`, but the step after it must still index the embedding table safely).
    if uniforms is None:
        uniforms = counter_uniforms(settings.keys, positions)
    targets = torch.minimum(uniforms * total, total * (1 - 1e-6))
    drawn = torch.searchsorted(cdf, targets[:, None], right=True).squeeze(1).clamp_(0, logits.shape[-1] - 1)
    if not settings.any_greedy:
        return Draw(drawn, logprobs.gather(1, drawn[:, None]).squeeze(1), torch.isfinite(total))
    tokens = torch.where(settings.greedy, greedy_tokens, drawn)
    picked = logprobs.gather(1, tokens[:, None]).squeeze(1)
    finite = torch.where(settings.greedy, torch.isfinite(picked), torch.isfinite(total))
    return Draw(tokens, picked, finite)


def draw_rows(logits: torch.Tensor, settings: DrawSettings, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample`, refusing non-finite rows at once (the one-step loop, which reads every step's picks anyway):
    each row's token and its log-prob."""
    draw = sample(logits, settings, positions)
    check_finite(draw.finite)
    return draw.tokens, draw.logprobs


def check_finite(finite: torch.Tensor) -> None:
    """Refuse to sample from NaN or infinite logits (a diverged adapter): they draw arbitrary tokens with NaN
    log-probs, which must never be recorded as the policy's samples. (A host read of `finite`.)"""
    if not bool(finite.all()):
        raise UserError(
            "the model's output is not finite (NaN or inf) for this policy: its weights have diverged",
            hint="load an earlier checkpoint or reset the policy, then train with a lower learning rate "
            "or grad_clip_norm",
        )
