"""HCache restore pipelines: "upfront" and the one-program "in_jit" / "in_jit_lhs" variants restore
bit for bit the K, V (and hgca queries) of the default "reader" pipeline, for MHA and GQA, ragged
and bucket-padded lengths, padded and unpadded sinks; their fallbacks are logged, never silent; and
the in_jit program, lowered for a GPU, moves every host row array to the device inside itself."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from jhybrid.hcache import CollectingSink, FullCacheWriter, HostMemorySource, LayerKernels, restore_kv
from jhybrid.hcache import restorer
from jhybrid.models import ModelConfig, create_model

BASE = dict(family="llama", vocab_size=97, d_model=64, num_layers=3, num_heads=4, head_dim=16,
            mlp_dim=96, max_position_embeddings=512, qkv_bias=True)
CONFIGS = {"mha": ModelConfig(num_kv_heads=4, **BASE), "gqa": ModelConfig(num_kv_heads=2, **BASE)}
TOTAL = 300
BUCKET = 64
MAX_LEN = 384
PLANS = [("hidden",) * 3, ("kv",) * 3, ("recompute", "hidden", "kv")]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def prefilled(request):
    config = CONFIGS[request.param]
    model = create_model(config, seed=4)
    tokens = np.random.default_rng(2).integers(0, config.vocab_size, TOTAL).astype(np.int32)
    _, cache, hidden = model(jnp.asarray(tokens)[None], jnp.arange(TOTAL, dtype=jnp.int32)[None],
                             model.init_cache(1, MAX_LEN), return_hidden_states=True)
    kv = [np.stack([np.asarray(c["k"][0, :TOTAL]), np.asarray(c["v"][0, :TOTAL])], axis=1)
          .reshape(TOTAL, -1) for c in cache.layers]
    return model, tokens, list(np.asarray(hidden[:, 0])), kv


class QuerySink(CollectingSink):
    num_queries = 5

    def __init__(self, num_layers, accepts_padded):
        super().__init__(num_layers)
        self.accepts_padded = accepts_padded
        self.q = {}

    def queries(self, layer, q):
        self.q[layer] = np.asarray(q)


def _pinned(arrays):
    sharding = SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    return [jax.device_put(a, sharding) for a in arrays]


def _source(prefilled, n, pinned, pad_to=None):
    """HostMemorySource over rows of exactly n (or pad_to, zero rows after n) tokens: NumPy or
    pinned_host arrays."""
    _, _, hidden, kv = prefilled
    send = pad_to or n
    rows = {}
    for name, arrays in (("hidden", hidden), ("kv", kv)):
        cut = []
        for a in arrays:  # zero rows after n, as the reader pipeline's device padding
            buf = np.zeros((send, a.shape[1]), a.dtype)
            buf[:n] = a[:n]
            cut.append(buf)
        rows[name] = _pinned(cut) if pinned else cut
    return HostMemorySource(rows["hidden"], rows["kv"], n, pad_to=pad_to)


def _run(kernels, prefilled, n, methods, sink, source, pipeline):
    used = restore_kv(kernels, methods, prefilled[1][:n], source, sink, recompute_chunk=32,
                      pipeline=pipeline)
    return sink, used


def _same(got, want, what):
    for layer, (a, b) in enumerate(zip(got.layers, want.layers)):
        assert a[0].shape == b[0].shape, f"{what}: layer {layer} shapes"
        np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]), err_msg=f"{what} k {layer}")
        np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]), err_msg=f"{what} v {layer}")


@pytest.mark.parametrize("n", [1, 63, 64, 300])
def test_pipelines_restore_the_reader_pipeline_kv_bit_for_bit(prefilled, n):
    model = prefilled[0]
    L = model.config.num_layers
    kernels = LayerKernels(model, bucket=BUCKET)
    nb = kernels.padded_length(n)
    for methods in PLANS:
        for padded in (False, True):
            want, used = _run(kernels, prefilled, n, methods, QuerySink(L, padded),
                              _source(prefilled, n, pinned=False), "reader")
            assert used == "reader"
            cases = [("upfront", False, None), ("in_jit", False, None), ("in_jit", True, None),
                     ("in_jit_lhs", True, None), ("in_jit", True, nb), ("in_jit", False, nb)]
            for pipeline, pinned, pad_to in cases:
                what = f"{methods} padded={padded} {pipeline} pinned={pinned} pad_to={pad_to}"
                got, used = _run(kernels, prefilled, n, methods, QuerySink(L, padded),
                                 _source(prefilled, n, pinned, pad_to), pipeline)
                expect = pipeline if pinned or pipeline == "upfront" else f"{pipeline}:dispatch_copies"
                assert used == expect, what
                _same(got, want, what)
                assert got.q.keys() == want.q.keys(), what
                for layer in want.q:
                    np.testing.assert_array_equal(got.q[layer], want.q[layer], err_msg=what)
    # the full-cache writer (a padded sink writing rows [0, n) only)
    plan = ("recompute", "hidden", "kv")
    ref = _run(kernels, prefilled, n, plan, FullCacheWriter(model, MAX_LEN, n),
               _source(prefilled, n, pinned=False), "reader")[0].cache()
    got = _run(kernels, prefilled, n, plan, FullCacheWriter(model, MAX_LEN, n),
               _source(prefilled, n, pinned=True, pad_to=nb), "in_jit")[0].cache()
    for layer, want in zip(got.layers, ref.layers):
        for name in ("k", "v"):
            np.testing.assert_array_equal(np.asarray(layer[name]), np.asarray(want[name]))
            assert not np.any(np.asarray(layer[name][:, n:]))


def test_in_jit_matches_the_prefill(prefilled):
    model, _, _, kv = prefilled
    n = 77
    sink, used = _run(LayerKernels(model), prefilled, n, ("hidden", "kv", "hidden"),
                      CollectingSink(model.config.num_layers), _source(prefilled, n, True), "in_jit")
    assert used == "in_jit"
    for layer, (k, v) in enumerate(sink.layers):
        want = kv[layer][:n].reshape(n, 2, model.config.num_kv_heads, model.config.head_dim)
        np.testing.assert_allclose(np.asarray(k[0]), want[:, 0], atol=2e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(v[0]), want[:, 1], atol=2e-5, rtol=1e-5)


def test_in_jit_pieces_and_one_compilation_per_bucket(prefilled):
    """Rows given as pieces are joined in the program; with pad_to sources two lengths of one
    bucket run the same compiled in_jit program."""
    model = prefilled[0]
    L = model.config.num_layers
    kernels = LayerKernels(model, bucket=BUCKET)
    n = 100
    source = _source(prefilled, n, pinned=True)

    class Pieces:
        def host_rows(self, layer, method):
            rows = source.host_rows(layer, method)
            return (rows[:40], rows[40:])

        def __call__(self, layer, method):
            return source(layer, method)

    want = _run(kernels, prefilled, n, PLANS[2], CollectingSink(L), source, "reader")[0]
    got, used = _run(kernels, prefilled, n, PLANS[2], CollectingSink(L), Pieces(), "in_jit")
    assert used == "in_jit"
    _same(got, want, "pieces")
    program = restorer._RESTORE_PROGRAMS["in_jit"]
    nb = kernels.padded_length(77)
    assert nb == kernels.padded_length(100)
    _run(kernels, prefilled, 77, PLANS[0], CollectingSink(L), _source(prefilled, 77, True, nb), "in_jit")
    compiled = program._cache_size()
    _run(kernels, prefilled, 100, PLANS[0], CollectingSink(L), _source(prefilled, 100, True, nb), "in_jit")
    assert program._cache_size() == compiled


def test_in_jit_falls_back_to_the_reader_loudly(prefilled, caplog):
    model = prefilled[0]
    L = model.config.num_layers
    kernels = LayerKernels(model, bucket=BUCKET)
    source = _source(prefilled, 50, pinned=True)
    restorer._logged.clear()
    with caplog.at_level(logging.WARNING, logger="jhybrid.hcache"):
        got, used = _run(kernels, prefilled, 50, PLANS[2], CollectingSink(L),
                         lambda layer, method: source(layer, method), "in_jit")
    assert used == "reader"
    assert any("has no host_rows" in r.getMessage() for r in caplog.records)
    want = _run(kernels, prefilled, 50, PLANS[2], CollectingSink(L), source, "reader")[0]
    _same(got, want, "fallback")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jhybrid.hcache"):
        used = _run(kernels, prefilled, 50, PLANS[0], CollectingSink(L),
                    _source(prefilled, 50, pinned=False), "in_jit")[1]
    assert used == "in_jit:dispatch_copies"
    assert any("not jax arrays in host memory" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="unknown restore pipeline"):
        _run(kernels, prefilled, 50, PLANS[0], CollectingSink(L), source, "bogus")


def test_in_jit_program_moves_host_rows_inside_itself_on_gpu(prefilled):
    """Lowered for CUDA (no GPU needed), the program carries one host->device placement
    annotation per host row array (XLA's async copy-start/copy-done), and none on CPU."""
    model = prefilled[0]
    kernels = LayerKernels(model, bucket=BUCKET)
    n, methods = 64, ("hidden", "hidden", "kv")
    source = _source(prefilled, n, pinned=True)
    rows = tuple(source.host_rows(l, m) for l, m in enumerate(methods))
    args = (kernels.config, tuple(kernels.graphdef_of[l] if m == "hidden" else None
                                  for l, m in enumerate(methods)),
            methods, 0, tuple(kernels.states[l] if m == "hidden" else None
                              for l, m in enumerate(methods)),
            rows, kernels.positions(n), None)
    traced = restorer._RESTORE_PROGRAMS["in_jit"].trace(*args)
    gpu = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert gpu.count("annotate_device_placement") == len(rows)
    assert gpu.count('mhlo.memory_kind = "pinned_host"') == len(rows)
    assert "annotate_device_placement" not in traced.lower().as_text()


def test_host_memory_source_slices_only_when_it_must(prefilled):
    hidden = _pinned(prefilled[2])
    source = HostMemorySource(hidden, None, TOTAL)
    assert source.host_rows(0, "hidden") is hidden[0]  # no slice program
    assert HostMemorySource(hidden, None, TOTAL, pad_to=TOTAL).host_rows(1, "hidden") is hidden[1]
    short = HostMemorySource(hidden, None, 10).host_rows(0, "hidden")
    assert short.shape[0] == 10
    np.testing.assert_array_equal(np.asarray(short), prefilled[2][0][:10])


@pytest.mark.parametrize("n", [1, 63])
def test_unbucketed_in_jit_is_bit_identical_too(prefilled, n):
    """Exact shapes (bucket=None): the in_jit program's [n, d] projections are the same bits as
    the reader's per-layer programs (same dot kernels for the same shapes)."""
    model = prefilled[0]
    L = model.config.num_layers
    kernels = LayerKernels(model, bucket=None)
    want = _run(kernels, prefilled, n, PLANS[2], QuerySink(L, False),
                _source(prefilled, n, pinned=True), "reader")[0]
    got, used = _run(kernels, prefilled, n, PLANS[2], QuerySink(L, False),
                     _source(prefilled, n, pinned=True), "in_jit")
    assert used == "in_jit"
    _same(got, want, "unbucketed")
    np.testing.assert_array_equal(got.q[1], want.q[1])
