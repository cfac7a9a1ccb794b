"""`quest`, the GPU-only block-sparse baseline: keep-all equals `full`, and a decode step attends
exactly what a float64 NumPy oracle of Quest's rule selects (sinks + recent window + top-k by the
digest bound), on random inputs with ragged lengths and GQA."""

from __future__ import annotations

import numpy as np
import pytest

from jhybrid.attention.base import LayerContext
from jhybrid.hybrid import OffloadConfig, make_backend
from jhybrid.models import create_model
from tests.hybrid_support import TINY, TOL, run_forced


@pytest.fixture(scope="module")
def model():
    return create_model(TINY, seed=0)


@pytest.mark.parametrize("kernels", [None, "interpret"])  # jnp paths; the Pallas kernels (the GPU's), interpreted
def test_quest_with_every_block_equals_full(model, rng, kernels):
    import jax

    prompt = rng.integers(0, TINY.vocab_size, (2, 50)).astype(np.int32)
    continuation = rng.integers(0, TINY.vocab_size, (2, 20 if kernels is None else 6)).astype(np.int32)
    # float32 matmuls on both sides (a GPU's default is TF32: 4e-3 apart, measured on the H100)
    with jax.default_matmul_precision("highest"):
        reference = run_forced(model, make_backend("full"), prompt, continuation)[0]
        quest = make_backend("quest", window_tokens=40, sink=8, block_size=16, budget=128,  # budget > context
                             kernel_backend=kernels)
        logits = run_forced(model, quest, prompt, continuation)[0]
    np.testing.assert_allclose(logits, reference, atol=TOL, rtol=0)


def _oracle(q, keys, values, n, sink, recent, bs, k, scale):
    """float64 Quest decode for one sequence: q [Hq, D]; keys / values [n, Hkv, D] (its tokens).
    -> o [Hq, D], and the selected top-k block set per KV head."""
    hq, d = q.shape
    hkv = keys.shape[1]
    g = hq // hkv
    nb = -(-n // bs)
    sink_blocks = -(-sink // bs)
    recent_first = max(max(n - recent, 0) // bs, sink_blocks)
    out = np.zeros((hq, d))
    chosen = []
    for h in range(hkv):
        qh = q[h * g:(h + 1) * g].astype(np.float64)  # the group's query heads
        scores = {}
        for blk in range(sink_blocks, recent_first):
            kb = keys[blk * bs:(blk + 1) * bs, h].astype(np.float64)
            lo, hi = kb.min(0), kb.max(0)
            scores[blk] = float(np.maximum(qh * lo, qh * hi).sum())
        top = sorted(scores, key=lambda b: -scores[b])[:k]
        chosen.append(set(top))
        blocks = sorted(set(range(min(sink_blocks, nb))) | set(range(recent_first, nb)) | set(top))
        tokens = [t for blk in blocks for t in range(blk * bs, min((blk + 1) * bs, n))]
        kk = keys[tokens, h].astype(np.float64)
        vv = values[tokens, h].astype(np.float64)
        s = qh @ kk.T * scale
        p = np.exp(s - s.max(1, keepdims=True))
        out[h * g:(h + 1) * g] = (p / p.sum(1, keepdims=True)) @ vv
    return out, chosen


@pytest.mark.parametrize("hq,hkv", [(4, 2), (8, 1)])
def test_decode_step_attends_what_the_oracle_selects(rng, hq, hkv):
    import jax.numpy as jnp

    from jhybrid.models import ModelConfig

    d, bs, sink, window, budget, max_len = 64, 16, 16, 48, 32, 160
    config = ModelConfig(family="llama", vocab_size=97, d_model=128, num_layers=1, num_heads=hq, num_kv_heads=hkv,
                         head_dim=d, mlp_dim=128, max_position_embeddings=256, dtype="float32")
    backend = make_backend(OffloadConfig(mode="quest", window_tokens=window, sink=sink, block_size=bs, budget=budget,
                                         kernel_backend="reference"))
    lengths = np.array([int(rng.integers(60, max_len)), 17, int(rng.integers(90, max_len))])  # ragged; one short
    b = len(lengths)
    keys = rng.standard_normal((b, max_len, hkv, d)).astype(np.float32)
    values = rng.standard_normal((b, max_len, hkv, d)).astype(np.float32)
    state = backend.init_layer_cache(config, 0, b, max_len, jnp.float32)
    ctx = LayerContext(scale=d ** -0.5, num_layers=1)
    # the history, written as one chunk per sequence (prefill path), then the decode token
    positions = np.where(np.arange(max_len)[None] < lengths[:, None] - 1, np.arange(max_len)[None], -1)
    q_hist = rng.standard_normal((b, max_len, hq, d)).astype(np.float32)
    _, state, _ = backend.attend(0, jnp.asarray(q_hist), jnp.asarray(keys), jnp.asarray(values),
                                 jnp.asarray(positions, jnp.int32), jnp.asarray(lengths - 1, jnp.int32), state, ctx)
    q = rng.standard_normal((b, 1, hq, d)).astype(np.float32)
    last = (lengths - 1)[:, None]
    k_new = keys[np.arange(b)[:, None], last]  # [B, 1, Hkv, D]
    v_new = values[np.arange(b)[:, None], last]
    o, state, _ = backend.attend(0, jnp.asarray(q), jnp.asarray(k_new), jnp.asarray(v_new),
                                 jnp.asarray(last, jnp.int32), jnp.asarray(lengths, jnp.int32), state, ctx)
    selected = np.asarray(state.selected)
    for i in range(b):
        n = int(lengths[i])
        want, chosen = _oracle(q[i, 0], keys[i, :n], values[i, :n], n, sink, window - sink, bs, budget // bs,
                               d ** -0.5)
        np.testing.assert_allclose(np.asarray(o[i, 0], np.float64), want, atol=2e-5, rtol=0)
        for h in range(hkv):
            assert set(selected[i, h][selected[i, h] >= 0].tolist()) == chosen[h]


@pytest.mark.gpu
def test_gpu_quest_with_every_block_equals_full(model, rng):
    """On a GPU: the Triton block-sparse and digest kernels, keep-all == full (float32 matmuls)."""
    import jax

    prompt = rng.integers(0, TINY.vocab_size, (2, 50)).astype(np.int32)
    continuation = rng.integers(0, TINY.vocab_size, (2, 20)).astype(np.int32)
    with jax.default_matmul_precision("highest"):
        reference = run_forced(model, make_backend("full"), prompt, continuation)[0]
        logits = run_forced(model, make_backend("quest", window_tokens=40, sink=8, block_size=16, budget=128),
                            prompt, continuation)[0]
    np.testing.assert_allclose(logits, reference, atol=2e-3, rtol=0)
