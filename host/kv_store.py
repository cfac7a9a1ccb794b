"""Host KV store: where offloaded KV lives, per layer and sequence, in preallocated growable arenas.

Layout (one `_LayerArena` per layer; a *slot* holds one offloaded block of one sequence):

    k, v        [slots, Hkv, block_size, D]   storage dtype (uint16 bit patterns for bf16 / fp16, float32 for fp32)
    maw         [slots, Hkv, block_size]      float32   moving-average attention weight per token and KV head
    positions   [slots, block_size]           int64     absolute token position
    key_min/max [slots, Hkv, D]               float32   per-block key digest (ScoutAttention / Quest block selection)

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
import mmap
import os
import platform
import sys
import threading
from dataclasses import dataclass

import ml_dtypes
import numpy as np

log = logging.getLogger(__name__)

KV_DTYPES = ("bf16", "fp16", "fp32")
# Code passed to the Numba kernels so they know how to widen the stored bits to float32.
FORMAT_CODE = {"fp32": 0, "bf16": 1, "fp16": 2}
STORAGE_DTYPE = {"bf16": np.dtype(np.uint16), "fp16": np.dtype(np.uint16), "fp32": np.dtype(np.float32)}


class HostMemoryCapError(MemoryError):
    """Raised when growing a host arena would exceed the configured host-memory cap."""


def to_storage(x: np.ndarray, kv_dtype: str) -> np.ndarray:
    """Convert K or V values to the store's storage representation (no copy when already there).

    Accepts float32, float16, ml_dtypes.bfloat16, or uint16 bit patterns (taken to be already in
    `kv_dtype`'s 16-bit format; not accepted for an fp32 store). Rounding is NumPy/ml_dtypes'
    round-to-nearest-even.
    """
    x = np.asarray(x)
    dt = x.dtype
    if kv_dtype == "fp32":
        if dt == np.uint16:
            raise ValueError("uint16 K/V given to an fp32 store: pass float32, float16 or bfloat16 values")
        if dt in (np.float32, np.float16, ml_dtypes.bfloat16):
            return x.astype(np.float32, copy=False)
    elif kv_dtype == "bf16":
        if dt == np.uint16:
            return x
        if dt == ml_dtypes.bfloat16:
            return x.view(np.uint16)
        if dt in (np.float32, np.float16):
            return x.astype(ml_dtypes.bfloat16).view(np.uint16)
    elif kv_dtype == "fp16":
        if dt == np.uint16:
            return x
        if dt == np.float16:
            return x.view(np.uint16)
        if dt in (np.float32, ml_dtypes.bfloat16):
            return x.astype(np.float16).view(np.uint16)
    else:
        raise ValueError(f"kv_dtype={kv_dtype!r}; expected one of {KV_DTYPES}")
    raise ValueError(f"K/V dtype {dt}; expected float32, float16, bfloat16 or uint16 bit patterns")


def from_storage(x: np.ndarray, kv_dtype: str) -> np.ndarray:
    """Storage representation -> float32 values (exact: every bf16/fp16 value is a float32)."""
    if kv_dtype == "fp32":
        return np.asarray(x, np.float32)
    if kv_dtype == "bf16":
        return np.asarray(x).view(ml_dtypes.bfloat16).astype(np.float32)
    if kv_dtype == "fp16":
        return np.asarray(x).view(np.float16).astype(np.float32)
    raise ValueError(f"kv_dtype={kv_dtype!r}; expected one of {KV_DTYPES}")


class HostMemoryBudget:
    """Bytes reserved by all host arenas against an optional cap (None = unlimited)."""

    def __init__(self, cap_bytes: int | None):
        if cap_bytes is not None and cap_bytes <= 0:
            raise ValueError(f"host_memory_cap_bytes={cap_bytes}; expected a positive int or None")
        self.cap_bytes = cap_bytes
        self.reserved = 0

    def reserve(self, nbytes: int, what: str) -> None:
        if self.cap_bytes is not None and self.reserved + nbytes > self.cap_bytes:
            raise HostMemoryCapError(
                f"growing {what} by {nbytes / 2**20:.1f} MiB would reserve "
                f"{(self.reserved + nbytes) / 2**20:.1f} MiB of host memory, over the cap of "
                f"{self.cap_bytes / 2**20:.1f} MiB (host_memory_cap_bytes); free sequences or raise the cap")
        self.reserved += nbytes

    def release(self, nbytes: int) -> None:
        self.reserved -= nbytes


def grow_arrays(arrays: dict[str, np.ndarray], new_len: int) -> dict[str, np.ndarray]:
    """New arrays with leading axis `new_len`, the old contents copied in front, the rest zero
    (lazily: fresh pages are only faulted in when touched). The copying fallback of `SlotArrays`."""
    grown = {}
    for name, a in arrays.items():
        b = np.zeros((new_len,) + a.shape[1:], a.dtype)
        b[: a.shape[0]] = a
        grown[name] = b
    return grown


def _physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


# mmap.MAP_NORESERVE appears in Python 3.13; its value on x86-64 / aarch64 / arm Linux is 0x4000.
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") and
                         platform.machine() in ("x86_64", "aarch64", "arm64", "armv7l", "i686") else 0)
_HUGE_FROM = 4 << 20
# First touch of 512 MiB measured on the 2-core EPYC VM: ~320 ms with 4 KiB pages, ~80 ms with THP.


def _reserve_address_space(nbytes: int) -> np.ndarray | None:
    """uint8 [nbytes] over a private anonymous mapping that reserves address space only
    (MAP_NORESERVE): physical pages come on first write, zero-filled; transparent huge pages are
    requested (MADV_HUGEPAGE: 512x fewer first-touch faults). None when the kernel refuses (e.g.
    strict overcommit accounting, vm.overcommit_memory=2, with too little commit headroom)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
    try:
        mm = mmap.mmap(-1, max(1, nbytes), flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError, OverflowError):
        return None
    # Huge pages only past the first few MiB: a small arena keeps 4 KiB pages (no 2 MiB per array).
    if hasattr(mmap, "MADV_HUGEPAGE") and nbytes > _HUGE_FROM:
        try:
            mm.madvise(mmap.MADV_HUGEPAGE, _HUGE_FROM, nbytes - _HUGE_FROM)
        except OSError:  # THP disabled: 4 KiB pages, still correct
            pass
    return np.frombuffer(mm, np.uint8)


class SlotArrays:
    """Named arrays sharing a leading *slot* axis that grow without copying.

    Each array sits at the front of its own address-space reservation of `max_slots` rows
    (MAP_NORESERVE, so only touched pages use memory); growing to n slots hands out views [:n] of
    the same memory: no copy, no stall proportional to the arena, and views held by readers stay
    valid. `max_slots` is as many slots as fit in `reserve_bytes` (default: the machine's physical
    memory, or the host-memory cap when one is set). Past the reservation, or where the kernel
    refuses to reserve address space, growth falls back to allocate-and-copy, logged as a warning.
    First touch of fresh pages is slow on the lent VMs (seconds per GiB): `touch` faults rows in
    ahead of time (`KVStore.reserve_blocks`), and `touched` counts the rows [0, touched) known done.
    """

    def __init__(self, templates: dict[str, np.ndarray], n_slots: int, what: str,
                 reserve_bytes: int | None = None):
        self.what = what
        self._tails = {name: (t.shape[1:], t.dtype) for name, t in templates.items()}
        slot_bytes = arrays_nbytes(1, templates)
        reserve_bytes = _physical_memory_bytes() if reserve_bytes is None else reserve_bytes
        max_slots = max(n_slots, reserve_bytes // max(1, slot_bytes))
        self._bases: dict[str, np.ndarray] | None = None
        while max_slots >= n_slots:
            bases = {}
            for name, (tail, dt) in self._tails.items():
                row = int(np.prod(tail, dtype=np.int64)) * dt.itemsize
                buf = _reserve_address_space(max_slots * row)
                if buf is None:
                    break
                bases[name] = buf[: max_slots * row].view(dt).reshape((max_slots,) + tail)
            if len(bases) == len(self._tails):
                self._bases = bases
                break
            del bases
            if max_slots == n_slots:
                break
            max_slots = max(n_slots, max_slots // 4)
        if self._bases is None:
            log.warning("%s: could not reserve address space for %d slots; growth will copy the arena",
                        what, n_slots)
            self.max_slots = n_slots
            self.arrays = {name: np.zeros((n_slots,) + tail, dt) for name, (tail, dt) in self._tails.items()}
        else:
            self.max_slots = max_slots
            self.arrays = {name: b[:n_slots] for name, b in self._bases.items()}
        self.touched = 0
        self.copies = 0  # growth events that had to copy (reservation exhausted)

    @property
    def capacity(self) -> int:
        return self.arrays[next(iter(self.arrays))].shape[0]

    def grow(self, new_cap: int) -> None:
        """Capacity `new_cap` (>= the current one): a view of the reservation when it fits, else a
        copy into new arrays (logged)."""
        if new_cap <= self.capacity:
            return
        if self._bases is not None and new_cap <= self.max_slots:
            self.arrays = {name: b[:new_cap] for name, b in self._bases.items()}
            return
        log.warning("%s: growing to %d slots beyond the %d-slot address-space reservation copies the "
                    "arena (%.1f MiB)", self.what, new_cap, self.max_slots,
                    arrays_nbytes(self.capacity, self.arrays) / 2**20)
        self.arrays = grow_arrays(self.arrays, new_cap)
        self._bases = None
        self.max_slots = new_cap
        self.copies += 1

    def touch(self, upto: int) -> None:
        """Write zeros to rows [touched, upto) (upto <= capacity): the first touch, done now."""
        upto = min(upto, self.capacity)
        if upto > self.touched:
            for a in self.arrays.values():
                a[self.touched:upto] = 0
            self.touched = upto


def arrays_nbytes(n: int, arrays: dict[str, np.ndarray]) -> int:
    return sum(n * a[0:1].nbytes for a in arrays.values())


class SlotPool:
    """Integer slots [0, capacity) of an arena: fresh ones from a high-water mark, recycled ones
    from a free list; slots released while readers may still see them wait in `retired`."""

    def __init__(self):
        self.high_water = 0
        self.free: list[int] = []
        self.retired: list[int] = []

    def take(self, n: int) -> np.ndarray:
        reuse = [self.free.pop() for _ in range(min(n, len(self.free)))]
        fresh = np.arange(self.high_water, self.high_water + n - len(reuse), dtype=np.int64)
        self.high_water += len(fresh)
        return np.concatenate([np.asarray(reuse, np.int64), fresh])

    def needed_capacity(self, n: int) -> int:
        return self.high_water + max(0, n - len(self.free))

    def n_in_use(self) -> int:
        return self.high_water - len(self.free) - len(self.retired)


@dataclass(frozen=True)
class StoreConfig:
    """Shape of what the store holds. `kv_dtype` in {"bf16", "fp16", "fp32"}."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    block_size: int
    kv_dtype: str = "bf16"
    host_memory_cap_bytes: int | None = None
    initial_blocks_per_layer: int = 16
    context_page_tokens: int = 256

    def __post_init__(self):
        for name in ("n_layers", "n_kv_heads", "head_dim", "block_size", "initial_blocks_per_layer",
                     "context_page_tokens"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"{name}={value!r}; expected a positive int")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype={self.kv_dtype!r}; expected one of {KV_DTYPES}")


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
        c = self.cfg
        sd = STORAGE_DTYPE[c.kv_dtype]
        return {
            "k": np.empty((1, c.n_kv_heads, c.block_size, c.head_dim), sd),
            "v": np.empty((1, c.n_kv_heads, c.block_size, c.head_dim), sd),
            "maw": np.empty((1, c.n_kv_heads, c.block_size), np.float32),
            "positions": np.empty((1, c.block_size), np.int64),
            "key_min": np.empty((1, c.n_kv_heads, c.head_dim), np.float32),
            "key_max": np.empty((1, c.n_kv_heads, c.head_dim), np.float32),
        }

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
        from host.context_cache import ContextCache  # one concept per module; the store owns both

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
        maw:       [n, block_size, Hkv]     float-like; the token's MAW per KV head (for GQA, the
                                            sum over the group's query heads; see host.sparsify)
        positions: [n, block_size]          integer absolute positions
        """
        c = self.config
        k, v = np.asarray(k), np.asarray(v)
        maw, positions = np.asarray(maw), np.asarray(positions)
        if k.ndim != 4 or k.shape[1:] != (c.block_size, c.n_kv_heads, c.head_dim):
            raise ValueError(f"k has shape {k.shape}; expected [n, block_size={c.block_size}, "
                             f"Hkv={c.n_kv_heads}, D={c.head_dim}]")
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
        """Copies of stored blocks in the append layout: k, v [n, bs, Hkv, D] (storage dtype),
        maw [n, bs, Hkv] float32, positions [n, bs] int64, key_min/key_max [n, Hkv, D] float32."""
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
            return {
                "k": a["k"][slots].transpose(0, 2, 1, 3).copy(),
                "v": a["v"][slots].transpose(0, 2, 1, 3).copy(),
                "maw": a["maw"][slots].transpose(0, 2, 1).copy(),
                "positions": a["positions"][slots].copy(),
                "key_min": a["key_min"][slots].copy(),
                "key_max": a["key_max"][slots].copy(),
            }

    def key_digests(self, layer: int, seq_id: int) -> tuple[np.ndarray, np.ndarray]:
        """Per-block channel-wise key (min, max), each float32 [n_blocks, Hkv, D]."""
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
