"""Quest block digests: build / incremental update, scores (Pallas interpret + jnp) vs float64, top-k."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from oracle import rel_err
from pallas_kernels.block_digest import block_scores, build_digests, select_blocks, update_digests


def _digests_f64(keys, num_tokens, bs):
    b, hkv, n, d = keys.shape
    nb = -(-n // bs)
    mn = np.full((b, hkv, nb, d), np.inf)
    mx = np.full((b, hkv, nb, d), -np.inf)
    for bi in range(b):
        for j in range(num_tokens[bi]):
            mn[bi, :, j // bs] = np.minimum(mn[bi, :, j // bs], keys[bi, :, j])
            mx[bi, :, j // bs] = np.maximum(mx[bi, :, j // bs], keys[bi, :, j])
    return mn, mx


def _scores_f64(q, mn, mx, num_blocks):
    b, hq, d = q.shape
    hkv, nb = mn.shape[1], mn.shape[2]
    g = hq // hkv
    s = np.full((b, hkv, nb), -np.inf)
    for bi in range(b):
        for h in range(hkv):
            for n in range(num_blocks[bi]):
                s[bi, h, n] = sum(np.maximum(q[bi, h * g + gi] * mn[bi, h, n], q[bi, h * g + gi] * mx[bi, h, n]).sum()
                                  for gi in range(g))
    return s


@pytest.mark.parametrize("bs", [16, 7])
def test_build_and_incremental_update_match_float64(rng, bs):
    b, hkv, n, d = 2, 3, 75, 64
    keys = rng.standard_normal((b, hkv, n, d)).astype(np.float32)
    num_tokens = np.array([75, 40], np.int32)
    mn_ref, mx_ref = _digests_f64(keys, num_tokens, bs)
    mn, mx = build_digests(jnp.asarray(keys), jnp.asarray(num_tokens), bs)
    np.testing.assert_array_equal(np.asarray(mn), mn_ref)
    np.testing.assert_array_equal(np.asarray(mx), mx_ref)
    # Incremental: ragged chunks, starting from stale garbage digests (reset at each block start).
    nb = mn_ref.shape[2]
    mn_i = jnp.asarray(rng.standard_normal((b, hkv, nb, d)), jnp.float32)
    mx_i = jnp.asarray(rng.standard_normal((b, hkv, nb, d)), jnp.float32)
    pos = 0
    for step in (1, 5, 13, 1, 30, 25):
        p = np.arange(pos, pos + step)
        positions = np.stack([np.where(p < t, p, -1) for t in num_tokens]).astype(np.int32)
        new = np.stack([keys[bi][:, np.clip(p, 0, n - 1)].transpose(1, 0, 2) for bi in range(b)])  # [B,T,Hkv,D]
        mn_i, mx_i = update_digests(mn_i, mx_i, jnp.asarray(new), jnp.asarray(positions), bs)
        pos += step
    for bi in range(b):
        used = -(-num_tokens[bi] // bs)
        np.testing.assert_array_equal(np.asarray(mn_i)[bi, :, :used], mn_ref[bi, :, :used])
        np.testing.assert_array_equal(np.asarray(mx_i)[bi, :, :used], mx_ref[bi, :, :used])


@pytest.mark.parametrize("hq,hkv,d,dtype", [(4, 4, 64, "float32"), (8, 2, 128, "float32"),
                                            (8, 1, 256, "bfloat16"), (9, 3, 64, "bfloat16")])
@pytest.mark.parametrize("backend", ["interpret", "reference"])
def test_block_scores_match_float64(rng, backend, hq, hkv, d, dtype):
    b, nb = 2, 37
    a = rng.standard_normal((b, hkv, nb, d)).astype(np.float32)
    c = rng.standard_normal((b, hkv, nb, d)).astype(np.float32)
    mn = np.asarray(jnp.asarray(np.minimum(a, c), dtype).astype(jnp.float32))
    mx = np.asarray(jnp.asarray(np.maximum(a, c), dtype).astype(jnp.float32))
    q = np.asarray(jnp.asarray(rng.standard_normal((b, hq, d)), dtype).astype(jnp.float32))
    num_blocks = np.array([nb, 11], np.int32)
    s = block_scores(jnp.asarray(q, dtype), jnp.asarray(mn, dtype), jnp.asarray(mx, dtype), jnp.asarray(num_blocks),
                     backend=backend, blocks_per_program=16)
    ref = _scores_f64(q, mn, mx, num_blocks)
    s = np.asarray(s)
    assert np.array_equal(np.isneginf(s), np.isneginf(ref)), "blocks past num_blocks must score -inf"
    fin = np.isfinite(ref)
    assert rel_err(s[fin], ref[fin]) < (1e-5 if dtype == "float32" else 2e-2)


def test_select_blocks_top_k_and_budget(rng):
    scores = rng.standard_normal((2, 3, 20)).astype(np.float32)
    num_blocks = np.array([20, 2], np.int32)
    scores[1, :, 2:] = -np.inf
    ids, counts = select_blocks(jnp.asarray(scores), jnp.asarray(num_blocks), budget_tokens=5 * 16, block_size=16)
    ids, counts = np.asarray(ids), np.asarray(counts)
    assert ids.shape == (2, 3, 5) and ids.dtype == np.int32
    np.testing.assert_array_equal(counts, [[5] * 3, [2] * 3])
    for h in range(3):
        np.testing.assert_array_equal(ids[0, h], np.argsort(-scores[0, h])[:5])
        assert set(ids[1, h, :2]) == {0, 1} and np.all(ids[1, h, 2:] == -1)


def test_select_blocks_rejects_budgets_that_do_not_fit():
    s = jnp.zeros((1, 1, 4))
    n = jnp.array([4], jnp.int32)
    with pytest.raises(ValueError, match="k=5 blocks"):
        select_blocks(s, n, budget_tokens=80, block_size=16)
    with pytest.raises(ValueError, match="smaller than one block"):
        select_blocks(s, n, budget_tokens=8, block_size=16)
