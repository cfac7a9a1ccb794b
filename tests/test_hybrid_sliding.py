"""Models with sliding-window layers (Gemma 3) in the offloading modes (CPU, tiny random model).

Sliding-window layers keep their last `sliding_window` tokens on the device and offload nothing;
only global layers get a GPU window and a host store. With a keep-everything policy every mode
must give `full`'s logits over decode steps that cross evictions, the host store must hold the
global layers only, and scout's layer-ahead selection must hand over from one global layer to the
next across the sliding layers between them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jhybrid.attention.full import masked_attention, store_kv
from jhybrid.hybrid import make_backend
from jhybrid.hybrid.sliding import LayerPlan, init_sliding, sliding_attention
from jhybrid.models import create_model
from tests.hybrid_support import GEMMA3_LIKE, KEEP_ALL, SCOUT_RECALLS, TOL, run_forced, two_turns

# 4 layers: sliding, global, sliding, global (scout's layer-ahead crosses a sliding layer). The
# window of 24 tokens is shorter than the offloading modes' GPU window of 40 and than the context.
B, PROMPT, STEPS = 2, 40, 64

CASES = {
    "recall": dict(mode="recall"),
    "hgca": dict(mode="hgca"),
    "topk": dict(mode="topk"),
    "scout-exact-query": dict(mode="scout", predict_query=False, **SCOUT_RECALLS),
}


@pytest.fixture(scope="module", autouse=True)
def float32_matmuls():
    """float32 matmuls (on a GPU the default is TF32: 2.5e-3 logit differences between any two
    formulations, above the keep-all tolerance; measured on the H100, BENCHMARKS.md)."""
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(scope="module")
def model():
    return create_model(GEMMA3_LIKE, seed=0)


@pytest.fixture(scope="module")
def tokens():
    rng = np.random.default_rng(4321)
    return rng.integers(0, 97, (B, PROMPT)).astype(np.int32), rng.integers(0, 97, (B, STEPS)).astype(np.int32)


@pytest.fixture(scope="module")
def reference(model, tokens):
    return run_forced(model, make_backend("full"), *tokens)[0]


@pytest.mark.parametrize("case", list(CASES))
def test_keep_all_equals_full_with_sliding_layers(model, tokens, reference, case):
    options = {**KEEP_ALL, **CASES[case]}
    logits, backend, cache, held = run_forced(model, make_backend(options.pop("mode"), **options), *tokens)
    np.testing.assert_allclose(logits, reference, atol=TOL, rtol=0)
    runtime = backend.runtime
    assert runtime.n_layers == 2  # the host side holds the two global layers only
    runtime.evictor.publish_all()
    for g in range(2):
        for b in range(B):
            assert runtime.store.n_tokens(g, b) == runtime.offloaded_blocks()[b] * backend.config.block_size > 0
    assert backend.counters()["n_evicted_blocks"] == 4 * B * 2
    for i in (0, 2):  # the sliding layers' rings hold exactly each sequence's last 24 positions
        positions = np.sort(np.asarray(cache.layers[i].positions), axis=1)
        np.testing.assert_array_equal(positions, np.broadcast_to(np.arange(held - 24, held), (B, 24)))


def test_scout_layer_ahead_crosses_sliding_layers(model, tokens, reference):
    """The predicted query of global layer 3 is made at global layer 1 (model layers 1 -> 3)."""
    backend = make_backend("scout", **SCOUT_RECALLS, **KEEP_ALL)
    assert backend.query_ahead(1, GEMMA3_LIKE) == 3
    assert [backend.query_ahead(i, GEMMA3_LIKE) for i in (0, 2, 3)] == [None, None, None]
    logits, backend, _, _ = run_forced(model, backend, *tokens)
    assert np.isfinite(logits).all()
    assert (logits.argmax(-1) == reference.argmax(-1)).mean() > 0.5


def test_every_layer_sliding_is_a_clear_error():
    config = GEMMA3_LIKE.replace(layer_types=None)
    with pytest.raises(ValueError, match="every layer of this model is a sliding-window layer"):
        make_backend("hgca", **KEEP_ALL).open(config, 1, 64)
    assert LayerPlan.of(GEMMA3_LIKE).global_layers == (1, 3)


@pytest.mark.parametrize("window,chunks", [(8, [5, 1, 1, 12, 1, 3]), (5, [16, 1, 1, 1]), (64, [7, 9, 1])])
def test_sliding_ring_equals_masked_cache(rng, window, chunks):
    """The ring (window slots) against a position-indexed cache with the same sliding mask, over
    ragged chunks longer and shorter than the window (padding included), GQA 4:2."""
    b, hq, hkv, d = 2, 4, 2, 16
    total = sum(chunks) + 4
    # jitted (one program per chunk length instead of one per primitive): the model's steps call
    # both inside its jitted step
    sliding = jax.jit(sliding_attention, static_argnums=(5, 6))
    reference = jax.jit(lambda q, k, v, p, n: masked_attention(q, k, v, p, n, 0.25, window))
    store = jax.jit(store_kv)
    state = init_sliding(b, window, hkv, d, jnp.float32)
    k_full = jnp.zeros((b, total, hkv, d))
    v_full = jnp.zeros((b, total, hkv, d))
    held = np.zeros(b, np.int64)
    for t in chunks:
        n_new = np.array([t, max(1, t - 2)])  # sequence 1 is shorter: padded (-1) slots at its end
        pos = np.full((b, t), -1, np.int32)
        for s in range(b):
            pos[s, :n_new[s]] = held[s] + np.arange(n_new[s])
        q = jnp.asarray(rng.standard_normal((b, t, hq, d)), jnp.float32)
        k = jnp.asarray(rng.standard_normal((b, t, hkv, d)), jnp.float32)
        v = jnp.asarray(rng.standard_normal((b, t, hkv, d)), jnp.float32)
        pos_j = jnp.asarray(pos)
        o, state = sliding(state, q, k, v, pos_j, window, 0.25)
        k_full, v_full = store(k_full, k, pos_j), store(v_full, v, pos_j)
        held += n_new
        expected, _ = reference(q, k_full, v_full, pos_j, jnp.asarray(held, jnp.int32))
        np.testing.assert_allclose(np.asarray(o), np.asarray(expected), atol=1e-5, rtol=0)
        assert np.all(np.asarray(o)[pos < 0] == 0)


@pytest.mark.parametrize("mode", ["hgca", "scout", "topk", "recall"])
def test_predicted_device_bytes_count_each_layer_kind(mode):
    """point_memory's device cache bytes equal the cache the backend builds (sliding layers hold
    their window, global layers the offloading window)."""
    import jax

    from jhybrid.bench.budget import point_memory

    options = dict(window_tokens=64, sink=16, block_size=16, recall_blocks=2, host_threads=1)
    if mode in ("scout", "topk"):
        options["budget"] = 32
    backend = make_backend(mode, **options)
    cfg = backend.config
    max_len = 256
    cache = create_model(GEMMA3_LIKE, seed=0).init_cache(3, max_len, backend)
    real = sum(x.nbytes for x in jax.tree_util.tree_leaves(cache))
    pred = point_memory(GEMMA3_LIKE, cfg, 3, 256, max_len)
    assert pred.device_cache_per_seq * 3 == real


def test_budget_offloads_only_global_layers():
    from jhybrid.bench.budget import kv_budget
    from jhybrid.bench.shapes import SHAPES

    config = SHAPES["gemma3-270m"]
    assert LayerPlan.of(config).global_layers == (5, 11, 17)
    b = kv_budget("gemma3-270m", config, context=32768, batch=2, gpu_bytes=80 * 2**30)
    per_layer_token = 2 * 1 * 256 * 2  # K + V, one KV head of 256, bf16
    assert b.kv_bytes_per_request == 18 * 32768 * per_layer_token  # full: every layer, whole context
    assert b.blocks_to_offload_total == b.blocks_to_offload_per_layer * 2 * 3
    assert b.host_kv_bytes == 2 * b.blocks_to_offload_per_layer * 16 * 3 * per_layer_token
    assert b.gpu_kv_bytes_with_window == 2 * (3 * b.window_tokens + 15 * 512) * per_layer_token


@pytest.fixture(scope="module")
def session_prompts():
    rng = np.random.default_rng(12)
    return [list(rng.integers(0, 97, n)) for n in (70, 21)]


@pytest.fixture(scope="module")
def full_session(model, session_prompts, tmp_path_factory):
    """The two turns of a `full` session, never evicted (what every mode below must give)."""
    return two_turns(model, tmp_path_factory.mktemp("full"), None, session_prompts, "hidden", evict=False)[0]


@pytest.mark.parametrize("mode", ["hgca", "scout"])
def test_restored_session_with_sliding_layers_continues_exactly(model, session_prompts, full_session, tmp_path,
                                                                mode):
    """HCache: a session saved, closed and restored into a hybrid mode (sliding layers refilled
    with their last 24 tokens, global layers split into window + host store) continues with the
    logits of the same session kept open, and of `full` (keep-everything policy)."""
    from jhybrid.hybrid import OffloadConfig

    prompts, full = session_prompts, full_session
    extra = dict(predict_query=False, **SCOUT_RECALLS) if mode == "scout" else {}
    backend = make_backend(OffloadConfig(mode=mode, **KEEP_ALL, **extra))
    kept, _ = two_turns(model, tmp_path / "kept", backend, prompts, "hidden", evict=False)
    restored, session = two_turns(model, tmp_path / "restored", backend, prompts, "hidden", evict=True)
    assert session.engine.backend.counters()["n_evicted_blocks"] > 0
    for turn in range(2):
        assert restored[turn][0] == kept[turn][0] == full[turn][0], f"turn {turn}: greedy tokens differ"
        np.testing.assert_allclose(restored[turn][1], kept[turn][1], atol=TOL, rtol=0)
        np.testing.assert_allclose(restored[turn][1], full[turn][1], atol=TOL, rtol=0)


@pytest.mark.parametrize("mode,fill", [("hgca", "synthetic"), ("scout", "calibrated"), ("topk", "synthetic")])
def test_throughput_points_with_sliding_layers(mode, fill):
    """The throughput suite fills a Gemma-3-like model's sliding rings and its global layers' windows
    and host stores, and decodes; the host store holds the global layers only."""
    import dataclasses

    from jhybrid.bench.shapes import load_model
    from jhybrid.bench.throughput import run_throughput
    from tests.bench_support import point

    p = point(mode, batch=2, context=256, fill=fill)
    p = dataclasses.replace(p, model=dataclasses.replace(p.model, name="tiny-gemma3"))
    model, _ = load_model(p.model)
    row = run_throughput(model, None, p)[0]
    assert row["decode_tok_s"] > 0 and row["steps"] == 3
    window = 16 + ((int(0.25 * 256) - 16) // 16) * 16
    stored = 2 * 2 * ((256 - window) // 16) * 16  # 2 global layers x 2 sequences x offloaded tokens
    assert row["host_kv_bytes"] >= stored * 2 * 2 * 64 * 4  # K + V, 2 KV heads of 64, float32
