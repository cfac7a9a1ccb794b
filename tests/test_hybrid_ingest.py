"""HCache restore into the hybrid modes (jhybrid.hybrid.ingest) on a tiny random model (CPU).

* Session API, every hybrid mode at a keep-everything policy: a session saved, closed and
  restored continues with exactly the greedy tokens (and logits to float tolerance) of the same
  session never evicted, and of `full`.
* Non-keep-all policies: the state a restore leaves (host store blocks and positions, sinks, ring,
  scout/topk digests, token counts) equals what a plain hybrid prefill of the same tokens leaves;
  hgca re-scores the restored offloaded tokens with the history's last queries.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jhybrid.generation import make_step
from jhybrid.hcache import HCacheEngine, HostMemorySource, LayerKernels, restore_kv
from jhybrid.hybrid import OffloadConfig, make_backend
from jhybrid.hybrid.ingest import HybridCacheWriter
from jhybrid.hybrid.window import slot_positions
from jhybrid.models import create_model
from tests.hybrid_support import KEEP_ALL, SCOUT_RECALLS, TINY, two_turns

CONFIG = TINY.replace(max_position_embeddings=512)
# Window 40 = 8 sinks + 2 blocks of 16 (max prefill chunk 16): a 70-token history evicts 2 blocks.
MODES = {
    "recall": dict(mode="recall"),
    "hgca": dict(mode="hgca"),
    "topk": dict(mode="topk"),
    "scout-exact-query": dict(mode="scout", predict_query=False, **SCOUT_RECALLS),
    "streaming": dict(mode="streaming"),
}
MAX_LEN, TOL = 256, 2e-4


@pytest.fixture(scope="module")
def model():
    return create_model(CONFIG, seed=3)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(11)
    return [list(rng.integers(0, CONFIG.vocab_size, n)) for n in (70, 21)]


@pytest.fixture(scope="module")
def full_reference(model, prompts, tmp_path_factory):
    return two_turns(model, tmp_path_factory.mktemp("full"), None, prompts, "hidden", evict=False)[0]


@pytest.mark.parametrize("mode", list(MODES))
def test_restored_hybrid_session_continues_exactly(model, prompts, full_reference, tmp_path, mode):
    options = {**KEEP_ALL, **MODES[mode]}
    plan = ("hidden", "kv") if mode == "topk" else ("recompute", "hidden") if mode == "recall" else "hidden"
    backend = make_backend(OffloadConfig(**options))  # one backend, used in turn: one compilation
    kept, _ = two_turns(model, tmp_path / "kept", backend, prompts, plan, evict=False)
    restored, session = two_turns(model, tmp_path / "restored", backend, prompts, plan, evict=True)
    assert session.engine.backend.counters()["n_evicted_blocks"] > 0, "turn 2 should evict more blocks"
    for turn in range(2):
        assert restored[turn][0] == kept[turn][0], f"turn {turn}: greedy tokens differ"
        np.testing.assert_allclose(restored[turn][1], kept[turn][1], atol=TOL, rtol=0)
        if mode != "streaming":  # keep-all: the hybrid result is full attention's
            assert restored[turn][0] == full_reference[turn][0]
            np.testing.assert_allclose(restored[turn][1], full_reference[turn][1], atol=TOL, rtol=0)
    if mode == "streaming":  # offloaded tokens not attended: the test must be able to see that
        assert np.abs(restored[1][1] - full_reference[1][1]).max() > 1e-3


def test_one_open_session_per_hybrid_engine(model, prompts, tmp_path):
    engine = HCacheEngine(model, str(tmp_path), max_len=MAX_LEN, chunk_tokens=16, prefix_reuse=False,
                          backend=OffloadConfig(mode="hgca", **KEEP_ALL))
    assert engine.prefill_chunk == 16  # bounded by the ring's max_prefill_chunk
    first = engine.new_session()
    first.generate(prompts[0], 2)
    session_id = first.save()
    with pytest.raises(RuntimeError, match=f"session {first.id} is still open"):
        engine.restore(session_id)
    first.close()
    again = engine.restore(session_id)
    assert again.tokens == first.tokens
    again.close()
    with pytest.raises(TypeError, match="backend="):
        HCacheEngine(model, str(tmp_path), backend="hgca")


# ----------------------------------------------------------------------------- state equality


def plain_prefill(model, backend, tokens, chunk=16):
    """A hybrid prefill of tokens [n] in chunks through the model -> (cache, backend)."""
    step, params = make_step(model, backend)
    backend.open(model.config, 1, MAX_LEN)
    cache = model.init_cache(1, MAX_LEN, backend)
    for begin in range(0, len(tokens), chunk):
        part = tokens[begin:begin + chunk]
        toks = np.zeros((1, chunk), np.int32)
        toks[0, :len(part)] = part
        pos = np.full((1, chunk), -1, np.int32)
        pos[0, :len(part)] = begin + np.arange(len(part))
        cache = backend.before_step(cache, pos)
        _, cache = step(params, toks, pos, cache)
    return cache


def restore_into(model, backend, tokens, methods):
    """The history's hidden states and KV from a `full` forward, restored into a hybrid cache."""
    n = len(tokens)
    _, cache, hidden = model(jnp.asarray(tokens)[None], jnp.arange(n, dtype=jnp.int32)[None],
                             model.init_cache(1, n), return_hidden_states=True)
    kv = [np.stack([np.asarray(c["k"][0]), np.asarray(c["v"][0])], axis=1).reshape(n, -1) for c in cache.layers]
    writer = HybridCacheWriter(model, backend, MAX_LEN, n)
    restore_kv(LayerKernels(model), methods, tokens, HostMemorySource(list(np.asarray(hidden[:, 0])), kv, n),
               writer, recompute_chunk=32)
    return writer.finish(), writer


def window_tokens(cfg, state, cache):
    """{position: (k, v)} of every valid sink and ring slot, [Hkv, D] each."""
    sink_pos, ring_pos = (np.asarray(a)[0] for a in slot_positions(cfg, cache.lengths, cache.meta.offloaded_blocks))
    w = state.window
    out = {}
    for slot, p in enumerate(sink_pos):
        if p >= 0:
            out[int(p)] = (np.asarray(w.sink_k[0, :, slot]), np.asarray(w.sink_v[0, :, slot]))
    for slot, p in enumerate(ring_pos):
        if p >= 0:
            out[int(p)] = (np.asarray(w.k_ring[0, :, slot]), np.asarray(w.v_ring[0, :, slot]))
    return out


@pytest.mark.parametrize("options", [
    dict(mode="hgca", beta=1.0),
    dict(mode="scout", budget=16, recall_blocks=1),  # layer-ahead digests (next_digests)
    dict(mode="recall"),
    dict(mode="streaming", sink=0, window_tokens=48),
])
def test_restored_state_equals_a_plain_prefill(model, rng, options):
    cfg = OffloadConfig(**{**KEEP_ALL, **options})
    n = int(rng.integers(60, 120))
    tokens = rng.integers(0, CONFIG.vocab_size, n).astype(np.int32)
    backend = make_backend(cfg)
    plain_backend = make_backend(cfg)
    want = plain_prefill(model, plain_backend, tokens)
    want_runtime = plain_backend.runtime
    got, writer = restore_into(model, backend, tokens, ("hidden", "kv"))
    runtime = backend.runtime
    assert int(got.lengths[0]) == int(want.lengths[0]) == n
    assert runtime.n_tokens.tolist() == want_runtime.n_tokens.tolist() == [n]
    e = (n - cfg.sink - cfg.ring_tokens + cfg.block_size - 1) // cfg.block_size
    assert writer.n_blocks == e * CONFIG.num_layers and e > 0
    atol = 2e-5
    for layer in range(CONFIG.num_layers):
        # host store: the same blocks, positions, K and V
        assert runtime.store.n_blocks(layer, 0) == want_runtime.store.n_blocks(layer, 0) == e
        a, b = runtime.store.read_blocks(layer, 0), want_runtime.store.read_blocks(layer, 0)
        np.testing.assert_array_equal(a["positions"], b["positions"])
        for name in ("k", "v"):
            np.testing.assert_allclose(np.asarray(a[name], np.float32), np.asarray(b[name], np.float32),
                                       atol=atol)
        # GPU window: the same positions hold the same K, V
        mine, theirs = (window_tokens(cfg, c.layers[layer], c) for c in (got, want))
        assert sorted(mine) == sorted(theirs) and len(mine) == n - e * cfg.block_size
        for p in mine:
            for x, y in zip(mine[p], theirs[p]):
                np.testing.assert_allclose(x, y, atol=atol)
        # scout / topk digests of the evicted blocks (and scout's copy one layer ahead)
        for name in ("digests", "next_digests"):
            if getattr(want.layers[layer], name) is not None:
                for x, y in zip(getattr(got.layers[layer], name).__dict__.values(),
                                getattr(want.layers[layer], name).__dict__.values()):
                    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol)
        if cfg.mode == "recall":
            for name in ("mirror_k", "mirror_v"):
                np.testing.assert_allclose(getattr(runtime.mode_host, name)[layer],
                                           getattr(want_runtime.mode_host, name)[layer], atol=atol)
        maw = np.asarray(got.layers[layer].window.maw)
        if cfg.mode == "hgca" and layer in writer.last_queries:  # scored by the history's last queries ...
            assert maw.max() > 0 and np.isfinite(maw).all()
            assert 0.0 < maw.sum(axis=-1).max() <= 2.0 + 1e-5  # ring probabilities summed over a group of 2
        else:  # ... or 0
            np.testing.assert_array_equal(maw, 0.0)


def test_hgca_reevaluates_restored_blocks_with_the_history_queries(model, rng):
    # beta 2: a token is kept iff its probability (summed over the 2 query heads of its group)
    # beats 2 / stored tokens, the mean: some are kept, some not.
    cfg = OffloadConfig(**{**KEEP_ALL, "mode": "hgca", "beta": 2.0})
    n = int(rng.integers(70, 120))
    tokens = rng.integers(0, CONFIG.vocab_size, n).astype(np.int32)
    plain_backend = make_backend(cfg)
    plain_prefill(model, plain_backend, tokens, chunk=16)
    # The plain prefill's last chunk queries (what its first decode step would re-score with).
    valid = n - (n - 1) // 16 * 16
    r = cfg.reevaluate_queries
    backend = make_backend(cfg)
    _, writer = restore_into(model, backend, tokens, ("hidden", "hidden"))
    store = backend.runtime.store
    backend.runtime.evictor.wait_background()  # the queued re-evaluations have run
    for layer in range(CONFIG.num_layers):
        tail, _ = plain_backend.runtime.mode_host.tails[layer]  # the chunk's queries the host received
        q_plain = tail[:, r - min(r, valid):]
        q_restored = np.asarray(writer.last_queries[layer], np.float32)
        if valid >= r:
            np.testing.assert_allclose(q_restored, q_plain, atol=2e-5)
        else:  # the last chunk had fewer than r queries: ours are its tail's superset
            np.testing.assert_allclose(q_restored[:, -valid:], q_plain, atol=2e-5)
        kept = store.context.kept_counts(layer, 0)
        assert kept.sum() > 0, "re-evaluation kept no restored token"
        assert (kept < store.n_tokens(layer, 0)).any(), "beta=2 should not keep every token"


def test_hgca_without_hidden_states_keeps_no_context_and_says_so(model, rng, caplog):
    cfg = OffloadConfig(**{**KEEP_ALL, "mode": "hgca", "beta": 1.0})
    tokens = rng.integers(0, CONFIG.vocab_size, 90).astype(np.int32)
    backend = make_backend(cfg)
    with caplog.at_level("INFO", logger="jhybrid.hybrid.ingest"):
        restore_into(model, backend, tokens, ("kv", "kv"))
    backend.runtime.evictor.wait_background()
    assert "not restored from hidden states" in caplog.text
    assert backend.runtime.store.context.kept_counts(0, 0).sum() == 0


def test_writer_rejects_bad_input(model):
    cfg = OffloadConfig(**{**KEEP_ALL, "mode": "hgca"})
    with pytest.raises(ValueError, match="300 tokens into a hybrid cache of max_len=256"):
        HybridCacheWriter(model, make_backend(cfg), MAX_LEN, 300)
    writer = HybridCacheWriter(model, make_backend(cfg), MAX_LEN, 50)
    k = jnp.zeros((1, 49, CONFIG.num_kv_heads, CONFIG.head_dim))
    with pytest.raises(ValueError, match=r"expected \[1, 50, Hkv, D\]"):
        writer(0, k, k)
    with pytest.raises(RuntimeError, match=r"layers \[0, 1\] were never restored"):
        writer.finish()
