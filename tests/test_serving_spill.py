"""The prefix cache's asynchronous device-to-host spill (jhybrid/serving/prefix_cache.py, module doc):

  * an insertion that spills returns while the copy is still in flight (a fake store whose copies
    wait for the test to open a gate); the spilled blocks come back bit for bit, and a hit on a
    block whose copy is in flight waits for it;
  * backpressure: with at most 2 blocks in flight a spill of 4 waits for the oldest copy;
  * a copy that fails: the call that needs its blocks raises PrefixCacheSpillError (once), the
    blocks and every block below them are dropped, the cache stays usable;
  * close with copies in flight: waits for the running one, cancels the queued ones (or awaits and
    saves them with a persistent disk tier) and ends the worker thread;
  * the real KVBlockPool (JAX on CPU): slots freed by a spill are overwritten at once, and the
    spilled KV still comes back unchanged (the gather is ordered before the pool's donated writes).

No wall-clock bound: waits are bounded by TIMEOUT, and a call "still waiting" is one blocked on a
gate only the test opens.
"""

from __future__ import annotations

import logging
import threading

import ml_dtypes
import numpy as np
import pytest

from jhybrid.serving import kv_blocks
from jhybrid.serving.kv_blocks import KVBlockPool
from jhybrid.serving.prefix_cache import (SPILL_THREAD_PREFIX, PrefixCache, PrefixCacheConfig,
                                          PrefixCacheSpillError, Tier, chain_hash)
from tests.test_serving_prefix_cache import BS, NumpyStore  # BS tokens per block
TIMEOUT = 60.0  # the longest any wait of these tests may take
BLOCKED = 0.3  # how long a call blocked on a closed gate is watched to still be waiting


class GatedStore(NumpyStore):
    """test_serving_prefix_cache's NumPy device tier (block j of a prompt = its BS token ids as K
    and V) whose read_start copies the blocks at once (as they are when called)
    and returns a finisher that, on the spill worker, waits for `gate` and raises `fail` (when set
    at read_start) or returns them."""

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.gate = threading.Event()
        self.gate.set()  # open unless a test closes it
        self.entered = threading.Semaphore(0)  # released as each finisher starts waiting
        self.reads: list[int] = []  # the block count of every read_start
        self.finished = 0  # finishers that got past the gate
        self.fail: Exception | None = None

    def read_start(self, slots):
        blocks, error = self.read(slots), self.fail
        self.reads.append(len(slots))

        def finish():
            self.entered.release()
            if not self.gate.wait(TIMEOUT):
                raise TimeoutError("the test never opened the gate")
            self.finished += 1
            if error is not None:
                raise error
            return blocks

        return finish


def make_cache(device, host=0, disk=0, disk_dir=None, max_spill_blocks=None, store=None):
    """A PrefixCache over a GatedStore; capacities in blocks."""
    store = store or GatedStore(device)
    size = store.block_bytes
    config = PrefixCacheConfig(block_size=BS, device_bytes=device * size, host_bytes=host * size,
                               disk_bytes=disk * size, disk_dir=disk_dir)
    return PrefixCache(config, store, max_spill_blocks=max_spill_blocks), store


def prompt(first: int, blocks: int) -> list[int]:
    return list(range(first, first + blocks * BS))


def insert(cache, store, tokens) -> int:
    blocks = np.asarray(tokens, np.int64).reshape(-1, 1, 1, BS, 1, 1)

    def copy(block_numbers, slots):
        store.data[slots] = blocks[block_numbers]

    return cache.insert(tokens, copy)


def acquire(cache, store, tokens) -> int:
    """Acquires `tokens`' cached prefix, checks its data is the prompt's own, returns its blocks."""
    slots = cache.acquire(tokens)
    want = np.broadcast_to(np.asarray(tokens[:len(slots) * BS], np.int64).reshape(-1, 1, 1, BS, 1, 1),
                           (len(slots), 1, 2, BS, 1, 1))
    assert np.array_equal(store.data[slots], want), "a hit returned other KV than its prompt's"
    return len(slots)


class Call(threading.Thread):
    """fn(*args) on a thread of its own; its result or exception kept."""

    def __init__(self, fn, *args):
        super().__init__(daemon=True)
        self.fn, self.args, self.result, self.error = fn, args, None, None
        self.start()

    def run(self):
        try:
            self.result = self.fn(*self.args)
        except BaseException as error:  # noqa: BLE001 (handed to the test)
            self.error = error

    def still_waiting(self) -> bool:
        self.join(BLOCKED)
        return self.is_alive()

    def outcome(self):
        self.join(TIMEOUT)
        assert not self.is_alive(), f"{self.fn.__name__} did not return within {TIMEOUT} s"
        if self.error is not None:
            raise self.error
        return self.result


def spill_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(SPILL_THREAD_PREFIX)}


def wait_entered(store, count: int = 1) -> None:
    for _ in range(count):
        assert store.entered.acquire(timeout=TIMEOUT), "the spill worker never started a copy"


# ----------------------------------------------------------------------------- in flight


def test_an_insertion_returns_while_its_spill_is_in_flight():
    cache, store = make_cache(device=2, host=8)
    p0, p1 = prompt(0, 2), prompt(100, 2)
    assert insert(cache, store, p0) == 2
    store.gate.clear()
    try:
        assert insert(cache, store, p1) == 2  # spills p0's 2 blocks; returns with their copy blocked
        wait_entered(store)
        assert store.finished == 0 and store.reads == [2]
        stats = cache.stats()
        assert (stats.spill_blocks_in_flight, stats.blocks_host, stats.bytes_host) == (2, 2, 2 * store.block_bytes)
        host = [cache._index[key] for key in cache.tier_keys(Tier.HOST)]
        assert all(block.pending is not None and block.data is None for block in host)
        assert sorted(store.data[:, 0, 0, :, 0, 0].ravel()) == p1  # p1 took p0's slots at once
    finally:
        store.gate.set()
    assert acquire(cache, store, p0) == 2  # back bit for bit (p1 spilled in turn)
    assert acquire(cache, store, p1) == 2
    stats = cache.stats()
    assert (stats.hits, stats.hit_tokens_host, stats.dropped) == (2, 4 * BS, 0)
    cache.close()


def test_a_hit_on_a_block_in_flight_waits_for_its_copy():
    cache, store = make_cache(device=2, host=8)
    p0, p1 = prompt(0, 2), prompt(100, 2)
    insert(cache, store, p0)
    store.gate.clear()
    try:
        insert(cache, store, p1)
        hit = Call(acquire, cache, store, p0)
        assert hit.still_waiting()  # on p0's copy, which the gate holds
        assert store.finished == 0
    finally:
        store.gate.set()
    assert hit.outcome() == 2
    cache.close()


def test_a_spill_beyond_the_limit_waits_for_the_oldest_copy(caplog):
    caplog.set_level(logging.DEBUG, logger="jhybrid.serving")
    cache, store = make_cache(device=4, host=16, max_spill_blocks=2)
    p0, p1 = prompt(0, 4), prompt(100, 4)
    insert(cache, store, p0)
    store.gate.clear()
    try:
        second = Call(insert, cache, store, p1)  # spills p0's 4 blocks, 2 at a time
        wait_entered(store)
        assert second.still_waiting()
        assert store.reads == [2]  # the second piece waits for the first's copy
        assert "waiting for the oldest copy" in caplog.text
    finally:
        store.gate.set()
    assert second.outcome() == 4
    assert store.reads == [2, 2]
    assert acquire(cache, store, p0) == 4 and acquire(cache, store, p1) == 4
    cache.close()


def test_max_spill_blocks_is_checked():
    with pytest.raises(ValueError, match="max_spill_blocks=0; expected an integer >= 1"):
        make_cache(device=2, host=2, max_spill_blocks=0)


# ----------------------------------------------------------------------------- failures


def test_a_failed_copy_raises_once_and_drops_its_blocks():
    """Decision (module doc): the failed spill's blocks are dropped with every block below them, the
    call that finds the failure raises PrefixCacheSpillError (once) and the cache stays usable."""
    cache, store = make_cache(device=2, host=8)
    p0, p1 = prompt(0, 2), prompt(100, 2)
    insert(cache, store, p0)
    store.fail = OSError("device lost")
    insert(cache, store, p1)  # p0's copy fails on the worker
    store.fail = None
    with pytest.raises(PrefixCacheSpillError, match=r"prefix cache spill of 2 blocks .* failed .*device lost") as info:
        cache.acquire(p0)
    assert isinstance(info.value.__cause__, OSError)
    assert acquire(cache, store, p0) == 0  # dropped: a miss, never other data
    assert acquire(cache, store, p1) == 2  # usable; the error was raised once
    stats = cache.stats()
    assert (stats.dropped, stats.blocks_host, stats.bytes_host) == (2, 0, 0)
    cache.close()


def test_a_failed_copy_drops_the_blocks_below_it_on_the_device():
    """x's copy fails while its child w (inserted under x, x in the host tier) is on the device: w
    is dropped too, and its slot freed; y, spilled after x, is not touched."""
    cache, store = make_cache(device=2, host=8)
    x, y, z, w = prompt(0, 1), prompt(100, 1), prompt(200, 1), prompt(300, 1)
    insert(cache, store, x)
    insert(cache, store, y)
    store.gate.clear()
    try:
        store.fail = OSError("device lost")
        insert(cache, store, z)  # x's copy: blocked, then fails
        store.fail = None
        assert insert(cache, store, x + w) == 1  # w under x (pending in the host tier); y spilled
    finally:
        store.gate.set()
    with pytest.raises(PrefixCacheSpillError, match="device lost"):
        cache.acquire(x + w)
    assert acquire(cache, store, x + w) == 0 and acquire(cache, store, x) == 0
    tokens = {tier: [cache._index[key].tokens for key in cache.tier_keys(tier)] for tier in Tier}
    assert tokens == {Tier.DEVICE: [np.asarray(z, np.int32).tobytes()],
                      Tier.HOST: [np.asarray(y, np.int32).tobytes()], Tier.DISK: []}
    assert len(cache._free_slots) == 1 and cache.stats().dropped == 2  # x and w
    assert acquire(cache, store, y) == 1 and acquire(cache, store, z) == 1
    cache.close()


# ----------------------------------------------------------------------------- close


def test_close_waits_for_the_running_copy_cancels_the_queued_and_ends_the_worker():
    before = spill_threads()
    cache, store = make_cache(device=2, host=8)
    insert(cache, store, prompt(0, 2))
    store.gate.clear()
    try:
        insert(cache, store, prompt(100, 2))  # spill 1: running, blocked at the gate
        wait_entered(store)
        insert(cache, store, prompt(200, 2))  # spill 2: queued behind it
        assert store.reads == [2, 2] and cache.stats().spill_blocks_in_flight == 4
        workers = spill_threads() - before
        assert len(workers) == 1
        closing = Call(cache.close)
        assert closing.still_waiting()  # for the running copy
    finally:
        store.gate.set()
    closing.outcome()
    assert store.finished == 1  # the queued copy was cancelled, never run
    assert not any(t.is_alive() for t in workers)
    assert not (spill_threads() - before)
    stats = cache.stats()
    assert (stats.blocks_device, stats.blocks_host, stats.spill_blocks_in_flight) == (0, 0, 0)


def test_close_with_a_persistent_disk_tier_saves_the_blocks_in_flight(tmp_path):
    cache, store = make_cache(device=2, host=8, disk=8, disk_dir=str(tmp_path))
    p0, p1, p2 = prompt(0, 2), prompt(100, 2), prompt(200, 2)
    insert(cache, store, p0)
    store.gate.clear()
    try:
        insert(cache, store, p1)
        insert(cache, store, p2)  # p0 and p1 in flight
        closing = Call(cache.close)
        assert closing.still_waiting()
    finally:
        store.gate.set()
    closing.outcome()
    reopened, store = make_cache(device=2, host=8, disk=8, disk_dir=str(tmp_path))
    assert reopened.stats().blocks_disk == 6
    for p in (p0, p1, p2):
        assert acquire(reopened, store, p) == 2
    reopened.close()


# ----------------------------------------------------------------------------- the real device pool


LAYERS, HEADS, DIM = 2, 2, 8


class GatedPool(KVBlockPool):
    """A KVBlockPool whose host copies are finished only once `gate` opens (so the pool's slots are
    overwritten while the gathered copy waits)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.gate.set()

    def read_start(self, slots):
        finish = super().read_start(slots)

        def gated():
            if not self.gate.wait(TIMEOUT):
                raise TimeoutError("the test never opened the gate")
            return finish()

        return gated


def random_kv(pool, tokens) -> np.ndarray:
    """Random KV [n, LAYERS, 2, BS, HEADS, DIM] in the pool's dtype for a prompt's whole blocks,
    seeded by each block's chained key."""
    ids, key, blocks = np.asarray(tokens, np.int32), 0, []
    for begin in range(0, len(ids) // BS * BS, BS):
        key = chain_hash(key, ids[begin:begin + BS].tobytes())
        blocks.append(np.random.default_rng(key).standard_normal(pool.block_shape).astype(pool.dtype))
    return np.stack(blocks)


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32])
@pytest.mark.parametrize("piece_blocks", [None, 3])  # the host copy in one piece, or in pieces of 3 blocks
def test_the_device_pool_spills_before_its_slots_are_rewritten(dtype, piece_blocks, monkeypatch):
    pool = GatedPool(4, LAYERS, BS, HEADS, DIM, dtype)
    if piece_blocks is not None:
        monkeypatch.setattr(kv_blocks, "HOST_COPY_PIECE_BYTES", piece_blocks * pool.block_bytes)
    size = pool.block_bytes
    cache = PrefixCache(PrefixCacheConfig(block_size=BS, device_bytes=4 * size, host_bytes=8 * size), pool)
    p0, p1 = prompt(0, 4), prompt(100, 4)

    def insert_kv(tokens):
        kv = random_kv(pool, tokens)
        return cache.insert(tokens, lambda numbers, slots: pool.write(slots, kv[numbers]))

    def acquired_kv(tokens) -> bytes:
        return pool.read(cache.acquire(tokens)).tobytes()

    assert insert_kv(p0) == 4
    p0_slots = [cache._index[key].slot for key in cache.tier_keys(Tier.DEVICE)]
    pool.gate.clear()
    try:
        assert insert_kv(p1) == 4  # p0's 4 blocks gathered, then their slots rewritten with p1's KV
        assert sorted(cache._index[key].slot for key in cache.tier_keys(Tier.DEVICE)) == sorted(p0_slots)
        assert acquired_kv(p1) == random_kv(pool, p1).tobytes()  # the rewrite is done
        assert cache.stats().spill_blocks_in_flight == 4
    finally:
        pool.gate.set()
    assert acquired_kv(p0) == random_kv(pool, p0).tobytes()  # the KV as it was before the rewrite
    assert acquired_kv(p1) == random_kv(pool, p1).tobytes()
    cache.close()
