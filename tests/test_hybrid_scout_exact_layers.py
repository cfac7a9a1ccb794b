"""scout_exact_layers: scout layers that run on their exact query instead of the layer-ahead prediction.

A 4-layer tiny model whose layer 1 is an identity (o_proj and down_proj zeroed): layer 2's predicted
query (layer 2's W_q on layer 1's input) then *is* its real query, while layer 3's prediction (from
layer 2's input) is wrong. With scout_exact_layers=(3,) every layer whose attention reaches the
logits uses the right query -> at keep-all the logits equal full attention, although layers 1 and
2 still run layer-ahead (so the test covers all four paths: exact -> predicted successor (0),
predicted -> predicted (1), predicted -> exact (2), exact last (3)). The same run with the default
(layer 0 only) must differ: that control shows the exactness test can fail. Which layer took which
path is counted from the host bridge's submissions.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from host.bridge import HostBridge
from host.targets import CHOSEN_BLOCKS
from jhybrid.hybrid import OffloadConfig, make_backend
from jhybrid.models import create_model
from tests.hybrid_support import CHUNK, SCOUT_RECALLS, TINY, TOL, WINDOW, run_forced as run_forced_full, window_only_chunks

L = 4
CONFIG = TINY.replace(num_layers=L)
# Window 40 = 8 sinks + 2 blocks of 16; 64 prompt + 24 decode tokens evict 2-3 blocks per layer.
# Which layer took which path is counted on the callback transport (one callback per submission);
# the native transport runs the same paths (tests/test_hybrid_native_exchange.py compares the two).
KEEP_ALL = dict(mode="scout", host_exchange="callback", **WINDOW, **SCOUT_RECALLS)
B, PROMPT, STEPS = 2, 64, 24
# submit + collect per layer and chunk that has offloaded tokens (the others attend to the window alone)
PREFILL_CALLBACKS = 2 * L * (PROMPT // CHUNK - window_only_chunks(PROMPT))


@pytest.fixture(scope="module")
def model():
    model = create_model(CONFIG, seed=0)
    identity = model.layers[1]
    identity.attention.o_proj.kernel[...] = jnp.zeros_like(identity.attention.o_proj.kernel[...])
    identity.mlp.down_proj.kernel[...] = jnp.zeros_like(identity.mlp.down_proj.kernel[...])
    return model


@pytest.fixture(scope="module")
def tokens():
    rng = np.random.default_rng(99)
    return rng.integers(0, 97, (B, PROMPT)).astype(np.int32), rng.integers(0, 97, (B, STEPS)).astype(np.int32)


@pytest.fixture
def submissions(monkeypatch):
    """Decode-step submissions seen by the host bridge: {"exact": [layer, ...], "ahead": [layer, ...]}
    (exact: submitted by the layer itself with its own query; ahead: submitted by the layer before)."""
    seen = {"exact": [], "ahead": []}
    submit, exchange = HostBridge.cb_submit, HostBridge.cb_collect_and_submit

    def cb_submit(self, layer, target, *args):
        if target is CHOSEN_BLOCKS:
            seen["exact"].append(layer)
        return submit(self, layer, target, *args)

    def cb_collect_and_submit(self, next_layer, target, *args):
        if next_layer is not None:
            seen["ahead"].append(next_layer)
        return exchange(self, next_layer, target, *args)

    monkeypatch.setattr(HostBridge, "cb_submit", cb_submit)
    monkeypatch.setattr(HostBridge, "cb_collect_and_submit", cb_collect_and_submit)
    return seen


def run_forced(model, backend, prompt, continuation):
    """Teacher-forced: prefill in chunks, then one token per step -> (logits [B, steps, V], cache)."""
    logits, _, cache, _ = run_forced_full(model, backend, prompt, continuation)
    return logits, cache


@pytest.fixture(scope="module")
def reference(model, tokens):
    return run_forced(model, make_backend("full"), *tokens)[0]


def per_layer(layers):
    return {layer: layers.count(layer) for layer in sorted(set(layers))}


def test_exact_layers_make_keep_all_scout_equal_full(model, tokens, reference, submissions):
    backend = make_backend(OffloadConfig(scout_exact_layers=(3,), **KEEP_ALL))
    logits, cache = run_forced(model, backend, *tokens)
    np.testing.assert_allclose(logits, reference, atol=TOL, rtol=0)
    assert (logits.argmax(-1) == reference.argmax(-1)).all()
    # Layers 0 and 3 submit their own (exact) query every decode step; 1 and 2 are submitted ahead
    # by their predecessor; nothing is submitted ahead for layer 3.
    assert per_layer(submissions["exact"]) == {0: STEPS, 3: STEPS}
    assert per_layer(submissions["ahead"]) == {1: STEPS, 2: STEPS}
    counters = backend.counters()
    assert counters["n_callbacks"] == PREFILL_CALLBACKS + STEPS * (L + 2)  # L + |{0, 3}| per step
    assert counters["n_evicted_blocks"] > 0
    # Recalled blocks were attended from the GPU pool in every layer, whichever path it takes (a
    # recall into layer 2 also updates layer 1's copy of its pool table; layer 3 has no such copy).
    assert {r["layer"] for r in backend.runtime.mode_host.recall_log} == set(range(L))
    # Each layer's digests live where its selection runs: its own (exact) or its predecessor's.
    keys = [{name for name in ("digests", "next_digests", "next_pool_blocks") if getattr(state, name) is not None}
            for state in cache.layers]
    assert keys == [{"digests", "next_digests", "next_pool_blocks"}, {"next_digests", "next_pool_blocks"}, set(),
                    {"digests"}]


def test_predicted_layer_3_is_not_exact(model, tokens, reference, submissions):
    """Control: the default (layer 0 exact only) predicts layer 3 from the wrong input."""
    backend = make_backend(OffloadConfig(**KEEP_ALL))
    logits, _ = run_forced(model, backend, *tokens)
    assert np.abs(logits - reference).max() > 1e-2
    assert per_layer(submissions["exact"]) == {0: STEPS}
    assert per_layer(submissions["ahead"]) == {1: STEPS, 2: STEPS, 3: STEPS}
    assert backend.counters()["n_callbacks"] == PREFILL_CALLBACKS + STEPS * (L + 1)


def test_int_means_leading_layers(model, tokens, reference, submissions):
    """scout_exact_layers=N: layers 0..N-1 exact; N = L runs every layer like predict_query=False."""
    backend = make_backend(OffloadConfig(scout_exact_layers=L, **KEEP_ALL))
    logits, cache = run_forced(model, backend, tokens[0], tokens[1][:, :8])
    np.testing.assert_allclose(logits, reference[:, :8], atol=TOL, rtol=0)
    assert per_layer(submissions["exact"]) == {layer: 8 for layer in range(L)}
    assert submissions["ahead"] == []
    assert all(state.next_digests is None and state.digests is not None for state in cache.layers)


def test_exact_layer_out_of_range(model):
    backend = make_backend(OffloadConfig(scout_exact_layers=(1, 7), **KEEP_ALL))
    with pytest.raises(ValueError, match=r"scout_exact_layers=\(1, 7\): layer\(s\) 7 out of range .* 4 layers"):
        backend.open(model.config, B, 128)
    with pytest.raises(ValueError, match="layer.* 4 out of range"):
        make_backend(OffloadConfig(scout_exact_layers=5, **KEEP_ALL)).open(model.config, B, 128)
