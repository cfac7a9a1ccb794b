"""Executor: concurrent submissions equal serial results, failures surface in collect, abandoned
handles do not block, background sparsification beside attention."""

from __future__ import annotations

import threading

import numba
import numpy as np
import pytest

from host import (THREADING_LAYER, HostExecutor, KVStore, StoreConfig, attend_all, attend_blocks,
                  attend_context, sparsify_evicted)
from host.targets import ALL_OFFLOADED, CHOSEN_BLOCKS, KEPT_TOKENS


def filled_store(rng, n_seq=4, n_blocks=6, hkv=2, d=32, bs=8, layers=2):
    store = KVStore(StoreConfig(n_layers=layers, n_kv_heads=hkv, head_dim=d, block_size=bs,
                                initial_blocks_per_layer=4, context_page_tokens=16))
    for s in range(n_seq):
        store.add_sequence(s)
        for layer in range(layers):
            k = rng.standard_normal((n_blocks, bs, hkv, d)).astype(np.float32)
            v = rng.standard_normal((n_blocks, bs, hkv, d)).astype(np.float32)
            numbers = store.append_blocks(layer, s, k, v, rng.random((n_blocks, bs, hkv)) / 16,
                                          np.arange(n_blocks * bs).reshape(n_blocks, bs))
            sparsify_evicted(store, layer, [s], [numbers], beta=1.0, window_tokens=32)
    return store


def test_threading_layer_is_thread_safe():
    assert THREADING_LAYER in ("omp", "tbb")


def test_concurrent_submissions_equal_serial(rng):
    store = filled_store(rng)
    seqs = list(range(4))
    jobs = []
    for i in range(24):
        layer = i % 2
        q = rng.standard_normal((4, 2, 8, 32)).astype(np.float32)
        mode = (KEPT_TOKENS, ALL_OFFLOADED, CHOSEN_BLOCKS)[i % 3]
        ids = rng.integers(-1, 6, size=(4, 2, 3)) if mode is CHOSEN_BLOCKS else None
        if ids is not None:  # no duplicates within a head
            for b in range(4):
                for h in range(2):
                    row = ids[b, h]
                    row[1:][np.isin(row[1:], row[:1])] = -1
                    if row[2] == row[1]:
                        row[2] = -1
        jobs.append((layer, q, mode, ids))
    serial = []
    for layer, q, mode, ids in jobs:
        if mode is KEPT_TOKENS:
            serial.append(attend_context(store, layer, seqs, q))
        elif mode is ALL_OFFLOADED:
            serial.append(attend_all(store, layer, seqs, q))
        else:
            serial.append(attend_blocks(store, layer, seqs, q, ids))
    with HostExecutor(store, n_workers=3, n_threads=numba.get_num_threads()) as ex:
        handles = [ex.submit(layer, q, seqs, mode, block_ids=ids) for layer, q, mode, ids in jobs]
        # the calling thread keeps working meanwhile (stands in for JAX dispatch)
        busy = sum(np.sin(np.arange(10000)).sum() for _ in range(5))
        results = [ex.collect(h, timeout=120) for h in reversed(handles)][::-1]
    assert np.isfinite(busy)
    for (o, lse), (so, slse) in zip(results, serial):
        np.testing.assert_array_equal(o, so)
        np.testing.assert_array_equal(lse, slse)


def test_failing_task_raises_in_collect_with_traceback(rng):
    store = filled_store(rng, n_seq=1, layers=1)

    def boom(x):
        raise ZeroDivisionError(f"bad value {x}")

    with HostExecutor(store) as ex:
        h = ex.submit_task(boom, 3)
        with pytest.raises(ZeroDivisionError, match="bad value 3") as info:
            ex.collect(h)
        notes = "".join(getattr(info.value, "__notes__", []))
        assert "host worker thread" in notes and "in boom" in notes
        # bad input inside a worker stays a ValueError
        q = np.zeros((1, 1, 2, 32), np.float32)
        h = ex.submit(0, q, [0], CHOSEN_BLOCKS, block_ids=np.array([[[99], [0]]]))
        with pytest.raises(ValueError, match="block id 99"):
            ex.collect(h)
        # the worker survives failures, and the store is still consistent
        o, lse = ex.collect(ex.submit(0, q, [0], ALL_OFFLOADED))
        assert np.isfinite(o).all() and np.isfinite(lse).all()
        assert store._readers == 0
    with pytest.raises(ValueError, match="float32"):
        HostExecutor(store).submit(0, q.astype(np.float64), [0], KEPT_TOKENS)


def test_abandoned_handles_do_not_block(rng):
    store = filled_store(rng, n_seq=2, layers=1)
    gate = threading.Event()
    with HostExecutor(store, n_workers=1) as ex:
        ex.submit_task(gate.wait, 10)                       # occupies the only worker
        for _ in range(5):                                  # abandoned: never collected
            ex.submit(0, rng.standard_normal((2, 1, 2, 32)).astype(np.float32), [0, 1], KEPT_TOKENS)
        h = ex.submit(0, rng.standard_normal((2, 1, 2, 32)).astype(np.float32), [0, 1], ALL_OFFLOADED)
        with pytest.raises(TimeoutError):
            ex.collect(h, timeout=0.05)
        gate.set()
        o, _ = ex.collect(h, timeout=60)  # a bounded wait: a stuck worker is a TimeoutError
        assert o.shape == (2, 1, 2, 32)
    assert store._readers == 0


def test_background_sparsify_then_attention_in_order(rng):
    store = filled_store(rng, n_seq=1, layers=1, n_blocks=0)
    k = rng.standard_normal((3, 8, 2, 32)).astype(np.float32)
    numbers = store.append_blocks(0, 0, k, k, np.ones((3, 8, 2)), np.zeros((3, 8), np.int64))
    q = rng.standard_normal((1, 1, 4, 32)).astype(np.float32)
    with HostExecutor(store, n_workers=1) as ex:
        ex.submit_sparsify(0, [0], [numbers], 1.0, 32)
        o, lse = ex.collect(ex.submit(0, q, [0], KEPT_TOKENS))
        counts = ex.collect(ex.submit_reevaluate(0, [0], q, beta=1e-9))  # tiny beta keeps everything
    np.testing.assert_array_equal(counts, [[24, 24]])
    # everything was kept (MAW 1 > 1/32), so context attention == attention over all tokens
    ro, rl = attend_all(store, 0, [0], q)
    np.testing.assert_allclose(o, ro, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, rl, rtol=1e-6)


def test_bad_executor_config(rng):
    store = filled_store(rng, n_seq=1, layers=1, n_blocks=1)
    with pytest.raises(ValueError, match="n_workers=0"):
        HostExecutor(store, n_workers=0)
    with pytest.raises(ValueError, match="n_threads=100000"):
        HostExecutor(store, n_threads=100000)


def test_attention_while_other_sequences_grow_and_free(rng):
    """Arena growth and slot recycling on the caller's thread never disturb running kernels."""
    store = filled_store(rng, n_seq=2, layers=1, n_blocks=3)
    stable = [0, 1]
    queries = [rng.standard_normal((2, 1, 4, 32)).astype(np.float32) for _ in range(12)]
    expected = [(attend_context(store, 0, stable, q), attend_all(store, 0, stable, q)) for q in queries]
    # same thread count as the serial run: the work split (and so the rounding) depends on it
    with HostExecutor(store, n_workers=2, n_threads=numba.get_num_threads()) as ex:
        handles = []
        churn = 100
        for i, q in enumerate(queries):
            handles.append((ex.submit(0, q, stable, KEPT_TOKENS), ex.submit(0, q, stable, ALL_OFFLOADED)))
            for _ in range(4):  # grow, sparsify and free other sequences meanwhile
                store.add_sequence(churn)
                k = rng.standard_normal((5, 8, 2, 32)).astype(np.float32)
                numbers = store.append_blocks(0, churn, k, k, np.ones((5, 8, 2)), np.zeros((5, 8), np.int64))
                sparsify_evicted(store, 0, [churn], [numbers], 1.0, 16)
                if churn % 2:
                    store.free_sequence(churn)
                churn += 1
        for (ha, hb), (ea, eb) in zip(handles, expected):
            for got, want in ((ex.collect(ha, timeout=60), ea), (ex.collect(hb, timeout=60), eb)):
                np.testing.assert_array_equal(got[0], want[0])
                np.testing.assert_array_equal(got[1], want[1])
    assert store._readers == 0
    assert store.layers[0].pool.retired == [] and store.context.layers[0].pool.retired == []
