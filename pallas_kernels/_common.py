"""Shared plumbing for the Pallas kernels: backend choice, input validation, split-KV combine.

Backends (the only place the choice is made):
  "triton"     Pallas lowered through Triton; the GPU path (measured faster than the alternatives
               we tried on the H100, see BENCHMARKS.md "Backend choice").
  "interpret"  the same Pallas kernel run by the Pallas interpreter on any backend (CPU CI parity).
  "reference"  the plain-jnp reference beside each kernel; what CPU runs by default because the
               interpreter is far slower than XLA there. Choosing it without being asked is logged.
"""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

log = logging.getLogger("pallas_kernels")

BACKENDS = ("triton", "interpret", "reference")
SUPPORTED_HEAD_DIMS = (64, 128, 256)
# Finite stand-in for -inf in the online softmax running max: exp(m_prev - m_next) stays finite
# for rows that have seen no valid token yet. Masked probabilities are zeroed explicitly.
NEG_BIG = -1e30

_logged_default = False


def resolve_backend(backend: str | None) -> str:
    """Return the backend to use: the one asked for, or "triton" on GPU / "reference" elsewhere."""
    global _logged_default
    if backend is not None:
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is not supported; expected one of {BACKENDS}")
        return backend
    if jax.default_backend() == "gpu":
        return "triton"
    if not _logged_default:
        log.info(
            "pallas_kernels: default JAX backend is %r, not 'gpu': using the plain-jnp reference "
            "path (pass backend='interpret' to run the Pallas kernels in the interpreter)",
            jax.default_backend(),
        )
        _logged_default = True
    return "reference"


def check_head_dim(head_dim: int) -> None:
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim={head_dim} is not supported; supported head dims: {SUPPORTED_HEAD_DIMS}")


def check_float_dtype(name: str, x) -> None:
    if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"{name}.dtype={x.dtype}; expected float32, bfloat16 or float16")


def check_int_vector(name: str, x, length: int) -> None:
    if x.shape != (length,):
        raise ValueError(f"{name}.shape={tuple(x.shape)}; expected ({length},) (one value per sequence)")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name}.dtype={x.dtype}; expected an integer dtype (int32)")


def check_gqa(num_q_heads: int, num_kv_heads: int) -> int:
    """Return the group size Hq // Hkv, or raise if Hq is not a multiple of Hkv."""
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"query heads Hq={num_q_heads} must be a positive multiple of KV heads Hkv={num_kv_heads}"
        )
    return num_q_heads // num_kv_heads


def check_query_and_kv(q, k, v, k_name: str, v_name: str, kv_layout: str):
    """Validate queries [B, Tq, Hq, D] against a K/V pair laid out as [_, Hkv, _, D].

    Checks ranks, equal K/V shapes and dtypes, float dtypes, the head dim and GQA grouping, and
    names the offending value. Returns (Hq // Hkv, Hkv).
    """
    if q.ndim != 4:
        raise ValueError(f"q.shape={tuple(q.shape)}; expected [B, Tq, Hq, D]")
    if k.ndim != 4:
        raise ValueError(f"{k_name}.shape={tuple(k.shape)}; expected {kv_layout}")
    if v.shape != k.shape:
        raise ValueError(f"{v_name}.shape={tuple(v.shape)} differs from {k_name}.shape={tuple(k.shape)}")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"{k_name} head dim {k.shape[3]} differs from q head dim {q.shape[3]}")
    check_head_dim(q.shape[3])
    group = check_gqa(q.shape[2], k.shape[1])
    for name, x in (("q", q), (k_name, k), (v_name, v)):
        check_float_dtype(name, x)
    if k.dtype != v.dtype:
        raise ValueError(f"{k_name}.dtype={k.dtype} differs from {v_name}.dtype={v.dtype}")
    return group, k.shape[1]


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (>= 1): padded sizes, so few shapes are ever compiled."""
    return 1 << max(0, (int(n) - 1).bit_length())


def default_tuning(programs: int, tokens: int, d: int, block_k=None, num_splits=None, num_warps=None,
                   num_stages=None):
    """Launch parameters of the split-KV kernels (measured on the H100, BENCHMARKS.md sweep).

    ``programs`` = B * Hkv * row tiles before splitting; ``tokens`` = KV tokens per program.
    Returns (block_k, num_splits, split_size, num_warps, num_stages).
    """
    if block_k is None:
        block_k = 32 if d >= 256 else 64
    if tokens < block_k:
        block_k = max(16, next_pow2(tokens))
    num_warps = num_warps or 4
    num_stages = num_stages or 4
    if num_splits is None:
        # Small grids need several programs per SM to pull full bandwidth; large ones need few.
        # Each split keeps >= num_stages blocks so the software pipeline has something to overlap.
        target = 528 if programs < 64 else 256
        num_splits = max(1, min(target // programs, tokens // (block_k * num_stages)))
    split_size = -(-tokens // num_splits)
    split_size = -(-split_size // block_k) * block_k
    num_splits = -(-tokens // split_size)
    return block_k, num_splits, split_size, num_warps, num_stages


def group_queries(q: jnp.ndarray, num_kv_heads: int) -> jnp.ndarray:
    """[B, Tq, Hq, D] -> [B, Hkv, R, D] with row r = t * G + g (t-major), R = Tq * G.

    Folding a KV group's query heads (and the Tq queries) into one row block lets each program
    read every K/V row once for the whole group. For Tq = 1 this is a free reshape. Kernels load
    row tiles of it with masked loads (rows past R read as 0), so no padded copy is made.
    """
    b, tq, hq, d = q.shape
    g = hq // num_kv_heads
    return q.reshape(b, tq, num_kv_heads, g, d).transpose(0, 2, 1, 3, 4).reshape(b, num_kv_heads, tq * g, d)


def row_tiling(rows: int) -> tuple[int, int]:
    """(row_tile, row_tiles) for R query rows: tiles of 16..64 rows (the MMA needs >= 16)."""
    row_tile = min(64, max(16, next_pow2(rows)))
    return row_tile, -(-rows // row_tile)


def ungroup_rows(x: jnp.ndarray, tq: int, num_q_heads: int) -> jnp.ndarray:
    """Inverse of ``group_queries`` on the row axis: [B, Hkv, R, ...] -> [B, Tq, Hq, ...]."""
    b, hkv = x.shape[:2]
    g = num_q_heads // hkv
    x = x.reshape(b, hkv, tq, g, *x.shape[3:])
    x = jnp.moveaxis(x, 2, 1)  # [B, Tq, Hkv, G, ...]
    return x.reshape(b, tq, num_q_heads, *x.shape[4:])


def finish_split(acc, m, l, out_dtype):
    """Normalise one program's online-softmax state: (o [R, D] out_dtype, lse [R] float32)."""
    has = l > 0
    o = jnp.where(has[:, None], acc / jnp.where(has, l, 1.0)[:, None], 0.0).astype(out_dtype)
    lse = jnp.where(has, m + jnp.log(jnp.where(has, l, 1.0)), -jnp.inf)
    return o, lse


def merge_split_states(o: jnp.ndarray, lse: jnp.ndarray, split_axis: int, out_dtype):
    """LSE-merge normalised partial states along ``split_axis`` of ``lse`` (o's axis is the same).

    o [..., S, R, D], lse [..., S, R] float32 (-inf for empty splits) -> o [..., R, D], lse [..., R].
    A single split is returned as is (no extra pass over memory).
    """
    if lse.shape[split_axis] == 1:
        return jnp.squeeze(o, split_axis).astype(out_dtype), jnp.squeeze(lse, split_axis)
    m = jnp.max(lse, axis=split_axis, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse - m_safe)  # 0 for empty splits
    w_sum = jnp.sum(w, axis=split_axis)
    o_sum = jnp.sum(w[..., None] * o.astype(jnp.float32), axis=split_axis)
    has = w_sum > 0
    o_out = jnp.where(has[..., None], o_sum / jnp.where(has, w_sum, 1.0)[..., None], 0.0).astype(out_dtype)
    lse_out = jnp.where(has, jnp.squeeze(m_safe, split_axis) + jnp.log(jnp.where(has, w_sum, 1.0)), -jnp.inf)
    return o_out, lse_out


def load_rows(ref, row_idx, row_tile: int, rows: int):
    """Masked load of query row tile ``row_idx`` from a [R, D] ref (rows >= R read as 0)."""
    from jax.experimental.pallas import triton as plgpu

    r = row_idx * row_tile + jnp.arange(row_tile, dtype=jnp.int32)
    return plgpu.load(ref.at[pl.ds(row_idx * row_tile, row_tile), :], mask=(r < rows)[:, None], other=0.0)


def store_rows(ref, row_idx, row_tile: int, rows: int, value):
    """Masked store of a [row_tile, ...] tile into rows of a [R, ...] ref (rows >= R dropped)."""
    from jax.experimental.pallas import triton as plgpu

    r = row_idx * row_tile + jnp.arange(row_tile, dtype=jnp.int32)
    mask = (r < rows).reshape((row_tile,) + (1,) * (value.ndim - 1))
    idx = (pl.ds(row_idx * row_tile, row_tile),) + (slice(None),) * (value.ndim - 1)
    plgpu.store(ref.at[idx], value, mask=jnp.broadcast_to(mask, value.shape))


def dot_f32(a, b, *, trans_b: bool = False, exact: bool = False):
    """2-D matmul with float32 accumulation inside a kernel (``pl.dot`` is gone in JAX 0.12).

    ``exact`` forces full float32 (no tf32) for float32 operands, as the parity tests require.
    """
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    precision = jax.lax.Precision.HIGHEST if exact else None
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def online_softmax_init(rows: int, d: int):
    """Initial (acc [rows, D], running max [rows], running sum [rows]) of the online softmax."""
    return (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), NEG_BIG, jnp.float32),
            jnp.zeros((rows,), jnp.float32))


def online_softmax_step(carry, s, valid, v_tile, exact: bool):
    """Fold one KV tile into the online softmax (FlashAttention-2 style, unnormalised acc).

    carry: (acc [R, D], m [R], l [R]) float32; s: [R, N] scaled scores; valid: [R, N] or [1, N] bool;
    v_tile: [N, D]. Masked entries get probability exactly 0 (not exp of a large negative number),
    so rows that have seen no valid token stay at acc = 0, l = 0.
    """
    acc, m_prev, l_prev = carry
    m_next = jnp.maximum(m_prev, jnp.max(jnp.where(valid, s, NEG_BIG), axis=1))
    corr = jnp.exp(m_prev - m_next)
    p = jnp.where(valid, jnp.exp(s - m_next[:, None]), 0.0)
    acc = acc * corr[:, None] + dot_f32(p.astype(v_tile.dtype), v_tile, exact=exact)
    return acc, m_next, l_prev * corr + jnp.sum(p, axis=1)


def gpu_compiler_params(interpret: bool, num_warps: int, num_stages: int) -> dict:
    """``pallas_call`` keyword arguments for the Triton lowering (none in interpret mode)."""
    if interpret:
        return {}
    from jax.experimental.pallas import triton as plgpu

    return {"compiler_params": plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)}


def softcap_scores(s: jnp.ndarray, softcap: float | None) -> jnp.ndarray:
    return s if softcap is None else softcap * jnp.tanh(s / softcap)
