"""Host KV store: where offloaded KV lives, per layer and sequence, in preallocated growable arenas.

Layout (one `_LayerArena` per layer; a *slot* holds one offloaded block of one sequence):

    k, v        [slots, Hkv, block_size, W]   storage dtype (uint16 bit patterns for bf16 / fp16, float32 for
                                              fp32; W = D, or D + 4 int8 with the row's scale for int8)
    maw         [slots, Hkv, block_size]      float32   moving-average attention weight per token and KV head
    positions   [slots, block_size]           int64     absolute token position
    key_min/max [slots, Hkv, D]               float32   per-block key digest (Quest-style block selection),
                                              only with StoreConfig.key_digests

Head-major inside a block, so the `block_size x D` rows of one (block, head) are contiguous: the
attention kernels read them as one "page" (see `host.attention`). A sequence owns an ordered list of
slots per layer; its n-th offloaded block ("block number" n, counted from 0 in eviction order) lives
in slot `slots[n]`. Slots of freed sequences are recycled, but only once no attention reader that
could still see them is in flight (`begin_read` / `end_read`). Nothing offloaded is ever dropped
while its sequence exists: sparsity (the `ContextCache`) only chooses what is *attended*.

All mutation happens under one lock; validation comes before any write and counts are published
last, so an exception (or a crashed worker) leaves the store as it was.
"""

from __future__ import annotations

import logging
import threading

import ml_dtypes
import numpy as np

from host.context_cache import ContextCache
from host.memory import HostMemoryBudget, HostMemoryCapError, SlotArrays, SlotPool, arrays_nbytes
from host.store_format import KV_DTYPES, STORAGE_DTYPE, StoreConfig, from_storage, to_storage

log = logging.getLogger(__name__)


def _slot_templates(c: StoreConfig) -> dict[str, np.ndarray]:
    """One slot of a layer's arena: the arrays' shapes and dtypes with a leading axis of 1."""
    sd = STORAGE_DTYPE[c.kv_dtype]
    shapes = {
        "k": np.empty((1, c.n_kv_heads, c.block_size, c.row_width), sd),
        "v": np.empty((1, c.n_kv_heads, c.block_size, c.row_width), sd),
        "maw": np.empty((1, c.n_kv_heads, c.block_size), np.float32),
        "positions": np.empty((1, c.block_size), np.int64),
    }
    if c.key_digests:
        shapes["key_min"] = np.empty((1, c.n_kv_heads, c.head_dim), np.float32)
        shapes["key_max"] = np.empty((1, c.n_kv_heads, c.head_dim), np.float32)
    return shapes


def block_nbytes(config: StoreConfig) -> int:
    """Host bytes of one offloaded block of one layer (one arena slot: K, V of every KV head, MAW,
    positions, digests when kept): what capacity predictions multiply."""
    return arrays_nbytes(1, _slot_templates(config))


class _LayerArena:
    """The offloaded blocks of one layer, all sequences together (see module docstring)."""

    def __init__(self, cfg: StoreConfig, budget: HostMemoryBudget, layer: int):
        self.cfg, self.budget, self.layer = cfg, budget, layer
        self.pool = SlotPool()
        n = cfg.initial_blocks_per_layer
        shapes = self._templates()
        budget.reserve(arrays_nbytes(n, shapes), f"KV arena of layer {layer}")
        self.slots = SlotArrays(shapes, n, f"KV arena of layer {layer}", budget.cap_bytes)

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        return self.slots.arrays

    def _templates(self) -> dict[str, np.ndarray]:
        return _slot_templates(self.cfg)

    @property
    def capacity(self) -> int:
        return self.arrays["k"].shape[0]

    def ensure_capacity(self, n_new: int) -> None:
        needed = self.pool.needed_capacity(n_new)
        if needed <= self.capacity:
            return
        new_cap = max(needed, 2 * self.capacity)
        extra = arrays_nbytes(new_cap - self.capacity, self.arrays)
        try:
            self.budget.reserve(extra, f"KV arena of layer {self.layer}")
        except HostMemoryCapError:
            # Doubling does not fit under the cap: try growing by exactly what is needed.
            new_cap = needed
            extra = arrays_nbytes(new_cap - self.capacity, self.arrays)
            self.budget.reserve(extra, f"KV arena of layer {self.layer}")
        # No copy while the address-space reservation lasts; readers' snapshots stay valid either way.
        self.slots.grow(new_cap)


class KVStore:
    """Offloaded KV for all layers and sequences, plus the sparse context cache (`self.context`).

    Thread safety: every public method takes `self.lock`. Attention readers snapshot tables under
    the lock and bracket their kernel with `begin_read` / `end_read` so recycled slots are never
    overwritten under them.
    """

    def __init__(self, config: StoreConfig):
        self.config = config
        self.lock = threading.RLock()
        self.budget = HostMemoryBudget(config.host_memory_cap_bytes)
        self.layers = [_LayerArena(config, self.budget, i) for i in range(config.n_layers)]
        # seq_id -> per layer: int64 array of slots (capacity >= count) and the count of blocks
        self._slots: dict[int, list[np.ndarray]] = {}
        self._n_blocks: dict[int, np.ndarray] = {}
        self._readers = 0
        self.context = ContextCache(config, self.budget, self.lock)

    # ---- sequences -------------------------------------------------------------------------
    def add_sequence(self, seq_id: int) -> None:
        with self.lock:
            if seq_id in self._slots:
                raise ValueError(f"seq_id={seq_id!r} is already in the store")
            self._slots[seq_id] = [np.empty(8, np.int64) for _ in range(self.config.n_layers)]
            self._n_blocks[seq_id] = np.zeros(self.config.n_layers, np.int64)
            self.context.add_sequence(seq_id)

    def free_sequence(self, seq_id: int) -> None:
        """Forget a sequence: its slots and context pages are recycled once no reader is in flight."""
        with self.lock:
            self.check_sequence(seq_id)
            for layer, arena in enumerate(self.layers):
                n = int(self._n_blocks[seq_id][layer])
                arena.pool.retired.extend(int(s) for s in self._slots[seq_id][layer][:n])
            del self._slots[seq_id], self._n_blocks[seq_id]
            self.context.free_sequence(seq_id)
            self._recycle_if_idle()

    def sequences(self) -> list[int]:
        with self.lock:
            return list(self._slots)

    def check_sequence(self, seq_id) -> None:
        if seq_id not in self._slots:
            raise ValueError(f"unknown seq_id={seq_id!r}; sequences in the store: {sorted(self._slots)[:20]}")

    def check_layer(self, layer) -> None:
        if not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.config.n_layers:
            raise ValueError(f"layer={layer!r}; expected an int in [0, {self.config.n_layers})")

    # ---- appending -------------------------------------------------------------------------
    def append_blocks(self, layer: int, seq_id: int, k: np.ndarray, v: np.ndarray, maw: np.ndarray,
                      positions: np.ndarray) -> np.ndarray:
        """Store `n` evicted blocks of one sequence; returns their block numbers (int64 [n]).

        k, v:      [n, block_size, Hkv, D]  float32 / float16 / bfloat16, or uint16 bits in kv_dtype
                                            (quantized here for an int8 store, which also
                                            takes int8 rows [.., D + 4] as stored)
        maw:       [n, block_size, Hkv]     float-like; the token's MAW per KV head (for GQA, the
                                            sum over the group's query heads; see host.sparsify)
        positions: [n, block_size]          integer absolute positions
        """
        c = self.config
        k, v = np.asarray(k), np.asarray(v)
        maw, positions = np.asarray(maw), np.asarray(positions)
        width = c.row_width if k.dtype == np.int8 else c.head_dim  # int8: stored rows, scale included
        if k.ndim != 4 or k.shape[1:] != (c.block_size, c.n_kv_heads, width):
            raise ValueError(f"k has shape {k.shape}; expected [n, block_size={c.block_size}, "
                             f"Hkv={c.n_kv_heads}, D={width}]")
        n = k.shape[0]
        if v.shape != k.shape:
            raise ValueError(f"v has shape {v.shape}; expected the shape of k {k.shape}")
        if maw.shape != (n, c.block_size, c.n_kv_heads):
            raise ValueError(f"maw has shape {maw.shape}; expected {(n, c.block_size, c.n_kv_heads)}")
        if positions.shape != (n, c.block_size):
            raise ValueError(f"positions has shape {positions.shape}; expected {(n, c.block_size)}")
        if not np.issubdtype(positions.dtype, np.integer):
            raise ValueError(f"positions dtype {positions.dtype}; expected an integer dtype")
        if not (np.issubdtype(maw.dtype, np.floating) or maw.dtype == ml_dtypes.bfloat16):
            raise ValueError(f"maw dtype {maw.dtype}; expected a float dtype")
        ks, vs = to_storage(k, c.kv_dtype), to_storage(v, c.kv_dtype)
        if c.key_digests:
            kf = from_storage(ks, c.kv_dtype)  # digests are of the values actually stored
            key_min, key_max = kf.min(axis=1), kf.max(axis=1)  # [n, Hkv, D]
        with self.lock:
            self.check_layer(layer)
            self.check_sequence(seq_id)
            arena = self.layers[layer]
            arena.ensure_capacity(n)
            slots = arena.pool.take(n)
            a = arena.arrays
            a["k"][slots] = ks.transpose(0, 2, 1, 3)
            a["v"][slots] = vs.transpose(0, 2, 1, 3)
            a["maw"][slots] = maw.astype(np.float32).transpose(0, 2, 1)
            a["positions"][slots] = positions
            if c.key_digests:
                a["key_min"][slots] = key_min
                a["key_max"][slots] = key_max
            table = self._slots[seq_id][layer]
            count = int(self._n_blocks[seq_id][layer])
            if count + n > table.shape[0]:
                grown = np.empty(max(2 * table.shape[0], count + n), np.int64)
                grown[:count] = table[:count]
                table = self._slots[seq_id][layer] = grown
            table[count:count + n] = slots
            self._n_blocks[seq_id][layer] = count + n  # publish last
            return np.arange(count, count + n, dtype=np.int64)

    def reserve_blocks(self, layer: int, n_blocks: int) -> None:
        """Make room in layer `layer` for `n_blocks` more blocks than are stored now and touch the
        slots they will take (first touch of fresh pages costs seconds per GiB on the lent VMs:
        do it at setup, not inside decode steps). Recycled slots are already touched."""
        if not isinstance(n_blocks, (int, np.integer)) or n_blocks < 0:
            raise ValueError(f"n_blocks={n_blocks!r}; expected an int >= 0")
        with self.lock:
            self.check_layer(layer)
            arena = self.layers[layer]
            arena.ensure_capacity(n_blocks)
            arena.slots.touch(arena.pool.needed_capacity(n_blocks))

    # ---- reading ---------------------------------------------------------------------------
    def n_blocks(self, layer: int, seq_id: int) -> int:
        with self.lock:
            self.check_layer(layer)
            self.check_sequence(seq_id)
            return int(self._n_blocks[seq_id][layer])

    def n_tokens(self, layer: int, seq_id: int) -> int:
        return self.n_blocks(layer, seq_id) * self.config.block_size

    def block_slots(self, layer: int, seq_id: int) -> np.ndarray:
        """Arena slots of the sequence's blocks in block-number order (int64 [n_blocks], a copy)."""
        with self.lock:
            self.check_layer(layer)
            self.check_sequence(seq_id)
            return self._slots[seq_id][layer][: self._n_blocks[seq_id][layer]].copy()

    def read_blocks(self, layer: int, seq_id: int, block_numbers=None) -> dict[str, np.ndarray]:
        """Copies of stored blocks in the append layout: k, v [n, bs, Hkv, W] (storage dtype; W = D,
        or D + 4 for int8: `host.store_format.from_storage` gives the values),
        maw [n, bs, Hkv] float32, positions [n, bs] int64, and with StoreConfig.key_digests
        key_min/key_max [n, Hkv, D] float32."""
        with self.lock:
            slots = self.block_slots(layer, seq_id)
            if block_numbers is not None:
                block_numbers = np.asarray(block_numbers, np.int64)
                bad = (block_numbers < 0) | (block_numbers >= slots.shape[0])
                if bad.any():
                    raise ValueError(f"block number {block_numbers[bad][0]} of seq_id={seq_id!r} layer {layer}; "
                                     f"expected [0, {slots.shape[0]})")
                slots = slots[block_numbers]
            a = self.layers[layer].arrays
            out = {
                "k": a["k"][slots].transpose(0, 2, 1, 3).copy(),
                "v": a["v"][slots].transpose(0, 2, 1, 3).copy(),
                "maw": a["maw"][slots].transpose(0, 2, 1).copy(),
                "positions": a["positions"][slots].copy(),
            }
            if self.config.key_digests:
                out["key_min"] = a["key_min"][slots].copy()
                out["key_max"] = a["key_max"][slots].copy()
            return out

    def key_digests(self, layer: int, seq_id: int) -> tuple[np.ndarray, np.ndarray]:
        """Per-block channel-wise key (min, max), each float32 [n_blocks, Hkv, D]."""
        if not self.config.key_digests:
            raise ValueError("key_digests: this store was built with StoreConfig.key_digests=False; "
                             "expected key_digests=True to keep per-block key digests")
        d = self.read_blocks(layer, seq_id)
        return d["key_min"], d["key_max"]

    # ---- memory accounting -----------------------------------------------------------------
    def bytes_reserved(self) -> int:
        """Bytes of all host arenas (KV store and context cache), allocated whether used or not."""
        with self.lock:
            return self.budget.reserved

    def bytes_used(self) -> int:
        """Bytes of arena rows currently holding a live block or context page."""
        with self.lock:
            used = 0
            for arena in self.layers:
                used += arrays_nbytes(arena.pool.n_in_use(), arena.arrays)
            return used + self.context.bytes_used()

    def bytes_resident_bound(self) -> int:
        """The most bytes the arenas (KV store and context cache) can hold resident: every row ever
        written or touched (up to each arena's high-water mark) rounded up to whole pages. Past
        the first 4 MiB of an array the pages may be 2 MiB huge pages (`host.memory`), so the
        store's resident memory grows in steps of up to 2 MiB per array, ahead of `bytes_used`."""
        with self.lock:
            arenas = self.layers + self.context.layers
            return sum(a.slots.resident_bound(max(a.pool.high_water, a.slots.touched)) for a in arenas)

    def bytes_resident(self) -> int | None:
        """Bytes of the arenas (KV store and context cache) resident now, page by page (mincore);
        None where that cannot be read. At most `bytes_resident_bound()`."""
        with self.lock:
            total = 0
            for arena in self.layers + self.context.layers:
                got = arena.slots.resident_bytes()
                if got is None:
                    return None
                total += got
            return total

    # ---- reader bracketing -----------------------------------------------------------------
    def begin_read(self) -> None:
        """Call with `self.lock` held, in the same critical section as the snapshot taken."""
        self._readers += 1

    def end_read(self) -> None:
        with self.lock:
            self._readers -= 1
            self._recycle_if_idle()

    def _recycle_if_idle(self) -> None:
        if self._readers:
            return
        for arena in self.layers:
            arena.pool.free.extend(arena.pool.retired)
            arena.pool.retired.clear()
        self.context.recycle_retired()
