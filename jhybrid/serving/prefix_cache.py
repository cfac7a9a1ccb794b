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
  host    a row of the host slab, one NumPy array of host_bytes // block_bytes rows allocated
          once (no allocation or page release per block: on the H100 per-block arrays cost the
          engine's step seconds per 4 GiB spilled), written off the caller's thread (the spill
          paragraph below); capacity in bytes (`host_bytes`, 0 = no host tier).
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

The spill from the device tier to the host tier is asynchronous: the caller (the engine's step)
does not wait for the device-to-host copy. `BlockStore.read_start` dispatches the gather of the
victims' slots on the caller's thread (so it is ordered before any later write into those slots;
`kv_blocks` says why); the slots are free at once, and the blocks enter the host tier (slab rows
reserved, their bytes counted as held) holding a `PendingCopy` (the spill's future and the block's
index in it). The cache's one worker thread (a ThreadPoolExecutor, started at the first spill,
named SPILL_THREAD_PREFIX) copies them to the host and into their rows. A block dropped while its
copy is in flight leaves its row reserved until the copy lands (the worker still writes it); a
spill is cut into pieces of at most the host tier's rows, so that placing a piece never evicts a
block of the same piece. Whatever needs a pending block's data (a hit, a move down to
the disk tier, close's persistence) waits for its copy; every public call first takes in the copies
already done. At most `max_spill_blocks` blocks are in flight (their gathered copies are extra
device memory): a spill beyond that waits for the oldest copies (backpressure, logged at DEBUG).
With no host tier a spilled block goes straight to the disk tier, its copy awaited. A copy that
fails drops its blocks (with every block below them: never served as wrong data), and the acquire
or insert that finds the failure raises `PrefixCacheSpillError` (at its start when the failure was
found there, else once its own work is done): once per failure, the cache staying usable (close
only logs it). `close` waits for the copies in flight (when the disk tier persists them) or cancels
those not started (waiting for the one running), and ends the worker thread.

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

Not thread-safe: the engine calls it from its step loop only (the spill worker only copies
blocks handed to it; every other state is the caller's).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import enum
import hashlib
import logging
import shutil
import tempfile
import time
from typing import Callable, Protocol, Sequence

import numpy as np

from jhybrid.serving.disk_tier import DiskBlockStore, SavedBlock

log = logging.getLogger("jhybrid.serving")

HashFn = Callable[[int, bytes], int]

SPILL_THREAD_PREFIX = "jhybrid-prefix-spill"  # the name of a PrefixCache's spill worker thread
# Blocks in flight at least (module doc); else half the device tier: one long prompt's insertion
# (a 32K prompt is 2048 blocks of 16) then spills without waiting on the H100 configs' 8 GiB tier.
DEFAULT_SPILL_BLOCKS = 64


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

    def read_start(self, slots: np.ndarray) -> Callable[[], np.ndarray]:
        """Starts copying the blocks in slots [n] int to the host and returns a callable (called
        once, on any thread) that waits for them, [n, *block shape]. The slots may be written as
        soon as read_start returns: the copy holds their blocks as they were."""

    def write(self, slots: np.ndarray, blocks: np.ndarray) -> None:
        """Stores blocks [n, *block shape] (host arrays) into slots [n]."""


class PrefixCacheSpillError(RuntimeError):
    """A device-to-host spill of the prefix cache failed; its blocks were dropped (module doc)."""


@dataclasses.dataclass(eq=False)
class _Spill:
    """One batch of blocks copied from the device tier: the worker's `future` writes them into
    their host-tier slab slots (None result), or, with no host tier, gives their host copies (a list
    of len(blocks) arrays [*block shape], block i's at i). orphan_slots: slab slots of its blocks
    dropped while the copy was in flight, free once it has landed (the worker still writes them)."""

    future: concurrent.futures.Future | None
    blocks: list["CachedBlock"]
    orphan_slots: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True, eq=False)
class PendingCopy:
    """A host-tier block whose data is still being copied off the device: item `index` of `spill`'s
    result."""

    spill: _Spill
    index: int


@dataclasses.dataclass(eq=False)
class CachedBlock:
    """One cached block: its key, tokens (int32 bytes), parent block (None for a prompt's first)
    and where its KV is (tier, and the device slot, the host slab slot or the disk tier's slot). A
    host block's KV is the host slab's row `host_slot`; `pending` while its copy off the device is
    in flight. `data` only holds a block's copy on its way straight to the disk tier (no host tier)."""

    key: int
    tokens: bytes
    parent: "CachedBlock | None"
    tier: Tier | None  # None once dropped
    slot: int = -1  # device tier
    host_slot: int = -1  # host tier
    pending: PendingCopy | None = None  # host tier, its copy in flight
    data: np.ndarray | None = None  # on its way to the disk tier
    disk_slot: int = -1  # disk tier
    children: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class PrefixCacheStats:
    """hits / misses: lookups (acquire) that found a cached prefix or not; hit_tokens: tokens
    they covered, and of those hit_tokens_host / hit_tokens_disk the tokens found in the host / disk
    tier (brought back to the device); inserted / dropped: blocks added, and removed from the last
    tier; bytes and blocks held per tier; disk_read_errors: disk blocks that failed their checksum
    (or whose file was missing or short) when read, dropped as misses; spill_blocks_in_flight:
    blocks whose copy from the device tier to the host tier is not done yet (counted as held by the
    host tier already)."""

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
    spill_blocks_in_flight: int = 0
    spill_wait_seconds: float = 0.0


def _land_into(finish: Callable[[], np.ndarray], slab: np.ndarray, targets: np.ndarray) -> None:
    """The spill worker's task with a host tier: waits for a `BlockStore.read_start` copy of
    len(targets) blocks and writes block i into slab row targets[i] ([n] int64; -1: the block was
    dropped before it landed). Preallocated rows: no allocation or page release per spill."""
    blocks = finish()
    if len(blocks) != len(targets):
        raise ValueError(f"a prefix cache spill read returned {len(blocks)} blocks; expected {len(targets)}")
    kept = targets >= 0
    slab[targets[kept]] = blocks[kept]


def _land(finish: Callable[[], np.ndarray], count: int) -> list[np.ndarray]:
    """The spill worker's task: waits for a `BlockStore.read_start` copy of `count` blocks and
    returns each block's own array [*block shape] (a block dropped later frees its memory alone)."""
    blocks = finish()
    if len(blocks) != count:
        raise ValueError(f"a prefix cache spill read returned {len(blocks)} blocks; expected {count}")
    return [np.array(block) for block in blocks]


class PrefixCache:
    """Longest-prefix matching over token blocks with device / host / disk LRU tiers (module doc).

    store: the device tier's slots; block_bytes is the size of one block's KV in every tier.
    hash_fn(parent_key, block_token_bytes) -> key (tests force collisions with their own).
    fingerprint: what the cached KV depends on (model, weights, dtype), recorded with a persistent
        disk tier and compared when one is opened again (module doc).
    max_spill_blocks: blocks whose copy from the device tier to the host tier may be in flight at
        once (their gathered copies are extra device memory: up to half the tier's bytes by default);
        None: max(DEFAULT_SPILL_BLOCKS, half the store's slots)."""

    def __init__(self, config: PrefixCacheConfig, store: BlockStore, hash_fn: HashFn = chain_hash,
                 fingerprint: str | None = None, max_spill_blocks: int | None = None):
        if max_spill_blocks is None:
            max_spill_blocks = max(DEFAULT_SPILL_BLOCKS, store.capacity // 2)
        if not isinstance(max_spill_blocks, int) or max_spill_blocks < 1:
            raise ValueError(f"prefix cache max_spill_blocks={max_spill_blocks!r}; expected an integer >= 1")
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
        # The host tier's blocks: rows of one array, allocated once (its pages touched when first written).
        host_slots = config.host_bytes // self.block_bytes
        self._host_slab = (np.empty((host_slots,) + tuple(store.block_shape), store.dtype) if host_slots else None)
        self._host_free = list(range(host_slots - 1, -1, -1))  # pop() gives row 0 first
        self._hits = self._misses = self._hit_tokens = self._inserted = self._dropped = 0
        self._hit_tokens_from = {Tier.HOST: 0, Tier.DISK: 0}  # hit tokens brought back from a lower tier
        self.max_spill_blocks = max_spill_blocks
        # Blocks per read_start: a power of two, at most the host tier's rows (a piece's blocks are
        # placed before their copy lands: none of them may have to make room for another).
        piece_limit = max_spill_blocks if self._host_slab is None else min(max_spill_blocks, len(self._host_slab))
        self._spill_piece = 1 << (piece_limit.bit_length() - 1)
        self._spills: collections.deque[_Spill] = collections.deque()  # not settled yet, oldest first
        self._spill_errors: list[PrefixCacheSpillError] = []  # found, not raised yet
        self._spill_wait_seconds = 0.0  # the callers' time waiting for spills' copies
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None  # started at the first spill
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
        its check ends the hit before it (module doc). The slots stay valid until the next call.
        Raises PrefixCacheSpillError when a spill it finds failed (module doc)."""
        self._check_spills()
        slots = self._acquire(tokens)
        self._raise_spill_error()
        return slots

    def _acquire(self, tokens: Sequence[int]) -> np.ndarray:
        chain = self.match(tokens)[:self.store.capacity]
        moving, data = [], []
        for i, block in enumerate(chain):  # host and disk blocks out of their tiers first
            if block.tier is Tier.DEVICE:
                continue
            tier = block.tier
            blob = self._take(block)
            if blob is None:  # a disk block failed its check or a spill its copy: dropped, with every block below it
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
        Returns the number of blocks added. Raises PrefixCacheSpillError when a spill it finds
        failed (module doc)."""
        self._check_spills()
        added = self._insert(tokens, copy)
        self._raise_spill_error()
        return added

    def _insert(self, tokens: Sequence[int], copy: Callable[[np.ndarray, np.ndarray], None]) -> int:
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
            if chain and chain[-1].tier is None:  # the spill cascade (or a failed spill) dropped the prefix above
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
        """Frees `count` device slots: the least recent device blocks not in `pinned` go to the host
        tier, copied there asynchronously (module doc), in pieces of at most max_spill_blocks."""
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
        size = self._spill_piece
        for first in range(0, len(victims), size):
            self._make_room(min(size, len(victims) - first))
            # a failed spill settled above (or a cascade below) may have dropped some victims already
            piece = [block for block in victims[first:first + size] if block.tier is Tier.DEVICE]
            if piece:
                self._spill(piece)

    def _spill(self, blocks: list[CachedBlock]) -> None:
        """Device blocks to the host tier: their copy dispatched now (their slots free at once), each
        entering the host tier with a PendingCopy that the worker's copy resolves (module doc)."""
        finish = self.store.read_start(np.array([b.slot for b in blocks], np.int64))
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=SPILL_THREAD_PREFIX)
        spill = _Spill(future=None, blocks=blocks)
        for index, block in enumerate(blocks):
            del self._tiers[Tier.DEVICE][block.key]
            self._free_slots.append(block.slot)
            block.slot, block.tier, block.pending = -1, None, PendingCopy(spill, index)
        if self._host_slab is None:  # no host tier: each block awaited and written to the disk tier
            spill.future = self._worker.submit(_land, finish, len(blocks))
            self._spills.append(spill)
            for block in blocks:
                if self._index.get(block.key) is block:  # not dropped meanwhile (with an ancestor)
                    self._to_host(block)
            return
        for block in blocks:  # placed first (slab rows reserved), then copied into their rows
            if self._index.get(block.key) is block:
                self._to_host(block)
        targets = np.array([b.host_slot if b.tier is Tier.HOST else -1 for b in blocks], np.int64)
        spill.future = self._worker.submit(_land_into, finish, self._host_slab, targets)
        self._spills.append(spill)

    def _to_host(self, block: CachedBlock) -> None:
        """A block out of the device tier (tier None, its data or pending copy set) into the host
        tier as its most recent block, the least recent host blocks moving down to make room."""
        if self.block_bytes > self.config.host_bytes:  # no host tier: straight to disk, its copy awaited
            if block.pending is not None:
                self._settle(until=block.pending.spill)
            if self._index.get(block.key) is block:  # its copy did not fail
                data, block.data = block.data, None
                self._to_disk(block, data)
            return
        host = self._tiers[Tier.HOST]
        while self._host_bytes + self.block_bytes > self.config.host_bytes or not self._host_free:
            if self._host_bytes + self.block_bytes <= self.config.host_bytes:
                # room in bytes, but the free rows are orphans of dropped blocks whose copies are
                # still in flight (the worker writes them): wait for the oldest copy, evict nothing
                self._settle(until=self._spills[0])
                continue
            oldest = next(iter(host.values()))
            if self._disk is None:  # nowhere below: dropped, its copy (if in flight) not awaited
                self._drop(oldest)
                continue
            data = self._take(oldest)
            if data is not None:  # else its spill failed: dropped (its bytes freed)
                self._to_disk(oldest, data)
        if self._index.get(block.key) is not block:  # the cascade dropped an ancestor (and it)
            return
        block.tier, block.host_slot = Tier.HOST, self._host_free.pop()
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
        """A host or disk block's data, the block taken out of its tier (tier None until placed); a
        host block's copy in flight is awaited. None when a disk block fails its check or a host
        block's spill failed: the block is dropped (with every block below it)."""
        if block.pending is not None:
            if block.pending.spill.future is None:  # _spill_piece rules this out
                raise RuntimeError("prefix cache: a spilled block was taken before its copy was started")
            self._settle(until=block.pending.spill)
            if block.tier is None:  # its copy failed: dropped
                return None
        tier = block.tier
        del self._tiers[tier][block.key]
        block.tier = None
        if tier is Tier.HOST:
            data = self._host_slab[block.host_slot].copy()
            self._host_free.append(block.host_slot)
            block.host_slot = -1
            self._host_bytes -= self.block_bytes
            return data
        data = self._disk.read(block.disk_slot)
        self._disk.free(block.disk_slot)
        block.disk_slot = -1
        if data is None:
            self._drop(block)
        return data

    # ---- spills in flight ---------------------------------------------------------------------------

    def _settle(self, until: _Spill | None = None) -> None:
        """Takes in finished spills, oldest first: with `until`, every spill up to it (waiting for
        their copies); without, those whose copies are done. A spill's blocks get their data; a
        failed spill's blocks are dropped and its error kept for _raise_spill_error."""
        while self._spills:
            spill = self._spills[0]
            if until is None and not spill.future.done():
                return
            self._spills.popleft()
            self._settle_one(spill)
            if spill is until:
                return

    def _settle_one(self, spill: _Spill) -> None:
        waited = not spill.future.done()
        start = time.perf_counter()
        try:
            rows = spill.future.result()
        except Exception as err:
            error = PrefixCacheSpillError(
                f"prefix cache spill of {len(spill.blocks)} blocks from the device tier to the host tier "
                f"failed ({type(err).__name__}: {err}); its blocks were dropped")
            error.__cause__ = err
            self._spill_errors.append(error)
            for block in spill.blocks:
                if block.pending is not None and block.pending.spill is spill:
                    if self._index.get(block.key) is block:
                        self._drop(block)  # with every block below it (its slab row an orphan)
                    block.pending = None
            self._host_free.extend(spill.orphan_slots)
            return
        finally:
            if waited:
                self._spill_wait_seconds += time.perf_counter() - start
        for block in spill.blocks:
            if block.pending is not None and block.pending.spill is spill:  # not dropped or spilled again
                if rows is not None:  # no host tier: its own copy, on its way to the disk tier
                    block.data = rows[block.pending.index]
                block.pending = None
        self._host_free.extend(spill.orphan_slots)

    def _make_room(self, count: int) -> None:
        """Backpressure: waits for the oldest spills until `count` more blocks fit max_spill_blocks."""
        self._settle()
        while self._spills and self._blocks_in_flight() + count > self.max_spill_blocks:
            oldest = self._spills[0]
            log.debug("prefix cache: %d spill blocks in flight, %d more to spill (at most %d): waiting for the "
                      "oldest copy (%d blocks)", self._blocks_in_flight(), count, self.max_spill_blocks,
                      len(oldest.blocks))
            self._settle(until=oldest)

    def _blocks_in_flight(self) -> int:
        return sum(len(spill.blocks) for spill in self._spills)

    def _check_spills(self) -> None:
        """At a public call's start: takes in the spills done and raises a failure found."""
        self._settle()
        self._raise_spill_error()

    def _raise_spill_error(self) -> None:
        """Raises the first spill failure not raised yet (later ones are logged)."""
        if not self._spill_errors:
            return
        error, *others = self._spill_errors
        self._spill_errors.clear()
        for other in others:
            log.warning("%s", other)
        raise error

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
                in_flight = current.pending is not None and current.pending.spill.future is not None
                (current.pending.spill.orphan_slots if in_flight else self._host_free).append(current.host_slot)
            elif current.tier is Tier.DISK:
                self._disk.free(current.disk_slot)
            if current.tier is not None:
                del self._tiers[current.tier][current.key]
            current.tier, current.slot, current.data, current.pending, current.disk_slot = None, -1, None, None, -1
            current.host_slot = -1
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
            disk_read_errors=self._disk_read_errors + (self._disk.read_errors if self._disk else 0),
            spill_blocks_in_flight=sum(len(spill.blocks) for spill in self._spills if not spill.future.done()),
            spill_wait_seconds=self._spill_wait_seconds)

    def count_miss(self) -> None:
        """A lookup the caller could not make (a backend whose KV the cache cannot hold)."""
        self._misses += 1

    def forget(self, tokens: Sequence[int]) -> int:
        """Drops the cached blocks of `tokens`'s prefix that no other cached prompt continues: from
        its last matched block up to (not including) the first block with another child, in whatever
        tier each is (a host block's copy in flight lands in a row freed after it; module doc). A
        prompt no other one extends leaves nothing; a prefix that other prompts share stays. Returns
        the blocks dropped (also counted in `dropped`). Raises PrefixCacheSpillError when a spill it
        finds failed (module doc)."""
        self._check_spills()
        forgotten = 0
        for block in reversed(self.match(tokens)):
            if block.children:
                break
            self._drop(block)
            forgotten += 1
        return forgotten

    def reset_counts(self) -> None:
        """Starts the lookup and block counts over (hits, misses, hit_tokens and its host / disk parts,
        inserted, dropped, spill_wait_seconds); the blocks held and disk_read_errors (a failing disk
        is news whenever it was found) stay."""
        self._hits = self._misses = self._hit_tokens = self._inserted = self._dropped = 0
        self._hit_tokens_from = {Tier.HOST: 0, Tier.DISK: 0}
        self._spill_wait_seconds = 0.0

    def close(self) -> None:
        """Forgets every block. A given disk_dir keeps the disk tier: the device and host tiers'
        blocks are written down to it first (their copies in flight awaited), and its index saved
        (module doc: persistence; an OSError is logged, not raised); a temporary folder is removed.
        Otherwise the copies in flight not started yet are cancelled. The spill worker thread has
        ended when close returns; a failed spill is logged, not raised (its blocks are not saved).
        The disk tier is off after; the cache is empty and usable (a spill starts a new worker)."""
        persist = self._disk is not None and not self._own_dir
        if persist and self._spills:
            self._settle(until=self._spills[-1])  # every host block gets its data (or is dropped)
        self._stop_worker()
        for error in self._spill_errors:
            log.warning("%s", error)
        self._spill_errors.clear()
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
        self._host_free = [] if self._host_slab is None else list(range(len(self._host_slab) - 1, -1, -1))
        self._free_slots = list(range(self.store.capacity - 1, -1, -1))
        if self._own_dir and self._disk_dir:
            shutil.rmtree(self._disk_dir, ignore_errors=True)

    def _stop_worker(self) -> None:
        """Cancels the spills whose copies have not started, waits for the one running (it cannot be
        interrupted) and ends the worker thread; the spills in flight are forgotten."""
        for spill in self._spills:
            spill.future.cancel()
        self._spills.clear()
        if self._worker is not None:
            self._worker.shutdown(wait=True, cancel_futures=True)
            self._worker = None

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
                data = self._host_slab[block.host_slot] if block.tier is Tier.HOST else device_data[block]
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


__all__ = ["PrefixCacheConfig", "PrefixCache", "PrefixCacheStats", "PrefixCacheSpillError", "BlockStore",
           "CachedBlock", "PendingCopy", "Tier", "chain_hash", "SPILL_THREAD_PREFIX"]
