"""The sparse context cache (HGCA's KV_ctx): per (layer, sequence, KV head), the offloaded tokens
currently selected for CPU attention, packed contiguously so the kernel streams memory.

Layout, one arena per layer (all sequences and heads share it):

    k, v       [pages, page_tokens, D]  storage dtype, the kept tokens' K/V copied out of the store
    weight     [pages, page_tokens]     float32, the token's salience score when it was kept (MAW at
                                        eviction, or the re-evaluation score)
    positions  [pages, page_tokens]     int64, absolute positions
    token_index [pages, page_tokens]    int64, block_number * block_size + row of the token in the store

Each (sequence, head) owns an ordered page list; its kept tokens fill the pages front to back, so a
head's tokens are `page_tokens` contiguous rows at a time (256 rows x D=128 x bf16 = 64 KiB runs).
Kept tokens are copies: the store still holds every offloaded token for re-evaluation.

Owned by `KVStore` (it shares the store's lock, memory budget and reader bracketing); use it through
`store.context`. Methods ending in `_locked` expect the caller to hold the lock.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from host.gather import copy_token_rows
from host.memory import HostMemoryBudget, SlotArrays, SlotPool, arrays_nbytes
from host.store_format import FORMAT_CODE, STORAGE_DTYPE, StoreConfig
from host.paged_view import PagedKV


def _page_templates(cfg: StoreConfig) -> dict[str, np.ndarray]:
    """One page of a layer's arena (leading axis of 1)."""
    p, d = cfg.context_page_tokens, cfg.row_width
    sd = STORAGE_DTYPE[cfg.kv_dtype]
    return {"k": np.empty((1, p, d), sd), "v": np.empty((1, p, d), sd),
            "weight": np.empty((1, p), np.float32), "positions": np.empty((1, p), np.int64),
            "token_index": np.empty((1, p), np.int64)}


def page_nbytes(cfg: StoreConfig) -> int:
    """Host bytes of one context-cache page (`cfg.context_page_tokens` kept tokens of one (layer,
    KV head))."""
    return arrays_nbytes(1, _page_templates(cfg))


class _PageArena:
    def __init__(self, cfg: StoreConfig, budget: HostMemoryBudget, layer: int):
        self.budget, self.layer = budget, layer
        self.pool = SlotPool()
        n = max(4, cfg.initial_blocks_per_layer * cfg.n_kv_heads * cfg.block_size // cfg.context_page_tokens)
        templates = _page_templates(cfg)
        budget.reserve(arrays_nbytes(n, templates), f"context cache of layer {layer}")
        self.slots = SlotArrays(templates, n, f"context cache of layer {layer}", budget.cap_bytes)

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        return self.slots.arrays

    @property
    def capacity(self) -> int:
        return self.arrays["k"].shape[0]

    def take(self, n: int) -> np.ndarray:
        needed = self.pool.needed_capacity(n)
        if needed > self.capacity:
            new_cap = max(needed, 2 * self.capacity)
            try:
                self.budget.reserve(arrays_nbytes(new_cap - self.capacity, self.arrays),
                                    f"context cache of layer {self.layer}")
            except MemoryError:
                new_cap = needed
                self.budget.reserve(arrays_nbytes(new_cap - self.capacity, self.arrays),
                                    f"context cache of layer {self.layer}")
            self.slots.grow(new_cap)
        return self.pool.take(n)


class _HeadPages:
    """Page lists of one (layer, sequence): table [Hkv, capacity] int64, n_pages / n_kept [Hkv]."""

    def __init__(self, n_kv_heads: int):
        self.table = np.empty((n_kv_heads, 8), np.int64)
        self.n_pages = np.zeros(n_kv_heads, np.int64)
        self.n_kept = np.zeros(n_kv_heads, np.int64)


class ContextCache:
    def __init__(self, cfg: StoreConfig, budget: HostMemoryBudget, lock):
        self.cfg, self.lock = cfg, lock
        self.layers = [_PageArena(cfg, budget, i) for i in range(cfg.n_layers)]
        self._heads: dict[int, list[_HeadPages]] = {}

    def add_sequence(self, seq_id) -> None:
        self._heads[seq_id] = [_HeadPages(self.cfg.n_kv_heads) for _ in range(self.cfg.n_layers)]

    def free_sequence(self, seq_id) -> None:
        for layer, hp in enumerate(self._heads.pop(seq_id)):
            for h in range(self.cfg.n_kv_heads):
                self.layers[layer].pool.retired.extend(int(p) for p in hp.table[h, : hp.n_pages[h]])

    def recycle_retired(self) -> None:
        for arena in self.layers:
            arena.pool.free.extend(arena.pool.retired)
            arena.pool.retired.clear()

    def bytes_used(self) -> int:
        return sum(arrays_nbytes(a.pool.n_in_use(), a.arrays) for a in self.layers)

    # ---- writing (lock held) ----------------------------------------------------------------
    def append_locked(self, layer: int, seq_id, heads: np.ndarray, k_rows: np.ndarray, v_rows: np.ndarray,
                      weights: np.ndarray, positions: np.ndarray, token_index: np.ndarray) -> None:
        """Append kept tokens of one sequence, several heads at once, each head's rows in order.

        heads [m] int64 (KV head of each row), k_rows, v_rows [m, D] storage dtype, weights [m]
        float32, positions [m] int64, token_index [m] int64 (the token's index among the sequence's
        stored tokens: block_number * block_size + row). Pages are allocated before any write and
        the counts are published last.
        """
        if heads.shape[0] == 0:
            return
        order, page_of_row, offset, counts = self._place_locked(layer, seq_id, heads)
        if order is not None:
            k_rows, v_rows, weights, positions, token_index = (
                x[order] for x in (k_rows, v_rows, weights, positions, token_index))
        a = self.layers[layer].arrays
        a["k"][page_of_row, offset] = k_rows
        a["v"][page_of_row, offset] = v_rows
        self._write_small(a, page_of_row, offset, weights, positions, token_index)
        self._heads[seq_id][layer].n_kept += counts

    def append_from_store_locked(self, layer: int, seq_id, store_arrays: dict[str, np.ndarray], heads: np.ndarray,
                                 slots: np.ndarray, rows: np.ndarray, weights: np.ndarray, positions: np.ndarray,
                                 token_index: np.ndarray) -> None:
        """`append_locked` of the tokens at (slots[i], heads[i], rows[i]) of the store's arena
        (`store_arrays`: the layer's "k", "v" [slots, Hkv, bs, W]), their K/V copied straight into
        the pages in parallel (`host.gather.copy_token_rows`), with no intermediate [m, W] copies.
        slots, rows [m] int64; the other arguments as `append_locked`'s."""
        if heads.shape[0] == 0:
            return
        order, page_of_row, offset, counts = self._place_locked(layer, seq_id, heads)
        if order is not None:
            heads, slots, rows, weights, positions, token_index = (
                x[order] for x in (heads, slots, rows, weights, positions, token_index))
        a = self.layers[layer].arrays
        copy_token_rows(store_arrays["k"], store_arrays["v"], slots, heads, rows, a["k"], a["v"], page_of_row, offset)
        self._write_small(a, page_of_row, offset, weights, positions, token_index)
        self._heads[seq_id][layer].n_kept += counts

    @staticmethod
    def _write_small(a, page_of_row, offset, weights, positions, token_index) -> None:
        a["weight"][page_of_row, offset] = weights
        a["positions"][page_of_row, offset] = positions
        a["token_index"][page_of_row, offset] = token_index

    def _place_locked(self, layer: int, seq_id, heads: np.ndarray):
        """Where `heads` [m] new rows go, pages allocated (counts not published): (order, the
        permutation that makes the rows head-major, each head's in their order, or None when they
        are; page_of_row, offset [m] int64 for the rows in that order; counts [Hkv] per head)."""
        m = heads.shape[0]
        hp = self._heads[seq_id][layer]
        arena = self.layers[layer]
        p = self.cfg.context_page_tokens
        counts = np.bincount(heads, minlength=self.cfg.n_kv_heads)
        pages_needed = -(-(hp.n_kept + counts) // p) - hp.n_pages
        if pages_needed.max() > 0:
            new_pages = arena.take(int(pages_needed.clip(0).sum()))
            width = int((hp.n_pages + pages_needed.clip(0)).max())
            if width > hp.table.shape[1]:
                grown = np.empty((hp.table.shape[0], max(2 * hp.table.shape[1], width)), np.int64)
                grown[:, : hp.table.shape[1]] = hp.table
                hp.table = grown
            used = 0
            for h in np.flatnonzero(pages_needed > 0):
                n_h, start = int(pages_needed[h]), int(hp.n_pages[h])
                hp.table[h, start:start + n_h] = new_pages[used:used + n_h]
                used += n_h
            hp.n_pages += pages_needed.clip(0)
        order = None
        if np.any(heads[1:] < heads[:-1]):  # a selection's rows are head-major already: no reordering
            order = np.argsort(heads, kind="stable")
            heads = heads[order]
        head_start = np.concatenate([[0], np.cumsum(counts)[:-1]])
        rows = hp.n_kept[heads] + np.arange(m) - head_start[heads]
        return order, hp.table[heads, rows // p], rows % p, counts

    def clear_head_locked(self, layer: int, seq_id, head: int) -> None:
        """Drop one head's selection (pages retire until no reader is in flight)."""
        hp = self._heads[seq_id][layer]
        self.layers[layer].pool.retired.extend(int(x) for x in hp.table[head, : hp.n_pages[head]])
        hp.n_pages[head] = 0
        hp.n_kept[head] = 0

    # ---- reading ----------------------------------------------------------------------------
    def kept_since_locked(self, layer: int, seq_id, head: int, first_token: int) -> tuple[np.ndarray, ...]:
        """One head's kept tokens whose token_index >= first_token, in order, as `append_locked`
        takes them: k, v [n, D] storage dtype, weight [n] float32, positions [n] int64, token_index
        [n] int64 (copies). Of the other kept tokens only the token indices are read: a
        re-evaluation keeps the selection of the blocks evicted after its scoring snapshot, few or
        none, where copying every kept token (`kept`) cost a sixth of its time."""
        hp = self._heads[seq_id][layer]
        p = self.cfg.context_page_tokens
        rows = np.arange(int(hp.n_kept[head]))
        pages, offsets = hp.table[head, rows // p], rows % p
        a = self.layers[layer].arrays
        since = a["token_index"][pages, offsets] >= first_token
        pages, offsets = pages[since], offsets[since]
        return tuple(a[name][pages, offsets] for name in ("k", "v", "weight", "positions", "token_index"))

    def kept_counts(self, layer: int, seq_id) -> np.ndarray:
        """Number of kept tokens per KV head, int64 [Hkv]."""
        with self.lock:
            self._check(layer, seq_id)
            return self._heads[seq_id][layer].n_kept.copy()

    def kept(self, layer: int, seq_id, head: int) -> dict[str, np.ndarray]:
        """Copies of one head's kept tokens, in order: k, v [n, D] storage dtype, positions [n] int64,
        token_index [n] int64 (block_number * block_size + row in the store),
        weight [n] float32 (raw score) and weight_normalised [n] float64 (sums to 1, HGCA's
        renormalised MAW; empty when nothing is kept)."""
        with self.lock:
            self._check(layer, seq_id)
            if not 0 <= head < self.cfg.n_kv_heads:
                raise ValueError(f"head={head!r}; expected [0, {self.cfg.n_kv_heads})")
            hp = self._heads[seq_id][layer]
            n, p = int(hp.n_kept[head]), self.cfg.context_page_tokens
            rows = np.arange(n)
            pages = hp.table[head, rows // p]
            a = self.layers[layer].arrays
            out = {name: a[name][pages, rows % p].copy() for name in ("k", "v", "weight", "positions", "token_index")}
        w = out["weight"].astype(np.float64)
        out["weight_normalised"] = w / w.sum() if n else w
        return out

    def snapshot_locked(self, layer: int, seq_ids) -> PagedKV:
        """The page lists of `seq_ids` (in batch order) for the attention kernel. This runs for every
        layer before a decode step's host attention starts, so the per-sequence work is three
        references; the page lists are gathered in nopython code (`_gather_page_lists`)."""
        hkv = self.cfg.n_kv_heads
        self._check_layer(layer)
        try:
            heads = [self._heads[s][layer] for s in seq_ids]
        except KeyError as missing:
            self._check(layer, missing.args[0])  # raises: names the unknown sequence
            raise
        a = self.layers[layer].arrays
        if not heads:
            empty = np.zeros(0, np.int64)
            return PagedKV(a["k"], a["v"], FORMAT_CODE[self.cfg.kv_dtype], np.zeros(1, np.int64), empty, empty, hkv)
        tables = np.concatenate([hp.table.ravel() for hp in heads])
        widths = np.array([hp.table.shape[1] for hp in heads], np.int64)
        n_pages = np.concatenate([hp.n_pages for hp in heads])
        unit_tokens = np.concatenate([hp.n_kept for hp in heads])
        page_ptr, page_ids = _gather_page_lists(tables, widths, n_pages, hkv)
        return PagedKV(a["k"], a["v"], FORMAT_CODE[self.cfg.kv_dtype], page_ptr, page_ids, unit_tokens, hkv)

    def _check_layer(self, layer) -> None:
        if not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.cfg.n_layers:
            raise ValueError(f"layer={layer!r}; expected an int in [0, {self.cfg.n_layers})")

    def _check(self, layer, seq_id) -> None:
        self._check_layer(layer)
        if seq_id not in self._heads:
            raise ValueError(f"unknown seq_id={seq_id!r}; sequences in the store: {sorted(self._heads)[:20]}")


@njit(cache=True)
def _gather_page_lists(tables, widths, n_pages, n_kv_heads):
    """tables: the sequences' [Hkv, widths[s]] int64 page tables raveled and concatenated;
    n_pages int64 [S * Hkv] -> (page_ptr int64 [S * Hkv + 1], page_ids int64: each unit's first
    n_pages pages, in unit order)."""
    units = n_pages.shape[0]
    page_ptr = np.zeros(units + 1, np.int64)
    for u in range(units):
        page_ptr[u + 1] = page_ptr[u] + n_pages[u]
    page_ids = np.empty(page_ptr[units], np.int64)
    table_start = 0
    for s in range(widths.shape[0]):
        for h in range(n_kv_heads):
            u = s * n_kv_heads + h
            row = table_start + h * widths[s]
            for i in range(n_pages[u]):
                page_ids[page_ptr[u] + i] = tables[row + i]
        table_start += n_kv_heads * widths[s]
    return page_ptr, page_ids
