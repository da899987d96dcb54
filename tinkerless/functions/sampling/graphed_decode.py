"""Decode steps replayed from CUDA graphs: the sampler's answer to being launch-bound on a GPU.

An eager decode step on a GPU costs tens of milliseconds whatever the model's size: hundreds of small
kernels launched one by one from Python. A CUDA graph records those launches once and replays them in
one call. A graph replays fixed addresses and shapes, so a block decoded this way keeps its keys and
values in a `DecodePool`: per layer, buffers of a fixed number of rows (`bucket`s of 1, 2, 4, 8, 16,
24, 32, 48, 64, ... rows) and a fixed number of positions, with fixed input, position and mask tensors
that each step fills before the replay. A graph is captured once per (policy, bucket, span) over the pool (the
span: the positions it attends over, the block's live width rounded up to a power of two from 128, not the pool's
whole width) and
replayed on every later step and call of that shape, until the pool is outgrown or the policy's weights
move to new storage (an optimizer step writes in place, so the graph sees it; a load that swaps
tensors, or a deleted and re-made adapter, is caught before the replay and recaptured).

What does not change: the block's rows, mask, positions and draws are the batcher's as before, so every
row draws the same tokens from its own seed. The pool keeps each row in a slot:

* **Rows that stop** leave their slot empty (nothing is copied); when the live rows fit a smaller bucket,
  they are moved to the front once, so later steps replay the smaller graph.
* **Rows that join** (continuous batching) turn the block back into the batcher's growing cache; the
  next step puts it in the pool again (one copy of the keys and values).
* **Rows of several adapters** replay a graph of their adapters stacked (`multi_lora.MultiLoRA`): each slot's
  adapter is a row of a mask buffer the graph reads, refilled when rows leave or join.
* **What cannot be graphed** runs eagerly, as on a CPU: adapters that `multi_lora` cannot stack (peft's
  per-row `adapter_names`), a block whose positions outgrow the pool's memory budget, a model in
  training mode. Those cases give the same tokens, only slower.

On a CPU the same layout runs without capturing (`TINKERLESS_STATIC_DECODE=1`): that is how the tests
check, token by token, that the pooled decode equals the eager one. `TINKERLESS_CUDA_GRAPHS=0` turns the
graphs off on a GPU (the "before" of bench/gpu_shapes.py).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Callable

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from tinkerless.functions.sampling.kv_cache import Layers

# Rows a graph is captured for: a block replays the smallest bucket that holds its highest live slot.
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
# Positions a pool is allocated with are rounded up to this (fewer pools, fewer captures).
POSITION_STEP = 128
# The pool's share of the GPU memory free when it is allocated; a block that needs more decodes eagerly.
POOL_MEMORY_SHARE = 0.25


def bucket(rows: int) -> int:
    """The smallest graph bucket holding `rows` rows."""
    return next((b for b in BUCKETS if b >= rows), -(-rows // 128) * 128)


def attention_span(width: int) -> int:
    """The positions a graph over a block of `width` reads: the next power of two from POSITION_STEP on (at most
    twice the live width, and few spans to capture: a pool of 2048 positions has 5)."""
    span = POSITION_STEP
    while span < width:
        span *= 2
    return span


def graphed_decoder(model, device: torch.device) -> "GraphedDecoder | None":
    """The engine's graphed decoder: on CUDA (unless TINKERLESS_CUDA_GRAPHS=0), or on any device with
    TINKERLESS_STATIC_DECODE=1 (the pooled layout run eagerly, for tests); None otherwise."""
    if device.type == "cuda" and os.environ.get("TINKERLESS_CUDA_GRAPHS", "1") != "0":
        return GraphedDecoder(model, capture=True)
    if os.environ.get("TINKERLESS_STATIC_DECODE", "0") == "1":
        return GraphedDecoder(model, capture=False)
    return None


class DecodePool:
    """Fixed buffers one block decodes in: per layer keys and values (rows, kv_heads, positions, head_dim),
    and the step's inputs (token, position, mask) and write column."""

    def __init__(self, like: Layers, rows: int, positions: int):
        keys, _ = like[0]
        self.rows, self.positions = rows, positions
        shape = (rows, keys.shape[1], positions, keys.shape[3])
        # zeros: a slot no row holds is read by the replay; its keys must be finite (a masked NaN still poisons)
        self.layers = [(k.new_zeros(shape), v.new_zeros(shape)) for k, v in like]
        self.input_ids = torch.zeros((rows, 1), dtype=torch.long, device=keys.device)
        self.position_ids = torch.zeros((rows, 1), dtype=torch.long, device=keys.device)
        self.mask = torch.zeros((rows, 1, 1, positions), dtype=torch.bool, device=keys.device)
        self.column = torch.zeros((1,), dtype=torch.long, device=keys.device)

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.layers)

    def reset_rows(self, rows: int) -> None:
        """Masks of the first `rows` slots cleared; every slot sees position 0 (an empty slot's attention then
        has one finite term, so its replayed rows stay finite)."""
        self.mask[:rows].zero_()
        self.mask[:, 0, 0, 0] = True

    def cache(self, rows: int, span: int) -> DynamicCache:
        """The transformers cache a graph of `rows` rows runs with: writes at `column`, reads the first `span`
        positions (the live width rounded up to POSITION_STEP, not the whole pool)."""
        cache = DynamicCache()
        cache.layers = [_PoolLayer(k[:rows, :, :span], v[:rows, :, :span], self.column) for k, v in self.layers]
        return cache


class _PoolLayer(DynamicLayer):
    """One layer of a pool as transformers sees it: `update` writes the step's keys/values at `column` (a
    device tensor, so a replay writes where that step's inputs say) and attends over every position (the mask
    hides those no row holds)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, column: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.column = keys, values, column
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys.index_copy_(2, self.column, key_states)
        self.values.index_copy_(2, self.column, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.keys.shape[-2]


class PooledCache:
    """A block's KV cache while it lives in the pool: which slot holds each row, and how many positions are
    filled (the batcher's `attention` width after the last forward)."""

    def __init__(self, pool: DecodePool, slots: list[int], length: int):
        self.pool, self.slots, self.length = pool, slots, length
        self._slot_index: torch.Tensor | None = None

    @property
    def slot_index(self) -> torch.Tensor:
        if self._slot_index is None:
            self._slot_index = torch.tensor(self.slots, dtype=torch.long, device=self.pool.column.device)
        return self._slot_index

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows `indices` (rows that stopped leave their slots; nothing is copied)."""
        self.slots = [self.slots[i] for i in indices.tolist()]
        self._slot_index = None

    def compact(self) -> None:
        """Move the live rows to the front slots (a smaller bucket's graph then serves them)."""
        live = len(self.slots)
        if self.slots == list(range(live)):
            return
        index = self.slot_index
        for keys, values in self.pool.layers:
            keys[:live] = keys.index_select(0, index)
            values[:live] = values.index_select(0, index)
        self.pool.mask[:live] = self.pool.mask.index_select(0, index)
        self.slots, self._slot_index = list(range(live)), None

    def row_layers(self, row: int, mask: torch.Tensor) -> Layers:
        """One row's keys/values at the positions `mask` marks real, as new tensors (`kv_cache.row_layers`)."""
        keep, slot = mask.nonzero().squeeze(1), self.slots[row]
        return [(k[slot].index_select(1, keep), v[slot].index_select(1, keep)) for k, v in self.pool.layers]

    def to_growing(self) -> DynamicCache:
        """The rows' keys/values copied out into the batcher's growing cache (rows are joining the block)."""
        from tinkerless.functions.sampling.kv_cache import growing_cache

        index, length = self.slot_index, self.length
        return growing_cache([(k.index_select(0, index)[:, :, :length], v.index_select(0, index)[:, :, :length])
                              for k, v in self.pool.layers], length)


class _Graph:
    """One captured (or, without capture, eagerly run) forward over a pool's first `rows` slots."""

    def __init__(self, run: Callable[[], torch.Tensor], capture: bool, memory_pool, watched: list):
        self.watched = watched  # what the weights were at capture (`_weights_watch`)
        self._run = run
        self.graph = None
        if not capture:
            self.logits = None
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the capture: cuBLAS handles, lazy LoRA views, autotuning
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: other threads' CUDA work (an update beside the sampler) does not break this capture
        with torch.cuda.graph(self.graph, pool=memory_pool, capture_error_mode="thread_local"):
            self.logits = run()

    def replay(self) -> torch.Tensor:
        if self.graph is None:
            self.logits = self._run()
        else:
            self.graph.replay()
        return self.logits


class GraphedDecoder:
    """Decodes a block's steps from graphs over one pool (see the module docstring)."""

    def __init__(self, model, capture: bool):
        self.model, self.capture = model, capture
        self.pool: DecodePool | None = None
        self._graphs: dict[tuple[str, int, int], _Graph] = {}  # (adapter, rows, positions read)
        self._memory_pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0  # statistics for tests and benchmarks
        self.captures = 0
        self.captured: set[str] = set()  # adapters a graph was captured for
        self.eager_steps = 0  # steps of blocks that could not be graphed
        self.disabled: str | None = None  # why graphs are off (a capture failed)
        self._masks: dict[tuple[str, int], tuple] = {}  # mixed graphs' slot masks: (buffer, what it was filled with)

    def takes(self, block, adapters: set[str], stacked: bool = False) -> bool:
        """Whether this block's next step can replay a graph: one adapter (or several `stacked` in a
        `multi_lora.MultiLoRA`), positions within the pool budget."""
        if (len(adapters) != 1 and not stacked) or self.model.training or self.disabled:
            return False
        if isinstance(block.cache, PooledCache):
            pool = block.cache.pool
            return block.attention.shape[1] <= pool.positions and len(block.cache.slots) <= pool.rows
        return True

    def decode(self, block, adapter: str, context, mixed: tuple | None = None) -> torch.Tensor | None:
        """Run the block's next step from a graph (putting the block in the pool first if needed); the last
        position's logits of its rows, in row order. None: the block cannot live in a pool (over budget).
        `mixed`: (a MultiLoRA, each row's adapter) for a block of several adapters: its graph reads each slot's
        adapter from a mask buffer filled here (`multi_lora`)."""
        if not isinstance(block.cache, PooledCache) and not self._adopt(block):
            return None
        cache: PooledCache = block.cache
        pool, width = cache.pool, block.attention.shape[1]
        if bucket(max(cache.slots) + 1) > bucket(len(cache.slots)):
            cache.compact()
        index = cache.slot_index
        pool.input_ids.index_copy_(0, index, block.input)
        pool.position_ids.index_copy_(0, index, block.positions)
        pool.mask[:, 0, 0, :width].index_copy_(0, index, block.attention.bool())
        pool.column.fill_(width - 1)
        rows = bucket(max(cache.slots) + 1)
        span = min(pool.positions, attention_span(width))  # attend over the live width only
        multi = None
        if mixed is not None:
            multi, names = mixed
            adapter = "mixed:" + ",".join(multi.adapters)
            context = _within(context, multi.using(self._slot_mask(adapter, rows, multi, cache.slots, names)))
        with context:
            try:
                graph = self._graph(adapter, rows, span, multi)
            except Exception as exc:  # noqa: BLE001 - a forward that cannot be captured runs eagerly from now on
                self.disable(exc)
                return None
            logits = graph.replay()
        cache.length = width
        self.replays += 1
        return logits[:, -1, :].index_select(0, index).float()

    def disable(self, reason: Exception) -> None:
        """Decode eagerly from now on (a capture failed: the model does something a graph cannot replay)."""
        warnings.warn(f"CUDA graphs are off for this engine, sampling runs eagerly: {type(reason).__name__}: {reason}",
                      RuntimeWarning, stacklevel=2)
        self.disabled = f"{type(reason).__name__}: {reason}"
        self.release()

    def release(self) -> None:
        """Drop the pool and every graph (their memory goes back to the allocator)."""
        self.pool = None
        self._graphs.clear()
        self._masks.clear()
        if self.capture:  # a pool id whose graphs are all gone cannot take new captures: the next pool gets its own
            self._memory_pool = torch.cuda.graph_pool_handle()

    # -- the pool and the graphs -------------------------------------------------------

    def _adopt(self, block) -> bool:
        """Copy the block's growing cache into the pool's first slots (allocating a larger pool if needed)."""
        layers = [(layer.keys, layer.values) for layer in block.cache.layers]
        rows, length = block.input.shape[0], layers[0][0].shape[2]
        reach = block.attention.shape[1] + max(m.job.sampling.max_tokens - min(len(r.tokens) for r in m.job.rows)
                                               for m in block.members)
        positions = -(-reach // POSITION_STEP) * POSITION_STEP
        pool = self.pool
        if pool is None or pool.rows < rows or pool.positions < positions or pool.layers[0][0].dtype != layers[0][0].dtype:
            wanted_rows = max(bucket(rows), pool.rows if pool is not None else 0)
            wanted_positions = max(positions, pool.positions if pool is not None else 0)
            self.release()
            if not self._affordable(layers, wanted_rows, wanted_positions):
                wanted_rows, wanted_positions = bucket(rows), positions
                if not self._affordable(layers, wanted_rows, wanted_positions):
                    return False
            pool = self.pool = DecodePool(layers, wanted_rows, wanted_positions)
        for (keys, values), (k, v) in zip(pool.layers, layers):
            keys[:rows, :, :length] = k
            values[:rows, :, :length] = v
        pool.reset_rows(rows)
        block.cache = PooledCache(pool, list(range(rows)), length)
        return True

    def _affordable(self, layers: Layers, rows: int, positions: int) -> bool:
        keys = layers[0][0]
        nbytes = 2 * len(layers) * rows * keys.shape[1] * positions * keys.shape[3] * keys.element_size()
        if keys.device.type != "cuda":
            return True
        from tinkerless.functions.training.micro_batches import gpu_available_bytes

        return nbytes <= POOL_MEMORY_SHARE * gpu_available_bytes(keys.device)

    def _slot_mask(self, key: str, rows: int, multi, slots: list[int], names: list[str]) -> torch.Tensor:
        """The (rows, adapters) mask a mixed graph reads, with each slot's adapter set (refilled only when the
        block's rows or adapters changed since the last fill)."""
        buffer, filled = self._masks.get((key, rows), (None, None))
        like = multi.groups[0].a_cat
        if buffer is None or buffer.shape[1] != len(multi.adapters) or buffer.dtype != like.dtype:
            buffer, filled = like.new_zeros((rows, len(multi.adapters))), None
        wanted = (tuple(slots), tuple(names), tuple(multi.adapters))
        if filled != wanted:
            column = {name: i for i, name in enumerate(multi.adapters)}
            host = torch.zeros((rows, len(multi.adapters)), dtype=buffer.dtype)
            for slot, name in zip(slots, names):
                if name in column:
                    host[slot, column[name]] = 1
            buffer.copy_(host)
        self._masks[(key, rows)] = (buffer, wanted)
        return buffer

    def _graph(self, adapter: str, rows: int, span: int, multi=None) -> _Graph:
        """The graph of `adapter` over the pool's first `rows` slots and `span` positions, captured on first use or
        when the adapter's weights moved to other storage since (a mixed graph: when its MultiLoRA is no longer
        the current one)."""
        key = (adapter, rows, span)
        graph = self._graphs.get(key)
        stale = graph is not None and (graph.watched is not multi or not multi.current() if multi is not None
                                       else not _unchanged(graph.watched, adapter))
        if stale:
            self._graphs = {k: g for k, g in self._graphs.items() if k[0] != adapter}
            graph = None
        if graph is None:
            pool = self.pool
            cache = pool.cache(rows, span)
            inputs = dict(input_ids=pool.input_ids[:rows], attention_mask=pool.mask[:rows, :, :, :span],
                          position_ids=pool.position_ids[:rows], past_key_values=cache, use_cache=True,
                          logits_to_keep=1)
            graph = _Graph(lambda: self.model(**inputs).logits, self.capture, self._memory_pool,
                           multi if multi is not None else _weights_watch(self.model, adapter))
            self._graphs[key] = graph
            self.captures += 1
            self.captured.add(adapter)
        return graph


@contextlib.contextmanager
def _within(first, second):
    with first, second:
        yield


def _weights_watch(model, adapter: str) -> list:
    """What a graph of `adapter` was captured over: each LoRA layer with the sampling views it read (the lean
    path's, `lora_inference`) and the storage of the adapter's weights in it."""
    from tinkerless.functions.sampling.lora_inference import views_of

    return [(module, views_of(module, adapter), _pointers(module, adapter))
            for module in model.modules() if isinstance(getattr(module, "lora_A", None), torch.nn.ModuleDict)]


def _pointers(module, adapter: str) -> tuple[int, ...]:
    """Where `module` holds `adapter`'s LoRA weights now (plain dict reads: this runs in every layer, every step)."""
    lora_a = module._modules["lora_A"]._modules.get(adapter)
    if lora_a is None:
        return ()
    lora_b = module._modules["lora_B"]._modules[adapter]
    return (lora_a._parameters["weight"].data_ptr(), lora_b._parameters["weight"].data_ptr())


def _unchanged(watched: list, adapter: str) -> bool:
    """The adapter's weights are where the graph reads them (an in-place write shows through; sampling copies in
    another dtype are refreshed in place here, before the replay reads them)."""
    from tinkerless.functions.sampling.lora_inference import views_current

    for module, views, pointers in watched:
        if _pointers(module, adapter) != pointers:
            return False
        if views is not None and not views_current(module, views):
            return False
    return True
