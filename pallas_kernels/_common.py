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


def next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def group_queries(q: jnp.ndarray, num_kv_heads: int, row_tile: int) -> tuple[jnp.ndarray, int]:
    """[B, Tq, Hq, D] -> [B, Hkv, R_pad, D] with row r = t * G + g (t-major), zero-padded rows.

    Folding a KV group's query heads (and the Tq queries) into one row block lets each program
    read every K/V row once for the whole group. Returns the grouped queries and R = Tq * G.
    """
    b, tq, hq, d = q.shape
    g = hq // num_kv_heads
    rows = tq * g
    qg = q.reshape(b, tq, num_kv_heads, g, d).transpose(0, 2, 1, 3, 4).reshape(b, num_kv_heads, rows, d)
    r_pad = -(-rows // row_tile) * row_tile
    if r_pad != rows:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, r_pad - rows), (0, 0)))
    return qg, rows


def ungroup_rows(x: jnp.ndarray, tq: int, num_q_heads: int) -> jnp.ndarray:
    """Inverse of ``group_queries`` on the row axis: [B, Hkv, R_pad, ...] -> [B, Tq, Hq, ...]."""
    b, hkv = x.shape[:2]
    g = num_q_heads // hkv
    x = x[:, :, : tq * g]
    x = x.reshape(b, hkv, tq, g, *x.shape[3:])
    x = jnp.moveaxis(x, 2, 1)  # [B, Tq, Hkv, G, ...]
    return x.reshape(b, tq, num_q_heads, *x.shape[4:])


def combine_splits(o_acc: jnp.ndarray, m: jnp.ndarray, l: jnp.ndarray, split_axis: int):
    """Combine flash-decoding splits into one normalised partial state.

    Args:
      o_acc: [..., S, R, D] float32, per split ``sum_j exp(s_j - m) v_j`` (unnormalised).
      m:     [..., S, R] float32 running max per split (NEG_BIG where the split saw nothing).
      l:     [..., S, R] float32 ``sum_j exp(s_j - m)`` per split (0 where it saw nothing).
      split_axis: the axis S in ``m`` / ``l`` (negative; o_acc's is one less).

    Returns:
      o [..., R, D] float32 (0 for rows with no token), lse [..., R] float32 (-inf for those rows).
    """
    m_max = jnp.max(m, axis=split_axis, keepdims=True)
    w = jnp.where(l > 0, jnp.exp(m - m_max), 0.0)  # [..., S, R]
    l_tot = jnp.sum(w * l, axis=split_axis)  # [..., R]
    o_tot = jnp.sum(w[..., None] * o_acc, axis=split_axis - 1)  # [..., R, D]
    has = l_tot > 0
    o = jnp.where(has[..., None], o_tot / jnp.where(has, l_tot, 1.0)[..., None], 0.0)
    lse = jnp.where(has, jnp.squeeze(m_max, split_axis) + jnp.log(jnp.where(has, l_tot, 1.0)), -jnp.inf)
    return o, lse


def dot_f32(a, b, *, trans_b: bool = False, exact: bool = False):
    """2-D matmul with float32 accumulation inside a kernel (``pl.dot`` is gone in JAX 0.12).

    ``exact`` forces full float32 (no tf32) for float32 operands, as the parity tests require.
    """
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    precision = jax.lax.Precision.HIGHEST if exact else None
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def softcap_scores(s: jnp.ndarray, softcap: float | None) -> jnp.ndarray:
    return s if softcap is None else softcap * jnp.tanh(s / softcap)
