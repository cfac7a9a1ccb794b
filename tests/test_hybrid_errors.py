"""Hybrid attention: bad input is a clear ValueError before anything compiles; a host exception
inside a callback surfaces as a Python error carrying the host traceback, never a hang; the host
bridge on its own."""

from __future__ import annotations

import time

import numpy as np
import pytest

from host import HostExecutor, KVStore, StoreConfig
from host.bridge import HostBridge
from host.targets import ALL_OFFLOADED, CHOSEN_BLOCKS
from host.reference import reference_attention, stored_tokens
from jhybrid.generation import Generator, make_step
from jhybrid.hybrid import OffloadConfig, make_backend
from jhybrid.models import ModelConfig, create_model
from tests.hybrid_support import TINY as CONFIG, WINDOW as SMALL


@pytest.fixture(scope="module")
def model():
    return create_model(CONFIG, seed=0)


@pytest.mark.parametrize("options, message", [
    (dict(mode="warp"), r"mode='warp' \(expected one of full, recall, hgca"),
    (dict(window_tokens=20, sink=8, block_size=16), "too small for one block"),
    (dict(window_tokens=40, sink=40, block_size=16), "too small for one block"),
    (dict(window_tokens=41, sink=8, block_size=16), "not a multiple of block_size"),
    (dict(window_tokens=64, gpu_ratio=0.25), "are exclusive"),
    (dict(alpha=0.0), "alpha"),
    (dict(beta=0.0), "beta"),
    (dict(budget=0), r"budget=0 \(expected 'auto', None \(every block\) or a positive int \(tokens\)\)"),
    (dict(window_tokens=64, gpu_ratio=0.25), "are exclusive"),
    (dict(gpu_ratio=1.5), r"gpu_ratio=1.5 \(expected a fraction"),
    (dict(host_overlap="async"), r"host_overlap='async' \(expected true or false\)"),
    (dict(keep_after=-1), r"keep_after=-1 \(expected an int >= 0\)"),
    (dict(keep_after=2.5), r"keep_after=2.5 \(expected an int >= 0\)"),
    (dict(mode="scout", scout_exact_layers="all"), r"scout_exact_layers='all' \(expected 'auto', a tuple"),
    (dict(mode="scout", recall_layers_per_step=0), r"recall_layers_per_step=0 \(expected None \(every layer due\)"),
    (dict(mode="scout", recall_after_dispatch="yes"), r"recall_after_dispatch='yes' \(expected true or false\)"),
    (dict(mode="scout", recall_after_dispatch=True, recall_lag_steps=2), r"recall_after_dispatch=True \(with recall_lag_steps=2"),
    (dict(mode="scout", scout_min_cos=1.5), r"scout_min_cos=1.5 \(expected a cosine in \[-1, 1\]"),
    (dict(mode="scout", scout_exact_layers=True), r"scout_exact_layers=True \(expected"),
    (dict(mode="scout", scout_exact_layers=-2), r"scout_exact_layers=-2 \(expected an int N >= 0"),
    (dict(mode="scout", scout_exact_layers=(1, "2")), r"'2' not a layer index"),
    (dict(mode="scout", scout_exact_layers=[3, 3]), r"scout_exact_layers=\(3, 3\) \(names a layer twice\)"),
    (dict(mode="scout", predict_query=False, scout_exact_layers=(1,)), "already uses its exact query"),
])
def test_bad_config(options, message):
    with pytest.raises(ValueError, match=message):
        OffloadConfig(**options)


def test_scout_exact_layers_forms():
    from jhybrid.hybrid.modes.scout import Scout

    def scout(**kw):
        return Scout(OffloadConfig(mode="scout", **kw))

    assert scout(scout_exact_layers=[2, 1]).exact_layers() == {0, 1, 2}
    assert OffloadConfig(mode="scout", scout_exact_layers=[2, 1]).scout_exact_layers == (2, 1)  # hashable
    assert scout(scout_exact_layers=3).exact_layers() == {0, 1, 2}
    assert scout().exact_layers() == {0}
    assert scout(scout_exact_layers=0).exact_layers() == {0}
    assert [scout(scout_exact_layers=(2,)).selects_exactly(i) for i in range(4)] == [True, False, True, False]


def test_gpu_ratio_resolves_in_one_place():
    cfg = OffloadConfig(mode="hgca", gpu_ratio=0.25, sink=16, block_size=16)
    assert cfg.resolved(1000).window_tokens == 16 + (250 - 16) // 16 * 16
    assert OffloadConfig(mode="hgca").resolved().window_tokens == 1024  # neither set: the default
    with pytest.raises(ValueError, match="gpu_ratio=0.25 needs the context length"):
        cfg.resolved()
    assert OffloadConfig(mode="topk", budget=33, block_size=16).topk_blocks == 3
    assert OffloadConfig(mode="scout", beta=0.5).ignored_settings() == ["beta"]
    assert OffloadConfig(mode="hgca", beta=0.5).ignored_settings() == []
    assert OffloadConfig(mode="full", window_tokens=64).ignored_settings() == ["window_tokens"]


@pytest.mark.parametrize("value, message", [
    ("all", r"expected .auto., a tuple of layer indices or an int N"),
    (-1, r"expected an int N >= 0"),
    ([1, "x"], r"not a layer index"),
    ([1, -1], r"not a layer index"),
])
def test_bad_scout_exact_layers_in_run_config(value, message):
    from jhybrid.config.loading import config_from_dict
    from jhybrid.config.schema import ConfigError

    doc = {"name": "x", "offload": {"mode": "scout", "scout_exact_layers": value}}
    with pytest.raises(ConfigError, match=rf"'offload.scout_exact_layers' = .*{message}"):
        config_from_dict(doc)
    ok = config_from_dict({"name": "x", "offload": {"mode": "scout", "scout_exact_layers": [1, 2]}})
    assert ok.offload.scout_exact_layers == (1, 2)


def test_unknown_mode_through_make_backend():
    with pytest.raises(ValueError, match=r"mode='warp' \(expected one of full, recall"):
        make_backend("warp")
    assert make_backend("scout").name == "scout" and make_backend("full").name == "full"


def test_budget_larger_than_context(model):
    backend = make_backend(**{**SMALL, "mode": "topk", "budget": 64 * 16})
    with pytest.raises(ValueError, match="larger than the context"):
        backend.open(model.config, 2, 128)


def test_host_cap_too_small(model):
    backend = make_backend("hgca", host_memory_cap_bytes=10_000, **SMALL)
    with pytest.raises(ValueError, match="cannot hold"):
        backend.open(model.config, 2, 128)
    generator = Generator(model, backend)
    with pytest.raises(ValueError, match="cannot hold"):
        generator.generate([[1, 2, 3]], max_new_tokens=4)
    assert generator.compile_seconds == 0.0  # nothing was compiled


def test_unsupported_head_dim():
    tiny = ModelConfig(family="llama", vocab_size=31, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2,
                       head_dim=8, mlp_dim=32, max_position_embeddings=64)
    with pytest.raises(ValueError, match="head_dim"):
        make_backend("hgca", **SMALL).open(tiny, 1, 32)


def test_prefill_chunk_larger_than_ring(model):
    backend = make_backend("hgca", **SMALL).open(model.config, 1, 128)
    cache = model.init_cache(1, 128, backend)
    positions = np.arange(32, dtype=np.int32)[None]
    with pytest.raises(ValueError, match="prefill chunk"):
        backend.before_step(cache, positions)
    # The Generator bounds its chunk by the backend's ring instead.
    assert Generator(model, backend, prefill_chunk=256).prefill_chunk == backend.max_prefill_chunk


def test_host_exception_in_callback_surfaces(model, monkeypatch):
    backend = make_backend("hgca", **SMALL)
    step, params = make_step(model, backend)
    backend.open(model.config, 1, 128)
    cache = model.init_cache(1, 128, backend)

    def broken(*args, **kwargs):
        raise ZeroDivisionError("host attention exploded")

    for start in (0, 16):  # inside the 40-token window: these chunks attend to no host part
        cache = backend.before_step(cache, np.arange(start, start + 16, dtype=np.int32)[None])
        _, cache = step(params, np.zeros((1, 16), np.int32), np.arange(start, start + 16, dtype=np.int32)[None], cache)
    monkeypatch.setattr(backend.runtime.bridge, "_timed_attention", broken)
    positions = np.arange(32, 48, dtype=np.int32)[None]  # past the 40-token window: offloaded tokens
    cache = backend.before_step(cache, positions)
    with pytest.raises(Exception, match="host attention exploded") as info:  # not a hang: the collect
        logits, cache = step(params, np.zeros((1, 16), np.int32), positions, cache)  # waits at most
        np.asarray(logits)                                                          # collect_timeout
    text = str(info.value) + "".join(getattr(info.value, "__notes__", []))
    assert "host attention exploded" in text
    # The original exception (with the worker's traceback note) is re-raised before the next step.
    with pytest.raises(ZeroDivisionError) as original:
        backend.before_step(cache, positions + 16)
    assert any("host worker thread" in n for n in getattr(original.value, "__notes__", []))


def test_bridge_submit_collect_matches_reference(rng):
    bs, hkv, d, n_blocks = 16, 2, 64, 3
    store = KVStore(StoreConfig(n_layers=1, n_kv_heads=hkv, head_dim=d, block_size=bs, kv_dtype="fp32"))
    store.add_sequence(0)
    k = rng.standard_normal((n_blocks, bs, hkv, d)).astype(np.float32)
    v = rng.standard_normal((n_blocks, bs, hkv, d)).astype(np.float32)
    store.append_blocks(0, 0, k, v, np.ones((n_blocks, bs, hkv), np.float32),
                        np.arange(n_blocks * bs).reshape(n_blocks, bs))
    with HostExecutor(store, n_threads=1) as executor:
        bridge = HostBridge(store, executor, [0], scale=d ** -0.5)
        q = rng.standard_normal((1, 1, 4, d)).astype(np.float32)
        o, lse = bridge.collect(bridge.submit(0, q, ALL_OFFLOADED))
        ids = np.array([[[2, -1], [0, 1]]])
        o_b, lse_b = bridge.cb_collect(bridge.cb_submit(0, CHOSEN_BLOCKS, q, ids))
        with pytest.raises(RuntimeError, match="unknown ticket"):
            bridge.collect(12345)
        counters = bridge.counters()
    keys, values = stored_tokens(store, 0, 0)
    o_ref, lse_ref = reference_attention(q, [keys], [values], hkv, d ** -0.5)
    np.testing.assert_allclose(o, o_ref, atol=1e-5)
    np.testing.assert_allclose(lse, lse_ref, atol=1e-5)
    assert np.isfinite(o_b).all() and counters["n_tasks"] == 2 and counters["n_callbacks"] == 2
    assert counters["cpu_tokens"] == 3 * bs


def test_bridge_rows_attend_only_the_chosen_rows(rng):
    """submit(rows=...): the rows left out (a prefill chunk's decoding rows) are not attended
    (o = 0, lse = -inf); the chosen ones get what a submit of the whole batch gives them."""
    bs, hkv, d = 16, 2, 64
    store = KVStore(StoreConfig(n_layers=1, n_kv_heads=hkv, head_dim=d, block_size=bs, kv_dtype="fp32"))
    for seq, n_blocks in ((0, 3), (1, 2), (2, 0)):
        store.add_sequence(seq)
        if n_blocks:
            k = rng.standard_normal((n_blocks, bs, hkv, d)).astype(np.float32)
            v = rng.standard_normal((n_blocks, bs, hkv, d)).astype(np.float32)
            store.append_blocks(0, seq, k, v, np.ones((n_blocks, bs, hkv), np.float32),
                                np.arange(n_blocks * bs).reshape(n_blocks, bs))
    q = rng.standard_normal((3, 5, 4, d)).astype(np.float32)
    with HostExecutor(store, n_threads=1) as executor:
        bridge = HostBridge(store, executor, [0, 1, 2], scale=d ** -0.5)
        o_all, lse_all = bridge.collect(bridge.submit(0, q, ALL_OFFLOADED))
        o, lse = bridge.cb_collect(bridge.cb_submit(0, ALL_OFFLOADED, q, None, np.array([False, True, True])))
        o_none, lse_none = bridge.collect(bridge.submit(0, q, ALL_OFFLOADED, rows=np.zeros(3, bool)))
        with pytest.raises(ValueError, match="rows of shape"):
            bridge.submit(0, q, ALL_OFFLOADED, rows=np.ones(2, bool))
    np.testing.assert_array_equal(o[0], 0.0)
    assert np.isneginf(lse[0]).all() and np.isneginf(lse[2]).all()
    np.testing.assert_allclose(o[1], o_all[1], atol=1e-6)
    np.testing.assert_allclose(lse[1], lse_all[1], atol=1e-6)
    np.testing.assert_array_equal(o_none, 0.0)
    assert np.isneginf(lse_none).all()


def test_cli_unknown_mode_is_reported(capsys):
    from jhybrid.cli import main

    with pytest.raises(SystemExit):  # argparse names the choices
        main(["generate", "--mode", "warp", "hello"])
    assert "invalid choice: 'warp'" in capsys.readouterr().err
    assert main(["generate", "--window-tokens", "64", "hello"]) == 2  # without a mode: not ignored
    assert "--window-tokens does not apply to --mode full" in capsys.readouterr().err


def test_cli_generate_in_a_hybrid_mode(capsys, short_smollm2_cli):
    """SmolLM2 cut to 2 layers (its tokenizer, chat format and shape otherwise): the 30 real layers
    only add compile time."""
    from jhybrid.cli import main

    assert main(["generate", "--mode", "scout", "--window-tokens", "48", "--sink", "16", "--max-tokens", "6",
                 "What is the capital of France?"]) == 0
    captured = capsys.readouterr()
    assert "decode" in captured.err and "tok/s" in captured.err
