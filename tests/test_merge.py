"""Exact LSE merge: merging partial states of any split of a token set equals attention over the set."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jhybrid.merge import PartialState, merge_partials, merge_two
from oracle import attention_f64, rel_err


def _partial(q, k, v, mask, scale):
    o, lse, _ = attention_f64(q, k, v, mask, scale)
    return PartialState(jnp.asarray(o, jnp.float32), jnp.asarray(lse, jnp.float32))


@pytest.mark.parametrize("parts", [1, 2, 3, 5])
def test_merge_of_any_split_equals_full_attention(rng, parts):
    r, n, d = 6, 57, 64
    q, k, v = rng.standard_normal((r, d)), rng.standard_normal((n, d)) * 2, rng.standard_normal((n, d))
    owner = rng.integers(0, parts, n)  # a random partition of the tokens, some parts possibly empty
    owner[: min(parts, n)] = np.arange(min(parts, n))
    states = [_partial(q, k, v, np.broadcast_to(owner == p, (r, n)), d**-0.5) for p in range(parts)]
    merged = merge_partials([s.o for s in states], [s.lse for s in states])
    o_ref, lse_ref, _ = attention_f64(q, k, v, np.ones((r, n), bool), d**-0.5)
    assert rel_err(merged.o, o_ref) < 1e-5
    np.testing.assert_allclose(np.asarray(merged.lse), lse_ref, rtol=1e-6)


def test_empty_partitions_never_give_nan():
    o = jnp.ones((3, 4), jnp.bfloat16)
    empty = PartialState(jnp.zeros((3, 4), jnp.bfloat16), jnp.full((3,), -jnp.inf))
    full = PartialState(o, jnp.array([0.5, -3.0, 10.0]))
    m = merge_two(empty, full)
    np.testing.assert_array_equal(np.asarray(m.o, np.float32), np.ones((3, 4)))
    np.testing.assert_allclose(np.asarray(m.lse), [0.5, -3.0, 10.0])
    both_empty = merge_two(empty, empty)
    assert not np.isnan(np.asarray(both_empty.o, np.float32)).any()
    assert np.all(np.asarray(both_empty.o, np.float32) == 0) and np.all(np.isneginf(np.asarray(both_empty.lse)))


def test_lse_is_float32_whatever_the_output_dtype():
    o = jnp.ones((2, 8), jnp.bfloat16)
    m = merge_partials([o, o], [jnp.zeros((2,), jnp.bfloat16), jnp.ones((2,), jnp.float16)])
    assert m.lse.dtype == jnp.float32 and m.o.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(m.lse), np.logaddexp(0.0, 1.0), rtol=1e-6)


def test_merge_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="outputs\\[1\\].shape"):
        merge_partials([jnp.zeros((2, 4)), jnp.zeros((3, 4))], [jnp.zeros((2,)), jnp.zeros((3,))])
    with pytest.raises(ValueError, match="lses\\[0\\].shape"):
        merge_partials([jnp.zeros((2, 4))], [jnp.zeros((4,))])


def _merge_f64(outputs, lses):
    """Float64 oracle of the merge, with the max subtracted (the definition)."""
    lse = np.stack([np.asarray(x, np.float64) for x in lses])
    m = np.max(lse, axis=0)
    safe = np.where(np.isfinite(m), m, 0.0)
    w = np.exp(lse - safe)
    total = w.sum(axis=0)
    o = sum(w[i][..., None] * np.asarray(x, np.float64) for i, x in enumerate(outputs))
    o = np.where(total[..., None] > 0, o / np.where(total > 0, total, 1.0)[..., None], 0.0)
    return o, np.where(total > 0, safe + np.log(np.where(total > 0, total, 1.0)), -np.inf)


@pytest.mark.parametrize("scale", [1.0, 90.0, 1e4])
def test_merge_under_extreme_lse_empty_parts_and_rows_empty_in_one_part(rng, scale):
    """Large LSE (exp overflows float32 past ~88 without the max subtraction), N = 4 parts of which
    one is empty everywhere, rows empty in some parts only, and an all-empty row."""
    rows, d, parts = 7, 16, 4
    outputs = [rng.standard_normal((rows, d)).astype(np.float32) for _ in range(parts)]
    lses = [(rng.standard_normal(rows) * 3 + scale).astype(np.float32) for _ in range(parts)]
    lses[1][:] = -np.inf  # an empty part
    outputs[1][:] = 0.0
    lses[2][[0, 3]] = -np.inf  # rows empty in one part only
    outputs[2][[0, 3]] = 0.0
    for i in range(parts):  # row 6: empty in every part
        lses[i][6] = -np.inf
        outputs[i][6] = 0.0
    merged = merge_partials([jnp.asarray(x) for x in outputs], [jnp.asarray(x) for x in lses],
                            out_dtype=jnp.float32)
    o_ref, lse_ref = _merge_f64(outputs, lses)
    o, lse = np.asarray(merged.o), np.asarray(merged.lse)
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    np.testing.assert_allclose(o, o_ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(lse[:6], lse_ref[:6], rtol=1e-6, atol=1e-4)
    assert np.isneginf(lse[6]) and not o[6].any()
