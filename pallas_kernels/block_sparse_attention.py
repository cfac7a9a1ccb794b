"""Block-sparse attention over a GPU block pool and a per-(sequence, KV head) block table.

Layout:
  q           [B, Tq, Hq, D]       queries (every listed block is older than every query: no mask)
  k_pool      [P, Hkv, bs, D]      block pool; block p of KV head h is k_pool[p, h] (contiguous)
  v_pool      [P, Hkv, bs, D]
  block_ids   [B, Hkv, M] int32    padded list of pool block ids attended by (sequence, KV head)
  counts      [B, Hkv] int32       how many leading entries of ``block_ids`` are real (0..M)
  block_lens  [P] int32 | None     valid tokens in each pool block (default: all ``bs``)

Result: partial state ``(o [B, Tq, Hq, D] q.dtype, lse [B, Tq, Hq] float32)`` over exactly the
listed blocks' valid tokens; an empty list gives o = 0, lse = -inf.

The GPU kernel walks the list ``block_k`` tokens at a time: token t of a split maps to list entry
t // bs and row t % bs, gathers those K/V rows (each a contiguous D-vector) from the pool viewed as
[P * Hkv * bs, D], and runs the same online softmax as the dense kernel. Work is proportional to
``counts``: programs stop at their count.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _common as C


def block_sparse_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    block_ids: jax.Array,
    counts: jax.Array,
    block_lens: jax.Array | None = None,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    backend: str | None = None,
    block_k: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
):
    """Attention of ``q`` over the listed pool blocks. Returns ``(o, lse)``; see the module docstring."""
    _validate(q, k_pool, v_pool, block_ids, counts, block_lens)
    backend = C.resolve_backend(backend)
    p_blocks, hkv, bs, d = k_pool.shape
    scale = float(d**-0.5 if scale is None else scale)
    counts = counts.astype(jnp.int32)
    block_ids = block_ids.astype(jnp.int32)
    if block_lens is None:
        block_lens = jnp.full((p_blocks,), bs, jnp.int32)
    block_lens = block_lens.astype(jnp.int32)
    if backend == "reference":
        return block_sparse_attention_reference(q, k_pool, v_pool, block_ids, counts, block_lens,
                                                scale=scale, softcap=softcap)
    interpret = backend == "interpret"
    b, tq, hq, _ = q.shape
    g = hq // hkv
    qg = C.group_queries(q, hkv)
    rows = tq * g
    row_tile, row_tiles = C.row_tiling(rows)
    capacity = block_ids.shape[2] * bs  # tokens a full list holds
    block_k, num_splits, split_size, num_warps, num_stages = C.default_tuning(
        b * hkv * row_tiles, capacity, d, block_k, num_splits, num_warps, num_stages)
    o_dtype = jnp.float32 if num_splits > 1 else q.dtype
    kernel = functools.partial(
        _sparse_kernel, scale=scale, softcap=softcap, block_k=block_k, split_size=split_size, bs=bs,
        hkv=hkv, row_tile=row_tile, rows=rows, exact_fp32=q.dtype == jnp.float32,
    )
    k_flat = k_pool.reshape(p_blocks * hkv * bs, d)
    v_flat = v_pool.reshape(p_blocks * hkv * bs, d)
    extra = C.gpu_compiler_params(interpret, num_warps, num_stages)
    full2 = lambda x: pl.BlockSpec(x.shape, lambda bi, hi, ri, si: (0, 0))  # noqa: E731
    o_parts, lse_parts = pl.pallas_call(
        kernel,
        grid=(b, hkv, row_tiles, num_splits),
        in_specs=[
            pl.BlockSpec((None, None), lambda bi, hi, ri, si: (bi, hi)),
            pl.BlockSpec((None, None, block_ids.shape[2]), lambda bi, hi, ri, si: (bi, hi, 0)),
            pl.BlockSpec(block_lens.shape, lambda bi, hi, ri, si: (0,)),
            pl.BlockSpec((None, None, rows, d), lambda bi, hi, ri, si: (bi, hi, 0, 0)),
            full2(k_flat),
            full2(v_flat),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, d), lambda bi, hi, ri, si: (bi, hi, si, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda bi, hi, ri, si: (bi, hi, si, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, hkv, num_splits, rows, d), o_dtype),
            jax.ShapeDtypeStruct((b, hkv, num_splits, rows), jnp.float32),
        ],
        interpret=interpret,
        name="jhybrid_block_sparse_attention",
        **extra,
    )(counts, block_ids, block_lens, qg, k_flat, v_flat)
    o_rows, lse_rows = C.merge_split_states(o_parts, lse_parts, split_axis=2, out_dtype=q.dtype)
    return C.ungroup_rows(o_rows, tq, hq), C.ungroup_rows(lse_rows, tq, hq)


def _validate(q, k_pool, v_pool, block_ids, counts, block_lens):
    _, hkv = C.check_query_and_kv(q, k_pool, v_pool, "k_pool", "v_pool", "[P, Hkv, block_size, D]")
    b, p_blocks = q.shape[0], k_pool.shape[0]
    if block_ids.ndim != 3 or block_ids.shape[:2] != (b, hkv):
        raise ValueError(f"block_ids.shape={tuple(block_ids.shape)}; expected [B={b}, Hkv={hkv}, M]")
    if block_ids.shape[2] < 1:
        raise ValueError("block_ids must have room for at least one block (M >= 1)")
    if counts.shape != (b, hkv):
        raise ValueError(f"counts.shape={tuple(counts.shape)}; expected [B={b}, Hkv={hkv}]")
    for name, x in (("block_ids", block_ids), ("counts", counts)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name}.dtype={x.dtype}; expected int32")
    if block_lens is not None:
        C.check_int_vector("block_lens", block_lens, p_blocks)


def _sparse_kernel(count_ref, ids_ref, blen_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale, softcap,
                   block_k, split_size, bs, hkv, row_tile, rows, exact_fp32):
    from jax.experimental.pallas import triton as plgpu

    head = pl.program_id(1)
    row_idx = pl.program_id(2)
    split = pl.program_id(3)
    count = count_ref[()]
    d = q_ref.shape[-1]
    q = C.load_rows(q_ref, row_idx, row_tile, rows)
    lo = split * split_size
    hi = jnp.minimum(lo + split_size, count * bs)
    n_iter = jnp.maximum(hi - lo + block_k - 1, 0) // block_k
    col = jnp.arange(block_k, dtype=jnp.int32)
    dcol = jnp.arange(d, dtype=jnp.int32)

    def body(i, carry):
        tok = lo + i * block_k + col  # token index within this (sequence, head)'s list
        entry = tok // bs
        row_in_block = tok % bs
        listed = tok < hi
        pool_id = plgpu.load(ids_ref.at[entry], mask=listed, other=0)
        blen = plgpu.load(blen_ref.at[pool_id], mask=listed, other=0)
        valid = listed & (row_in_block < blen)
        flat_row = (pool_id * hkv + head) * bs + row_in_block
        kv = plgpu.load(k_ref.at[flat_row[:, None], dcol[None, :]], mask=valid[:, None], other=0.0)
        s = C.softcap_scores(C.dot_f32(q, kv, trans_b=True, exact=exact_fp32) * scale, softcap)
        vv = plgpu.load(v_ref.at[flat_row[:, None], dcol[None, :]], mask=valid[:, None], other=0.0)
        return C.online_softmax_step(carry, s, valid[None, :], vv, exact_fp32)

    acc, m, l = jax.lax.fori_loop(0, n_iter, body, C.online_softmax_init(row_tile, d))
    o, lse = C.finish_split(acc, m, l, o_ref.dtype)
    C.store_rows(o_ref, row_idx, row_tile, rows, o)
    C.store_rows(lse_ref, row_idx, row_tile, rows, lse)


def block_sparse_attention_reference(q, k_pool, v_pool, block_ids, counts, block_lens=None, *, scale=None,
                                     softcap=None):
    """Plain-jnp reference (gathers the listed blocks, masks, float32 softmax); also the CPU path."""
    b, tq, hq, d = q.shape
    p_blocks, hkv, bs, _ = k_pool.shape
    g = hq // hkv
    m = block_ids.shape[2]
    scale = d**-0.5 if scale is None else scale
    if block_lens is None:
        block_lens = jnp.full((p_blocks,), bs, jnp.int32)
    ids = jnp.clip(block_ids, 0, p_blocks - 1)  # [B, Hkv, M]
    heads = jnp.arange(hkv)[None, :, None]
    kg = k_pool[ids, heads].astype(jnp.float32).reshape(b, hkv, m * bs, d)  # [B, Hkv, M*bs, D]
    vg = v_pool[ids, heads].astype(jnp.float32).reshape(b, hkv, m * bs, d)
    listed = jnp.arange(m)[None, None, :] < counts[:, :, None]  # [B, Hkv, M]
    row_ok = jnp.arange(bs)[None, None, None, :] < block_lens[ids][..., None]  # [B, Hkv, M, bs]
    valid = (listed[..., None] & row_ok).reshape(b, hkv, m * bs)
    qf = q.astype(jnp.float32).reshape(b, tq, hkv, g, d)
    s = jnp.einsum("bthgd,bhnd->bhtgn", qf, kg, precision="highest") * scale
    s = jnp.where(valid[:, :, None, None, :], C.softcap_scores(s, softcap), -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    fin = jnp.isfinite(lse)
    p = jnp.where(fin[..., None], jnp.exp(s - jnp.where(fin, lse, 0.0)[..., None]), 0.0)
    o = jnp.einsum("bhtgn,bhnd->bthgd", p, vg, precision="highest").reshape(b, tq, hq, d)
    return o.astype(q.dtype), lse.transpose(0, 2, 1, 3).reshape(b, tq, hq)
