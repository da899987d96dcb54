"""Conversations' KV caches kept between generate calls, so a new turn prefills only what was appended.

A `KVSession` is the handle of one conversation (an episode, or one role of a multi-agent game):
the caller passes the same handle with each turn's prompt. When the conversation's row finishes
decoding, the engine moves the row's keys and values into the handle; the next call takes them
back if they were computed for a prefix of the new prompt, by the same weights, and prefills only
the tokens after that prefix. Anything else (another prefix, weights changed in between, the
store's byte budget full, the cache switched off) falls back to a full prefill: the same tokens,
only slower. A handle holds memory until its next call or until it is closed; the caller closes
it when the conversation ends.

Taking a cache empties the handle (the keys and values move into the running batch), so no
cache is ever held twice, and a row that fails loses only its own cache.
"""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

# What the kept caches of one engine may hold together; more falls back to full prefill (~23k positions of SmolLM2 in fp32).
DEFAULT_MAX_SESSION_BYTES = 1 << 30
# TINKERLESS_KV_CACHE=0 turns the cache off (every turn re-prefills the whole conversation: the "before" of bench/multiturn.py).
ENV_SWITCH = "TINKERLESS_KV_CACHE"

Layers = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys and values, each (kv_heads, positions, head_dim)


class KVSession:
    """One conversation's KV cache between turns; empty until a generate call fills it."""

    def __init__(self) -> None:
        self.tokens: list[int] = []  # the tokens whose keys/values are held, in order
        self.layers: Layers | None = None
        self.weights: object = None  # the weights tag they were computed with (`TransformersEngine.weights_tag`)
        self.nbytes = 0

    @property
    def held(self) -> bool:
        return self.layers is not None

    def close(self) -> None:
        """Free the held cache now (the conversation ended, or its cache moved into a batch)."""
        self.tokens, self.layers, self.weights, self.nbytes = [], None, None, 0


@dataclass
class Continuation:
    """What a row's prefill starts from: the cached keys/values of its prompt's first `length` tokens."""
    layers: Layers
    length: int


class KVSessionStore:
    """The engine's budget for kept caches, and the rules for taking and keeping them."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_SESSION_BYTES, enabled: bool | None = None):
        self.max_bytes = max_bytes
        self.enabled = os.environ.get(ENV_SWITCH, "1") != "0" if enabled is None else enabled
        self._holding: weakref.WeakSet[KVSession] = weakref.WeakSet()  # a dropped handle frees its budget too
        self._lock = threading.Lock()
        self.hits = 0  # statistics for tests and benchmarks
        self.misses = 0
        self.refused = 0  # caches not kept: over budget

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(s.nbytes for s in list(self._holding))

    def take(self, session: KVSession, prompt: list[int], weights: object) -> Continuation | None:
        """The session's cache for the longest prefix it shares with `prompt` (at least one prompt token is
        left to prefill: its logits start the turn), or None. The session is empty afterwards either way."""
        layers, tokens, made_with = session.layers, session.tokens, session.weights
        with self._lock:
            self._holding.discard(session)
        session.close()
        if layers is None or not self.enabled:
            return None
        length = min(_common_prefix(tokens, prompt), len(prompt) - 1)
        if made_with != weights or length <= 0:
            self.misses += 1
            return None
        self.hits += 1
        if length < len(tokens):  # the conversation was edited after this point: keep only what still matches
            layers = [(k[:, :length].contiguous(), v[:, :length].contiguous()) for k, v in layers]
        return Continuation(layers, length)

    def keep(self, session: KVSession, tokens: list[int], layers: Layers, weights: object) -> bool:
        """Store a finished row's cache in its session, if the budget allows (else the next turn re-prefills)."""
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)
        with self._lock:
            self._holding.discard(session)
            session.close()
            if not self.enabled:
                return False
            if sum(s.nbytes for s in list(self._holding)) + nbytes > self.max_bytes:
                self.refused += 1
                return False
            session.tokens, session.layers, session.weights, session.nbytes = list(tokens), layers, weights, nbytes
            self._holding.add(session)
        return True


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case (the new prompt extends the old one), compared in C
        return n
    return next(i for i in range(n) if a[i] != b[i])


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys/values live in a preallocated buffer, written in place.

    transformers' DynamicLayer appends each decoded token with `torch.cat` of the whole cache, a copy of
    every layer's keys and values per token. Here they live at the front of a buffer with room to spare
    (`capacity` positions, doubled when full), `keys`/`values` are views of the filled part, and a decode
    step writes only its own position. Assigning `keys`/`values` (as DynamicLayer's own methods and the
    batcher's merges do) adopts the new tensors as the buffer, to grow again when needed.
    """

    def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None, length: int | None = None,
                 reserve: int = 0):
        self._keys = self._values = None
        self.length = 0
        self.reserve = reserve  # spare positions to allocate beyond the first update's
        super().__init__()  # sets keys/values to None, through the setters
        if keys is not None:
            self.adopt(keys, values, keys.shape[-2] if length is None else length)

    def adopt(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """Use `keys`/`values` (batch, kv_heads, capacity, head_dim) as the buffers, their first `length` positions filled."""
        self._keys, self._values, self.length = keys, values, length
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._keys is None else self._keys[:, :, : self.length]

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        self._keys = tensor
        self.length = 0 if tensor is None or tensor.dim() < 3 else tensor.shape[-2]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._values is None else self._values[:, :, : self.length]

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        self._values = tensor

    @property
    def capacity(self) -> int:
        return 0 if self._keys is None or self._keys.dim() < 3 else self._keys.shape[-2]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            self._grow(max(end + (self.reserve if not self.length else 0), 2 * self.capacity), key_states)
        self._keys[:, :, self.length : end].copy_(key_states)
        self._values[:, :, self.length : end].copy_(value_states)
        self.length = end
        return self.keys, self.values

    def _grow(self, capacity: int, like: torch.Tensor) -> None:
        """New buffers of `capacity` positions holding the filled part (one copy, amortized over the doubling)."""
        shape = (*like.shape[:2], capacity, like.shape[-1])
        keys, values = like.new_empty(shape), like.new_empty(shape)
        if self.length:
            keys[:, :, : self.length].copy_(self.keys)
            values[:, :, : self.length].copy_(self.values)
        length = self.length
        self.adopt(keys, values, length)

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows `indices` (repeats allowed), with their room to decode into: one copy of the buffers."""
        if self.length:
            self.adopt(self._keys.index_select(0, indices), self._values.index_select(0, indices), self.length)


def stack_left_padded(tensors: list[torch.Tensor], width: int, capacity: int) -> torch.Tensor:
    """`tensors` (rows, kv_heads, positions, head_dim) stacked by rows into one new buffer of `capacity` positions,
    each right-aligned at position `width`; the left padding is zeros (masked positions, but they must be finite:
    a masked NaN would still poison the attention's weighted sum)."""
    first = tensors[0]
    buffer = first.new_empty((sum(t.shape[0] for t in tensors), first.shape[1], capacity, first.shape[3]))
    start = 0
    for tensor in tensors:
        end, filled = start + tensor.shape[0], tensor.shape[2]
        buffer[start:end, :, : width - filled].zero_()
        buffer[start:end, :, width - filled : width].copy_(tensor)
        start = end
    return buffer


def growing_cache(layers: Layers | None = None, length: int | None = None, reserve: int = 0) -> DynamicCache:
    """A DynamicCache of GrowingLayers: over `layers` (per layer, key and value buffers whose first `length`
    positions are filled; all of them by default), or empty, each layer reserving `reserve` spare positions
    beyond its first update (the tokens the batch will decode)."""
    cache = DynamicCache()
    if layers is None:
        cache.layer_class_to_replicate = lambda: GrowingLayer(reserve=reserve)
    else:
        cache.layers = [GrowingLayer(k, v, length) for k, v in layers]
    return cache


def row_layers(layers, row: int, mask: torch.Tensor) -> Layers:
    """One row's keys/values at the positions `mask` marks real (a batch cache is padded), as new tensors."""
    keep = mask.nonzero().squeeze(1)
    return [(layer.keys[row].index_select(1, keep), layer.values[row].index_select(1, keep)) for layer in layers]


def length_buckets(lengths: list[int], max_padding: float) -> list[list[int]]:
    """Indices of `lengths` grouped for left-padded forwards, longest first: a row joins the current group
    while the group's padding stays within `max_padding` times its real tokens (0: equal lengths only)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    buckets: list[list[int]] = []
    real = 0
    for i in order:
        if buckets:
            bucket = buckets[-1]
            width, grown = lengths[bucket[0]], real + lengths[i]
            if width * (len(bucket) + 1) - grown <= max_padding * grown:
                bucket.append(i)
                real = grown
                continue
        buckets.append([i])
        real = lengths[i]
    return buckets
