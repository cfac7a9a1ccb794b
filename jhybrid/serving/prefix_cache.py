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
  disk    slots of HCache-layout per-layer chunk files in `disk_dir` (a temporary folder when
          None): `disk_tier.DiskBlockStore`, one chunk slot per block in every layer's file, rows
          in HCache's "kv" layout (its module doc says why KV, not hidden states), each chunk's
          crc32 checked on read; capacity in bytes (`disk_bytes` // block_bytes slots, 0 = no disk
          tier). A block whose check fails (or whose file is missing or short) is dropped as a miss,
          logged and counted (`disk_read_errors`), never returned.
A block leaves the device tier (LRU first) when a slot is needed and enters the host tier as its
most recent block; a block leaving the host tier enters the disk tier the same way; one leaving the
disk tier (or a tier that is off) is dropped together with every block below it (its descendants
could never be reached again). A hit brings the matched blocks in the host and disk tiers back to
the device tier (the engine copies device slots into a request's row). Tiers are exclusive: a block
lives in exactly one. Every access touches a prefix's blocks from the last to the first, so a parent
is always more recent than its children in its tier: the LRU order evicts the leaves of a prefix
first and a shared prefix (a system prompt) stays while its many continuations come and go.

Persistence: with a `disk_dir` given, the disk tier outlives the process. `close` writes the
device and host tiers' blocks down to it (most recent first, a block only with its parent, within
its capacity) and an index of its blocks (tokens, parent, key, slot, checksums) with the caller's
`fingerprint` (what the KV depends on: the engine passes the model's config hash and weights
fingerprint and the KV dtype); a PrefixCache opened later on the same folder with the same
fingerprint starts with that tree in its disk tier (a block whose parent did not load is dropped).
Another fingerprint: the files are discarded, with one log line naming both. A temporary folder
(disk_dir None) is removed at close: nothing persists.

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
import logging
import shutil
import tempfile
from typing import Callable, Protocol, Sequence

import numpy as np

from jhybrid.serving.disk_tier import DiskBlockStore, SavedBlock

log = logging.getLogger("jhybrid.serving")

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
    disk_dir: the disk tier's folder, kept across restarts (module doc: persistence); None: a
        temporary folder, removed at close."""

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
    """The device tier's storage: `capacity` slots of one block each (block_bytes bytes), a block
    being block_shape (num_layers, 2, block_size, Hkv, D) values of `dtype` (a NumPy dtype)."""

    capacity: int
    block_bytes: int
    block_shape: tuple[int, ...]
    dtype: np.dtype

    def read(self, slots: np.ndarray) -> np.ndarray:
        """Host copies of the blocks in slots [n] int -> [n, *block shape]."""

    def write(self, slots: np.ndarray, blocks: np.ndarray) -> None:
        """Stores blocks [n, *block shape] (host arrays) into slots [n]."""


@dataclasses.dataclass(eq=False)
class CachedBlock:
    """One cached block: its key, tokens (int32 bytes), parent block (None for a prompt's first)
    and where its KV is (tier, and the device slot, the host array or the disk tier's slot)."""

    key: int
    tokens: bytes
    parent: "CachedBlock | None"
    tier: Tier | None  # None once dropped
    slot: int = -1  # device tier
    data: np.ndarray | None = None  # host tier
    disk_slot: int = -1  # disk tier
    children: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class PrefixCacheStats:
    """hits / misses: lookups (acquire) that found a cached prefix or not; hit_tokens: tokens
    they covered, and of those hit_tokens_host / hit_tokens_disk the tokens found in the host / disk
    tier (brought back to the device); inserted / dropped: blocks added, and removed from the last
    tier; bytes and blocks held per tier; disk_read_errors: disk blocks that failed their checksum
    (or whose file was missing or short) when read, dropped as misses."""

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
    disk_read_errors: int = 0


class PrefixCache:
    """Longest-prefix matching over token blocks with device / host / disk LRU tiers (module doc).

    store: the device tier's slots; block_bytes is the size of one block's KV in every tier.
    hash_fn(parent_key, block_token_bytes) -> key (tests force collisions with their own).
    fingerprint: what the cached KV depends on (model, weights, dtype), recorded with a persistent
        disk tier and compared when one is opened again (module doc)."""

    def __init__(self, config: PrefixCacheConfig, store: BlockStore, hash_fn: HashFn = chain_hash,
                 fingerprint: str | None = None):
        self.config = config
        self.block_size = config.block_size
        self.store = store
        self.block_bytes = int(store.block_bytes)
        self.hash_fn = hash_fn
        self.fingerprint = fingerprint
        self._index: dict[int, CachedBlock] = {}
        self._tiers: dict[Tier, collections.OrderedDict[int, CachedBlock]] = {
            tier: collections.OrderedDict() for tier in Tier}
        self._free_slots = list(range(store.capacity - 1, -1, -1))  # pop() gives slot 0 first
        self._host_bytes = 0
        self._hits = self._misses = self._hit_tokens = self._inserted = self._dropped = 0
        self._hit_tokens_from = {Tier.HOST: 0, Tier.DISK: 0}  # hit tokens brought back from a lower tier
        self._disk: DiskBlockStore | None = None
        self._disk_read_errors = 0  # of disk stores closed already
        self._disk_dir: str | None = None
        self._own_dir = False  # a temporary folder: removed at close, nothing persists
        disk_slots = config.disk_bytes // self.block_bytes
        if disk_slots >= 1:
            self._own_dir = config.disk_dir is None
            self._disk_dir = tempfile.mkdtemp(prefix="jhybrid-prefix-") if self._own_dir else config.disk_dir
            self._disk = DiskBlockStore(self._disk_dir, disk_slots, store.block_shape, store.dtype)
            if self._disk.block_bytes != self.block_bytes:
                raise ValueError(f"prefix cache store block_bytes={self.block_bytes}; its block_shape "
                                 f"{store.block_shape} of {store.dtype} is {self._disk.block_bytes} bytes")
            if not self._own_dir:
                self._load_disk_tier()

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
        [] on a miss. Counts a hit (with n * block_size hit tokens) or a miss. A disk block that fails
        its check ends the hit before it (module doc). The slots stay valid until the next call."""
        chain = self.match(tokens)[:self.store.capacity]
        moving, data = [], []
        for i, block in enumerate(chain):  # host and disk blocks out of their tiers first
            if block.tier is Tier.DEVICE:
                continue
            tier = block.tier
            blob = self._take(block)
            if blob is None:  # a disk block failed its check: dropped, with every block below it
                chain = chain[:i]
                break
            self._hit_tokens_from[tier] += self.block_size
            moving.append(block)
            data.append(blob)
        if not chain:
            self._misses += 1
            return np.zeros(0, np.int64)
        if moving:
            data = np.stack(data)
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
        if self._disk is None:
            self._drop(block)
            return
        disk = self._tiers[Tier.DISK]
        while self._disk.free_slots == 0:
            self._drop(next(iter(disk.values())))
        if self._index.get(block.key) is not block:  # the drops above took an ancestor (and it)
            return
        try:
            slot = self._disk.write(data)
        except OSError as err:
            log.warning("prefix cache: a block could not be written to the disk tier (%s); dropped", err)
            self._drop(block)
            return
        block.tier, block.disk_slot = Tier.DISK, slot
        disk[block.key] = block

    def _take(self, block: CachedBlock) -> np.ndarray | None:
        """A host or disk block's data, the block taken out of its tier (tier None until placed).
        None when a disk block fails its check: the block is dropped (with every block below it)."""
        tier = block.tier
        del self._tiers[tier][block.key]
        block.tier = None
        if tier is Tier.HOST:
            data, block.data = block.data, None
            self._host_bytes -= self.block_bytes
            return data
        data = self._disk.read(block.disk_slot)
        self._disk.free(block.disk_slot)
        block.disk_slot = -1
        if data is None:
            self._drop(block)
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
                self._disk.free(current.disk_slot)
            if current.tier is not None:
                del self._tiers[current.tier][current.key]
            current.tier, current.slot, current.data, current.disk_slot = None, -1, None, -1
            self._dropped += 1

    # ---- reporting and lifetime -------------------------------------------------------------------

    @property
    def disk_dir(self) -> str | None:
        """The disk tier's folder (None when the tier is off: disk_bytes holds no block)."""
        return self._disk_dir

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
            bytes_host=self._host_bytes, bytes_disk=blocks[Tier.DISK] * self.block_bytes,
            blocks_device=blocks[Tier.DEVICE], blocks_host=blocks[Tier.HOST], blocks_disk=blocks[Tier.DISK],
            disk_read_errors=self._disk_read_errors + (self._disk.read_errors if self._disk else 0))

    def count_miss(self) -> None:
        """A lookup the caller could not make (a backend whose KV the cache cannot hold)."""
        self._misses += 1

    def close(self) -> None:
        """Forgets every block. A given disk_dir keeps the disk tier: the device and host tiers'
        blocks are written down to it first, and its index saved (module doc: persistence; an
        OSError is logged, not raised); a temporary folder is removed. The disk tier is off after."""
        if self._disk is not None:
            try:
                if not self._own_dir:
                    self._save_disk_tier()
            except OSError as err:
                log.warning("prefix cache: disk tier in %s not saved (%s); it starts empty next time",
                            self._disk_dir, err)
            finally:
                self._disk_read_errors += self._disk.read_errors
                self._disk.close()
                self._disk = None
        for tier in Tier:
            self._tiers[tier].clear()
        self._index.clear()
        self._host_bytes = 0
        self._free_slots = list(range(self.store.capacity - 1, -1, -1))
        if self._own_dir and self._disk_dir:
            shutil.rmtree(self._disk_dir, ignore_errors=True)

    # ---- persistence (a given disk_dir) ------------------------------------------------------------

    def _load_disk_tier(self) -> None:
        """The tree an earlier close left in the disk tier (same fingerprint) into its tier: a block
        is loaded only with its parent, and when its key is its tokens' key under this hash_fn."""
        loaded: list[CachedBlock] = []  # the index's order: most recent first, parents before children
        for saved in self._disk.load_index(self.fingerprint):
            parent = None if saved.parent_key is None else self._index.get(saved.parent_key)
            if ((saved.parent_key is not None and parent is None) or saved.key in self._index
                    or len(saved.tokens) != np.dtype(np.int32).itemsize * self.block_size
                    or self.hash_fn(0 if parent is None else parent.key, saved.tokens) != saved.key):
                self._disk.free(saved.slot)
                continue
            block = CachedBlock(key=saved.key, tokens=saved.tokens, parent=parent, tier=Tier.DISK,
                                disk_slot=saved.slot)
            if parent is not None:
                parent.children.append(block)
            self._index[block.key] = block
            loaded.append(block)
        for block in reversed(loaded):  # least recent first: a parent ends more recent than its children
            self._tiers[Tier.DISK][block.key] = block
        if loaded:
            log.info("prefix cache: %d blocks loaded into the disk tier from %s", len(loaded), self._disk_dir)

    def _save_disk_tier(self) -> None:
        """Writes the device and host tiers' blocks down to the disk tier and saves its index.

        Candidates, most recent first: the device tier's blocks, then the host tier's, then the
        disk tier's; each is kept with its ancestors not kept yet (parents before children) while
        the disk tier's slots last. Disk blocks not kept are freed first; a kept block whose write
        fails is left out with every block below it."""
        candidates = [block for tier in Tier for block in reversed(self._tiers[tier].values())]
        kept: list[CachedBlock] = []  # most recent first, parents before children
        kept_set: set[CachedBlock] = set()  # (blocks hash by identity)
        for block in candidates:
            if len(kept) == self._disk.capacity:
                break
            missing = []  # the block and its ancestors not kept yet, the block first
            current = block
            while current is not None and current not in kept_set:
                missing.append(current)
                current = current.parent
            if len(kept) + len(missing) <= self._disk.capacity:
                kept.extend(reversed(missing))
                kept_set.update(missing)
        for block in self._tiers[Tier.DISK].values():
            if block not in kept_set:
                self._disk.free(block.disk_slot)
                block.tier, block.disk_slot = None, -1
        on_device = [block for block in kept if block.tier is Tier.DEVICE]
        device_data = dict(zip(on_device, self.store.read(np.array([b.slot for b in on_device], np.int64))
                               if on_device else []))
        saved: list[SavedBlock] = []
        written: set[CachedBlock] = set()
        for block in kept:
            if block.parent is not None and block.parent not in written:
                continue  # its parent's write failed
            if block.tier is not Tier.DISK:
                data = block.data if block.tier is Tier.HOST else device_data[block]
                try:
                    block.disk_slot = self._disk.write(np.asarray(data))
                except OSError as err:
                    log.warning("prefix cache: a block could not be written to the disk tier (%s); "
                                "not saved, nor the blocks below it", err)
                    continue
                block.tier = Tier.DISK
            written.add(block)
            saved.append(SavedBlock(key=block.key, parent_key=None if block.parent is None else block.parent.key,
                                    tokens=block.tokens, slot=block.disk_slot))
        self._disk.save_index(saved, self.fingerprint)
        log.info("prefix cache: %d blocks saved in the disk tier at %s", len(saved), self._disk_dir)


__all__ = ["PrefixCacheConfig", "PrefixCache", "PrefixCacheStats", "BlockStore", "CachedBlock", "Tier",
           "chain_hash"]
