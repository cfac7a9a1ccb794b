"""The prefix cache (jhybrid/serving/prefix_cache.py, kv_blocks.py) alone and in the engine:

  * longest-prefix matching over whole blocks; a hit is token-exact: forced hash collisions (a
    constant hash, a hash that ignores the parent) miss instead of returning another prefix's KV;
  * LRU order at the device, host and disk tiers equals an independent OrderedDict model over
    random inserts and lookups, the blocks' data surviving device -> host -> disk and back;
  * the disk tier (HCache-layout layer files, jhybrid/serving/disk_tier.py): random bfloat16 KV
    comes back bit for bit; a corrupted or missing layer file ends a hit before the block (counted,
    no exception); with a given disk_dir the tree survives close and reopen under the same
    fingerprint, and another fingerprint discards it;
  * random shared prefixes under tiny capacities keep the index consistent (no orphan block, slots
    and bytes accounted, every hit's data the prompt's own);
  * in the engine (tiny model): a hit's output equals the miss's and the Generator's alone, with the
    right cached_tokens (whole blocks, the last prompt token always prefilled) and counters; KV
    spilled to host and disk comes back for a hit with the same output, also in a new engine opened
    on the same disk_dir.
"""

from __future__ import annotations

import collections
import logging
import os

import ml_dtypes
import numpy as np
import pytest

from jhybrid.attention.full import FULL_ROW_KV
from jhybrid.generation import Generator
from jhybrid.models import create_model
from jhybrid.serving.api import Request
from jhybrid.serving.disk_tier import INDEX_FILE, SESSION_ID
from jhybrid.serving.engine import ServingEngine
from jhybrid.serving.kv_blocks import HostKVBlockPool
from jhybrid.serving.prefix_cache import PrefixCache, PrefixCacheConfig, Tier, chain_hash
from tests.hybrid_support import TINY

BS = 4  # tokens per block in the unit tests
TIMEOUT = 120.0


class NumpyStore:
    """A device tier of NumPy blocks [1 layer, 2, BS, 1 head, 1 value] int64: block j of a prompt
    is stored as its BS token ids, as its K and as its V (so a hit's data can be checked against
    the prompt)."""

    block_shape = (1, 2, BS, 1, 1)
    dtype = np.dtype(np.int64)

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.data = np.full((capacity,) + self.block_shape, -1, np.int64)
        self.block_bytes = self.data[0].nbytes

    def read(self, slots):
        return self.data[slots].copy()

    def read_start(self, slots):
        blocks = self.read(slots)
        return lambda: blocks

    def write(self, slots, blocks):
        self.data[slots] = blocks


def make_cache(device, host=0, disk=0, disk_dir=None, hash_fn=chain_hash):
    """A PrefixCache over a NumpyStore; capacities in blocks."""
    store = NumpyStore(device)
    config = PrefixCacheConfig(block_size=BS, device_bytes=device * store.block_bytes,
                               host_bytes=host * store.block_bytes, disk_bytes=disk * store.block_bytes,
                               disk_dir=disk_dir)
    return PrefixCache(config, store, hash_fn), store


def as_blocks(tokens) -> np.ndarray:
    """NumpyStore blocks of whole blocks of tokens: [n, 1, 2, BS, 1, 1] (K = V = the ids)."""
    ids = np.asarray(tokens, np.int64).reshape(-1, 1, 1, BS, 1, 1)
    return np.broadcast_to(ids, (len(ids), 1, 2, BS, 1, 1))


def insert(cache, store, tokens) -> int:
    blocks = as_blocks(np.asarray(tokens)[:len(tokens) // BS * BS])

    def copy(block_numbers, slots):
        store.data[slots] = blocks[block_numbers]

    return cache.insert(tokens, copy)


def acquire(cache, store, tokens) -> int:
    """Acquires `tokens`' cached prefix, checks its data is the prompt's own, returns its blocks."""
    slots = cache.acquire(tokens)
    want = as_blocks(np.asarray(tokens)[:len(slots) * BS])
    assert np.array_equal(store.data[slots], want), "a hit returned another prefix's KV"
    return len(slots)


def key_of(tokens) -> int:
    return chain_hash(0, np.asarray(tokens, np.int32).tobytes())


# ----------------------------------------------------------------------------- matching


def test_longest_prefix_whole_blocks(rng):
    cache, store = make_cache(device=16)
    a = rng.integers(0, 1000, 20).tolist()
    assert insert(cache, store, a) == 5 and insert(cache, store, a) == 0
    assert acquire(cache, store, a) == 5
    assert acquire(cache, store, a[:13]) == 3  # whole blocks only
    b = a[:8] + rng.integers(1000, 2000, 12).tolist()
    assert acquire(cache, store, b) == 2
    assert insert(cache, store, b) == 3  # its first two blocks are a's
    assert acquire(cache, store, b) == 5
    assert acquire(cache, store, rng.integers(2000, 3000, 9).tolist()) == 0
    assert acquire(cache, store, a[:3]) == 0
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.hit_tokens, stats.inserted) == (4, 2, (5 + 3 + 2 + 5) * BS, 8)
    assert (stats.blocks_device, stats.bytes_device) == (8, 8 * store.block_bytes)


def test_forced_collisions_miss():
    # Every block has the same key: the second block of a prompt collides with its first.
    cache, store = make_cache(device=8, hash_fn=lambda parent, block: 1)
    a, b = [1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]
    assert insert(cache, store, a) == 1
    assert acquire(cache, store, b) == 0  # the same key, other tokens
    assert insert(cache, store, b) == 0
    assert acquire(cache, store, a) == 1

    # A hash that ignores the parent: a block with equal tokens under another prefix has the same key.
    cache, store = make_cache(device=8, hash_fn=lambda parent, block: chain_hash(0, block))
    x, y, z = [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]
    assert insert(cache, store, x + y) == 2
    assert insert(cache, store, z + y) == 1  # y's key is held by (x, y): the insertion stops there
    assert acquire(cache, store, z + y) == 1  # y's key and tokens match, its parent is x, not z
    assert acquire(cache, store, x + y) == 2


def test_config_errors():
    with pytest.raises(ValueError, match="block_size=0; expected an integer >= 1"):
        PrefixCacheConfig(block_size=0)
    with pytest.raises(ValueError, match="host_bytes=-1; expected an integer >= 0"):
        PrefixCacheConfig(host_bytes=-1)


# ----------------------------------------------------------------------------- tiers


class TierModel:
    """The tiers as three plain LRU OrderedDicts of single-block prompts (least recent first)."""

    def __init__(self, capacities):
        self.capacities = capacities
        self.tiers = [collections.OrderedDict() for _ in capacities]

    def where(self, prompt):
        return next((i for i, tier in enumerate(self.tiers) if prompt in tier), None)

    def enter(self, level, prompt):
        """prompt enters tier `level` as its most recent; the least recent moves one tier down."""
        if level == len(self.tiers):
            return  # dropped
        if self.capacities[level] == 0:
            return self.enter(level + 1, prompt)
        tier = self.tiers[level]
        if len(tier) == self.capacities[level]:
            self.enter(level + 1, tier.popitem(last=False)[0])
        tier[prompt] = True

    def insert(self, prompt):
        level = self.where(prompt)
        if level is None:
            self.enter(0, prompt)
        else:
            self.tiers[level].move_to_end(prompt)

    def acquire(self, prompt) -> bool:
        level = self.where(prompt)
        if level is None:
            return False
        if level == 0:
            self.tiers[0].move_to_end(prompt)
        else:
            del self.tiers[level][prompt]
            self.enter(0, prompt)
        return True


@pytest.mark.parametrize("capacities", [(3, 2, 2), (2, 0, 3), (1, 3, 0), (4, 0, 0)])
def test_lru_order_at_each_tier_equals_a_plain_model(capacities, tmp_path, rng):
    cache, store = make_cache(*capacities, disk_dir=str(tmp_path / "spill"))
    model = TierModel(capacities)
    prompts = [tuple(int(t) for t in rng.integers(0, 1000, BS)) for _ in range(9)]
    for _ in range(300):
        prompt = prompts[int(rng.integers(len(prompts)))]
        if rng.random() < 0.5:
            insert(cache, store, list(prompt))
            model.insert(prompt)
        else:
            assert acquire(cache, store, list(prompt)) == int(model.acquire(prompt))
        for tier, modelled in zip(Tier, model.tiers):
            assert cache.tier_keys(tier) == [key_of(p) for p in modelled], tier
        stats = cache.stats()
        assert (stats.blocks_device, stats.blocks_host, stats.blocks_disk) == tuple(len(t) for t in model.tiers)
        assert stats.bytes_disk == len(model.tiers[2]) * store.block_bytes
        used = cache._disk.used_slots if cache._disk else []
        assert used == sorted(b.disk_slot for b in cache._tiers[Tier.DISK].values())
    cache.close()
    assert (tmp_path / "spill" / INDEX_FILE).exists() == (capacities[2] > 0)  # a given disk_dir persists


def test_device_only_eviction_reads_nothing_back():
    """With no host or disk tier an evicted block is dropped without reading it off the device (the
    read was seconds of device-to-host copies per long prompt inserted on the H100); a long prompt
    into a small tier keeps its first blocks, and a hit then returns them."""
    cache, store = make_cache(device=4)
    reads = []
    store.read = store.read_start = lambda slots: reads.append(len(slots))  # any read recorded (and fails below)
    prompts = [list(range(100 * i, 100 * i + 3 * BS)) for i in range(4)]  # 3 blocks each
    for p in prompts:
        insert(cache, store, p)
    assert reads == [] and cache.stats().blocks_device <= 4 and cache.stats().dropped > 0
    assert acquire(cache, store, prompts[-1]) == 3


def test_spill_to_disk_and_back():
    """device 1, host 1, disk 2 blocks (a temporary folder): p0..p3 fill disk, host, device; a hit on
    p0 brings it back from disk and pushes the others one tier down; close removes the folder."""
    cache, store = make_cache(device=1, host=1, disk=2)
    folder = cache.disk_dir
    prompts = [[i] * BS for i in range(5)]
    for p in prompts[:4]:
        insert(cache, store, p)
    def tiers():
        return [cache.tier_keys(tier) for tier in Tier]

    assert tiers() == [[key_of(prompts[3])], [key_of(prompts[2])], [key_of(prompts[0]), key_of(prompts[1])]]
    assert cache._disk.used_slots == [0, 1]
    assert acquire(cache, store, prompts[0]) == 1
    assert tiers() == [[key_of(prompts[0])], [key_of(prompts[3])], [key_of(prompts[1]), key_of(prompts[2])]]
    insert(cache, store, prompts[4])  # p0 -> host, p3 -> disk, p1 (least recent on disk) dropped
    assert tiers() == [[key_of(prompts[4])], [key_of(prompts[0])], [key_of(prompts[2]), key_of(prompts[3])]]
    assert acquire(cache, store, prompts[1]) == 0 and acquire(cache, store, prompts[3]) == 1
    assert tiers() == [[key_of(prompts[3])], [key_of(prompts[4])], [key_of(prompts[2]), key_of(prompts[0])]]
    assert acquire(cache, store, prompts[4]) == 1 and acquire(cache, store, prompts[4]) == 1
    stats = cache.stats()  # hits: p0 and p3 from disk, p4 from the host, then p4 on the device
    assert stats.dropped == 1
    assert (stats.hits, stats.hit_tokens, stats.hit_tokens_host, stats.hit_tokens_disk) == (4, 4 * BS, BS, 2 * BS)
    cache.close()
    assert not os.path.exists(folder)


def test_forget_drops_a_prompts_own_blocks_in_every_tier_and_counts_start_over():
    """device 2, host 2, disk 2 blocks: a 2-block prompt `a` and two continuations of a shared block
    `s` spread over the three tiers. forget(a) frees a's blocks wherever they are (slots, slab rows,
    disk slots all back); forget of one continuation keeps the shared block its sibling continues;
    forgetting an uncached prompt drops nothing. reset_counts zeroes the lookups and block counts,
    the blocks held staying; the cache then works as before."""
    cache, store = make_cache(device=2, host=2, disk=2)
    a = [1] * BS + [2] * BS
    shared = [7] * BS
    left, right = shared + [8] * BS, shared + [9] * BS
    for prompt in (a, left, right):
        insert(cache, store, prompt)
    assert acquire(cache, store, [5] * BS) == 0  # a miss, counted
    cache._settle(until=cache._spills[-1] if cache._spills else None)
    held = cache.stats()
    assert held.blocks_device + held.blocks_host + held.blocks_disk == 5 and held.blocks_disk >= 1
    assert cache.forget(a) == 2 and cache.match(a) == []
    assert cache.forget(left) == 1  # its last block; the shared one stays for `right`
    assert len(cache.match(right)) == 2 and len(cache.match(left)) == 1
    assert cache.forget([3] * BS) == 0
    stats = cache.stats()
    assert stats.blocks_device + stats.blocks_host + stats.blocks_disk == 2 and stats.dropped == 3
    assert len(cache._free_slots) + stats.blocks_device == store.capacity
    assert cache._disk.free_slots + stats.blocks_disk == 2
    cache._settle(until=cache._spills[-1] if cache._spills else None)
    assert len(cache._host_free) + stats.blocks_host == 2
    cache.reset_counts()
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.hit_tokens, stats.inserted, stats.dropped) == (0, 0, 0, 0, 0)
    assert stats.blocks_device + stats.blocks_host + stats.blocks_disk == 2
    assert acquire(cache, store, right) == 2 and cache.stats().hits == 1
    assert insert(cache, store, a) == 2 and acquire(cache, store, a) == 2
    cache.close()


def test_shared_prefixes_under_pressure_keep_the_index_consistent(tmp_path, rng):
    """Prompts built from 4 block patterns (so prefixes are shared), tiny tiers, random inserts and
    hits: every hit's data is the prompt's, no cached block outlives its parent, slots and bytes add up."""
    cache, store = make_cache(device=4, host=3, disk=2, disk_dir=str(tmp_path))
    patterns = [[p * 10 + i for i in range(BS)] for p in range(4)]
    for _ in range(400):
        blocks = rng.integers(0, 4, int(rng.integers(1, 6)))
        prompt = [t for b in blocks for t in patterns[b]] + [99] * int(rng.integers(0, BS))
        if rng.random() < 0.5:
            insert(cache, store, prompt)
        else:
            acquire(cache, store, prompt)
        held = [b for tier in Tier for b in cache._tiers[tier].values()]
        assert len(held) == len(cache._index) and all(cache._index[b.key] is b for b in held)
        assert all(b.parent is None or b.parent.tier is not None for b in held)  # no orphan
        slots = [b.slot for b in cache._tiers[Tier.DEVICE].values()]
        assert len(set(slots)) == len(slots) and len(slots) + len(cache._free_slots) == store.capacity
        stats = cache.stats()
        assert stats.bytes_host == stats.blocks_host * store.block_bytes <= 3 * store.block_bytes
        assert stats.bytes_disk == stats.blocks_disk * store.block_bytes
        disk_slots = sorted(b.disk_slot for b in cache._tiers[Tier.DISK].values())
        assert disk_slots == cache._disk.used_slots and len(disk_slots) + cache._disk.free_slots == 2


# ----------------------------------------------------------------------------- the disk tier (HCache files)


LAYERS, HEADS, DIM = 2, 2, 8  # the KV tests' block: [2 layers, 2, BS, 2 heads, 8]


def kv_cache(device, host=0, disk=0, disk_dir=None, dtype=ml_dtypes.bfloat16, fingerprint=None):
    """A PrefixCache over a HostKVBlockPool of KV blocks [LAYERS, 2, BS, HEADS, DIM]; capacities in blocks."""
    pool = HostKVBlockPool(device, LAYERS, BS, HEADS, DIM, dtype)
    size = pool.block_bytes
    config = PrefixCacheConfig(block_size=BS, device_bytes=device * size, host_bytes=host * size,
                               disk_bytes=disk * size, disk_dir=disk_dir)
    return PrefixCache(config, pool, fingerprint=fingerprint), pool


def kv_blocks(pool, tokens) -> np.ndarray:
    """The KV of the whole blocks of a prompt, [n, LAYERS, 2, BS, HEADS, DIM] in the pool's dtype:
    random, seeded by each block's chained key (so equal prefixes have equal KV)."""
    ids = np.asarray(tokens, np.int32)
    blocks, key = [], 0
    for begin in range(0, len(ids) // BS * BS, BS):
        key = chain_hash(key, ids[begin:begin + BS].tobytes())
        blocks.append(np.random.default_rng(key).standard_normal(pool.block_shape).astype(pool.dtype))
    return np.stack(blocks)


def kv_insert(cache, pool, tokens) -> int:
    blocks = kv_blocks(pool, tokens)

    def copy(block_numbers, slots):
        pool.write(slots, blocks[block_numbers])

    return cache.insert(tokens, copy)


def kv_acquire(cache, pool, tokens) -> int:
    """Acquires a prompt's cached prefix, checks its KV bit for bit, returns its blocks."""
    slots = cache.acquire(tokens)
    assert pool.read(slots).tobytes() == kv_blocks(pool, tokens)[:len(slots)].tobytes(), "a hit's KV differs"
    return len(slots)


def layer_file(folder, layer) -> str:
    return os.path.join(folder, SESSION_ID, f"layer_{layer:03d}.bin")


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32])
def test_random_kv_through_host_and_disk_comes_back_bit_for_bit(dtype, rng):
    """Tiers of 2 / 2 / 4 blocks: four 2-block prompts push the first two to disk; hits on them bring
    their random KV back from the HCache-layout files unchanged, and the tiers shift down."""
    cache, pool = kv_cache(device=2, host=2, disk=4, dtype=dtype)
    prompts = [rng.integers(0, 1000, 2 * BS + 1).tolist() for _ in range(4)]
    for prompt in prompts:
        assert kv_insert(cache, pool, prompt) == 2
    stats = cache.stats()
    assert (stats.blocks_device, stats.blocks_host, stats.blocks_disk) == (2, 2, 4)
    assert sorted(os.listdir(os.path.join(cache.disk_dir, SESSION_ID))) == ["layer_000.bin", "layer_001.bin"]
    assert kv_acquire(cache, pool, prompts[0]) == 2 and kv_acquire(cache, pool, prompts[1]) == 2
    assert kv_acquire(cache, pool, prompts[2]) == 2 and kv_acquire(cache, pool, prompts[3]) == 2
    stats = cache.stats()
    assert (stats.hit_tokens_disk, stats.hit_tokens_host, stats.disk_read_errors) == (8 * BS, 0, 0)  # each hit pushes
    # the device tier's blocks to the host and the host's to disk: the next prompt is always on disk
    assert (stats.blocks_device, stats.blocks_host, stats.blocks_disk, stats.dropped) == (2, 2, 4, 0)
    cache.close()


@pytest.mark.parametrize("damage, block", [("flip", 1), ("flip", 0), ("truncate", 0), ("remove", 0)])
def test_a_damaged_layer_file_ends_the_hit_before_that_block(damage, block, tmp_path, rng, caplog):
    """A flipped byte, a short file or a missing file under a disk block: the hit stops before it
    (block 1: a 1-block hit; block 0: a miss), the block and its child are dropped, one warning is
    logged and counted, nothing raises; the cache goes on working."""
    cache, pool = kv_cache(device=2, disk=4, disk_dir=str(tmp_path))
    first, second = rng.integers(0, 1000, 2 * BS).tolist(), rng.integers(1000, 2000, 2 * BS).tolist()
    kv_insert(cache, pool, first)
    kv_insert(cache, pool, second)  # first's two blocks -> disk
    assert cache.stats().blocks_disk == 2
    slot = cache.match(first)[block].disk_slot
    path = layer_file(tmp_path, 1 - block)
    chunk_bytes = BS * 2 * HEADS * DIM * 2  # one layer of one block, bfloat16
    if damage == "flip":
        with open(path, "r+b") as f:
            f.seek(slot * chunk_bytes + 7)
            byte = f.read(1)[0]
            f.seek(slot * chunk_bytes + 7)
            f.write(bytes([byte ^ 0x40]))
    elif damage == "truncate":  # the file's last slot loses its last byte
        assert slot == max(cache._disk.used_slots)
        os.truncate(path, (slot + 1) * chunk_bytes - 1)
    else:
        os.remove(path)
    with caplog.at_level(logging.WARNING, logger="jhybrid.serving"):
        assert kv_acquire(cache, pool, first) == block
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"slot {slot}" in warnings[0].getMessage()
    stats = cache.stats()
    assert (stats.disk_read_errors, stats.dropped, stats.hit_tokens_disk) == (1, 2 - block, block * BS)
    assert (stats.hits, stats.misses) == ((1, 0) if block else (0, 1))
    assert len(cache.match(first)) == block  # the damaged block is gone, not kept for another try
    assert kv_insert(cache, pool, first) == 2 - block and kv_acquire(cache, pool, first) == 2
    cache.close()


def test_the_disk_tier_survives_close_and_reopen(tmp_path, caplog):
    """device 3, host 1, disk 3 blocks: A (3 blocks), then B (1) pushes A's last block to the host.
    close writes the most recent 3 blocks (B, A1, A2; A3 would not fit) to the disk tier; a cache
    opened on the folder with the same fingerprint hits them from disk with the same KV; one with
    another fingerprint logs both, discards the files and misses."""
    a, b = list(range(100, 100 + 3 * BS)), list(range(500, 500 + BS))
    cache, pool = kv_cache(device=3, host=1, disk=3, disk_dir=str(tmp_path), fingerprint="model-a")
    kv_insert(cache, pool, a)
    kv_insert(cache, pool, b)
    assert cache.stats().blocks_host == 1
    cache.close()
    assert os.path.exists(tmp_path / INDEX_FILE)

    cache, pool = kv_cache(device=3, host=1, disk=3, disk_dir=str(tmp_path), fingerprint="model-a")
    assert not os.path.exists(tmp_path / INDEX_FILE)  # the open cache owns the slots now
    assert [len(cache.tier_keys(tier)) for tier in Tier] == [0, 0, 3]
    assert cache.tier_keys(Tier.DISK)[-1] == key_of(b)  # the most recent block stays the most recent
    assert kv_acquire(cache, pool, a) == 2 and kv_acquire(cache, pool, b) == 1
    assert cache.stats().hit_tokens_disk == 3 * BS
    cache.close()

    with caplog.at_level(logging.INFO, logger="jhybrid.serving"):
        cache, pool = kv_cache(device=3, host=1, disk=3, disk_dir=str(tmp_path), fingerprint="model-b")
    assert any("'model-a'" in r.getMessage() and "'model-b'" in r.getMessage() for r in caplog.records)
    assert cache.stats().blocks_disk == 0 and not os.path.exists(tmp_path / INDEX_FILE)
    assert kv_acquire(cache, pool, a) == 0 and kv_acquire(cache, pool, b) == 0
    cache.close()


def test_a_block_whose_parent_did_not_load_is_dropped(tmp_path):
    """An index missing a prompt's first block: its second block (an orphan) is not loaded and its
    slot is free again; the other prompt loads."""
    import json

    a, b = list(range(100, 100 + 2 * BS)), list(range(500, 500 + BS))
    cache, pool = kv_cache(device=3, disk=3, disk_dir=str(tmp_path), fingerprint="f")
    kv_insert(cache, pool, a)
    kv_insert(cache, pool, b)
    cache.close()
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    index["blocks"] = [entry for entry in index["blocks"] if entry["key"] != key_of(a[:BS])]
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    cache, pool = kv_cache(device=3, disk=3, disk_dir=str(tmp_path), fingerprint="f")
    assert cache.tier_keys(Tier.DISK) == [key_of(b)] and cache._disk.free_slots == 2
    assert kv_acquire(cache, pool, b) == 1 and kv_acquire(cache, pool, a) == 0
    cache.close()


def test_a_temporary_disk_folder_is_removed_and_nothing_persists():
    cache, pool = kv_cache(device=1, disk=2)
    folder = cache.disk_dir
    kv_insert(cache, pool, list(range(BS)))
    kv_insert(cache, pool, list(range(BS, 2 * BS)))
    assert os.path.isdir(folder) and cache.stats().blocks_disk == 1
    cache.close()
    assert not os.path.exists(folder)
    cache, pool = kv_cache(device=1, disk=2)
    assert cache.disk_dir != folder and cache.stats().blocks_disk == 0
    cache.close()


# ----------------------------------------------------------------------------- in the engine


SLOTS, MAX_LEN, CHUNK, BLOCK = 2, 128, 16, 16


@pytest.fixture(scope="module")
def model():
    return create_model(TINY, seed=0)


@pytest.fixture(scope="module")
def alone(model):
    generator = Generator(model, prefill_chunk=CHUNK, max_len=MAX_LEN)
    return lambda prompt, max_tokens: generator.generate([list(prompt)], max_new_tokens=max_tokens).tokens[0]


def test_a_hit_equals_the_miss_and_running_alone(model, alone, rng):
    shared = rng.integers(0, TINY.vocab_size, 40).tolist()
    first = shared + rng.integers(0, TINY.vocab_size, 5).tolist()   # 45 tokens: 2 whole blocks cached
    other = shared + rng.integers(0, TINY.vocab_size, 7).tolist()   # 47: the same 2 blocks
    exact = shared[:32]  # 32 tokens = 2 blocks, but its last token must be prefilled: 1 block used
    engine = ServingEngine(model, slots=SLOTS, max_len=MAX_LEN, prefill_chunk=CHUNK,
                           prefix_cache=PrefixCacheConfig(block_size=BLOCK, device_bytes=1 << 20))
    assert engine._pool.row_kv is FULL_ROW_KV  # full's rows: the device pool
    with engine:
        engine.start()
        runs = [(p, engine.submit(Request(p, max_tokens=20)).result(TIMEOUT)) for p in (first, first, other, exact)]
        stats = engine.stats()
    assert [out.cached_tokens for _, out in runs] == [0, 32, 32, 16]
    for prompt, out in runs:
        assert out.tokens == alone(prompt, 20)
    assert runs[0][1].tokens == runs[1][1].tokens
    block_bytes = TINY.num_layers * 2 * BLOCK * TINY.num_kv_heads * TINY.head_dim * 4
    assert (stats.prefix_hits, stats.prefix_misses, stats.prefix_hit_tokens) == (3, 1, 80)
    assert (stats.prefix_bytes_device, stats.prefix_bytes_host, stats.prefix_bytes_disk) == (2 * block_bytes, 0, 0)
    assert stats.prefill_tokens == sum(len(p) - out.cached_tokens for p, out in runs)


def test_a_finished_prompt_enters_the_cache_over_the_next_steps(model, alone, rng, monkeypatch):
    # 2 blocks a step: a 6-block prompt is cached over 3 steps while it decodes; a request that ends
    # before that (3 tokens) has its blocks flushed before its output is visible
    from jhybrid.serving import engine as engine_module

    monkeypatch.setattr(engine_module, "PREFIX_INSERT_BLOCKS_PER_STEP", 2)
    long_prompt = rng.integers(0, TINY.vocab_size, 6 * BLOCK + 3).tolist()
    short_lived = rng.integers(0, TINY.vocab_size, 6 * BLOCK + 1).tolist()
    engine = ServingEngine(model, slots=SLOTS, max_len=MAX_LEN, prefill_chunk=6 * BLOCK + 3,
                           prefix_cache=PrefixCacheConfig(block_size=BLOCK, device_bytes=1 << 20))
    with engine:
        handle = engine.submit(Request(long_prompt, max_tokens=10))
        cached = []
        while not handle.done:
            engine.step()  # the caller's thread: one step at a time
            cached.append(engine._prefix.stats().blocks_device)
        assert cached[:4] == [2, 4, 6, 6]  # the prefill step inserts its first 2, then 2 a step
        assert handle.result(TIMEOUT).tokens == alone(long_prompt, 10)

        ended = engine.submit(Request(short_lived, max_tokens=2))
        while not ended.done:
            engine.step()
        assert engine._prefix.stats().blocks_device == 12  # all 6 of it, though it ran 2 steps
        again = engine.submit(Request(short_lived + [3], max_tokens=8))
        while not again.done:
            engine.step()
        assert again.result(TIMEOUT).cached_tokens == 6 * BLOCK
        assert again.result(TIMEOUT).tokens == alone(short_lived + [3], 8)


def test_a_failed_insert_at_the_end_loses_only_the_caching(model, alone, rng, monkeypatch, caplog):
    from jhybrid.serving import engine as engine_module

    monkeypatch.setattr(engine_module, "PREFIX_INSERT_BLOCKS_PER_STEP", 1)
    prompt = rng.integers(0, TINY.vocab_size, 4 * BLOCK + 1).tolist()
    engine = ServingEngine(model, slots=SLOTS, max_len=MAX_LEN, prefill_chunk=4 * BLOCK + 1,
                           prefix_cache=PrefixCacheConfig(block_size=BLOCK, device_bytes=1 << 20))
    with engine:
        handle = engine.submit(Request(prompt, max_tokens=2))
        engine.step()  # the prefill: its first block inserted
        monkeypatch.setattr(engine._pool, "from_row", lambda *a: (_ for _ in ()).throw(OSError("copy failed")))
        with caplog.at_level(logging.ERROR, logger="jhybrid.serving"):
            while not handle.done:
                engine.step()  # its last token: the flush of its 3 other blocks fails
        assert handle.result(TIMEOUT).tokens == alone(prompt, 2)
        assert "not cached" in caplog.text and engine._inserting == []
        assert engine._prefix.stats().blocks_device == 1


QUEST = dict(window_tokens=40, sink=8, block_size=32, budget=32)  # 32-token pages: one page of top-k


def test_quest_row_kv_writes_what_its_prefill_writes(model, rng):
    """QuestRowKV: the K, V a prefill left in row 1 (read back), written into row 0 of an empty
    cache, give row 0 the prefill's pages AND digests (the 16-token blocks end mid-page); row 1 of
    the new cache stays empty."""
    import jax.numpy as jnp

    from jhybrid.generation import make_step
    from jhybrid.hybrid import make_backend

    backend = make_backend("quest", **QUEST)
    backend.open(model.config, 2, MAX_LEN)
    step, params = make_step(model, backend)
    cache = model.init_cache(2, MAX_LEN, backend)
    n = 72
    tokens = np.zeros((2, 80), np.int32)
    tokens[1, :n] = rng.integers(0, TINY.vocab_size, n)
    positions = np.full((2, 80), -1, np.int32)
    positions[1, :n] = np.arange(n)
    _, prefilled = step(params, tokens, positions, cache)
    row_kv = backend.row_kv()
    kv = row_kv.read(prefilled.layers, jnp.int32(1), jnp.arange(n, dtype=jnp.int32))
    placed = row_kv.write(model.init_cache(2, MAX_LEN, backend).layers, jnp.int32(0), kv,
                          jnp.arange(n, dtype=jnp.int32))
    nb = placed[0].kmin.shape[2]
    for got, want in zip(placed, prefilled.layers):
        np.testing.assert_array_equal(np.asarray(got.k[:nb]), np.asarray(want.k[nb:]))
        np.testing.assert_array_equal(np.asarray(got.v[:nb]), np.asarray(want.v[nb:]))
        used = -(-n // 32)  # pages the prompt touched (the rest hold the empty cache's values)
        np.testing.assert_array_equal(np.asarray(got.kmin[0, :, :used]), np.asarray(want.kmin[1, :, :used]))
        np.testing.assert_array_equal(np.asarray(got.kmax[0, :, :used]), np.asarray(want.kmax[1, :, :used]))
        assert not np.asarray(got.k[nb:]).any() and not np.asarray(got.kmin[1]).any()
    backend.close()


def test_quest_serves_hits_with_the_output_of_running_alone(model, rng):
    """quest in the engine with the prefix cache: a request sharing 64 tokens with an earlier one
    hits 4 blocks (2 pages) and decodes (top-k over digests rebuilt from the placed pages) exactly
    as the same request run alone through quest."""
    from jhybrid.hybrid import make_backend

    shared = rng.integers(0, TINY.vocab_size, 70).tolist()
    prompts = [shared + rng.integers(0, TINY.vocab_size, 9).tolist(), shared + rng.integers(0, TINY.vocab_size, 5).tolist()]
    alone = Generator(model, make_backend("quest", **QUEST), prefill_chunk=CHUNK, max_len=MAX_LEN)
    expected = [alone.generate([p], max_new_tokens=12).tokens[0] for p in prompts]
    alone.close()
    engine = ServingEngine(model, make_backend("quest", **QUEST), slots=SLOTS, max_len=MAX_LEN, prefill_chunk=CHUNK,
                           prefix_cache=PrefixCacheConfig(block_size=BLOCK, device_bytes=1 << 20))
    with engine:
        engine.start()
        outs = [engine.submit(Request(p, max_tokens=12)).result(TIMEOUT) for p in prompts]
    assert [o.cached_tokens for o in outs] == [0, 64]
    assert [o.tokens for o in outs] == expected


def test_kv_spilled_to_host_and_disk_comes_back_for_a_hit(model, alone, rng, tmp_path):
    """Tiers of 2 blocks (device), 2 (host), 4 (disk): four 33-token prompts push the first two to
    disk; a prompt extending the first hits its blocks from disk with the output of running alone."""
    block_bytes = TINY.num_layers * 2 * BLOCK * TINY.num_kv_heads * TINY.head_dim * 4
    config = PrefixCacheConfig(block_size=BLOCK, device_bytes=2 * block_bytes, host_bytes=2 * block_bytes,
                               disk_bytes=4 * block_bytes, disk_dir=str(tmp_path))
    prompts = [rng.integers(0, TINY.vocab_size, 33).tolist() for _ in range(4)]
    extended = prompts[0] + rng.integers(0, TINY.vocab_size, 10).tolist()
    engine = ServingEngine(model, slots=SLOTS, max_len=MAX_LEN, prefill_chunk=CHUNK, prefix_cache=config)
    with engine:
        engine.start()
        for prompt in prompts:
            assert engine.submit(Request(prompt, max_tokens=4)).result(TIMEOUT).cached_tokens == 0
        stats = engine.stats()
        assert (stats.prefix_bytes_device, stats.prefix_bytes_host, stats.prefix_bytes_disk) == (
            2 * block_bytes, 2 * block_bytes, 4 * block_bytes)
        assert len(engine._prefix._disk.used_slots) == 4
        out = engine.submit(Request(extended, max_tokens=12)).result(TIMEOUT)
        assert out.cached_tokens == 32 and out.tokens == alone(extended, 12)
        # prompts[0]'s blocks: disk -> device; prompts[3]'s: device -> host; prompts[2]'s: host -> disk
        stats = engine.stats()
        assert (stats.prefix_bytes_device, stats.prefix_bytes_host, stats.prefix_bytes_disk) == (
            2 * block_bytes, 2 * block_bytes, 4 * block_bytes)
        again = engine.submit(Request(prompts[2] + [5], max_tokens=12)).result(TIMEOUT)
        assert again.cached_tokens == 32 and again.tokens == alone(prompts[2] + [5], 12)
    assert os.path.exists(tmp_path / INDEX_FILE)  # close() wrote every tier down to the disk tier

    # A new engine on the same folder: the blocks come back from the disk tier with the same output.
    engine = ServingEngine(model, slots=SLOTS, max_len=MAX_LEN, prefill_chunk=CHUNK, prefix_cache=config)
    # the 4 most recent of the 8 blocks held at close: prompts[2]'s (device), prompts[0]'s (host)
    assert engine._prefix.stats().blocks_disk == 4
    with engine:
        engine.start()
        out = engine.submit(Request(extended, max_tokens=12)).result(TIMEOUT)
        assert out.cached_tokens == 32 and out.tokens == alone(extended, 12)
        assert engine.stats().prefix_hit_tokens_disk == 32 and engine.stats().prefix_disk_read_errors == 0


def test_host_pool_write_history_stores_each_block_in_its_slot(rng):
    """HostKVBlockPool.write_history against an independent per-token oracle: slot s[i] holds tokens
    numbers[i]*bs .. +bs-1 of the history, every layer's K and V; other slots are untouched (poison)."""
    pool = HostKVBlockPool(8, LAYERS, BS, HEADS, DIM, np.float32)
    pool.data.fill(np.nan)
    tokens = 5 * BS + 3  # a partial last block is never stored
    kv = rng.standard_normal((LAYERS, 2, tokens, HEADS, DIM)).astype(np.float32)
    slots, numbers = np.array([6, 0, 3]), np.array([4, 1, 0])
    pool.write_history(slots, kv, numbers)
    for slot, number in zip(slots, numbers):
        for t in range(BS):
            np.testing.assert_array_equal(pool.data[slot][:, :, t], kv[:, :, number * BS + t])
    untouched = np.setdiff1d(np.arange(8), slots)
    assert np.isnan(pool.data[untouched]).all()
