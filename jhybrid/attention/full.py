"""The `full` backend: every token's K/V in one static-shape device buffer per layer.

Cache of one layer: {"k": [B, max_len, Hkv, D], "v": [B, max_len, Hkv, D]}. New tokens are
scattered to their positions (padding, position -1, is dropped), then attention runs in plain jnp
over the whole buffer with a mask built from positions and lengths — exact, float32 softmax.
On the GPU a chunk of two or more queries (prefill, append) runs the flash kernel
`pallas_kernels.range_attention` instead: it streams each query's visible keys and never holds the
[B, Hq, T, L] float32 scores the jnp path does (8 GiB per layer for 4 rows x 256 queries x 64K keys
at 32 heads). Decode (one query) keeps the jnp path below.

A step may also run over SOME rows of the batch (`PrefillRows` as the cache's meta): R token rows,
row r written into and attending batch row rows[r] of the [B, max_len, Hkv, D] buffers in place.
The serving engine prefills its prefilling requests this way, so a call costs their tokens, not
every slot's (`jhybrid.serving.engine`).

A step may also pack two groups into one call (`PackedRows` as the cache's meta): the chunks of R
prefilling rows and one decode token of every row, as one token row [1, R*C + B]. Everything but
attention is per token, so the weights are read once for both; attention splits the groups again
(chunks: the range kernel or jnp, as above; decode tokens: the decode path). The serving engine
decodes its running requests this way while others prefill (stall-free batching, Sarathi-Serve):
a decode step then costs almost nothing on top of the prefill it rides with.

No copy of the cache for a decode step of two or more sequences: the grouped einsum (batch and KV head as the dot's batch
dimensions) needs the KV-head axis next to the batch axis, so XLA copies each layer's K and V
buffer into a transposed temporary every step (one layer's K and V of extra memory at the largest
batch, and twice their bytes moved). With few query rows per KV head (decode: memory bound) the
scores are instead a dot contracting (KV head, D) — the buffer's minor axes as they lie — against
a block-diagonal query (zero outside its own KV head: Hkv x the FLOPs, still far below the bytes
read), and the output a dot contracting L over all KV heads, keeping each head's own diagonal. Exact:
the extra products are exact zeros. Longer chunks (prefill, compute bound) use the grouped einsum.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jhybrid.attention.base import AttentionBackend, LayerContext, RowKV
from pallas_kernels._common import SUPPORTED_HEAD_DIMS, resolve_backend
from pallas_kernels.range_attention import causal_ranges, range_attention

if TYPE_CHECKING:  # the models import the attention package, not the other way round
    from jhybrid.models.config import ModelConfig

log = logging.getLogger(__name__)
_logged_head_dim: set[int] = set()


def store_kv(cache: jax.Array, new: jax.Array, positions: jax.Array, rows: jax.Array | None = None) -> jax.Array:
    """Writes new [R, T, H, D] into cache [B, L, H, D] at positions [R, T] of batch rows `rows` [R]
    (distinct; None: R = B, row r is batch row r); position -1 (or >= L) is dropped."""
    max_len = cache.shape[1]
    index = jnp.where(positions >= 0, positions, max_len)  # out of bounds -> dropped
    batch = (jnp.arange(cache.shape[0]) if rows is None else rows)[:, None]
    return cache.at[batch, index].set(new.astype(cache.dtype), mode="drop")


@struct.dataclass
class PrefillRows:
    """`KVCache.meta` of a `full` step over some rows of the batch: rows [R] int32, distinct, the
    batch row of each of the step's R token rows (the cache's `lengths` are then those rows', [R])."""

    rows: jax.Array


@struct.dataclass
class PackedRows:
    """`KVCache.meta` of a step packing prefill chunks and decode tokens into one token row
    [1, R*C + B]: tokens [0, R*C) are R chunks of C tokens, chunk r of batch row rows[r]; token
    R*C + b is batch row b's decode token (position -1: row b does not decode). A row is in at most
    one group with valid positions (a padding chunk, all -1, may repeat a decoding row).

    rows [R] int32 distinct; prefill_lengths [R] int32, decode_lengths [B] int32: each group's rows'
    lengths including this step's tokens (the [1] lengths the decoder derives are not read).
    step: the backend's own meta of the whole batch for this step (`KVCache.meta` as its
    `before_packed_step` left it; None for `full`), e.g. an offloading mode's `StepMeta`."""

    rows: jax.Array
    prefill_lengths: jax.Array
    decode_lengths: jax.Array
    step: Any = None

    def split(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """[1, R*C + B, ...] -> (chunks [R, C, ...], decode [B, 1, ...])."""
        num_rows, batch = self.rows.shape[0], self.decode_lengths.shape[0]
        chunk = (x.shape[1] - batch) // num_rows
        chunks = x[0, :num_rows * chunk].reshape(num_rows, chunk, *x.shape[2:])
        return chunks, x[0, num_rows * chunk:][:, None]


def pack_rows(chunks: jax.Array, decode: jax.Array) -> jax.Array:
    """chunks [R, C, ...], decode [B, ...] -> [1, R*C + B, ...] (PackedRows' token order)."""
    return jnp.concatenate([chunks.reshape(-1, *chunks.shape[2:]), decode])[None]


# The copy-free formulation for up to this many query rows (steps x query heads) per sequence, and
# from 2 sequences on: with one sequence XLA drops the batch axis, and XLA:CPU then fuses the cache
# update into the dot's operand as well as into the returned cache and copies the buffer (3x a
# layer's K of temporaries, against 2x with the grouped einsum; unchecked on GPU).
COPY_FREE_MAX_ROWS = 128


def _scores_copy_free(q, k_cache):
    """q [B, T, Hkv, G, D] x k_cache [B, L, Hkv, D] -> float32 [B, Hkv, G, T, L] without a layout
    change of the cache: contract (KV head, D) against a block-diagonal query."""
    batch, steps, num_kv_heads, group, head_dim = q.shape
    eye = jnp.eye(num_kv_heads, dtype=q.dtype)
    q_bd = q[:, :, :, :, None, :] * eye[None, None, :, None, :, None]  # [B, T, Hkv, G, Hkv, D]
    q_bd = q_bd.reshape(batch, steps * num_kv_heads * group, num_kv_heads * head_dim)
    keys = k_cache.reshape(batch, k_cache.shape[1], num_kv_heads * head_dim)  # free: minor axes
    scores = jnp.einsum("bmc,bsc->bms", q_bd, keys, preferred_element_type=jnp.float32)
    scores = scores.reshape(batch, steps, num_kv_heads, group, -1)  # [B, T, Hkv, G, L]
    return jnp.transpose(scores, (0, 2, 3, 1, 4))


def _values_copy_free(probs, v_cache):
    """probs [B, Hkv, G, T, L] x v_cache [B, L, Hkv, D] -> float32 [B, T, Hkv, G, D]: one dot
    contracting L (the buffer's rows) for all KV heads at once, then each head's own."""
    batch, num_kv_heads, group, steps, length = probs.shape
    head_dim = v_cache.shape[3]
    rows = jnp.transpose(probs, (0, 3, 1, 2, 4)).reshape(batch, steps * num_kv_heads * group, length)
    values = v_cache.reshape(batch, length, num_kv_heads * head_dim)  # [B, L, Hkv*D]
    every = jnp.einsum("bms,bsc->bmc", rows, values, preferred_element_type=jnp.float32)
    every = every.reshape(batch, steps, num_kv_heads, group, num_kv_heads, head_dim)
    eye = jnp.eye(num_kv_heads, dtype=jnp.float32)
    return jnp.sum(every * eye[None, None, :, None, :, None], axis=4)  # [B, T, Hkv, G, D]


def masked_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    positions: jax.Array,
    lengths: jax.Array,
    scale: float,
    sliding_window: int | None = None,
    key_positions: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Causal GQA attention of q [B, T, Hq, D] over a cache [B, L, Hkv, D] (plain jnp reference).

    Key j holds position j (or key_positions[b, j], [B, L] int32 with -1 for an empty slot, for a
    cache that is not position-indexed such as a ring; lengths is then not read). A key at position
    j is visible to a query at position p when j <= p, j < lengths[b] and (with a window)
    p - j < sliding_window. Returns o [B, T, Hq, D] in q's dtype (zero for padding queries) and
    lse [B, T, Hq] float32 in natural log (docs/design.md, "Partial states").
    """
    batch, steps, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    q = q.reshape(batch, steps, num_kv_heads, group, head_dim)
    copy_free = batch > 1 and num_kv_heads > 1 and steps * num_heads <= COPY_FREE_MAX_ROWS
    if copy_free:
        scores = _scores_copy_free(q, k_cache)
    else:
        scores = jnp.einsum("btkgd,bskd->bkgts", q, k_cache, preferred_element_type=jnp.float32)
    scores = scores * jnp.float32(scale)  # [B, Hkv, G, T, L]
    query_pos = positions[:, :, None]  # [B, T, 1]
    if key_positions is None:
        key_pos = jnp.arange(k_cache.shape[1])[None, None, :]  # [1, 1, L]
        visible = (key_pos <= query_pos) & (key_pos < lengths[:, None, None]) & (query_pos >= 0)
    else:
        key_pos = key_positions[:, None, :]  # [B, 1, L]
        visible = (key_pos >= 0) & (key_pos <= query_pos) & (query_pos >= 0)
    if sliding_window is not None:
        visible &= query_pos - key_pos < sliding_window
    visible = visible[:, None, None]  # [B, 1, 1, T, L]
    scores = jnp.where(visible, scores, -jnp.inf)
    max_score = jnp.max(scores, axis=-1, keepdims=True)
    max_score = jnp.where(jnp.isfinite(max_score), max_score, 0.0)
    weights = jnp.exp(scores - max_score)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights / jnp.where(denom > 0, denom, 1.0)
    if copy_free:
        out = _values_copy_free(probs.astype(v_cache.dtype), v_cache)
    else:
        out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v_cache.dtype), v_cache,
                         preferred_element_type=jnp.float32)
    lse = (jnp.log(denom) + max_score)[..., 0]  # [B, Hkv, G, T]; -inf where nothing is visible
    lse = jnp.transpose(lse, (0, 3, 1, 2)).reshape(batch, steps, num_heads)
    return out.reshape(batch, steps, num_heads, head_dim).astype(q.dtype), lse


class FullRowKV(RowKV):
    """FullAttention's {"k", "v"} [B, max_len, Hkv, D] per layer: token p of row b at [b, p]."""

    def __eq__(self, other):
        return type(other) is FullRowKV

    def __hash__(self):
        return hash(FullRowKV)

    def read(self, layers, row, positions):
        return jnp.stack([jnp.stack([layer["k"][row, positions], layer["v"][row, positions]]) for layer in layers])

    def write(self, layers, row, kv, positions):
        max_len = layers[0]["k"].shape[1]
        index = jnp.where(positions >= 0, positions, max_len)  # padding: dropped
        return tuple({"k": layer["k"].at[row, index].set(kv[i, 0].astype(layer["k"].dtype), mode="drop"),
                      "v": layer["v"].at[row, index].set(kv[i, 1].astype(layer["v"].dtype), mode="drop")}
                     for i, layer in enumerate(layers))


FULL_ROW_KV = FullRowKV()


class FullAttention(AttentionBackend):
    """All KV on the device; the reference every other backend must match with keep-everything.

    prefill_backend: the pallas_kernels backend of chunks of two or more queries ("triton",
    "interpret"), "jnp" for `masked_attention`, or None: the range kernel on the GPU and
    `masked_attention` elsewhere."""

    name = "full"
    reuses_rows = True
    prefills_rows = True  # a step may run over some rows of the batch (PrefillRows)
    packs_decode = True  # a step may pack prefill chunks and decode tokens (PackedRows)
    prefill_backend: str | None = None  # (a subclass that skips __init__ keeps the default)

    def __init__(self, prefill_backend: str | None = None):
        allowed = (None, "jnp", "triton", "interpret")
        if prefill_backend not in allowed:
            raise ValueError(f"prefill_backend={prefill_backend!r}; expected one of {allowed}")
        self.prefill_backend = prefill_backend

    def __eq__(self, other):
        return type(other) is FullAttention and other.prefill_backend == self.prefill_backend

    def __hash__(self):
        return hash((FullAttention, self.prefill_backend))

    def _chunk_kernel(self) -> str | None:
        """The Pallas backend chunks run on, or None for the jnp path."""
        if self.prefill_backend is None:
            return "triton" if resolve_backend(None) == "triton" else None
        return None if self.prefill_backend == "jnp" else self.prefill_backend

    def reset_rows(self, cache, rows):
        """Empties rows `rows` ([n] ints, batch indices) for new sequences: their lengths become 0.
        Their K/V stay in the buffers but are never seen: attention masks keys at positions >=
        the length, and the new sequence overwrites them as it grows. ValueError for a row outside
        the batch; no rows returns the cache as it is."""
        batch = int(cache.lengths.shape[0])
        rows = np.unique(np.asarray(rows, np.int64).reshape(-1))
        bad = rows[(rows < 0) | (rows >= batch)]
        if bad.size:
            raise ValueError(f"reset_rows: row {int(bad[0])} is out of range for a batch of {batch} "
                             f"(rows 0..{batch - 1})")
        if rows.size == 0:
            return cache
        keep = np.ones(batch, bool)
        keep[rows] = False  # a [B] mask, not the rows: one shape whatever rows are reset
        return cache.replace(lengths=jnp.where(keep, cache.lengths, 0).astype(cache.lengths.dtype))

    def rows_meta(self, meta, rows):
        return PrefillRows(rows)

    def row_kv(self) -> RowKV:
        return FULL_ROW_KV

    def init_layer_cache(self, config: ModelConfig, layer_idx: int, batch_size: int, max_len: int,
                         dtype):
        shape = (batch_size, max_len, config.num_kv_heads, config.head_dim)
        return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}

    def attend(self, layer_idx, q, k, v, positions, lengths, layer_cache, context: LayerContext):
        if isinstance(context.meta, PackedRows):
            return self._attend_packed(q, k, v, positions, layer_cache, context)
        rows = context.meta.rows if isinstance(context.meta, PrefillRows) else None
        k_cache = store_kv(layer_cache["k"], k, positions, rows)
        v_cache = store_kv(layer_cache["v"], v, positions, rows)
        out = self._attention(q, k_cache, v_cache, positions, lengths, rows, context)
        return out, {"k": k_cache, "v": v_cache}, None

    def _attend_packed(self, q, k, v, positions, layer_cache, context: LayerContext):
        """attend for a PackedRows step: both groups' K, V stored, then each group attends apart."""
        meta: PackedRows = context.meta
        (q_chunks, q_decode), (k_chunks, k_decode), (v_chunks, v_decode), (p_chunks, p_decode) = (
            meta.split(x) for x in (q, k, v, positions))
        k_cache = store_kv(store_kv(layer_cache["k"], k_chunks, p_chunks, meta.rows), k_decode, p_decode)
        v_cache = store_kv(store_kv(layer_cache["v"], v_chunks, p_chunks, meta.rows), v_decode, p_decode)
        out_chunks = self._attention(q_chunks, k_cache, v_cache, p_chunks, meta.prefill_lengths, meta.rows, context)
        out_decode = self._attention(q_decode, k_cache, v_cache, p_decode, meta.decode_lengths, None, context)
        return pack_rows(out_chunks, out_decode[:, 0]), {"k": k_cache, "v": v_cache}, None

    def _attention(self, q, k_cache, v_cache, positions, lengths, rows, context: LayerContext):
        """q [R, T, Hq, D] of batch rows `rows` [R] (None: R = B) over the stored cache -> o [R, T, Hq, D]."""
        kernel = self._chunk_kernel() if q.shape[1] > 1 else None
        if kernel is not None and q.shape[-1] not in SUPPORTED_HEAD_DIMS:
            if q.shape[-1] not in _logged_head_dim:
                _logged_head_dim.add(q.shape[-1])
                log.warning("full: head dim %d has no range-attention kernel (supported: %s); prefill "
                            "chunks use the jnp path", q.shape[-1], SUPPORTED_HEAD_DIMS)
            kernel = None
        if kernel is not None:
            key_lo, key_hi = causal_ranges(positions, lengths, context.sliding_window)
            out, _ = range_attention(q, k_cache, v_cache, key_lo, key_hi, batch_rows=rows, scale=context.scale,
                                     backend=kernel)
            return out
        # with rows, the jnp path reads the rows' copies
        keys, values = (k_cache, v_cache) if rows is None else (k_cache[rows], v_cache[rows])
        out, _ = masked_attention(q, keys, values, positions, lengths, context.scale, context.sliding_window)
        return out
