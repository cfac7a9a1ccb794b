"""Sampling: parameter validation, greedy equivalences, filters, seeds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jhybrid.generation import SamplingParams, sample_tokens


@pytest.mark.parametrize("kwargs, named", [
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=1.5), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
])
def test_invalid_parameters_are_named(kwargs, named):
    with pytest.raises(ValueError, match=named):
        SamplingParams(**kwargs)


def test_two_invalid_parameters_both_named():
    with pytest.raises(ValueError, match="temperature.*top_p"):
        SamplingParams(temperature=-1, top_p=2)


def test_greedy_equivalences(rng):
    logits = jnp.asarray(rng.standard_normal((4, 50)), jnp.float32)
    greedy = np.asarray(sample_tokens(logits, jax.random.key(0), SamplingParams()))
    np.testing.assert_array_equal(greedy, np.argmax(np.asarray(logits), axis=-1))
    for params in (SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=1e-6)):
        for seed in range(5):
            np.testing.assert_array_equal(
                np.asarray(sample_tokens(logits, jax.random.key(seed), params)), greedy)


def test_top_k_and_top_p_keep_only_allowed_tokens():
    probs = np.array([0.5, 0.3, 0.15, 0.05], np.float32)
    logits = jnp.asarray(np.log(probs))[None].repeat(2000, axis=0)
    top_p = np.asarray(sample_tokens(logits, jax.random.key(1), SamplingParams(temperature=1.0, top_p=0.6)))
    assert set(np.unique(top_p)) == {0, 1}  # 0.5 < 0.6, so token 1 is needed; token 2 is not
    assert abs((top_p == 0).mean() - 0.5 / 0.8) < 0.05
    top_k = np.asarray(sample_tokens(logits, jax.random.key(2), SamplingParams(temperature=1.0, top_k=3)))
    assert set(np.unique(top_k)) == {0, 1, 2}


def test_seed_reproducible_and_temperature_flattens(rng):
    logits = jnp.asarray(rng.standard_normal((64, 100)), jnp.float32)
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=3)
    a = sample_tokens(logits, jax.random.key(3), params)
    b = sample_tokens(logits, jax.random.key(3), params)
    c = sample_tokens(logits, jax.random.key(4), params)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(c))
