"""scout_exact_layers="auto": the layer-ahead query cosines, the per-model cache, the resolution."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from jhybrid.bench.query_similarity import query_similarity
from jhybrid.hybrid import OffloadConfig, make_backend
from jhybrid.hybrid.calibration import cache_dir, calibrate, layer_ahead_cosines, resolve_exact_layers
from jhybrid.models import create_model
from tests.hybrid_support import GEMMA3_LIKE, TINY

TOKENS = np.random.default_rng(3).integers(0, 97, 48).astype(np.int32)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JHYBRID_CACHE", str(tmp_path / "cache"))


def test_cosines_of_consecutive_layers_match_query_similarity():
    model = create_model(TINY.replace(num_layers=3), seed=1)
    cos = layer_ahead_cosines(model, TOKENS)
    rows = query_similarity(model, TOKENS, skip_first=1)
    assert cos[0] == 1.0 and len(cos) == 3
    np.testing.assert_allclose(cos[1:], [r["cos_mean"] for r in rows], atol=1e-4)
    assert all(-1.0 <= c <= 1.0 for c in cos)


def test_cosines_pair_global_layers_across_sliding_ones():
    """Gemma-3-like (global layers 1 and 3): offloaded layer 1's query predicted from layer 1's input."""
    model = create_model(GEMMA3_LIKE, seed=0)
    cos = layer_ahead_cosines(model, TOKENS)
    ids, positions = jnp.asarray(TOKENS[None]), jnp.arange(48, dtype=jnp.int32)[None]
    _, _, inputs = model.hidden_states(ids, positions, model.init_cache(1, 48), return_hidden_states=True)
    layer = model.layers[3]
    p = np.asarray(layer.attention.project_q(layer.attention_input(inputs[1]), positions), np.float64)[0, 1:]
    r = np.asarray(layer.attention.project_q(layer.attention_input(inputs[3]), positions), np.float64)[0, 1:]
    expected = ((p * r).sum(-1) / (np.linalg.norm(p, axis=-1) * np.linalg.norm(r, axis=-1))).mean()
    assert len(cos) == 2 and cos[1] == pytest.approx(expected, abs=1e-6)


def test_resolution_thresholds_and_cache():
    model = create_model(TINY.replace(num_layers=4), seed=2)
    strict = resolve_exact_layers(OffloadConfig(mode="scout", scout_min_cos=1.0), model, TOKENS)
    assert strict.scout_exact_layers == (1, 2, 3)  # no prediction is exact
    lax = resolve_exact_layers(OffloadConfig(mode="scout", scout_min_cos=-1.0), model, TOKENS)
    assert lax.scout_exact_layers == ()
    cos = calibrate(model, TOKENS)
    middle = sorted(cos[1:])[1]  # the median of three: one layer below it
    chosen = resolve_exact_layers(OffloadConfig(mode="scout", scout_min_cos=middle), model, TOKENS)
    assert chosen.scout_exact_layers == tuple(g for g in (1, 2, 3) if cos[g] < middle) and len(chosen.scout_exact_layers) == 1
    files = os.listdir(cache_dir())
    assert len(files) == 1  # measured once, then read back
    path = os.path.join(cache_dir(), files[0])
    with open(path, "w") as f:
        json.dump({"cosines": [1.0, 0.1, 0.1, 0.1]}, f)  # what the cache says wins ...
    assert resolve_exact_layers(OffloadConfig(mode="scout"), model, TOKENS).scout_exact_layers == (1, 2, 3)
    with open(path, "w") as f:
        f.write("{torn")  # ... and an unreadable cache is measured again
    assert calibrate(model, TOKENS) == pytest.approx(cos)
    other = create_model(TINY.replace(num_layers=4), seed=3)  # other weights: another entry
    calibrate(other, TOKENS)
    assert len(os.listdir(cache_dir())) == 2


def test_make_backend_resolves_auto_and_leaves_explicit_settings():
    model = create_model(TINY, seed=1)
    backend = make_backend("scout", window_tokens=40, block_size=16, sink=8, scout_min_cos=1.0, model=model,
                           calibration_tokens=TOKENS)
    assert backend.config.scout_exact_layers == (1,)
    assert make_backend("scout", window_tokens=40, block_size=16, sink=8, scout_exact_layers=(),
                        model=model, calibration_tokens=TOKENS).config.scout_exact_layers == ()
    assert make_backend("scout", window_tokens=40, block_size=16, sink=8).config.scout_exact_layers == "auto"
    assert resolve_exact_layers(OffloadConfig(mode="scout", predict_query=False), model, TOKENS).scout_exact_layers == ()
    with pytest.raises(ValueError, match="calibration tokens of shape"):
        layer_ahead_cosines(model, TOKENS[:2])
