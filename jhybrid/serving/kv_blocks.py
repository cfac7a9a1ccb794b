"""The prefix cache's first tier ("device" in its stats): a pool of KV blocks.

For the `full` backend's cache layout the pool lives on the device (`KVBlockPool`); for an
offloading (hybrid) backend, whose KV mostly lives in the host store, on the host
(`HostKVBlockPool`: a hit's offloaded part is appended to the host store from there, only its
window part is uploaded). Both keep one block as every layer's K and V of block_size tokens.

`KVBlockPool` holds `capacity` blocks in one preallocated device array and copies blocks between
it and the rows of a `KVCache` through the backend's `RowKV` (`AttentionBackend.row_kv()`: how a
row's tokens are read and written in its layers; FullAttention's {"k", "v"} [B, max_len, Hkv, D],
`FULL_ROW_KV`, or quest's pages). One block = `block_size` consecutive tokens of every layer's K and V:

    pool  [capacity, num_layers, 2, block_size, Hkv, D]   the cache's dtype (index 0: K, 1: V)

Block j of a row holds positions j*bs .. j*bs + bs - 1. Copies between the pool and a row run in
pieces of one fixed block count (`piece_blocks`, the last piece padded; padding is dropped by the
scatters), so each copy compiles once, at its first use (the engine's warm-up), never while serving:
a count padded to a power of two instead compiled a new program (~2 s on the H100 at 32 layers) for
each count first seen under load. The host copies (`read` / `read_start` / `write`: the spill tiers)
pad to powers of two. The pool implements the `prefix_cache.BlockStore` protocol (host copies in
and out for the host and disk tiers).

`read_start` is the prefix cache's asynchronous spill: it dispatches the gather of the slots into a
new device array (on the caller's thread, so before any later write into those slots: `_scatter`
and `_from_row` donate the pool, and the runtime starts a computation that reuses a donated buffer
only after the reads already dispatched on it; the gathered copy is a buffer of its own anyway)
and returns a `PendingRead` that the cache's worker thread calls: the device-to-host copy starts
there. Not `copy_to_host_async` on the caller's thread: on the H100 that call took 2.2-3.0 s for
4 GiB (`benchmarks/probe_spill.py`), the whole stall the asynchronous spill exists to remove.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jhybrid.attention.base import RowKV
from jhybrid.attention.full import FULL_ROW_KV
from jhybrid.hybrid.transfer import to_host


PIECE_BLOCKS = 64  # blocks per copy between the pool and a row (the last piece padded)


def _bucket(n: int) -> int:
    """n rounded up to a power of two (at least 1)."""
    return 1 << max(n - 1, 0).bit_length()


def _padded(values: np.ndarray, size: int, fill: int) -> np.ndarray:
    out = np.full(size, fill, np.int32)
    out[:len(values)] = values
    return out


@jax.jit
def _gather(pool, slots):
    return pool[slots]


@functools.partial(jax.jit, donate_argnums=(0,))
def _scatter(pool, slots, blocks):
    return pool.at[slots].set(blocks.astype(pool.dtype), mode="drop")


@functools.partial(jax.jit, donate_argnums=(0,), static_argnums=(7,))
def _into_row(cache, pool, row, slots, first, count, length, row_kv):
    """Writes pool[slots[:count]] to positions first*bs .. (first + count)*bs - 1 of cache row `row`,
    whose length becomes `length`."""
    n, bs = slots.shape[0], pool.shape[3]
    blocks = pool[slots]  # [n, L, 2, bs, Hkv, D]
    positions = jnp.arange(n * bs, dtype=jnp.int32)
    positions = jnp.where(positions < count * bs, first * bs + positions, -1)  # padding blocks: dropped
    kv = jnp.transpose(blocks, (1, 2, 0, 3, 4, 5)).reshape(blocks.shape[1:3] + (n * bs,) + blocks.shape[4:])
    return cache.replace(layers=row_kv.write(cache.layers, row, kv, positions),
                         lengths=cache.lengths.at[row].set(length))


@functools.partial(jax.jit, donate_argnums=(0,), static_argnums=(5,))
def _from_row(pool, cache, row, block_numbers, slots, row_kv):
    """pool[slots] = blocks `block_numbers` of cache row `row` (padding slots are out of range: dropped)."""
    bs = pool.shape[3]
    positions = (block_numbers[:, None] * bs + jnp.arange(bs, dtype=jnp.int32)[None, :]).reshape(-1)
    blocks = row_kv.read(cache.layers, row, positions)  # [L, 2, n*bs, Hkv, D]
    blocks = blocks.reshape(blocks.shape[:2] + (slots.shape[0], bs) + blocks.shape[3:])
    blocks = jnp.transpose(blocks, (2, 0, 1, 3, 4, 5))  # [n, L, 2, bs, Hkv, D]
    return pool.at[slots].set(blocks.astype(pool.dtype), mode="drop")


def block_bytes_of(config, block_size: int, dtype=None) -> int:
    """Bytes of one block for a model config (every layer's K and V of block_size tokens; dtype: the
    cache's, default the model's)."""
    return (config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim
            * jnp.dtype(config.dtype if dtype is None else dtype).itemsize)


HOST_COPY_PIECE_BYTES = 64 << 20  # a spill's device-to-host copy, per `to_host` call (PendingRead)


class PendingRead:
    """Blocks to copy off the device: a dispatched gather [size, L, 2, bs, Hkv, D] (size >= n,
    padded). Called once (on any thread: the prefix cache's worker) it copies them to the host and
    returns the host blocks [n, L, 2, bs, Hkv, D] (the pool's dtype), dropping its reference to the
    device copy so that its device memory is freed."""

    def __init__(self, gathered: jax.Array, count: int):
        self._gathered: jax.Array | None = gathered
        self.count = count

    def __call__(self) -> np.ndarray:
        gathered, self._gathered = self._gathered, None
        if gathered is None:
            raise RuntimeError(f"a PendingRead of {self.count} KV blocks was called twice; it returns its blocks once")
        # In pieces of about HOST_COPY_PIECE_BYTES, each through pinned host memory (`to_host`):
        # np.asarray of a device array copies at ~1-2 GB/s holding the GIL the whole time (on the
        # H100 a 4 GiB one let the thread dispatching the engine's steps run twice in 2.6 s; in
        # 128 MiB pieces its longest step was 82 ms: benchmarks/probe_spill.py).
        per_block = int(np.prod(gathered.shape[1:])) * gathered.dtype.itemsize
        step = max(1, HOST_COPY_PIECE_BYTES // per_block)
        host = np.empty((self.count,) + gathered.shape[1:], np.dtype(gathered.dtype))
        for first in range(0, self.count, step):
            last = min(first + step, self.count)
            host[first:last] = to_host(gathered[first:last])
        return host


class _BlockSlots:
    """`capacity` slots of one KV block each, a block = [num_layers, 2, block_size, Hkv, D]: the shape
    both pools share (each allocates its own storage)."""

    def __init__(self, capacity: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype):
        if capacity < 1:
            raise ValueError(f"a KV block pool of {capacity} blocks; expected at least 1")
        self.capacity = capacity
        self.block_size = block_size
        self.block_shape = (num_layers, 2, block_size, num_kv_heads, head_dim)
        self.dtype = np.dtype(jnp.dtype(dtype))  # the blocks' NumPy dtype (bfloat16: ml_dtypes')
        self.block_bytes = int(np.prod(self.block_shape)) * self.dtype.itemsize


class KVBlockPool(_BlockSlots):
    """`capacity` device slots of one KV block each (module doc); a `prefix_cache.BlockStore`."""

    def __init__(self, capacity: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype, row_kv: RowKV = FULL_ROW_KV):
        super().__init__(capacity, num_layers, block_size, num_kv_heads, head_dim, dtype)
        self.pool = jnp.zeros((capacity,) + self.block_shape, dtype)
        self.piece_blocks = min(PIECE_BLOCKS, _bucket(capacity))
        self.row_kv = row_kv

    # ---- BlockStore: host copies ------------------------------------------------------------------

    def read(self, slots: np.ndarray) -> np.ndarray:
        """[n, L, 2, bs, Hkv, D] host copies of the blocks in slots [n]."""
        n = len(slots)
        return np.asarray(_gather(self.pool, _padded(slots, _bucket(n), 0)))[:n]

    def read_start(self, slots: np.ndarray) -> Callable[[], np.ndarray]:
        """Dispatches the copy of the blocks in slots [n] and returns a `PendingRead` that gives them,
        [n, L, 2, bs, Hkv, D] on the host, when called (module doc: the slots may be written as soon
        as this returns)."""
        n = len(slots)
        gathered = _gather(self.pool, _padded(slots, _bucket(n), 0))
        return PendingRead(gathered, n)  # its host copy starts on the thread that calls it (module doc)

    def write(self, slots: np.ndarray, blocks: np.ndarray) -> None:
        """Stores host blocks [n, L, 2, bs, Hkv, D] into slots [n]."""
        n = len(slots)
        size = _bucket(n)
        padded = np.zeros((size,) + self.block_shape, blocks.dtype)
        padded[:n] = blocks
        self.pool = _scatter(self.pool, _padded(slots, size, self.capacity), padded)

    # ---- copies between the pool and a cache row ---------------------------------------------------

    def into_row(self, cache, row: int, slots: np.ndarray):
        """The cache (donated) with blocks `slots` [n] as positions 0 .. n*bs - 1 of row `row`, whose
        length becomes n*bs (what it held beyond is masked by the length)."""
        n, size, length = len(slots), self.piece_blocks, np.int32(len(slots) * self.block_size)
        for first in range(0, n, size):
            part = slots[first:first + size]
            cache = _into_row(cache, self.pool, np.int32(row), _padded(part, size, 0), np.int32(first),
                              np.int32(len(part)), length, self.row_kv)
        return cache

    def from_row(self, cache, row: int, block_numbers: np.ndarray, slots: np.ndarray) -> None:
        """Copies blocks `block_numbers` [n] of cache row `row` into slots [n] (the cache is read only)."""
        size = self.piece_blocks
        for first in range(0, len(slots), size):
            self.pool = _from_row(self.pool, cache, np.int32(row), _padded(block_numbers[first:first + size], size, 0),
                                  _padded(slots[first:first + size], size, self.capacity), self.row_kv)


class HostKVBlockPool(_BlockSlots):
    """`capacity` host slots of one KV block each, [capacity, num_layers, 2, block_size, Hkv, D] in
    the model dtype (NumPy, every page touched when the pool is made): the prefix cache's first tier
    for an offloading backend (`jhybrid.hybrid.ingest` places a hit from it); a
    `prefix_cache.BlockStore`."""

    def __init__(self, capacity: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype):
        super().__init__(capacity, num_layers, block_size, num_kv_heads, head_dim, dtype)
        # Written once here, not left to the first writes: a page's first touch is slow (on the CPU
        # machine a fresh GiB took 7 s to write once, 0.3 s after), and it would land in engine steps.
        self.data = np.empty((capacity,) + self.block_shape, np.dtype(jnp.dtype(dtype)))
        self.data.fill(0)
        # The same bytes as unsigned words: NumPy copies a custom float dtype (ml_dtypes' bfloat16)
        # element by element through the dtype, 2.7x slower than words (16 blocks of the 8B shape:
        # 62 ms against 22 ms on the CPU machine).
        self._words = self.data.view(_words_dtype(self.data.dtype))

    def _as_words(self, array) -> np.ndarray:
        """array (any dtype: converted to the pool's first) as the pool's words, a view."""
        return np.asarray(array, self.data.dtype).view(self._words.dtype)

    def read(self, slots: np.ndarray) -> np.ndarray:
        """[n, L, 2, bs, Hkv, D] copies of the blocks in slots [n]."""
        return self._words[np.asarray(slots, np.int64)].view(self.data.dtype)

    def read_start(self, slots: np.ndarray) -> Callable[[], np.ndarray]:
        """The blocks in slots [n] copied now (host memory: nothing to wait for; the slots may be
        written as soon as this returns), returned by the callable [n, L, 2, bs, Hkv, D]."""
        blocks = self.read(slots)
        return lambda: blocks

    def write(self, slots: np.ndarray, blocks: np.ndarray) -> None:
        """Stores blocks [n, L, 2, bs, Hkv, D] into slots [n]."""
        self._words[np.asarray(slots, np.int64)] = self._as_words(blocks)

    def history(self, slots: np.ndarray) -> np.ndarray:
        """The blocks in slots [n] as one history: [L, 2, n * bs, Hkv, D] (block i = tokens i*bs ..)."""
        blocks = self._words[np.asarray(slots, np.int64)]
        n, (layers, _, bs, hkv, d) = len(slots), self.block_shape
        return blocks.transpose(1, 2, 0, 3, 4, 5).reshape(layers, 2, n * bs, hkv, d).view(self.data.dtype)

    def write_history(self, slots: np.ndarray, kv: np.ndarray, block_numbers: np.ndarray) -> None:
        """Stores blocks `block_numbers` [n] of a history kv [L, 2, T, Hkv, D] (block j = tokens
        j*bs .. j*bs + bs - 1) into slots [n]."""
        layers, _, bs, hkv, d = self.block_shape
        count = kv.shape[2] // bs
        blocks = self._as_words(kv)[:, :, :count * bs].reshape(
            layers, 2, count, bs, hkv, d)  # a view
        # one strided copy per block straight into its slot (a gather of the blocks first, then the
        # transposed scatter, copied every byte twice: ~25 ms a [4, 256] call at the 8B shape)
        for slot, number in zip(np.asarray(slots, np.int64).tolist(), np.asarray(block_numbers, np.int64).tolist()):
            self._words[slot] = blocks[:, :, number]


def _words_dtype(dtype: np.dtype) -> np.dtype:
    """The unsigned integer dtype of dtype's item size (a plain copy of the same bytes)."""
    return np.dtype(f"u{dtype.itemsize}")


__all__ = ["KVBlockPool", "HostKVBlockPool", "PendingRead", "block_bytes_of"]
