"""The attention backend interface: the one place that knows where KV lives.

Every attention layer of every model calls `backend.attend(...)` with its already projected and
rotated q and the new k, v of this step; the backend stores k, v in its own per-layer cache state
(an explicit pytree passed in and returned, so the whole step stays a pure, jittable function) and
returns the attention output. `full` (all KV on the device) is `jhybrid.attention.full`; the
offloading modes are `jhybrid.hybrid.HybridAttention`. Callers use exactly what this class declares:

    backend.open(model_config, batch, max_len)     # host side for this batch (no-op for full)
    cache = model.init_cache(batch, max_len, backend)       # device side: pure, nothing else
    for each step:
        cache = backend.before_step(cache, positions)       # per-step host work (eviction, ...)
        logits, cache = step(params, tokens, positions, cache)  # each layer calls attend(...)
    backend.counters(); backend.row_fields(); backend.close()

Position convention (all backends): `positions [B, T]` int32 holds each token's absolute position
in its sequence; a padding slot has position -1 and must be neither stored nor attended. Valid
positions of one sequence are contiguous and start at that sequence's current length, so a ragged
batch is right-padded within each step (prompt tokens first, -1 slots after).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

if TYPE_CHECKING:  # the models import the attention package, not the other way round
    from jhybrid.models.config import ModelConfig

LayerCache = Any  # a backend-defined pytree of arrays with static shapes


@dataclasses.dataclass(frozen=True)
class LayerContext:
    """What a backend may want besides q/k/v (most backends ignore most of it).

    scale: the score scale (the model's attention_scale).
    num_layers: decoder layers of the model (the layer index comes with `attend`).
    sliding_window: attend only to keys with q_pos - key_pos < sliding_window (None: no window).
    meta: the backend's per-step metadata (`KVCache.meta`, built by `before_step`; None for full).
    carry: what the previous layer's `attend` handed on within this step (None for the first
        layer and for backends that hand nothing on).
    next_query: [B, T, Hq, D] the query of layer `backend.query_ahead(layer, config)` (the next
        layer, or with sliding-window layers between them the next global one) predicted from this
        layer's input (that layer's norm, W_q and RoPE applied to this layer's input); None when the
        backend asks for none.
    global_layers: indices of the model's layers that attend the whole context (not sliding-window);
        None when every layer does.
    """

    scale: float
    num_layers: int = 1
    sliding_window: int | None = None
    meta: Any = None
    carry: Any = None
    next_query: jax.Array | None = None
    global_layers: tuple[int, ...] | None = None


class RowKV(abc.ABC):
    """How one row's tokens lie in a backend's layer caches (a jit static: hashable); traced code."""

    @abc.abstractmethod
    def read(self, layers, row, positions):
        """-> [L, 2, T, Hkv, D]: every layer's K (index 0) and V at positions [T] of row `row`
        (a traced int32; each position below the row's length)."""

    @abc.abstractmethod
    def write(self, layers, row, kv, positions):
        """-> layers with kv [L, 2, T, Hkv, D] written at positions [T] of row `row` exactly as a
        prefill of those tokens leaves them (position -1: dropped)."""


class AttentionBackend(abc.ABC):
    """Interface every attention mode implements. Instances are jit statics (hashable). The traced
    computation of `full` depends only on its configuration; an offloading backend's host calls reach
    its own open host side, so a compiled step belongs to that backend object (cache executables per
    object, not per equal configuration)."""

    name: str = "abstract"
    # True for offloading modes that can hold more context than the device cache: generation then
    # lets prompts exceed the model's cache instead of raising.
    handles_long_context: bool = False

    # ---- host side: lifetime and per-step work (no-ops unless a backend needs them) ----------------
    def open(self, config: ModelConfig, batch_size: int, max_len: int, dtype=None) -> "AttentionBackend":
        """Prepare the host side for `batch_size` sequences of up to `max_len` tokens (replacing any
        earlier batch); returns self. Call before running steps on a cache of that shape."""
        return self

    def close(self) -> None:
        """Release the host side (threads, host memory)."""

    def before_step(self, cache, positions):
        """Per-step host work before the step with positions [B, T] (NumPy int32); returns the cache."""
        return cache

    def overlap_dispatch(self) -> bool:
        """The driver will call `after_dispatch` right after every call it dispatches, from now on:
        host work the backend can do in the call's shadow moves there from `before_step`. Returns
        whether the backend has such work (False: after_dispatch is the identity)."""
        return False

    def after_dispatch(self, cache):
        """(after `overlap_dispatch`) Host work right after a call's dispatch, while the device runs
        it; `cache` is the call's output (not yet computed). Returns the cache for the next call. By
        default the cache."""
        return cache

    def can_pack(self, positions) -> bool:
        """(a backend that `packs_decode`) May the prefill chunks of positions [B, C] (NumPy int32,
        -1 = padding; rows without a token in them may decode) ride in one call with decode tokens?"""
        return self.packs_decode

    def packed_variant(self, cache):
        """The cache as `before_packed_step` hands it to a packed step (arrays or ShapeDtypeStructs),
        for compiling the packed steps ahead (`ServingEngine.compile_steps`), of a `prefill_variants`
        cache; None: such a prefill never packs. By default the cache."""
        return cache

    def before_packed_step(self, cache, positions, decode_positions):
        """The host work before a packed step (`packs_decode`, `PackedRows`): prefill chunks at
        positions [B, C] (NumPy int32, -1 = padding) and decode tokens at decode_positions [B] (-1: the
        row does not decode; a row is in at most one group). Returns the cache. By default the
        `before_step` of the positions with each decode position in its row's first column."""
        merged = np.array(positions, np.int32, copy=True)
        decode_positions = np.asarray(decode_positions)
        merged[:, 0] = np.where(decode_positions >= 0, decode_positions, merged[:, 0])
        return self.before_step(cache, merged)

    # True when `reset_rows` is implemented: a serving engine may then start a new sequence in a row
    # while the other rows go on (continuous batching).
    reuses_rows: bool = False
    # True when a step may run over some rows of the batch (the cache's meta from `rows_meta`): the
    # serving engine then prefills only the rows that are prefilling.
    prefills_rows: bool = False
    # True when what a row keeps depends on where its prefill chunks end (the offloading modes: their
    # eviction and attention weights step once per chunk): the serving engine then gives every row
    # whole chunks of its prefill_chunk, as a request prefilled alone gets, never a budget's cut.
    chunk_dependent: bool = False
    # True when a step may pack some rows' prefill chunks and every row's decode token into one call
    # (`jhybrid.attention.full.PackedRows`): the serving engine then decodes while it prefills.
    packs_decode: bool = False

    def rows_meta(self, meta, rows):
        """(traced; a backend that `prefills_rows`) The cache meta of a step over batch rows `rows` [R]
        int32 (distinct) of a cache whose meta is `meta`: the step's token rows are those rows' and
        its cache `lengths` theirs ([R]); its layer caches stay the whole batch's."""
        raise NotImplementedError(f"backend {self.name!r} runs steps over every row of the batch")

    def reset_rows(self, cache, rows):
        """Empties the sequences in `rows` ([n] int NumPy, batch indices) so that new sequences start
        there at position 0 while the other rows go on: their lengths become 0, and whatever this
        backend holds for them on the device and the host (windows, host-store blocks, selections,
        pools) is dropped and reusable. Returns the cache (a `KVCache`)."""
        raise NotImplementedError(f"backend {self.name!r} cannot reset single rows (continuous batching)")

    def row_kv(self) -> "RowKV | None":
        """How one row's tokens lie in this backend's layer caches, for copies of whole token
        blocks in and out of a row (the serving engine's device prefix cache); None: not
        expressible (the offloading modes place hits through `jhybrid.hybrid.ingest`)."""
        return None

    @property
    def max_prefill_chunk(self) -> int | None:
        """Longest prefill chunk the backend accepts (None: any)."""
        return None

    def prefill_variants(self, cache) -> list:
        """The caches of an open batch's prefill steps, as `before_step` can hand them to a step
        (arrays or ShapeDtypeStructs of the same shapes), for compiling every prefill shape ahead
        (`ServingEngine.compile_steps`): a backend whose prefill cache never changes its shapes
        returns [cache]."""
        return [cache]

    def precompile_host(self, cache) -> None:
        """Compile ahead what this backend's host side would otherwise compile on first use during
        steps (scout: its recall scatter for every padded size), for an open batch whose cache is
        `cache`; a compile on a background thread holds the GIL a serving engine's thread needs.
        Nothing for a backend without such work."""

    def counters(self) -> dict:
        """Cumulative instrumentation of the open batch (seconds, counts); {} when there is none."""
        return {}

    def reset_counters(self) -> None:
        """Zero the counters (e.g. after a warm-up)."""

    def step_history(self) -> list[dict]:
        """Per-step changes of the counters since the last reset (one dict per step); [] when none."""
        return []

    def host_bytes(self) -> int:
        """Host bytes the open batch holds (offloaded KV and what the mode keeps besides); 0 for none."""
        return 0

    def selections(self, cache) -> list | None:
        """The top-k block ids each selecting layer chose at the last decode step (NumPy [B, Hkv, k]
        int, -1 = none, best first), or None for a backend that selects nothing."""
        return None

    def row_fields(self) -> dict:
        """Benchmark row columns of this backend: its mode's settings and what its host side measured
        (e.g. hgca's kept share); {} when there is nothing to add."""
        return {}

    def query_ahead(self, layer_idx: int, config: ModelConfig) -> int | None:
        """The later layer whose query the decoder should predict from this layer's input and hand
        over as `context.next_query` (scout's layer-ahead selection), or None for none."""
        return None

    # ---- device side -------------------------------------------------------------------------------
    def init_meta(self, batch_size: int, max_len: int) -> Any:
        """The per-step metadata of an empty cache (`KVCache.meta`); None when the backend has none."""
        return None

    @abc.abstractmethod
    def init_layer_cache(self, config: ModelConfig, layer_idx: int, batch_size: int, max_len: int,
                         dtype) -> LayerCache:
        """An empty cache state for one layer (device arrays only; no side effects)."""

    @abc.abstractmethod
    def attend(
        self,
        layer_idx: int,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        positions: jax.Array,
        lengths: jax.Array,
        layer_cache: LayerCache,
        context: LayerContext,
    ) -> tuple[jax.Array, LayerCache, Any]:
        """Stores this step's k, v and attends q causally over everything the sequence holds.

        q: [B, T, Hq, D]; k, v: [B, T, Hkv, D] (RoPE already applied to q and k).
        positions: [B, T] int32, -1 for padding. lengths: [B] int32, each sequence's number of
        tokens INCLUDING this step's (so the keys are positions 0 .. lengths-1).
        Returns o [B, T, Hq, D] in q's dtype (padding rows are zero), the new layer cache and the
        carry handed to the next layer's attend (None when there is nothing to hand on).
        """
