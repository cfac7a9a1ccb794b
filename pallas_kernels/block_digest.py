"""Quest-style block digests (channel-wise key min/max per block), block scores and top-k selection.

Layout:
  kmin, kmax   [B, Hkv, NB, D]   per logical block of ``block_size`` tokens (key dtype; exact)
  num_blocks   [B] int32         blocks holding at least one token (a partial last block counts)
  q            [B, Hq, D]        the (exact or predicted) query of the step

Score of block n for KV head h (upper bound of q.k over the block, Quest):
  score[b, h, n] = sum over the group's query heads g of sum_d max(q_gd * kmin_nd, q_gd * kmax_nd)
Blocks at n >= num_blocks score -inf. ``select_blocks`` keeps the top ``budget_tokens // block_size``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _common as C


def build_digests(keys: jax.Array, num_tokens: jax.Array, block_size: int):
    """Digests of whole sequences of keys.

    Args:
      keys: [B, Hkv, N, D] keys in logical order; tokens at index >= num_tokens[b] are ignored.
      num_tokens: [B] int32.
      block_size: tokens per block; N need not be a multiple (the tail block is partial).

    Returns:
      kmin, kmax: [B, Hkv, ceil(N / block_size), D] in keys.dtype; empty blocks hold +inf / -inf.
    """
    b, hkv, n, d = keys.shape
    if block_size < 1:
        raise ValueError(f"block_size={block_size}; expected >= 1")
    C.check_int_vector("num_tokens", num_tokens, b)
    nb = -(-n // block_size)
    pad = nb * block_size - n
    valid = (jnp.arange(nb * block_size)[None, :] < num_tokens[:, None])[:, None, :, None]  # [B,1,N',1]
    k = jnp.pad(keys, ((0, 0), (0, 0), (0, pad), (0, 0)))
    big = jnp.array(jnp.inf, keys.dtype)
    kmin = jnp.where(valid, k, big).reshape(b, hkv, nb, block_size, d).min(axis=3)
    kmax = jnp.where(valid, k, -big).reshape(b, hkv, nb, block_size, d).max(axis=3)
    return kmin, kmax


def update_digests(kmin: jax.Array, kmax: jax.Array, new_keys: jax.Array, positions: jax.Array,
                   block_size: int):
    """Fold newly appended keys into the digests (incremental; jit-friendly).

    Args:
      kmin, kmax: [B, Hkv, NB, D].
      new_keys: [B, T, Hkv, D] keys of the T new tokens of each sequence.
      positions: [B, T] int32 logical token index of each new key (< NB * block_size). A token at
        the start of a block (position % block_size == 0) resets that block's digest first, so a
        reused digest slot never keeps stale values. Negative positions mark padding (ignored).

    Returns the updated ``(kmin, kmax)``.
    """
    b, t, hkv, d = new_keys.shape
    nb = kmin.shape[2]
    if kmin.shape != (b, hkv, nb, d) or kmax.shape != kmin.shape:
        raise ValueError(f"kmin/kmax shapes {kmin.shape}/{kmax.shape}; expected [B={b}, Hkv={hkv}, NB, D={d}]")
    if positions.shape != (b, t):
        raise ValueError(f"positions.shape={tuple(positions.shape)}; expected [B={b}, T={t}]")
    ok = positions >= 0
    blk = jnp.where(ok, positions // block_size, nb)  # out-of-range index nb -> dropped by scatter
    starts = ok & (positions % block_size == 0)
    bi = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    big = jnp.array(jnp.inf, kmin.dtype)
    reset_blk = jnp.where(starts, blk, nb)
    kmin = kmin.at[bi, :, reset_blk].set(big, mode="drop")
    kmax = kmax.at[bi, :, reset_blk].set(-big, mode="drop")
    k = new_keys.astype(kmin.dtype)  # [B, T, Hkv, D]
    kmin = kmin.at[bi, :, blk].min(k, mode="drop")
    kmax = kmax.at[bi, :, blk].max(k, mode="drop")
    return kmin, kmax


def block_scores(q: jax.Array, kmin: jax.Array, kmax: jax.Array, num_blocks: jax.Array, *,
                 backend: str | None = None, blocks_per_program: int = 128, num_warps: int = 4):
    """Quest scores ``[B, Hkv, NB]`` float32 (see module docstring); -inf past ``num_blocks``."""
    _validate(q, kmin, kmax, num_blocks)
    backend = C.resolve_backend(backend)
    num_blocks = num_blocks.astype(jnp.int32)
    if backend == "reference":
        return block_scores_reference(q, kmin, kmax, num_blocks)
    b, hq, d = q.shape
    _, hkv, nb, _ = kmin.shape
    g = hq // hkv
    bn = min(blocks_per_program, C.next_pow2(nb))
    qg = q.reshape(b, hkv, g, d)
    interpret = backend == "interpret"
    extra = C.gpu_compiler_params(interpret, num_warps, num_stages=2)
    return pl.pallas_call(
        functools.partial(_score_kernel, group=g, bn=bn, nb=nb),
        grid=(b, hkv, -(-nb // bn)),
        in_specs=[
            pl.BlockSpec((None,), lambda bi, hi, ni: (bi,)),
            pl.BlockSpec((None, None, g, d), lambda bi, hi, ni: (bi, hi, 0, 0)),
            pl.BlockSpec((None, None, nb, d), lambda bi, hi, ni: (bi, hi, 0, 0)),
            pl.BlockSpec((None, None, nb, d), lambda bi, hi, ni: (bi, hi, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, nb), lambda bi, hi, ni: (bi, hi, 0)),
        out_shape=jax.ShapeDtypeStruct((b, hkv, nb), jnp.float32),
        interpret=interpret,
        name="jhybrid_block_scores",
        **extra,
    )(num_blocks, qg, kmin, kmax)


def _score_kernel(nblk_ref, q_ref, kmin_ref, kmax_ref, s_ref, *, group, bn, nb):
    from jax.experimental.pallas import triton as plgpu

    # sum_d max(q_d mn_d, q_d mx_d) = sum_d (max(q_d, 0) mx_d + min(q_d, 0) mn_d): two small matmuls
    # on the tensor cores instead of an elementwise pass per query head. The group's query heads are
    # padded to >= 16 columns (the MMA minimum) with zeros, which add nothing to the sum.
    j = pl.program_id(2)
    idx = j * bn + jnp.arange(bn, dtype=jnp.int32)
    in_range = idx < nb
    mn = plgpu.load(kmin_ref.at[pl.ds(j * bn, bn), :], mask=in_range[:, None], other=0.0)
    mx = plgpu.load(kmax_ref.at[pl.ds(j * bn, bn), :], mask=in_range[:, None], other=0.0)
    cols = max(16, C.next_pow2(group))
    g_ok = (jnp.arange(cols) < group)[:, None]
    q = plgpu.load(q_ref.at[pl.ds(0, cols), :], mask=g_ok, other=0.0).astype(jnp.float32)  # [16, D]
    q_pos = jnp.maximum(q, 0.0).astype(mx.dtype)
    q_neg = jnp.minimum(q, 0.0).astype(mn.dtype)
    exact = mx.dtype == jnp.float32
    s = C.dot_f32(mx, q_pos, trans_b=True, exact=exact) + C.dot_f32(mn, q_neg, trans_b=True, exact=exact)
    acc = jnp.sum(s, axis=1)  # [bn]
    out = jnp.where(idx < nblk_ref[()], acc, -jnp.inf)
    plgpu.store(s_ref.at[pl.ds(j * bn, bn)], out, mask=in_range)


def block_scores_reference(q, kmin, kmax, num_blocks):
    """Plain-jnp reference of ``block_scores`` (also the CPU path)."""
    b, hq, d = q.shape
    _, hkv, nb, _ = kmin.shape
    qg = q.astype(jnp.float32).reshape(b, hkv, hq // hkv, 1, d)
    mn = kmin.astype(jnp.float32)[:, :, None]
    mx = kmax.astype(jnp.float32)[:, :, None]
    s = jnp.sum(jnp.maximum(qg * mn, qg * mx), axis=(2, 4))  # [B, Hkv, NB]
    return jnp.where(jnp.arange(nb)[None, None, :] < num_blocks[:, None, None], s, -jnp.inf)


def select_blocks(scores: jax.Array, num_blocks: jax.Array, k: int | None = None, *,
                  budget_tokens: int | None = None, block_size: int | None = None):
    """Top-k blocks per (sequence, KV head).

    Give either ``k`` (blocks) or ``budget_tokens`` and ``block_size`` (k = budget // block_size).

    Returns:
      ids [B, Hkv, k] int32: logical block indices, best first; entries past ``counts`` are -1.
      counts [B, Hkv] int32: min(k, num_blocks[b]).
    """
    b, hkv, nb = scores.shape
    if k is None:
        if budget_tokens is None or block_size is None:
            raise ValueError("select_blocks needs k, or budget_tokens and block_size")
        if budget_tokens < block_size:
            raise ValueError(f"budget_tokens={budget_tokens} is smaller than one block (block_size={block_size})")
        k = budget_tokens // block_size
    if not 1 <= k <= nb:
        raise ValueError(f"top-k of k={k} blocks does not fit the {nb} digest blocks; expected 1 <= k <= {nb}")
    C.check_int_vector("num_blocks", num_blocks, b)
    _, ids = jax.lax.top_k(scores, k)
    counts = jnp.broadcast_to(jnp.minimum(num_blocks.astype(jnp.int32), k)[:, None], (b, hkv))
    ids = jnp.where(jnp.arange(k)[None, None, :] < counts[..., None], ids, -1).astype(jnp.int32)
    return ids, counts


def _validate(q, kmin, kmax, num_blocks):
    if q.ndim != 3:
        raise ValueError(f"q.shape={tuple(q.shape)}; expected [B, Hq, D] (one query per sequence)")
    if kmin.ndim != 4 or kmax.shape != kmin.shape:
        raise ValueError(f"kmin/kmax shapes {tuple(kmin.shape)}/{tuple(kmax.shape)}; expected equal [B, Hkv, NB, D]")
    b, hq, d = q.shape
    if kmin.shape[0] != b or kmin.shape[3] != d:
        raise ValueError(f"kmin.shape={tuple(kmin.shape)} does not match q.shape={tuple(q.shape)} (B, D)")
    C.check_head_dim(d)
    C.check_gqa(hq, kmin.shape[1])
    C.check_int_vector("num_blocks", num_blocks, b)
