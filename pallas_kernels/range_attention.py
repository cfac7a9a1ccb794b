"""Flash attention of a prefill chunk over a long per-sequence KV buffer, each query over a key range.

Layout:
  q          [B, T, Hq, D]    a chunk of T queries per sequence (prefill / append)
  k, v       [B, L, Hkv, D]   kv_layout="tokens_heads": the `full` backend's cache, key j at row j
             [B, Hkv, L, D]   kv_layout="heads_tokens": the hybrid prefill's offloaded copies
             [B*NB, Hkv, bs, D]  kv_layout="blocks": quest's cache, key j of sequence b in block row
                              b * NB + j // bs at j % bs (L = NB * bs; bs a power of two >= 16)
  key_lo     [B, T] int32     query t of sequence b sees keys j with key_lo[b, t] <= j < key_hi[b, t]
  key_hi     [B, T] int32     (an empty range, e.g. a padding query, gives o = 0 and lse = -inf)
  batch_rows [B] int32        optional: query row b reads K, V row batch_rows[b] of a larger buffer
                              ([N, L, Hkv, D] / [N, Hkv, L, D], N >= B): a prefill of a few rows of a
                              serving batch without copying their KV out of it

Result: the partial state of docs/design.md ("Partial states") over each query's range:
  o [B, T, Hq, D] in out_dtype (q.dtype by default), lse [B, T, Hq] float32, natural log.

Why a range per query: a causal chunk over a position-indexed cache is the range
[0, min(position + 1, length)) (`causal_ranges`), a sliding window moves the lower end, and the
hybrid prefill's offloaded copies are [0, n_valid) for every valid query. The plain-jnp path
materialises float32 scores [B, Hq, T, L] (8 GiB for 4 rows x 256 queries x 64K keys at 32 heads,
per layer); this kernel streams the keys and never holds more than a tile of them.

The GPU kernel (Triton lowering): grid (B, Hkv, row tiles). A program folds the KV group's query
heads and a tile of queries into one row block (K and V are read once per group, as in
`window_attention`), and walks only the key blocks between its rows' smallest key_lo and largest
key_hi with an online softmax: the causal upper triangle, rows of a sequence that is not prefilling
(padding queries) and keys past the length cost nothing. No split over keys: a prefill chunk has
enough row tiles (B x Hkv x T*G/64) to fill the GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _common as C

KV_LAYOUTS = ("tokens_heads", "heads_tokens", "blocks")


def range_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    key_lo: jax.Array,
    key_hi: jax.Array,
    *,
    kv_layout: str = "tokens_heads",
    batch_rows: jax.Array | None = None,
    scale: float | None = None,
    out_dtype=None,
    backend: str | None = None,
    block_k: int = 64,
    row_tile: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
):
    """Attention of q over each query's key range. See the module docstring for shapes.

    Returns (o, lse). ``block_k``, ``row_tile`` (a power of two, 16..128; None = 64), ``num_warps``
    and ``num_stages`` tune the GPU kernel.
    """
    _validate(q, k, v, key_lo, key_hi, kv_layout, batch_rows)
    backend = C.resolve_backend(backend)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    out_dtype = jnp.dtype(q.dtype if out_dtype is None else out_dtype)
    key_lo, key_hi = key_lo.astype(jnp.int32), key_hi.astype(jnp.int32)
    if backend == "reference":
        if batch_rows is not None:
            k, v = k[batch_rows], v[batch_rows]
        return range_attention_reference(q, k, v, key_lo, key_hi, kv_layout=kv_layout, scale=scale,
                                         out_dtype=out_dtype)
    b, t, hq, d = q.shape
    hkv = k.shape[2] if kv_layout == "tokens_heads" else k.shape[1]
    length = _length(k, kv_layout, b)
    g = hq // hkv
    rows = t * g
    tile = row_tile or min(64, max(16, C.next_pow2(rows)))
    if tile & (tile - 1) or not 16 <= tile <= 128:
        raise ValueError(f"row_tile={row_tile}; expected a power of two from 16 to 128")
    block_k = k.shape[2] if kv_layout == "blocks" else min(block_k, max(16, C.next_pow2(length)))
    # Ranges per row (r = t * G + g, as group_queries orders them); a padding row gets the empty
    # range [L, 0) so it widens no tile's key walk.
    empty = key_hi <= key_lo
    lo_rows = jnp.repeat(jnp.where(empty, length, key_lo), g, axis=1)  # [B, R]
    hi_rows = jnp.repeat(jnp.where(empty, 0, key_hi), g, axis=1)
    mapped = batch_rows is not None or kv_layout == "blocks"
    kernel = functools.partial(_range_kernel, scale=scale, block_k=block_k, row_tile=tile, rows=rows,
                               length=length, exact_fp32=q.dtype == jnp.float32,
                               layout=kv_layout if mapped else None, seq_blocks=length // block_k)
    if mapped:  # the whole buffer: the kernel picks its row and head (block index maps cannot read data)
        kv_spec = pl.BlockSpec(k.shape, lambda bi, hi, ri: (0, 0, 0, 0))
    elif kv_layout == "tokens_heads":
        kv_spec = pl.BlockSpec((None, length, None, d), lambda bi, hi, ri: (bi, 0, hi, 0))
    else:
        kv_spec = pl.BlockSpec((None, None, length, d), lambda bi, hi, ri: (bi, hi, 0, 0))
    row_range = pl.BlockSpec((None, rows), lambda bi, hi, ri: (bi, 0))
    batch_rows = jnp.arange(b, dtype=jnp.int32) if batch_rows is None else batch_rows.astype(jnp.int32)
    o, lse = pl.pallas_call(
        kernel,
        grid=(b, hkv, -(-rows // tile)),
        in_specs=[pl.BlockSpec((None,), lambda bi, hi, ri: (bi,)), row_range, row_range,
                  pl.BlockSpec((None, None, rows, d), lambda bi, hi, ri: (bi, hi, 0, 0)), kv_spec, kv_spec],
        out_specs=[pl.BlockSpec((None, None, rows, d), lambda bi, hi, ri: (bi, hi, 0, 0)),
                   pl.BlockSpec((None, None, rows), lambda bi, hi, ri: (bi, hi, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, hkv, rows, d), out_dtype),
                   jax.ShapeDtypeStruct((b, hkv, rows), jnp.float32)],
        interpret=backend == "interpret",
        name="jhybrid_range_attention",
        **C.gpu_compiler_params(backend == "interpret", num_warps, num_stages),
    )(batch_rows, lo_rows, hi_rows, C.group_queries(q, hkv), k, v)
    return C.ungroup_rows(o, t, hq), C.ungroup_rows(lse, t, hq)


def _length(k, kv_layout: str, batch: int) -> int:
    """Keys per sequence (L) of a K buffer in `kv_layout` holding `batch` sequences."""
    if kv_layout == "tokens_heads":
        return k.shape[1]
    if kv_layout == "heads_tokens":
        return k.shape[2]
    return k.shape[0] // batch * k.shape[2]


def causal_ranges(positions: jax.Array, lengths: jax.Array, sliding_window: int | None = None):
    """Key ranges of a causal chunk over a position-indexed cache (key j holds position j).

    positions [B, T] int32 (-1: padding), lengths [B] int32 (tokens written, the chunk's included).
    Query at position p sees keys max(0, p - window + 1) <= j < min(p + 1, length). Returns
    (key_lo, key_hi), each [B, T] int32; padding queries get an empty range."""
    hi = jnp.where(positions >= 0, jnp.minimum(positions + 1, lengths[:, None]), 0)
    lo = jnp.zeros_like(hi) if sliding_window is None else jnp.maximum(positions - sliding_window + 1, 0)
    return lo.astype(jnp.int32), hi.astype(jnp.int32)


def _validate(q, k, v, key_lo, key_hi, kv_layout, batch_rows=None):
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout={kv_layout!r}; expected one of {KV_LAYOUTS}")
    if q.ndim != 4:
        raise ValueError(f"q.shape={tuple(q.shape)}; expected [B, T, Hq, D]")
    if kv_layout == "tokens_heads":  # check_query_and_kv reads KV heads from axis 1
        if k.ndim != 4:
            raise ValueError(f"k.shape={tuple(k.shape)}; expected [B, L, Hkv, D]")
        C.check_query_and_kv(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), "k", "v", "[B, L, Hkv, D]")
        if v.shape != k.shape:
            raise ValueError(f"v.shape={tuple(v.shape)} differs from k.shape={tuple(k.shape)}")
    else:
        C.check_query_and_kv(q, k, v, "k", "v", "[B, Hkv, L, D]")
    if kv_layout == "blocks":
        bs = k.shape[2]
        if batch_rows is not None:
            raise ValueError("batch_rows with kv_layout='blocks': expected one or the other")
        if k.shape[0] % q.shape[0] or bs < 16 or bs & (bs - 1):
            raise ValueError(f"k.shape={tuple(k.shape)}; expected [B*NB, Hkv, bs, D] for q's batch B={q.shape[0]} "
                             "with bs a power of two >= 16")
    elif batch_rows is None and k.shape[0] != q.shape[0]:
        raise ValueError(f"k.shape={tuple(k.shape)} does not match q's batch B={q.shape[0]}")
    if batch_rows is not None:
        if batch_rows.shape != (q.shape[0],) or not jnp.issubdtype(batch_rows.dtype, jnp.integer):
            raise ValueError(f"batch_rows: shape {tuple(batch_rows.shape)} {batch_rows.dtype}; expected "
                             f"({q.shape[0]},) integers (a K, V row per query row)")
    for name, x in (("key_lo", key_lo), ("key_hi", key_hi)):
        if x.shape != q.shape[:2]:
            raise ValueError(f"{name}.shape={tuple(x.shape)}; expected {tuple(q.shape[:2])} ([B, T], one per query)")
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name}.dtype={x.dtype}; expected an integer dtype (int32)")


def _range_kernel(row_ref, lo_ref, hi_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale, block_k, row_tile,
                  rows, length, exact_fp32, layout, seq_blocks):
    from jax.experimental.pallas import triton as plgpu

    row, head = row_ref[()], pl.program_id(1)

    def tile_of(ref, key0):  # [block_k, D] from key0 (one indexer: Triton lowers no chained ones)
        if layout is None:  # the program's own [L, D] block
            return ref.at[pl.ds(key0, block_k), :]
        if layout == "tokens_heads":  # the whole buffer: this program's K, V row and head
            return ref.at[row, pl.ds(key0, block_k), head, :]
        if layout == "blocks":  # block_k = bs: one block of the sequence per tile
            return ref.at[row * seq_blocks + key0 // block_k, head, :, :]
        return ref.at[row, head, pl.ds(key0, block_k), :]

    row_idx = pl.program_id(2)
    row_ids = row_idx * row_tile + jnp.arange(row_tile, dtype=jnp.int32)
    in_rows = row_ids < rows
    tile = pl.ds(row_idx * row_tile, row_tile)
    lo = plgpu.load(lo_ref.at[tile], mask=in_rows, other=length)  # [row_tile]
    hi = plgpu.load(hi_ref.at[tile], mask=in_rows, other=0)
    q = C.load_rows(q_ref, row_idx, row_tile, rows)
    d = q.shape[-1]
    first = jnp.min(lo) // block_k
    last = (jnp.max(hi) + block_k - 1) // block_k  # exclusive; first >= last: nothing to attend
    col = jnp.arange(block_k, dtype=jnp.int32)

    def body(i, carry):
        key0 = i * block_k
        keys = key0 + col
        in_cache = keys < length
        kk = plgpu.load(tile_of(k_ref, key0), mask=in_cache[:, None], other=0.0)
        s = C.dot_f32(q, kk, trans_b=True, exact=exact_fp32) * scale  # [row_tile, block_k] float32
        valid = (keys[None, :] >= lo[:, None]) & (keys[None, :] < hi[:, None])
        vv = plgpu.load(tile_of(v_ref, key0), mask=in_cache[:, None], other=0.0)
        return C.online_softmax_step(carry, s, valid, vv, exact_fp32)

    acc, m, l = jax.lax.fori_loop(first, jnp.maximum(first, last), body, C.online_softmax_init(row_tile, d))
    o, lse = C.finish_split(acc, m, l, o_ref.dtype)
    C.store_rows(o_ref, row_idx, row_tile, rows, o)
    C.store_rows(lse_ref, row_idx, row_tile, rows, lse)


def range_attention_reference(q, k, v, key_lo, key_hi, *, kv_layout="tokens_heads", scale=None, out_dtype=None):
    """Plain-jnp reference with the same contract (float32 math, the whole [B, Hq, T, L] scores;
    K, V rows already picked: `range_attention` gathers batch_rows before calling it)."""
    b, t, hq, d = q.shape
    if kv_layout == "tokens_heads":
        k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # -> [B, Hkv, L, D]
    elif kv_layout == "blocks":  # [B*NB, Hkv, bs, D] -> [B, Hkv, NB*bs, D]
        nb, hkv_, bs = k.shape[0] // b, k.shape[1], k.shape[2]
        k, v = (x.reshape(b, nb, hkv_, bs, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv_, nb * bs, d) for x in (k, v))
    hkv, length = k.shape[1], k.shape[2]
    scale = d**-0.5 if scale is None else scale
    qf = q.astype(jnp.float32).reshape(b, t, hkv, hq // hkv, d)
    s = jnp.einsum("btkgd,bkld->bkgtl", qf, k.astype(jnp.float32), precision="highest") * scale
    keys = jnp.arange(length, dtype=jnp.int32)
    visible = (keys[None, None, :] >= key_lo[:, :, None]) & (keys[None, None, :] < key_hi[:, :, None])  # [B,T,L]
    s = jnp.where(visible[:, None, None], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)  # [B, Hkv, G, T]
    has = jnp.isfinite(lse)
    p = jnp.where(has[..., None], jnp.exp(s - jnp.where(has, lse, 0.0)[..., None]), 0.0)
    o = jnp.einsum("bkgtl,bkld->btkgd", p, v.astype(jnp.float32), precision="highest")
    out_dtype = q.dtype if out_dtype is None else out_dtype
    return (o.reshape(b, t, hq, d).astype(out_dtype),
            jnp.transpose(lse, (0, 3, 1, 2)).reshape(b, t, hq))
