"""HCache restore length buckets: every history length of a bucket reuses one compilation of the
projection / KV split / recompute programs, and the bucketed restore gives the real tokens exactly
(bit for bit) the KV of the unbucketed path, with no padded row written into the cache."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jhybrid.hcache import CollectingSink, FullCacheWriter, HostMemorySource, LayerKernels, restore_kv
from jhybrid.hcache import restorer
from jhybrid.hcache.restorer import bucket_length
from jhybrid.models import ModelConfig, create_model

CONFIG = ModelConfig(family="llama", vocab_size=97, d_model=64, num_layers=3, num_heads=4,
                     num_kv_heads=2, head_dim=16, mlp_dim=96, max_position_embeddings=512,
                     qkv_bias=True)
TOTAL = 120
BUCKET = 64  # 77 and 100 tokens share the 128-token bucket
PLAN = ("recompute", "hidden", "kv")
MAX_LEN = 160


@pytest.fixture(scope="module")
def prefilled():
    model = create_model(CONFIG, seed=3)
    tokens = np.random.default_rng(1).integers(0, CONFIG.vocab_size, TOTAL).astype(np.int32)
    positions = jnp.arange(TOTAL, dtype=jnp.int32)[None]
    _, cache, hidden = model(jnp.asarray(tokens)[None], positions, model.init_cache(1, 128),
                             return_hidden_states=True)
    kv = np.stack([np.stack([np.asarray(c["k"][0, :TOTAL]), np.asarray(c["v"][0, :TOTAL])], axis=1)
                   .reshape(TOTAL, -1) for c in cache.layers])
    return model, tokens, list(np.asarray(hidden[:, 0])), list(kv)


class QuerySink(CollectingSink):
    num_queries = 5

    def __init__(self, num_layers, accepts_padded):
        super().__init__(num_layers)
        self.accepts_padded = accepts_padded
        self.q = {}

    def queries(self, layer, q):
        self.q[layer] = np.asarray(q)


def _restore(kernels, prefilled, n, sink):
    model, tokens, hidden, kv = prefilled
    restore_kv(kernels, PLAN, tokens[:n], HostMemorySource(hidden, kv, n), sink, recompute_chunk=32)
    return sink


COMPILED = ("_project", "_split_kv", "_run_layer", "_embed", "_write_prefix")


def _compiled():
    return {name: getattr(restorer, name)._cache_size() for name in COMPILED}


def test_bucket_policy():
    assert [bucket_length(n) for n in (1, 255, 256, 257, 1000, 1024, 1025, 2048)] == \
        [256, 256, 256, 512, 1024, 1024, 1280, 2048]
    assert [bucket_length(n) for n in (2049, 3000, 4096, 4097, 100_000)] == \
        [2560, 3072, 4096, 5120, 114_688]
    for n in range(1, 20_000, 7):
        nb = bucket_length(n)
        assert n <= nb < n + max(256, n / 4 + 1)
    assert bucket_length(1000, None) == bucket_length(1000, 1) == 1000


def test_two_lengths_of_one_bucket_compile_once(prefilled):
    model = prefilled[0]
    kernels = LayerKernels(model, bucket=BUCKET)
    for name in COMPILED:  # whatever an earlier test of this process compiled (pytest-xdist runs files
        getattr(restorer, name).clear_cache()  # in any order) does not count here
    assert kernels.padded_length(77) == kernels.padded_length(100) == 128
    first = _restore(kernels, prefilled, 77, FullCacheWriter(model, MAX_LEN, 77)).cache()
    compiled = _compiled()
    second = _restore(kernels, prefilled, 100, FullCacheWriter(model, MAX_LEN, 100)).cache()
    assert _compiled() == compiled, "a second length of the same bucket compiled again"
    # ... and a length of another bucket does compile (the counter sees compilations)
    _restore(kernels, prefilled, 20, FullCacheWriter(model, MAX_LEN, 20))
    after = _compiled()
    assert after["_project"] > compiled["_project"] and after["_split_kv"] > compiled["_split_kv"]
    for cache, n in ((first, 77), (second, 100)):
        assert int(cache.lengths[0]) == n
        for layer in cache.layers:  # no padded row was written: slots n.. are still empty
            assert not np.any(np.asarray(layer["k"][:, n:])) and not np.any(np.asarray(layer["v"][:, n:]))


def _assert_same(a, b, exact, msg):
    if exact:
        np.testing.assert_array_equal(a, b, err_msg=msg)
    else:
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6, err_msg=msg)


# 77 is no multiple of the bucket: bit for bit. 13: under 64 rows XLA's CPU backend runs the
# unbucketed [13, d] x [d, r] projection through another dot kernel than the [128, d] one (a
# different summation order, ~1 ulp apart): the padding changes no row's math, the backend's
# choice of matmul kernel for the smaller shape does. Checked to float tolerance there.
def test_source_sent_padding_compiles_nothing_for_a_new_length(prefilled):
    """HostMemorySource(pad_to=nb) sends the bucket's rows: a second length of the bucket runs no
    new program at all (not even the device pad), and rows after n (here NaN) change nothing."""
    model, tokens, hidden, kv = prefilled
    kernels = LayerKernels(model, bucket=BUCKET)

    def run(n):
        sink = FullCacheWriter(model, MAX_LEN, n)
        restore_kv(kernels, PLAN, tokens[:n], HostMemorySource(
            [np.where(np.arange(TOTAL)[:, None] < n, h, np.nan).astype(h.dtype) for h in hidden],
            [np.where(np.arange(TOTAL)[:, None] < n, x, np.nan).astype(x.dtype) for x in kv], n,
            pad_to=kernels.padded_length(n)), sink, recompute_chunk=32)
        return sink.cache()

    run(77)
    compiled = {**_compiled(), "_pad_rows": restorer._pad_rows._cache_size()}
    cache = run(100)
    assert {**_compiled(), "_pad_rows": restorer._pad_rows._cache_size()} == compiled
    reference = _restore(LayerKernels(model, bucket=None), prefilled, 100,
                         FullCacheWriter(model, MAX_LEN, 100)).cache()
    for layer, ref in zip(cache.layers, reference.layers):
        for name in ("k", "v"):
            got = np.asarray(layer[name])
            assert np.isfinite(got).all()
            np.testing.assert_array_equal(got, np.asarray(ref[name]))


@pytest.mark.parametrize("n,exact", [(77, True), (13, False)])
def test_bucketed_restore_is_bit_identical_to_unbucketed(prefilled, n, exact):
    model = prefilled[0]
    reference = _restore(LayerKernels(model, bucket=None), prefilled, n,
                         QuerySink(CONFIG.num_layers, accepts_padded=False))
    assert reference.layers[0][0].shape[1] == n
    for padded in (False, True):
        got = _restore(LayerKernels(model, bucket=BUCKET), prefilled, n,
                       QuerySink(CONFIG.num_layers, accepts_padded=padded))
        for layer, ((k, v), (rk, rv)) in enumerate(zip(got.layers, reference.layers)):
            assert k.shape[1] == (n if not padded else k.shape[1]) and k.shape[1] >= n
            _assert_same(np.asarray(k)[:, :n], np.asarray(rk), exact, f"k {layer}")
            _assert_same(np.asarray(v)[:, :n], np.asarray(rv), exact, f"v {layer}")
        assert got.q.keys() == reference.q.keys() == {1}
        _assert_same(got.q[1], reference.q[1], exact, "q")
    # the full-cache writer: same cache as the unbucketed restore, slots n.. untouched
    ref_cache = _restore(LayerKernels(model, bucket=None), prefilled, n,
                         FullCacheWriter(model, MAX_LEN, n)).cache()
    cache = _restore(LayerKernels(model, bucket=BUCKET), prefilled, n,
                     FullCacheWriter(model, MAX_LEN, n)).cache()
    for layer, ref in zip(cache.layers, ref_cache.layers):
        for name in ("k", "v"):
            _assert_same(np.asarray(layer[name]), np.asarray(ref[name]), exact, name)
            assert not np.any(np.asarray(layer[name][:, n:]))


def test_lengths_of_one_bucket_agree_bit_for_bit(prefilled):
    """One program per bucket: the first 77 tokens restored as a 77- or a 100-token history are
    the same bits (padding and the later real tokens do not touch earlier rows)."""
    kernels = LayerKernels(prefilled[0], bucket=BUCKET)
    short = _restore(kernels, prefilled, 77, CollectingSink(CONFIG.num_layers))
    long = _restore(kernels, prefilled, 100, CollectingSink(CONFIG.num_layers))
    for (k, v), (lk, lv) in zip(short.layers, long.layers):
        np.testing.assert_array_equal(np.asarray(k), np.asarray(lk)[:, :77])
        np.testing.assert_array_equal(np.asarray(v), np.asarray(lv)[:, :77])


def test_engine_restores_of_two_lengths_compile_once(prefilled, tmp_path):
    """HCacheEngine restores (SessionFileSource, pad_to the bucket) of a 70- and a 95-token
    history (one 256-token bucket): the second restore compiles no restore program."""
    from jhybrid.hcache import HCacheEngine

    model, tokens = prefilled[0], prefilled[1]
    engine = HCacheEngine(model, str(tmp_path), max_len=256, prefill_chunk=32, chunk_tokens=16,
                          prefix_reuse=False, plan=PLAN)
    saved = []
    for n in (64, 89):
        session = engine.new_session()
        session.generate(list(tokens[:n]), 6)
        saved.append((session.save(), len(session.tokens)))
        session.close()
    assert engine.kernels.padded_length(saved[0][1]) == engine.kernels.padded_length(saved[1][1])
    engine.restore(saved[0][0]).close()
    compiled = {**_compiled(), "_pad_rows": restorer._pad_rows._cache_size()}
    restored = engine.restore(saved[1][0])
    assert {**_compiled(), "_pad_rows": restorer._pad_rows._cache_size()} == compiled
    n = saved[1][1]
    assert int(restored.cache.lengths[0]) == n
    for layer in restored.cache.layers:
        assert not np.any(np.asarray(layer["k"][:, n:])) and not np.any(np.asarray(layer["v"][:, n:]))
    restored.close()
