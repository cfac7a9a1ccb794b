"""Gathers out of the host store's arena, in parallel (Numba, nogil).

scout's recall moves the blocks the CPU attends into the GPU pool: one (block, head) row is a
contiguous `block_size x W` run of the arena ([slots, Hkv, bs, W], host.kv_store), scattered over
gigabytes. hgca's context cache copies single kept tokens (one `W` row each) out of it into its
pages. A NumPy fancy-index gather runs on one core at a few GB/s; these split the rows over
`n_threads` threads (the caller's thread count, thread-local in Numba: set it on the thread that calls).

    gather_rows(arena_k, arena_v, slots, heads, out_k, out_v)   # out[i] = arena[slots[i], heads[i]]
    copy_token_rows(arena_k, arena_v, slots, heads, rows, out_k, out_v, pages, offsets)
        # out[pages[i], offsets[i]] = arena[slots[i], heads[i], rows[i]]
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


@njit(parallel=True, nogil=True, cache=True)
def _copy_tokens(arena_k, arena_v, slots, heads, rows, out_k, out_v, pages, offsets):
    for i in prange(slots.shape[0]):
        out_k[pages[i], offsets[i]] = arena_k[slots[i], heads[i], rows[i]]
        out_v[pages[i], offsets[i]] = arena_v[slots[i], heads[i], rows[i]]


def _check_index(name: str, index: np.ndarray, size: int) -> None:
    if index.size and (index.min() < 0 or index.max() >= size):
        raise IndexError(f"copy_token_rows: a value of {name} outside [0, {size})")


def copy_token_rows(arena_k: np.ndarray, arena_v: np.ndarray, slots: np.ndarray, heads: np.ndarray,
                    rows: np.ndarray, out_k: np.ndarray, out_v: np.ndarray, pages: np.ndarray,
                    offsets: np.ndarray) -> None:
    """out_k[pages[i], offsets[i]] = arena_k[slots[i], heads[i], rows[i]] (a [W] token row), and
    the same for v, for every i.

    arena_*: [slots, Hkv, bs, W] storage dtype; out_*: [pages, page_tokens, W] of the arena's dtype
    and W; slots, heads, rows, pages, offsets: int64 [N] (validated here: a bad index is an
    IndexError, not a write out of bounds). No two i may name the same (page, offset)."""
    n = slots.shape[0]
    if any(x.shape != (n,) for x in (heads, rows, pages, offsets)):
        raise ValueError(f"copy_token_rows: {n} slots, heads {heads.shape}, rows {rows.shape}, pages "
                         f"{pages.shape}, offsets {offsets.shape}")
    if out_k.dtype != arena_k.dtype or out_k.shape[2:] != arena_k.shape[3:] or out_v.shape != out_k.shape:
        raise ValueError(f"copy_token_rows: outputs {out_k.dtype} {out_k.shape} / {out_v.shape}; the arena "
                         f"holds {arena_k.dtype} rows of {arena_k.shape[3:]}")
    for name, index, size in (("slots", slots, arena_k.shape[0]), ("heads", heads, arena_k.shape[1]),
                              ("rows", rows, arena_k.shape[2]), ("pages", pages, out_k.shape[0]),
                              ("offsets", offsets, out_k.shape[1])):
        _check_index(name, index, size)
    as64 = [np.ascontiguousarray(x, np.int64) for x in (slots, heads, rows, pages, offsets)]
    _copy_tokens(arena_k, arena_v, *as64[:3], out_k, out_v, *as64[3:])


__all__ = ["copy_token_rows", "gather_rows"]
