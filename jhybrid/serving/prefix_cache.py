"""The prefix cache: KV of prompt prefixes kept across requests, in three LRU tiers.

A prompt is cut into blocks of `block_size` tokens; block i's key is a chained hash
h_i = hash(h_{i-1}, tokens of block i) (h_{-1} = 0), so equal keys mean equal prefixes up to a
hash collision. Every cached block keeps its tokens and its parent block (the object, not a key):
a lookup walks the prompt's blocks from the first and accepts block i only when its tokens are the
prompt's and its parent is the block accepted at i - 1, so a hit is token-exact over the whole prefix
whatever the hash does (a colliding key is a miss, and an insertion stops there).

Tiers, each an LRU with a capacity:
  device  the block's KV in a slot of a `BlockStore` (for the engine: `kv_blocks.KVBlockPool`, a
          preallocated device array of slots); capacity = the store's slots.
  host    a NumPy copy; capacity in bytes (`host_bytes`, 0 = no host tier).
  disk    one `.npy` file per block in a plain folder (`disk_dir`; a temporary folder when None);
          capacity in bytes (`disk_bytes`, 0 = no disk tier). Not HCache: HCache saves a session's
          per-layer hidden states and recomputes KV on restore; a block here is a KV copy read back
          as it was written. The folder is a spill area of this process (cleared by `close`), not
          a store that outlives it.
A block leaves the device tier (LRU first) when a slot is needed and enters the host tier as its
most recent block; a block leaving the host tier enters the disk tier the same way; one leaving the
disk tier (or a tier that is off) is dropped together with every block below it (its descendants
could never be reached again). A hit brings the matched blocks in the host and disk tiers back to
the device tier (the engine copies device slots into a request's row). Tiers are exclusive: a block
lives in exactly one. Every access touches a prefix's blocks from the last to the first, so a parent
is always more recent than its children in its tier: the LRU order evicts the leaves of a prefix
first and a shared prefix (a system prompt) stays while its many continuations come and go.

The engine (`jhybrid.serving.engine`) uses it with two layouts of a block (every layer's K and V of
its tokens): the `full` backend's, whose device tier is `kv_blocks.KVBlockPool` (a device array, a
hit copied into the row's KV), and an offloading backend's (`HybridAttention`, any mode), whose
"device" tier is `kv_blocks.HostKVBlockPool`, an array in host memory: a hit is placed into the
row's GPU window, host store and digests as a plain prefill would have left them
(`jhybrid.hybrid.ingest.place_history`), bounded by `ingest.reusable_prefix` so that the prefill of
the rest gives exactly a plain prefill's state (hgca: its ring MAW is attention history no block
holds). Other backends (quest, tensor-parallel ones) run without it (logged once, every request
counted as a miss).

Not thread-safe: the engine calls it from its step loop only.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import hashlib
import os
import shutil
import tempfile
from typing import Callable, Protocol, Sequence

import numpy as np

HashFn = Callable[[int, bytes], int]


def chain_hash(parent: int, block: bytes) -> int:
    """The key of a block: 64-bit BLAKE2b of the parent's key and the block's int32 token bytes."""
    digest = hashlib.blake2b(parent.to_bytes(8, "little") + block, digest_size=8).digest()
    return int.from_bytes(digest, "little")


@dataclasses.dataclass(frozen=True)
class PrefixCacheConfig:
    """block_size: tokens per cached block (a hit covers whole blocks).
    device_bytes: the device tier's bytes (None: the engine's default; 0 turns the cache off); with
        an offloading backend the engine keeps this first tier in host memory (module doc).
    host_bytes, disk_bytes: the host and disk tiers' bytes (0: tier off).
    disk_dir: the disk tier's folder (None: a temporary folder, removed at close)."""

    block_size: int = 16
    device_bytes: int | None = None
    host_bytes: int = 0
    disk_bytes: int = 0
    disk_dir: str | None = None

    def __post_init__(self):
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"prefix cache block_size={self.block_size!r}; expected an integer >= 1")
        for name in ("device_bytes", "host_bytes", "disk_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"prefix cache {name}={value!r}; expected an integer >= 0")


class Tier(str, enum.Enum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


class BlockStore(Protocol):
    """The device tier's storage: `capacity` slots of one block each (block_bytes bytes)."""

    capacity: int
    block_bytes: int

    def read(self, slots: np.ndarray) -> np.ndarray:
        """Host copies of the blocks in slots [n] int -> [n, *block shape]."""

    def write(self, slots: np.ndarray, blocks: np.ndarray) -> None:
        """Stores blocks [n, *block shape] (host arrays) into slots [n]."""


@dataclasses.dataclass(eq=False)
class CachedBlock:
    """One cached block: its key, tokens (int32 bytes), parent block (None for a prompt's first)
    and where its KV is (tier, and the device slot, the host array or the disk file)."""

    key: int
    tokens: bytes
    parent: "CachedBlock | None"
    tier: Tier | None  # None once dropped
    slot: int = -1
    data: np.ndarray | None = None
    path: str | None = None
    children: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class PrefixCacheStats:
    """hits / misses: lookups (acquire) that found a cached prefix or not; hit_tokens: tokens
    they covered, and of those hit_tokens_host / hit_tokens_disk the tokens found in the host / disk
    tier (brought back to the device); inserted / dropped: blocks added, and removed from the last
    tier; bytes and blocks held per tier."""

    hits: int
    misses: int
    hit_tokens: int
    hit_tokens_host: int
    hit_tokens_disk: int
    inserted: int
    dropped: int
    bytes_device: int
    bytes_host: int
    bytes_disk: int
    blocks_device: int
    blocks_host: int
    blocks_disk: int


class PrefixCache:
    """Longest-prefix matching over token blocks with device / host / disk LRU tiers (module doc).

    store: the device tier's slots; block_bytes is the size of one block's KV in every tier.
    hash_fn(parent_key, block_token_bytes) -> key (tests force collisions with their own)."""

    def __init__(self, config: PrefixCacheConfig, store: BlockStore, hash_fn: HashFn = chain_hash):
        self.config = config
        self.block_size = config.block_size
        self.store = store
        self.block_bytes = int(store.block_bytes)
        self.hash_fn = hash_fn
        self._index: dict[int, CachedBlock] = {}
        self._tiers: dict[Tier, collections.OrderedDict[int, CachedBlock]] = {
            tier: collections.OrderedDict() for tier in Tier}
        self._free_slots = list(range(store.capacity - 1, -1, -1))  # pop() gives slot 0 first
        self._host_bytes = 0
        self._disk_bytes = 0
        self._own_dir = config.disk_bytes > 0 and config.disk_dir is None
        self._disk_dir = (tempfile.mkdtemp(prefix="jhybrid-prefix-") if self._own_dir else config.disk_dir)
        if config.disk_bytes > 0:
            os.makedirs(self._disk_dir, exist_ok=True)
        self._files = 0
        self._hits = self._misses = self._hit_tokens = self._inserted = self._dropped = 0
        self._hit_tokens_from = {Tier.HOST: 0, Tier.DISK: 0}  # hit tokens brought back from a lower tier

    # ---- lookups and insertions ----------------------------------------------------------------

    def _blocks(self, tokens: Sequence[int]) -> list[bytes]:
        ids = np.asarray(tokens, np.int32)
        full = len(ids) // self.block_size * self.block_size
        return [ids[i:i + self.block_size].tobytes() for i in range(0, full, self.block_size)]

    def match(self, tokens: Sequence[int]) -> list[CachedBlock]:
        """The cached blocks of the longest cached prefix of `tokens` (whole blocks), first block
        first; token-exact (module doc). No side effect: nothing is touched or moved."""
        chain: list[CachedBlock] = []
        key, parent = 0, None
        for block in self._blocks(tokens):
            key = self.hash_fn(key, block)
            found = self._index.get(key)
            if found is None or found.tokens != block or found.parent is not parent:
                break
            chain.append(found)
            parent = found
        return chain

    def acquire(self, tokens: Sequence[int]) -> np.ndarray:
        """Device slots [n] int of the longest cached prefix of `tokens` (n whole blocks, at most
        the device tier's slots), its blocks brought to the device tier and made most recent;
        [] on a miss. Counts a hit (with n * block_size hit tokens) or a miss. The slots stay valid
        until the next call."""
        chain = self.match(tokens)[:self.store.capacity]
        if not chain:
            self._misses += 1
            return np.zeros(0, np.int64)
        moving = [block for block in chain if block.tier is not Tier.DEVICE]
        for block in moving:
            self._hit_tokens_from[block.tier] += self.block_size
        if moving:
            data = np.stack([self._take(block) for block in moving])  # out of their tiers first
            self._evict_device(len(moving) - len(self._free_slots), pinned=chain)
            slots = np.array([self._free_slots.pop() for _ in moving], np.int64)
            self.store.write(slots, data)
            for block, slot in zip(moving, slots):
                block.tier, block.slot = Tier.DEVICE, int(slot)
                self._tiers[Tier.DEVICE][block.key] = block
        self._touch(chain)
        self._hits += 1
        self._hit_tokens += len(chain) * self.block_size
        return np.array([block.slot for block in chain], np.int64)

    def insert(self, tokens: Sequence[int], copy: Callable[[np.ndarray, np.ndarray], None]) -> int:
        """Caches the whole blocks of `tokens` that are not cached yet.

        copy(block_numbers [n], slots [n]) writes the KV of the prompt's blocks block_numbers
        (block j = tokens j*bs .. j*bs + bs - 1) into device slots `slots`. Blocks already cached
        are touched where they are; a key held by other tokens (a collision) ends the insertion
        there; only as many new blocks as the device tier can take (evicting older ones) are added.
        Returns the number of blocks added."""
        chain: list[CachedBlock] = []
        new: list[tuple[int, bytes]] = []
        new_keys: set[int] = set()
        key, parent = 0, None
        for block in self._blocks(tokens):
            key = self.hash_fn(key, block)
            found = self._index.get(key)
            if not new and found is not None and found.tokens == block and found.parent is parent:
                chain.append(found)
                parent = found
                continue
            if found is not None or key in new_keys:
                break  # a collision: nothing below it can be cached
            new.append((key, block))
            new_keys.add(key)
        pinned = [block for block in chain if block.tier is Tier.DEVICE]
        new = new[:max(0, self.store.capacity - len(pinned))]
        if new:
            self._evict_device(len(new) - len(self._free_slots), pinned=chain)
            if chain and chain[-1].tier is None:  # the spill cascade dropped the prefix above
                new = []
        if new:
            slots = np.array([self._free_slots.pop() for _ in new], np.int64)
            copy(np.arange(len(chain), len(chain) + len(new)), slots)
            for (key, block), slot in zip(new, slots):
                cached = CachedBlock(key=key, tokens=block, parent=parent, tier=Tier.DEVICE, slot=int(slot))
                if parent is not None:
                    parent.children.append(cached)
                self._index[key] = cached
                self._tiers[Tier.DEVICE][key] = cached
                chain.append(cached)
                parent = cached
            self._inserted += len(new)
        self._touch(chain)
        return len(new)

    # ---- tiers ------------------------------------------------------------------------------------

    def _touch(self, chain: list[CachedBlock]) -> None:
        """Most recent in their tiers, the last block first: a parent ends more recent than its children."""
        for block in reversed(chain):
            if block.tier is not None:
                self._tiers[block.tier].move_to_end(block.key)

    def _evict_device(self, count: int, pinned: list[CachedBlock]) -> None:
        """Frees `count` device slots: the least recent device blocks not in `pinned` go to the host tier."""
        if count <= 0:
            return
        keep = {id(block) for block in pinned}
        victims = []
        for block in self._tiers[Tier.DEVICE].values():  # least recent first
            if id(block) not in keep:
                victims.append(block)
                if len(victims) == count:
                    break
        if self.block_bytes > max(self.config.host_bytes, self.config.disk_bytes):  # no tier below takes one
            for block in victims:
                if block.tier is not None:  # not dropped with an ancestor already
                    self._drop(block)  # frees its slot (and its descendants')
            return
        data = self.store.read(np.array([b.slot for b in victims], np.int64))  # one batched copy
        for block in victims:
            del self._tiers[Tier.DEVICE][block.key]
            self._free_slots.append(block.slot)
            block.slot, block.tier = -1, None
        for block, blob in zip(victims, data):
            if block.key in self._index and self._index[block.key] is block:  # not dropped meanwhile
                self._to_host(block, np.array(blob))

    def _to_host(self, block: CachedBlock, data: np.ndarray) -> None:
        if self.block_bytes > self.config.host_bytes:
            self._to_disk(block, data)
            return
        host = self._tiers[Tier.HOST]
        while self._host_bytes + self.block_bytes > self.config.host_bytes:
            oldest = next(iter(host.values()))
            self._to_disk(oldest, self._take(oldest))
        if self._index.get(block.key) is not block:  # the cascade dropped an ancestor (and it)
            return
        block.tier, block.data = Tier.HOST, data
        host[block.key] = block
        self._host_bytes += self.block_bytes

    def _to_disk(self, block: CachedBlock, data: np.ndarray) -> None:
        if self.block_bytes > self.config.disk_bytes:
            self._drop(block)
            return
        disk = self._tiers[Tier.DISK]
        while self._disk_bytes + self.block_bytes > self.config.disk_bytes:
            self._drop(next(iter(disk.values())))
        if self._index.get(block.key) is not block:  # the drops above took an ancestor (and it)
            return
        self._files += 1
        path = os.path.join(self._disk_dir, f"{block.key:016x}-{self._files}.npy")
        np.save(path, data)
        block.tier, block.path = Tier.DISK, path
        disk[block.key] = block
        self._disk_bytes += self.block_bytes

    def _take(self, block: CachedBlock) -> np.ndarray:
        """A host or disk block's data, the block taken out of its tier (tier None until placed)."""
        if block.tier is Tier.HOST:
            data, block.data = block.data, None
            self._host_bytes -= self.block_bytes
        else:
            data = np.load(block.path)
            os.remove(block.path)
            block.path = None
            self._disk_bytes -= self.block_bytes
        del self._tiers[block.tier][block.key]
        block.tier = None
        return data

    def _drop(self, block: CachedBlock) -> None:
        """Removes a block and every block below it from the cache (and their storage)."""
        stack = [block]
        if block.parent is not None:
            block.parent.children.remove(block)
        while stack:
            current = stack.pop()
            stack.extend(current.children)
            current.children = []
            if self._index.get(current.key) is current:
                del self._index[current.key]
            if current.tier is Tier.DEVICE:
                self._free_slots.append(current.slot)
            elif current.tier is Tier.HOST:
                self._host_bytes -= self.block_bytes
            elif current.tier is Tier.DISK:
                os.remove(current.path)
                self._disk_bytes -= self.block_bytes
            if current.tier is not None:
                del self._tiers[current.tier][current.key]
            current.tier, current.slot, current.data, current.path = None, -1, None, None
            self._dropped += 1

    # ---- reporting and lifetime -------------------------------------------------------------------

    @property
    def disk_dir(self) -> str | None:
        """The disk tier's folder (None when the tier is off)."""
        return self._disk_dir if self.config.disk_bytes > 0 else None

    def tier_keys(self, tier: Tier) -> list[int]:
        """The keys of a tier's blocks, least recent first."""
        return list(self._tiers[Tier(tier)])

    def stats(self) -> PrefixCacheStats:
        blocks = {tier: len(self._tiers[tier]) for tier in Tier}
        return PrefixCacheStats(
            hits=self._hits, misses=self._misses, hit_tokens=self._hit_tokens,
            hit_tokens_host=self._hit_tokens_from[Tier.HOST], hit_tokens_disk=self._hit_tokens_from[Tier.DISK],
            inserted=self._inserted,
            dropped=self._dropped, bytes_device=blocks[Tier.DEVICE] * self.block_bytes,
            bytes_host=self._host_bytes, bytes_disk=self._disk_bytes, blocks_device=blocks[Tier.DEVICE],
            blocks_host=blocks[Tier.HOST], blocks_disk=blocks[Tier.DISK])

    def count_miss(self) -> None:
        """A lookup the caller could not make (a backend whose KV the cache cannot hold)."""
        self._misses += 1

    def close(self) -> None:
        """Forgets every block and removes the disk tier's files (its folder too when it made it)."""
        for block in list(self._tiers[Tier.DISK].values()):
            os.remove(block.path)
        for tier in Tier:
            self._tiers[tier].clear()
        self._index.clear()
        self._host_bytes = self._disk_bytes = 0
        self._free_slots = list(range(self.store.capacity - 1, -1, -1))
        if self._own_dir and self._disk_dir and os.path.isdir(self._disk_dir):
            shutil.rmtree(self._disk_dir, ignore_errors=True)


__all__ = ["PrefixCacheConfig", "PrefixCache", "PrefixCacheStats", "BlockStore", "CachedBlock", "Tier",
           "chain_hash"]
