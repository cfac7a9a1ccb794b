"""Gathers of whole (block, KV head) rows out of the host store's arena, in parallel (Numba, nogil).

scout's recall moves the blocks the CPU attends into the GPU pool: one (block, head) row is a
contiguous `block_size x W` run of the arena ([slots, Hkv, bs, W], host.kv_store), scattered over
gigabytes. A NumPy fancy-index gather runs on one core at a few GB/s; this one splits the rows over
`n_threads` threads (the caller's thread count, thread-local in Numba: set it on the thread that calls).

    gather_rows(arena_k, arena_v, slots, heads, out_k, out_v)   # out[i] = arena[slots[i], heads[i]]
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from host.numba_threads import configure_threading_layer

THREADING_LAYER = configure_threading_layer()


@njit(parallel=True, nogil=True, cache=True)
def _gather(arena_k, arena_v, slots, heads, out_k, out_v):
    for i in prange(slots.shape[0]):
        out_k[i] = arena_k[slots[i], heads[i]]
        out_v[i] = arena_v[slots[i], heads[i]]


def gather_rows(arena_k: np.ndarray, arena_v: np.ndarray, slots: np.ndarray, heads: np.ndarray,
                out_k: np.ndarray, out_v: np.ndarray) -> None:
    """out_k[i], out_v[i] = arena_k[slots[i], heads[i]], arena_v[...] ([bs, W] rows) for i < len(slots).

    arena_*: [slots, Hkv, bs, W] storage dtype; slots, heads: int64 [N] (validated here: a bad index
    is an IndexError, not a read out of bounds); out_*: [>= N, bs, W] of the arena's dtype."""
    n = slots.shape[0]
    if heads.shape != (n,) or out_k.shape[0] < n or out_v.shape[0] < n:
        raise ValueError(f"gather_rows: {n} slots, heads {heads.shape}, outputs {out_k.shape} / {out_v.shape}")
    if n and (slots.min() < 0 or slots.max() >= arena_k.shape[0] or heads.min() < 0
              or heads.max() >= arena_k.shape[1]):
        raise IndexError(f"gather_rows: a slot outside [0, {arena_k.shape[0]}) or a head outside "
                         f"[0, {arena_k.shape[1]})")
    if out_k.dtype != arena_k.dtype or out_k.shape[1:] != arena_k.shape[2:]:
        raise ValueError(f"gather_rows: outputs {out_k.dtype} {out_k.shape[1:]}; the arena holds "
                         f"{arena_k.dtype} {arena_k.shape[2:]}")
    _gather(arena_k, arena_v, slots.astype(np.int64), heads.astype(np.int64), out_k, out_v)


__all__ = ["gather_rows"]
