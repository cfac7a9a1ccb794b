"""Float64 NumPy reference for the CPU attention contract, used by the tests and the benchmark.

Deliberately plain: one (sequence, KV head) at a time, explicit token lists, no paging.
"""

from __future__ import annotations

import math

import numpy as np


def reference_attention(queries: np.ndarray, keys: list, values: list, n_kv_heads: int,
                        scale: float | None = None, return_probs: bool = False):
    """queries [B, Tq, Hq, D]; keys[b][h], values[b][h]: [n_bh, D] arrays of the tokens attended by
    sequence b, KV head h (any float dtype; computed in float64).

    Returns o [B, Tq, Hq, D] float64, lse [B, Tq, Hq] float64 (empty set: o = 0, lse = -inf) and,
    with return_probs, a list probs[b][h] [n_bh] = mean over Tq of the sum over the group's heads of
    the attention probability.
    """
    q = np.asarray(queries, np.float64)
    b_size, tq, hq, d = q.shape
    group = hq // n_kv_heads
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    o = np.zeros((b_size, tq, hq, d))
    lse = np.full((b_size, tq, hq), -np.inf)
    probs = [[None] * n_kv_heads for _ in range(b_size)]
    for b in range(b_size):
        for h in range(n_kv_heads):
            k = np.asarray(keys[b][h], np.float64).reshape(-1, d)
            v = np.asarray(values[b][h], np.float64).reshape(-1, d)
            qg = q[b, :, h * group:(h + 1) * group]            # [Tq, G, D]
            probs[b][h] = np.zeros(k.shape[0])
            if k.shape[0] == 0:
                continue
            s = scale * np.einsum("tgd,nd->tgn", qg, k)
            m = s.max(axis=-1, keepdims=True)
            e = np.exp(s - m)
            total = e.sum(axis=-1, keepdims=True)
            p = e / total
            o[b, :, h * group:(h + 1) * group] = np.einsum("tgn,nd->tgd", p, v)
            lse[b, :, h * group:(h + 1) * group] = (m + np.log(total))[..., 0]
            probs[b][h] = p.sum(axis=1).mean(axis=0)
    if return_probs:
        return o, lse, probs
    return o, lse


def norm_relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """||actual - expected|| / max(||expected||, tiny) over finite entries (inf must match exactly)."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    inf = np.isinf(expected)
    if not np.array_equal(np.isinf(actual), inf) or not np.array_equal(actual[inf], expected[inf]):
        return float("inf")
    if np.isnan(actual).any():
        return float("inf")
    a, e = actual[~inf], expected[~inf]
    return float(np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-30))


def stored_tokens(store, layer: int, seq_id, block_numbers=None) -> tuple[list, list]:
    """float32 K and V of one sequence as the reference takes them: keys[h], values[h] [n, D] (all
    stored blocks in block-number order, or the given block numbers of every head)."""
    from host.store_format import from_storage

    d = store.read_blocks(layer, seq_id, block_numbers)
    kf, vf = from_storage(d["k"], store.config.kv_dtype), from_storage(d["v"], store.config.kv_dtype)
    hkv, dim = store.config.n_kv_heads, store.config.head_dim
    return ([kf[:, :, h].reshape(-1, dim) for h in range(hkv)], [vf[:, :, h].reshape(-1, dim) for h in range(hkv)])


def context_tokens(store, layer: int, seq_id) -> tuple[list, list]:
    """float32 K and V of one sequence's context cache: keys[h], values[h] [n_kept_h, D]."""
    from host.store_format import from_storage

    kept = [store.context.kept(layer, seq_id, h) for h in range(store.config.n_kv_heads)]
    dt = store.config.kv_dtype
    return [from_storage(x["k"], dt) for x in kept], [from_storage(x["v"], dt) for x in kept]
