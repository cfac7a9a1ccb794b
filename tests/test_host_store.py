"""KV store invariants under random append/free sequences, memory cap, digests, arena growth."""

from __future__ import annotations

import numpy as np
import pytest

from host import HostMemoryCapError, KVStore, StoreConfig, from_storage, to_storage


def cfg(**kw):
    base = dict(n_layers=2, n_kv_heads=2, head_dim=16, block_size=4, kv_dtype="bf16", initial_blocks_per_layer=1)
    base.update(kw)
    return StoreConfig(**base)


def test_random_evict_free_sequences_keep_every_token(rng):
    """Tokens in == tokens stored, positions and values preserved, slots recycled after free."""
    c = cfg(key_digests=True)
    store = KVStore(c)
    sink = 3                           # positions start after a sink, as evicted blocks do
    expected: dict[tuple, list] = {}   # (layer, seq) -> list of (k, v, maw, positions) blocks
    next_seq = 0
    live = []
    for step in range(150):
        action = rng.random()
        if action < 0.15 or not live:
            store.add_sequence(next_seq)
            live.append(next_seq)
            for layer in range(c.n_layers):
                expected[layer, next_seq] = []
            next_seq += 1
        elif action < 0.25 and len(live) > 1:
            s = live.pop(int(rng.integers(len(live))))
            store.free_sequence(s)
            for layer in range(c.n_layers):
                del expected[layer, s]
        else:
            s = live[int(rng.integers(len(live)))]
            layer = int(rng.integers(c.n_layers))
            n, bs = int(rng.integers(0, 4)), c.block_size
            done = sum(x[0].shape[0] for x in expected[layer, s])
            k = rng.standard_normal((n, bs, c.n_kv_heads, c.head_dim)).astype(np.float32)
            v = rng.standard_normal((n, bs, c.n_kv_heads, c.head_dim)).astype(np.float32)
            maw = rng.random((n, bs, c.n_kv_heads)).astype(np.float32)
            pos = sink + (done + np.arange(n))[:, None] * bs + np.arange(bs)
            numbers = store.append_blocks(layer, s, k, v, maw, pos)
            np.testing.assert_array_equal(numbers, done + np.arange(n))   # block numbers count up per (layer, seq)
            if n:
                expected[layer, s].append((k, v, maw, pos))
        # invariants
        total_in = 0
        for (layer, s), blocks in expected.items():
            n_blocks = sum(x[0].shape[0] for x in blocks)
            assert store.n_tokens(layer, s) == n_blocks * c.block_size
            total_in += n_blocks
        assert sum(a.pool.n_in_use() for a in store.layers) == total_in
    for (layer, s), blocks in expected.items():
        if not blocks:
            continue
        got = store.read_blocks(layer, s)
        k = np.concatenate([x[0] for x in blocks])
        np.testing.assert_array_equal(got["k"], to_storage(k, "bf16"))
        np.testing.assert_array_equal(got["maw"], np.concatenate([x[2] for x in blocks]))
        positions = np.concatenate([x[3] for x in blocks])
        np.testing.assert_array_equal(got["positions"], positions)
        # evicted positions are the ring's oldest non-sink tokens, contiguous from the sink on
        np.testing.assert_array_equal(positions.reshape(-1), sink + np.arange(positions.size))
        kf = from_storage(got["k"], "bf16")
        np.testing.assert_array_equal(got["key_min"], kf.min(axis=1))
        np.testing.assert_array_equal(got["key_max"], kf.max(axis=1))


def test_bytes_used_and_reserved_and_cap(rng):
    c = cfg(n_layers=1, host_memory_cap_bytes=None)
    store = KVStore(c)
    store.add_sequence(0)
    r0 = store.bytes_reserved()
    assert store.bytes_used() == 0
    k = rng.standard_normal((3, 4, 2, 16)).astype(np.float32)
    store.append_blocks(0, 0, k, k, np.ones((3, 4, 2)), np.zeros((3, 4), np.int64))
    per_block = 2 * (2 * 4 * 16 * 2) + 2 * 4 * 4 + 4 * 8  # K + V bf16, MAW float32, positions int64
    assert store.bytes_used() == 3 * per_block
    assert store.bytes_reserved() >= r0 + 2 * per_block
    store.free_sequence(0)
    assert store.bytes_used() == 0

    capped = KVStore(cfg(n_layers=1, host_memory_cap_bytes=KVStore(c).bytes_reserved() + 2 * per_block))
    capped.add_sequence(0)
    capped.append_blocks(0, 0, k[:2], k[:2], np.ones((2, 4, 2)), np.zeros((2, 4), np.int64))
    before = capped.read_blocks(0, 0)
    with pytest.raises(HostMemoryCapError, match="over the cap"):
        capped.append_blocks(0, 0, k, k, np.ones((3, 4, 2)), np.zeros((3, 4), np.int64))
    # the failed append changed nothing
    assert capped.n_blocks(0, 0) == 2
    np.testing.assert_array_equal(capped.read_blocks(0, 0)["k"], before["k"])


def test_freed_slots_wait_for_readers():
    store = KVStore(cfg(n_layers=1))
    store.add_sequence(0)
    z = np.zeros((2, 4, 2, 16), np.float32)
    store.append_blocks(0, 0, z, z, np.ones((2, 4, 2)), np.zeros((2, 4), np.int64))
    with store.lock:
        store.begin_read()
    store.free_sequence(0)
    assert store.layers[0].pool.free == []  # a reader may still see the slots
    store.end_read()
    assert sorted(store.layers[0].pool.free) == [0, 1]


@pytest.mark.parametrize("kw,match", [
    (dict(block_size=0), "block_size=0"),
    (dict(kv_dtype="q4"), "kv_dtype='q4'"),
    (dict(head_dim=-4), "head_dim=-4"),
    (dict(host_memory_cap_bytes=-1), "host_memory_cap_bytes=-1"),
])
def test_bad_config(kw, match):
    with pytest.raises(ValueError, match=match):
        KVStore(cfg(**kw))


def test_bad_appends_name_the_problem(rng):
    store = KVStore(cfg())
    store.add_sequence(0)
    k = np.zeros((1, 4, 2, 16), np.float32)
    good = dict(k=k, v=k, maw=np.ones((1, 4, 2)), positions=np.zeros((1, 4), np.int64))
    for change, match in [
        (dict(k=np.zeros((1, 5, 2, 16), np.float32)), "block_size=4"),
        (dict(v=np.zeros((2, 4, 2, 16), np.float32)), "v has shape"),
        (dict(maw=np.ones((1, 4))), "maw has shape"),
        (dict(positions=np.zeros((1, 4))), "positions dtype"),
        (dict(k=np.zeros((1, 4, 2, 16), np.int32), v=np.zeros((1, 4, 2, 16), np.int32)), "K/V dtype int32"),
    ]:
        with pytest.raises(ValueError, match=match):
            store.append_blocks(0, 0, **{**good, **change})
    with pytest.raises(ValueError, match="unknown seq_id=9"):
        store.append_blocks(0, 9, **good)
    with pytest.raises(ValueError, match="layer=2"):
        store.append_blocks(2, 0, **good)
    with pytest.raises(ValueError, match="already"):
        store.add_sequence(0)
    with pytest.raises(ValueError, match="unknown seq_id=3"):
        store.free_sequence(3)
    fp32 = KVStore(cfg(kv_dtype="fp32"))
    fp32.add_sequence(0)
    with pytest.raises(ValueError, match="uint16"):
        fp32.append_blocks(0, 0, **{**good, "k": k.astype(np.uint16), "v": k.astype(np.uint16)})
    assert store.n_blocks(0, 0) == 0


# ---- arena growth without copies; first touch ahead ------------------------------------------------

def test_growth_is_a_view_of_the_reservation_and_keeps_contents(rng):
    store = KVStore(cfg(n_layers=1, initial_blocks_per_layer=1, context_page_tokens=8))
    store.add_sequence(0)
    arena = store.layers[0]
    first_view = arena.arrays["k"]
    written = []
    for n in (1, 3, 2, 9, 17):  # capacity 1 -> 2 -> 4 -> 8 -> 16 -> 32 -> 64
        k = rng.standard_normal((n, 4, 2, 16)).astype(np.float32)
        store.append_blocks(0, 0, k, -k, np.ones((n, 4, 2)), np.zeros((n, 4), np.int64))
        written.append(to_storage(k, "bf16"))
    assert arena.capacity >= 32 and arena.slots.copies == 0
    assert np.shares_memory(first_view, arena.arrays["k"])  # no copy: the same memory, longer view
    got = store.read_blocks(0, 0)
    np.testing.assert_array_equal(got["k"], np.concatenate(written))
    # the context cache's arena grows the same way
    ctx = store.context.layers[0]
    with store.lock:
        rows = np.arange(32 * 4)
        store.context.append_locked(0, 0, rows % 2, np.full((rows.size, 16), 7, np.uint16),
                                    np.full((rows.size, 16), 9, np.uint16), np.ones(rows.size, np.float32),
                                    rows, rows)
    assert ctx.capacity >= 16 and ctx.slots.copies == 0 and store.context.kept_counts(0, 0).tolist() == [64, 64]
    assert np.all(store.context.kept(0, 0, 1)["v"] == 9)
    for head in (0, 1):  # rows of interleaved heads: each head's rows in their order
        np.testing.assert_array_equal(store.context.kept(0, 0, head)["positions"], rows[head::2])


def test_growth_past_the_reservation_copies_and_says_so(rng, caplog):
    from host.memory import SlotArrays

    arrays = SlotArrays({"x": np.empty((1, 3), np.float32)}, 2, "test arena", reserve_bytes=0)
    assert arrays.max_slots == 2
    arrays.arrays["x"][:] = [[1, 2, 3], [4, 5, 6]]
    with caplog.at_level("WARNING", logger="host.kv_store"):
        arrays.grow(5)
    assert arrays.copies == 1 and arrays.capacity == 5
    assert "copies the arena" in caplog.text and "test arena" in caplog.text
    np.testing.assert_array_equal(arrays.arrays["x"][:2], [[1, 2, 3], [4, 5, 6]])
    np.testing.assert_array_equal(arrays.arrays["x"][2:], 0)


def test_reserve_blocks_touches_the_slots_the_next_appends_take(rng):
    store = KVStore(cfg(n_layers=1, initial_blocks_per_layer=64))
    store.add_sequence(0)
    slots = store.layers[0].slots
    assert slots.touched == 0
    store.reserve_blocks(0, 10)
    assert slots.touched == 10 and store.layers[0].capacity == 64
    k = rng.standard_normal((5, 4, 2, 16)).astype(np.float32)
    store.append_blocks(0, 0, k, k, np.ones((5, 4, 2)), np.zeros((5, 4), np.int64))
    store.reserve_blocks(0, 10)
    assert slots.touched == 15
    store.reserve_blocks(0, 100)  # grows, then touches what the next 100 blocks will take
    assert store.layers[0].capacity >= 105 and slots.touched == 105
    np.testing.assert_array_equal(store.read_blocks(0, 0)["k"], to_storage(k, "bf16"))  # contents kept
    with pytest.raises(ValueError, match="n_blocks=-1"):
        store.reserve_blocks(0, -1)
