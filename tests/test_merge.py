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
