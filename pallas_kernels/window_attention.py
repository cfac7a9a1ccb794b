"""Dense attention over a per-layer GPU KV ring buffer (+ optional sink tokens), decode and append.

Layout (per layer):
  q          [B, Tq, Hq, D]   Tq = 1 for decode, up to 64 for append / chunked prefill
  k_ring     [B, Hkv, W, D]   ring buffer; slot ``(ring_start + j) % W`` holds logical token j,
  v_ring     [B, Hkv, W, D]   j = 0 the oldest valid token, j = length - 1 the newest
  lengths    [B] int32        valid tokens in the ring (0..W)
  ring_start [B] int32        physical slot of logical token 0
  sink_k/v   [B, Hkv, S, D]   optional attention-sink tokens kept outside the ring (older than every
  sink_lengths [B] int32      ring token; every query sees all valid sinks)

Causality for Tq > 1: the chunk's own K/V are already the newest Tq ring tokens, so query t sees
logical tokens j <= length - Tq + t. Tq = 1 sees the whole valid ring.

Result: the partial state of docs/design.md ("Partial states") over sinks + valid ring tokens:
  o   [B, Tq, Hq, D] in q.dtype (0 for an empty window), lse [B, Tq, Hq] float32 natural log
  (-inf for an empty window), and with ``return_probs`` probs [B, Hkv, W] float32: per physical ring
  slot, the attention probability (normalised over this call's token set) summed over the query
  heads of the KV group and the Tq queries; 0 for invalid slots. HGCA's moving average consumes it.

The GPU kernel is flash-decoding: grid (B, Hkv, row tiles, KV splits); each program folds the KV
group's query heads (and queries) into one row block, so K/V are read once per group, streams its
split of the ring in ``block_k`` slices with an online softmax, and writes an unnormalised partial;
``combine_splits`` merges the splits. Slot validity is computed from (slot - ring_start) mod W, so a
wrapped ring needs no gather.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _common as C

MAX_TQ = 64


def window_attention(
    q: jax.Array,
    k_ring: jax.Array,
    v_ring: jax.Array,
    lengths: jax.Array,
    ring_start: jax.Array,
    *,
    sink_k: jax.Array | None = None,
    sink_v: jax.Array | None = None,
    sink_lengths: jax.Array | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    return_probs: bool = False,
    backend: str | None = None,
    block_k: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
):
    """Attention of ``q`` over the ring window (+ sinks). See the module docstring for shapes.

    Returns ``(o, lse)`` or ``(o, lse, probs)`` when ``return_probs``.
    ``block_k``, ``num_splits``, ``num_warps``, ``num_stages`` tune the GPU kernel (None = heuristic).
    """
    _validate(q, k_ring, v_ring, lengths, ring_start, sink_k, sink_v, sink_lengths)
    backend = C.resolve_backend(backend)
    d = q.shape[-1]
    scale = float(d**-0.5 if scale is None else scale)
    lengths = lengths.astype(jnp.int32)
    ring_start = ring_start.astype(jnp.int32)
    if backend == "reference":
        return window_attention_reference(
            q, k_ring, v_ring, lengths, ring_start, sink_k=sink_k, sink_v=sink_v,
            sink_lengths=sink_lengths, scale=scale, softcap=softcap, return_probs=return_probs,
        )
    tune = dict(block_k=block_k, num_splits=num_splits, num_warps=num_warps, num_stages=num_stages)
    interpret = backend == "interpret"
    has_sinks = sink_k is not None
    o_parts, lse_parts, scores = _ring_partials(
        q, k_ring, v_ring, lengths, ring_start, causal=q.shape[1] > 1, scale=scale, softcap=softcap,
        want_scores=return_probs, interpret=interpret, merge_later=has_sinks, **tune,
    )
    if has_sinks:
        zeros = jnp.zeros_like(sink_lengths, dtype=jnp.int32)
        so, slse, _ = _ring_partials(
            q, sink_k, sink_v, sink_lengths.astype(jnp.int32), zeros, causal=False, scale=scale,
            softcap=softcap, want_scores=False, interpret=interpret, merge_later=True, **tune,
        )
        o_parts = jnp.concatenate([o_parts, so], axis=2)
        lse_parts = jnp.concatenate([lse_parts, slse], axis=2)
    o_rows, lse_rows = C.merge_split_states(o_parts, lse_parts, split_axis=2, out_dtype=q.dtype)
    tq, hq = q.shape[1], q.shape[2]
    o = C.ungroup_rows(o_rows, tq, hq)
    lse = C.ungroup_rows(lse_rows, tq, hq)
    if not return_probs:
        return o, lse
    lse_real = lse_rows[..., None]  # [B, Hkv, R, 1]
    fin = jnp.isfinite(lse_real)
    p = jnp.where(fin, jnp.exp(scores - jnp.where(fin, lse_real, 0.0)), 0.0)
    return o, lse, jnp.sum(p, axis=2)


def _validate(q, k_ring, v_ring, lengths, ring_start, sink_k, sink_v, sink_lengths):
    _, hkv = C.check_query_and_kv(q, k_ring, v_ring, "k_ring", "v_ring", "[B, Hkv, W, D]")
    b, tq, _, d = q.shape
    if k_ring.shape[0] != b:
        raise ValueError(f"k_ring.shape={tuple(k_ring.shape)} does not match q's batch B={b}")
    if not 1 <= tq <= MAX_TQ:
        raise ValueError(f"Tq={tq}; expected 1 <= Tq <= {MAX_TQ} (decode or an append chunk)")
    if k_ring.shape[2] < 1:
        raise ValueError(f"ring size W={k_ring.shape[2]}; expected W >= 1")
    C.check_int_vector("lengths", lengths, b)
    C.check_int_vector("ring_start", ring_start, b)
    given = [x is not None for x in (sink_k, sink_v, sink_lengths)]
    if any(given) and not all(given):
        raise ValueError("sink_k, sink_v and sink_lengths must be given together")
    if all(given):
        if sink_k.ndim != 4 or sink_k.shape[:2] != (b, hkv) or sink_k.shape[3] != d:
            raise ValueError(f"sink_k.shape={tuple(sink_k.shape)}; expected [B={b}, Hkv={hkv}, S, D={d}]")
        if sink_v.shape != sink_k.shape:
            raise ValueError(f"sink_v.shape={tuple(sink_v.shape)} differs from sink_k.shape={tuple(sink_k.shape)}")
        if sink_k.dtype != k_ring.dtype or sink_v.dtype != k_ring.dtype:
            raise ValueError(f"sink dtypes ({sink_k.dtype}, {sink_v.dtype}) differ from k_ring.dtype={k_ring.dtype}")
        C.check_int_vector("sink_lengths", sink_lengths, b)


def _ring_partials(q, k_ring, v_ring, lengths, ring_start, *, causal, scale, softcap, want_scores,
                   interpret, merge_later, block_k, num_splits, num_warps, num_stages):
    """Run the split-KV kernel over one ring.

    Returns per-split normalised partial states o [B, Hkv, S, R, D], lse [B, Hkv, S, R] float32,
    and raw masked scores [B, Hkv, R, W] float32 (or None). ``o`` is float32 when it will be
    merged (S > 1 or ``merge_later``), else already in q.dtype.
    """
    b, tq, hq, d = q.shape
    _, hkv, w, _ = k_ring.shape
    g = hq // hkv
    qg = C.group_queries(q, hkv)
    rows = tq * g
    row_tile, row_tiles = C.row_tiling(rows)
    block_k, num_splits, split_size, num_warps, num_stages = C.default_tuning(
        b * hkv * row_tiles, w, d, block_k, num_splits, num_warps, num_stages)
    o_dtype = jnp.float32 if (num_splits > 1 or merge_later) else q.dtype
    kernel = functools.partial(
        _ring_kernel, scale=scale, softcap=softcap, block_k=block_k, split_size=split_size, ring=w,
        group=g, tq=tq, causal=causal, row_tile=row_tile, rows=rows, want_scores=want_scores,
        exact_fp32=q.dtype == jnp.float32,
    )
    scalar = pl.BlockSpec((None,), lambda bi, hi, ri, si: (bi,))
    out_shape = [
        jax.ShapeDtypeStruct((b, hkv, num_splits, rows, d), o_dtype),
        jax.ShapeDtypeStruct((b, hkv, num_splits, rows), jnp.float32),
    ]
    # Output blocks span all R rows; each row tile stores its rows with a mask.
    out_specs = [
        pl.BlockSpec((None, None, None, rows, d), lambda bi, hi, ri, si: (bi, hi, si, 0, 0)),
        pl.BlockSpec((None, None, None, rows), lambda bi, hi, ri, si: (bi, hi, si, 0)),
    ]
    if want_scores:
        out_shape.append(jax.ShapeDtypeStruct((b, hkv, rows, w), jnp.float32))
        out_specs.append(pl.BlockSpec((None, None, rows, w), lambda bi, hi, ri, si: (bi, hi, 0, 0)))
    extra = C.gpu_compiler_params(interpret, num_warps, num_stages)
    outs = pl.pallas_call(
        kernel,
        grid=(b, hkv, row_tiles, num_splits),
        in_specs=[
            scalar,
            scalar,
            pl.BlockSpec((None, None, rows, d), lambda bi, hi, ri, si: (bi, hi, 0, 0)),
            pl.BlockSpec((None, None, w, d), lambda bi, hi, ri, si: (bi, hi, 0, 0)),
            pl.BlockSpec((None, None, w, d), lambda bi, hi, ri, si: (bi, hi, 0, 0)),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        name="jhybrid_window_attention",
        **extra,
    )(lengths, ring_start, qg, k_ring, v_ring)
    return outs[0], outs[1], (outs[2] if want_scores else None)


def _ring_kernel(len_ref, start_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *score_refs, scale, softcap,
                 block_k, split_size, ring, group, tq, causal, row_tile, rows, want_scores, exact_fp32):
    from jax.experimental.pallas import triton as plgpu

    row_idx = pl.program_id(2)
    split = pl.program_id(3)
    length = len_ref[()]
    start = start_ref[()]
    d = q_ref.shape[-1]
    q = C.load_rows(q_ref, row_idx, row_tile, rows)
    row_ids = row_idx * row_tile + jnp.arange(row_tile, dtype=jnp.int32)
    # Logical index of the newest token query row r may see (causal inside the chunk).
    last_visible = (length - tq + row_ids // group) if causal else jnp.full((row_tile,), length - 1, jnp.int32)
    split_lo = split * split_size
    n_blocks = jnp.minimum(split_size, ring - split_lo + block_k - 1) // block_k
    col = jnp.arange(block_k, dtype=jnp.int32)

    def body(i, carry):
        slot0 = split_lo + i * block_k
        slots = slot0 + col
        in_ring = slots < ring
        kv = plgpu.load(k_ref.at[pl.ds(slot0, block_k), :], mask=in_ring[:, None], other=0.0)
        s = C.dot_f32(q, kv, trans_b=True, exact=exact_fp32) * scale  # [row_tile, block_k] float32
        s = C.softcap_scores(s, softcap)
        logical = slots - start + jnp.where(slots < start, ring, 0)
        valid = (in_ring & (logical < length))[None, :] & (logical[None, :] <= last_visible[:, None])
        if want_scores:
            plgpu.store(
                score_refs[0].at[pl.ds(row_idx * row_tile, row_tile), pl.ds(slot0, block_k)],
                jnp.where(valid, s, -jnp.inf),
                mask=(row_ids < rows)[:, None] & in_ring[None, :],
            )
        vv = plgpu.load(v_ref.at[pl.ds(slot0, block_k), :], mask=in_ring[:, None], other=0.0)
        return C.online_softmax_step(carry, s, valid, vv, exact_fp32)

    acc, m, l = jax.lax.fori_loop(0, n_blocks, body, C.online_softmax_init(row_tile, d))
    o, lse = C.finish_split(acc, m, l, o_ref.dtype)
    C.store_rows(o_ref, row_idx, row_tile, rows, o)
    C.store_rows(lse_ref, row_idx, row_tile, rows, lse)


def window_attention_reference(q, k_ring, v_ring, lengths, ring_start, *, sink_k=None, sink_v=None,
                               sink_lengths=None, scale=None, softcap=None, return_probs=False):
    """Plain-jnp reference with the same contract (float32 math); also the CPU execution path."""
    b, tq, hq, d = q.shape
    _, hkv, w, _ = k_ring.shape
    g = hq // hkv
    scale = d**-0.5 if scale is None else scale
    qf = q.astype(jnp.float32).reshape(b, tq, hkv, g, d)
    s = jnp.einsum("bthgd,bhwd->bhtgw", qf, k_ring.astype(jnp.float32), precision="highest") * scale
    s = C.softcap_scores(s, softcap)
    slots = jnp.arange(w, dtype=jnp.int32)
    logical = (slots[None, :] - ring_start[:, None]) % w  # [B, W]
    t = jnp.arange(tq, dtype=jnp.int32)
    last = (lengths[:, None] - tq + t[None, :]) if tq > 1 else jnp.broadcast_to(lengths[:, None] - 1, (b, 1))
    valid = (logical[:, None, :] < lengths[:, None, None]) & (logical[:, None, :] <= last[:, :, None])  # [B,Tq,W]
    s = jnp.where(valid[:, None, :, None, :], s, -jnp.inf)
    values = [v_ring.astype(jnp.float32)]
    if sink_k is not None:
        ss = jnp.einsum("bthgd,bhsd->bhtgs", qf, sink_k.astype(jnp.float32), precision="highest") * scale
        ss = C.softcap_scores(ss, softcap)
        sv = jnp.arange(sink_k.shape[2])[None, :] < sink_lengths[:, None]
        ss = jnp.where(sv[:, None, None, None, :], ss, -jnp.inf)
        s_all = jnp.concatenate([s, ss], axis=-1)
        values.append(sink_v.astype(jnp.float32))
    else:
        s_all = s
    lse = jax.nn.logsumexp(s_all, axis=-1)  # [B, Hkv, Tq, G]
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]
    p_all = jnp.where(jnp.isfinite(lse)[..., None], jnp.exp(s_all - safe), 0.0)
    o = jnp.einsum("bhtgw,bhwd->bthgd", p_all, jnp.concatenate(values, axis=2), precision="highest")
    o = o.reshape(b, tq, hq, d).astype(q.dtype)
    lse_out = lse.transpose(0, 2, 1, 3).reshape(b, tq, hq)
    if not return_probs:
        return o, lse_out
    return o, lse_out, jnp.sum(p_all[..., :w], axis=(2, 3))
