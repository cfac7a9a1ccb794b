"""Per-row sampling (jhybrid/serving/sampling.py) against the Generator's `sample_tokens`.

Every row of a batch is drawn as `sample_tokens` draws a batch of one with that row's parameters
and key fold_in(key(seed), index), whichever branch the batch takes: all greedy (argmax only),
sampling without filters (no sort), and filters on some rows only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jhybrid.generation import SamplingParams, sample_tokens
from jhybrid.serving.sampling import RowSampling, sample_rows

VOCAB = 301  # odd, not a power of two

BATCHES = {
    "all greedy": [SamplingParams(), SamplingParams()],
    "temperature only": [SamplingParams(temperature=0.7, seed=1), SamplingParams(), SamplingParams(temperature=1.3, seed=2)],
    "filters on some rows": [SamplingParams(temperature=1.0, top_k=5, seed=3), SamplingParams(temperature=0.9, seed=4),
                             SamplingParams(), SamplingParams(temperature=1.1, top_p=0.8, seed=5),
                             SamplingParams(temperature=0.6, top_k=40, top_p=0.5, seed=6),
                             SamplingParams(temperature=1.0, top_k=VOCAB, seed=7)],
}


def expected(logits: np.ndarray, params: SamplingParams, index: int) -> int:
    key = jax.random.fold_in(jax.random.key(params.seed), index)
    return int(sample_tokens(jnp.asarray(logits[None]), key, params)[0])


@pytest.mark.parametrize("name", sorted(BATCHES))
def test_each_row_draws_as_a_batch_of_one(name):
    rows = BATCHES[name]
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    sampling = RowSampling.empty(len(rows))
    for row, params in enumerate(rows):
        sampling.set_row(row, params)
    sample = jax.jit(sample_rows)
    for draw in range(4):  # fresh logits and token indices each time
        logits = rng.normal(size=(len(rows), VOCAB)).astype(np.float32) * 3
        sampling = sampling.replace(index=rng.integers(0, 1000, len(rows)).astype(np.int32))
        got = np.asarray(sample(jnp.asarray(logits), sampling))
        want = [expected(logits[r], p, int(sampling.index[r])) for r, p in enumerate(rows)]
        assert got.tolist() == want, f"{name}, draw {draw}"
        greedy = [r for r, p in enumerate(rows) if p.greedy]
        assert (got[greedy] == logits[greedy].argmax(-1)).all()
