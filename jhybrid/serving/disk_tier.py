"""The prefix cache's disk tier: KV blocks in fixed slots of HCache's per-layer chunk files.

The files are an HCache store's data files (`jhybrid.hcache.storage`: `ChunkLayout`, one
`LayerAppender` per layer, `read_chunk`, `verify_chunks`), written under one session id, `blocks`,
with chunk_tokens = the prefix cache's block_size:

  <stripe_dirs[s]>/blocks/layer_<l>.bin   per layer, the slots c with c % S == s; slot c at byte
                                          (c // S) * chunk_bytes (S stripe directories, default 1:
                                          the tier's folder)
  <folder>/index.json                     written at `save_index` (the prefix cache's close) and
                                          read back, then removed, by `load_index`
  <folder>/locks/blocks.lock              HCache's writer lock (`SessionLock`): one open store
                                          per folder (another gets SessionLocked)

A block [L, 2, block_size, Hkv, D] (index 0: K, 1: V; the prefix cache's block shape,
`kv_blocks._BlockSlots.block_shape`) occupies one chunk slot in every layer's file; layer l's
chunk is HCache's "kv" row layout, rows [block_size, 2*Hkv*D] (a token's K, Hkv*D values, then its
V), as `HCacheEngine` saves a "kv" layer and the restorer splits it back (`restorer._split_kv`).
The tier has a fixed number of slots (`capacity`, the prefix cache's disk_bytes // block_bytes):
the files are sized for all of them when opened (sparse until written), a freed slot goes back on
a free list and is written over by the next block. Every written chunk's crc32 is kept (per slot
and layer) and checked when the block is read: a failed check, or a missing or short file, is
not wrong KV served but a miss (`read` returns None, logs one warning and counts `read_errors`).

Why "kv" and not HCache's hidden states: for grouped-query models a layer's hidden state row is
larger than its K + V row (Llama-3-8B: d_model 4096 vs 2 * 8 * 128 = 2048 values per token and
layer; SmolLM2-135M: 576 vs 2 * 3 * 64 = 384; `jhybrid.bench.shapes`), so reading hidden states
moves more bytes and still needs the K/V projections, and HCache's own planner restores such
layers from KV (bytes decide it: `jhybrid.hcache.planner`). And the prefix cache only ever holds
KV: the serving engine never captures hidden states.

Persistence: `save_index` records every kept block (key, parent key, int32 token ids, slot, the
slot's per-layer crc32s) with a caller's fingerprint (the model and KV dtype: the serving engine
passes HCache's config hash, weights fingerprint and the cache dtype), atomically
(`write_file_atomically`); `load_index` with the same fingerprint, block shape, dtype and number of
stripes adopts those slots. Another fingerprint discards the files (one log line naming both).

Not thread-safe (the prefix cache's caller's thread only).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import numpy as np

from jhybrid.hcache.storage import (ChunkLayout, CorruptSession, LayerAppender, SessionLock, SessionLocked,
                                    read_chunk, verify_chunks, write_file_atomically)

log = logging.getLogger("jhybrid.serving")

SESSION_ID = "blocks"  # the HCache session id the tier's layer files live under
INDEX_FILE = "index.json"
INDEX_FORMAT = 1


@dataclasses.dataclass(frozen=True)
class SavedBlock:
    """One disk block as the index records it: its prefix-cache key, its parent's key (None for a
    prompt's first block), its tokens (int32 bytes, block_size ids) and its slot."""

    key: int
    parent_key: int | None
    tokens: bytes
    slot: int


class DiskBlockStore:
    """`capacity` slots of one KV block each in HCache-layout layer files (module doc).

    folder: where the index file lives, and the layer files unless stripe_dirs is given.
    block_shape: (L, 2, block_size, Hkv, D); dtype: the blocks' NumPy dtype (bfloat16 via ml_dtypes).
    stripe_dirs: directories the slots are striped over (slot c in stripe c % S); default (folder,).
    """

    def __init__(self, folder: str, capacity: int, block_shape: tuple[int, ...], dtype,
                 stripe_dirs: tuple[str, ...] | None = None):
        block_shape = tuple(int(n) for n in block_shape)
        if len(block_shape) != 5 or block_shape[1] != 2:
            raise ValueError(f"disk tier block_shape={block_shape}; expected (num_layers, 2, block_size, Hkv, D)")
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"disk tier capacity={capacity!r}; expected an integer >= 1 (slots)")
        self.folder = folder
        self.capacity = capacity
        self.block_shape = block_shape
        self.dtype = np.dtype(dtype)
        self.num_layers, _, self.block_size, heads, head_dim = block_shape
        self.row_values = 2 * heads * head_dim  # HCache's "kv" row: K then V of one token
        self.block_bytes = int(np.prod(block_shape)) * self.dtype.itemsize
        self.layout = ChunkLayout(stripe_dirs=tuple(stripe_dirs or (folder,)), chunk_tokens=self.block_size)
        self.read_errors = 0
        self._crcs: dict[int, tuple[int, ...]] = {}  # used slot -> its chunks' crc32, one per layer
        self._free = list(range(capacity - 1, -1, -1))  # pop() gives the lowest slot first
        os.makedirs(folder, exist_ok=True)
        chunk_bytes = self.block_size * self.row_values * self.dtype.itemsize
        self._appenders: list[LayerAppender] = []
        try:
            self._lock: SessionLock | None = SessionLock(folder, SESSION_ID)
        except SessionLocked as err:
            raise SessionLocked(f"prefix cache disk tier {folder} is in use by another prefix cache: {err}") from None
        try:  # files sized for every slot (their bytes past the capacity cut away)
            for layer in range(self.num_layers):
                self._appenders.append(LayerAppender(self.layout, SESSION_ID, layer, capacity, chunk_bytes))
        except BaseException:
            self.close()
            raise

    # ---- slots -----------------------------------------------------------------------------------

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def used_slots(self) -> list[int]:
        return sorted(self._crcs)

    def write(self, block: np.ndarray) -> int:
        """Stores one block [L, 2, block_size, Hkv, D] (this store's dtype) in a free slot; -> the
        slot. RuntimeError when no slot is free; an OSError (a full disk) leaves the slot free."""
        if block.shape != self.block_shape or block.dtype != self.dtype:
            raise ValueError(f"disk tier block {block.shape} {block.dtype}; expected {self.block_shape} {self.dtype}")
        if not self._free:
            raise RuntimeError(f"disk tier: all {self.capacity} slots are used; free one first")
        slot = self._free.pop()
        try:
            crcs = tuple(appender.write_at(slot, self._rows(block, layer))
                         for layer, appender in enumerate(self._appenders))
        except BaseException:
            self._free.append(slot)
            raise
        self._crcs[slot] = crcs
        return slot

    def _rows(self, block: np.ndarray, layer: int) -> np.ndarray:
        """Layer `layer` of a block as HCache "kv" rows [block_size, 2*Hkv*D] (token t: K, then V)."""
        return block[layer].transpose(1, 0, 2, 3).reshape(self.block_size, self.row_values)

    def read(self, slot: int) -> np.ndarray | None:
        """The block in `slot`, [L, 2, block_size, Hkv, D], every layer's chunk checked against its
        crc32; None (one warning logged, read_errors counted) when a chunk fails its check or its
        file is missing, short or unreadable. The slot stays used (`free` it)."""
        crcs = self._crcs[slot]
        rows = np.empty((self.num_layers, self.block_size, self.row_values), self.dtype)
        try:
            for layer in range(self.num_layers):
                read_chunk(self.layout, SESSION_ID, layer, slot, rows[layer])
                verify_chunks(rows[layer], self.block_size, [crcs[layer]],
                              f"prefix cache disk slot {slot} layer {layer}")
        except (CorruptSession, OSError) as err:
            self.read_errors += 1
            log.warning("prefix cache disk tier: block in slot %d unreadable (%s); dropped as a miss", slot, err)
            return None
        _, _, bs, heads, head_dim = self.block_shape
        return np.ascontiguousarray(rows.reshape(self.num_layers, bs, 2, heads, head_dim).transpose(0, 2, 1, 3, 4))

    def free(self, slot: int) -> None:
        """Gives a used slot back (its bytes stay until written over)."""
        del self._crcs[slot]
        self._free.append(slot)

    # ---- persistence -----------------------------------------------------------------------------

    @property
    def index_path(self) -> str:
        return os.path.join(self.folder, INDEX_FILE)

    def _header(self, fingerprint: str | None) -> dict:
        return {"format": INDEX_FORMAT, "fingerprint": fingerprint, "block_shape": list(self.block_shape),
                "dtype": self.dtype.name, "num_stripes": len(self.layout.stripe_dirs)}

    def save_index(self, blocks: list[SavedBlock], fingerprint: str | None) -> None:
        """Syncs the layer files, then writes the index of `blocks` (each in a used slot; the order
        is kept: the prefix cache lists parents before children) atomically."""
        for appender in self._appenders:
            appender.sync()
        entries = [{"key": b.key, "parent": b.parent_key, "tokens": np.frombuffer(b.tokens, np.int32).tolist(),
                    "slot": b.slot, "crc": list(self._crcs[b.slot])} for b in blocks]
        index = dict(self._header(fingerprint), blocks=entries)
        write_file_atomically(self.index_path, json.dumps(index).encode())

    def load_index(self, fingerprint: str | None) -> list[SavedBlock]:
        """The blocks of the index left in the folder, in its order, their slots now used (and
        their crc32s known again); the index file is removed (this store now owns the slots).
        [] when there is none; an index of another fingerprint or layout, or an unreadable one,
        is discarded with its blocks' files (one log line)."""
        path = self.index_path
        if not os.path.exists(path):
            return []
        try:
            with open(path, "rb") as f:
                index = json.loads(f.read())
            header = {name: index[name] for name in self._header(None)}
            entries = index["blocks"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.warning("prefix cache disk tier: index %s unreadable (%s); its blocks are discarded", path, err)
            self.discard()
            return []
        expected = self._header(fingerprint)
        if header["fingerprint"] != fingerprint:
            log.warning("prefix cache disk tier: %s holds blocks of fingerprint %r, this cache's is %r; "
                        "they are discarded", self.folder, header["fingerprint"], fingerprint)
            self.discard()
            return []
        if header != expected:
            differ = ", ".join(f"{name} {header[name]!r} (now {expected[name]!r})"
                               for name in expected if header[name] != expected[name])
            log.warning("prefix cache disk tier: %s holds blocks of another layout (%s); they are discarded",
                        self.folder, differ)
            self.discard()
            return []
        blocks = []
        for entry in entries:
            try:
                slot, crcs = int(entry["slot"]), tuple(int(c) for c in entry["crc"])
                block = SavedBlock(key=int(entry["key"]),
                                   parent_key=None if entry["parent"] is None else int(entry["parent"]),
                                   tokens=np.asarray(entry["tokens"], np.int32).tobytes(), slot=slot)
            except (KeyError, TypeError, ValueError):
                continue  # a malformed entry: its block (and the blocks below it) are not loaded
            if not 0 <= slot < self.capacity or slot in self._crcs or len(crcs) != self.num_layers:
                continue  # past a smaller capacity now, or listed twice
            self._crcs[slot] = crcs
            blocks.append(block)
        self._free = [slot for slot in range(self.capacity - 1, -1, -1) if slot not in self._crcs]
        os.remove(path)
        return blocks

    def discard(self) -> None:
        """Forgets every block: all slots free, the layer files emptied (then sized again), the
        index removed."""
        self._crcs.clear()
        self._free = list(range(self.capacity - 1, -1, -1))
        for appender in self._appenders:
            appender.truncate(0)
            appender.truncate(self.capacity)
        try:
            os.remove(self.index_path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Closes the layer files (their bytes and the index stay on disk) and releases the folder."""
        for appender in self._appenders:
            appender.close()
        self._appenders = []
        if self._lock is not None:
            self._lock.release()
            self._lock = None


__all__ = ["DiskBlockStore", "SavedBlock", "SESSION_ID", "INDEX_FILE"]
