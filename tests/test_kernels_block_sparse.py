"""Parity of the block-sparse attention kernel (Pallas interpret mode) and its jnp reference vs float64."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from oracle import attention_f64, rel_err
from pallas_kernels.block_sparse_attention import block_sparse_attention

TOL = {"float32": 1e-5, "bfloat16": 2e-2}


def _case(rng, b, tq, hq, hkv, pool, bs, d, m, dtype):
    def rounded(shape):
        x = rng.standard_normal(shape).astype(np.float32)
        return np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))

    ids = np.stack([np.stack([rng.permutation(pool)[:m] for _ in range(hkv)]) for _ in range(b)]).astype(np.int32)
    counts = rng.integers(0, m + 1, (b, hkv)).astype(np.int32)
    counts[0, 0] = m
    counts[-1, -1] = 0  # an empty block list
    block_lens = rng.integers(1, bs + 1, pool).astype(np.int32)  # partially filled blocks
    block_lens[0] = bs
    return dict(q=rounded((b, tq, hq, d)), k=rounded((pool, hkv, bs, d)), v=rounded((pool, hkv, bs, d)),
                ids=ids, counts=counts, block_lens=block_lens)


def _oracle(c, scale):
    q = c["q"]
    b, tq, hq, d = q.shape
    hkv = c["k"].shape[1]
    g = hq // hkv
    o = np.zeros(q.shape)
    lse = np.zeros(q.shape[:3])
    for bi in range(b):
        for h in range(hkv):
            chosen = c["ids"][bi, h, : c["counts"][bi, h]]
            keys = [c["k"][p, h, : c["block_lens"][p]] for p in chosen]
            vals = [c["v"][p, h, : c["block_lens"][p]] for p in chosen]
            keys = np.concatenate(keys) if keys else np.zeros((0, d))
            vals = np.concatenate(vals) if vals else np.zeros((0, d))
            for gi in range(g):
                oo, ll, _ = attention_f64(q[bi, :, h * g + gi], keys, vals, np.ones((tq, len(keys)), bool), scale)
                o[bi, :, h * g + gi], lse[bi, :, h * g + gi] = oo, ll
    return o, lse


CASES = [
    # b, tq, hq, hkv, pool, bs, d, m, dtype
    (2, 1, 4, 4, 12, 16, 64, 5, "float32"),  # group 1
    (2, 1, 8, 2, 9, 8, 128, 4, "float32"),  # group 4, blocks smaller than a kernel step
    (1, 2, 8, 1, 6, 32, 256, 3, "bfloat16"),  # group 8, D = 256, Tq = 2
    (3, 1, 12, 3, 20, 64, 64, 7, "bfloat16"),  # SmolLM2-like group 3, 64-token blocks
]


@pytest.mark.parametrize("b,tq,hq,hkv,pool,bs,d,m,dtype", CASES)
@pytest.mark.parametrize("backend", ["interpret", "reference"])
def test_block_sparse_matches_float64(rng, backend, b, tq, hq, hkv, pool, bs, d, m, dtype):
    c = _case(rng, b, tq, hq, hkv, pool, bs, d, m, dtype)
    o, lse = block_sparse_attention(
        jnp.asarray(c["q"], dtype), jnp.asarray(c["k"], dtype), jnp.asarray(c["v"], dtype),
        jnp.asarray(c["ids"]), jnp.asarray(c["counts"]), jnp.asarray(c["block_lens"]),
        backend=backend, block_k=16, num_splits=2,
    )
    o_ref, lse_ref = _oracle(c, d**-0.5)
    assert o.dtype == jnp.dtype(dtype) and lse.dtype == jnp.float32
    assert rel_err(o, o_ref) < TOL[dtype]
    lse = np.asarray(lse)
    assert np.array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    fin = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse[fin], lse_ref[fin], rtol=TOL[dtype], atol=TOL[dtype])
    assert np.all(np.asarray(o)[-1, :, -(hq // hkv):] == 0), "an empty block list must give o = 0"


def test_block_sparse_ignores_ids_past_count(rng):
    """Entries past ``counts`` (padding, here -1 and out-of-range ids) are never read."""
    c = _case(rng, 1, 1, 4, 2, 8, 16, 64, 4, "float32")
    ids = c["ids"].copy()
    counts = np.array([[2, 3]], np.int32)
    args = [jnp.asarray(c[k]) for k in ("q", "k", "v")]
    o1, l1 = block_sparse_attention(*args, jnp.asarray(ids), jnp.asarray(counts), jnp.asarray(c["block_lens"]),
                                    backend="interpret", block_k=16)
    ids[0, 0, 2:] = -1
    ids[0, 1, 3:] = 10_000
    o2, l2 = block_sparse_attention(*args, jnp.asarray(ids), jnp.asarray(counts), jnp.asarray(c["block_lens"]),
                                    backend="interpret", block_k=16)
    np.testing.assert_array_equal(np.asarray(o1), np.asarray(o2))
    np.testing.assert_array_equal(np.asarray(l1), np.asarray(l2))


@pytest.mark.parametrize(
    "what, match",
    [("ids_shape", "block_ids.shape"), ("counts_shape", "counts.shape"), ("d", "head_dim=32"),
     ("lens", "block_lens.shape")],
)
def test_block_sparse_bad_input(what, match):
    d = 32 if what == "d" else 64
    q = jnp.zeros((2, 1, 4, d))
    pool = jnp.zeros((5, 2, 16, d))
    ids = jnp.zeros((2, 3, 4) if what == "ids_shape" else (2, 2, 4), jnp.int32)
    counts = jnp.zeros((2,) if what == "counts_shape" else (2, 2), jnp.int32)
    lens = jnp.zeros((4,) if what == "lens" else (5,), jnp.int32)
    with pytest.raises(ValueError, match=match):
        block_sparse_attention(q, pool, pool, ids, counts, lens, backend="interpret")
