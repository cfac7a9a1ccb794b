"""Per-row sampling: every row of a batch with its own SamplingParams, in one jitted function.

The serving engine's rows belong to different requests, each with its own temperature, top-k,
top-p and seed. `RowSampling` carries them as [B] arrays (a pytree of fixed shapes: changing a
request's parameters never recompiles), and `sample_rows` draws row b's token exactly as
`jhybrid.generation.sample_tokens` draws it for a batch of one with that row's parameters and key
`fold_in(key(seed), index)` (the Generator's key of a request's token `index`): a request's seeded
output does not depend on its slot or its batch mates, and equals the Generator's run alone.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jhybrid.generation import SamplingParams


@struct.dataclass
class RowSampling:
    """The sampling parameters of B rows (host NumPy or device arrays).

    key_data     [B, 2] uint32  `jax.random.key_data(jax.random.key(seed))` of each row's request
    index        [B] int32      which token of its request each row samples (0 = the first)
    temperature  [B] float32    0 = greedy (argmax)
    top_k        [B] int32      0 = no top-k filter
    top_p        [B] float32    1.0 = no nucleus filter
    """

    key_data: jax.Array
    index: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array

    @classmethod
    def empty(cls, batch: int) -> "RowSampling":
        """B greedy rows (NumPy, to be filled in place with `set_row`)."""
        return cls(key_data=np.zeros((batch, 2), np.uint32), index=np.zeros(batch, np.int32),
                   temperature=np.zeros(batch, np.float32), top_k=np.zeros(batch, np.int32),
                   top_p=np.ones(batch, np.float32))

    def set_row(self, row: int, params: SamplingParams) -> None:
        """Row `row` samples with `params` from now on (in place; NumPy arrays only)."""
        self.key_data[row] = seed_key_data(params.seed) if not params.greedy else 0
        self.temperature[row] = params.temperature
        self.top_k[row] = params.top_k
        self.top_p[row] = params.top_p


@functools.lru_cache(maxsize=4096)
def _seed_key_data(seed: int) -> tuple[int, int]:
    return tuple(int(x) for x in np.asarray(jax.random.key_data(jax.random.key(seed))))


def seed_key_data(seed: int) -> np.ndarray:
    """[2] uint32: the key data of `jax.random.key(seed)` (what the Generator builds from a seed)."""
    return np.asarray(_seed_key_data(int(seed)), np.uint32)


def _filter_one(scaled, top_k, top_p):
    """One row's top-k, then top-p filter: scaled logits [V] float32 -> the same with the cut ones -inf
    (the arithmetic of `sample_tokens`; top_k 0 and top_p 1.0 leave the row as it is)."""
    vocab = scaled.shape[-1]
    sorted_desc = jnp.sort(scaled)[::-1]
    use_k = (top_k > 0) & (top_k < vocab)
    kth_largest = sorted_desc[jnp.clip(top_k - 1, 0, vocab - 1)]
    scaled = jnp.where(use_k & (scaled < kth_largest), -jnp.inf, scaled)
    # The nucleus over what top-k kept: the sorted kept logits are sorted_desc with the cut ones -inf.
    kept_sorted = jnp.where(use_k & (sorted_desc < kth_largest), -jnp.inf, sorted_desc)
    probs = jax.nn.softmax(kept_sorted)
    mass_before = jnp.cumsum(probs) - probs
    num_kept = jnp.sum(mass_before < top_p)
    threshold = kept_sorted[num_kept - 1]
    return jnp.where((top_p < 1.0) & (scaled < threshold), -jnp.inf, scaled)


def _draw_one(scaled, key_data, index):
    """One row's draw from scaled logits [V] with key fold_in(key, index) -> token int32: a [1, V]
    draw, as the Generator's batch of one draws it (the same Gumbel noise)."""
    key = jax.random.fold_in(jax.random.wrap_key_data(key_data), index)
    return jax.random.categorical(key, scaled[None], axis=-1)[0].astype(jnp.int32)


def sample_rows(logits: jax.Array, sampling: RowSampling) -> jax.Array:
    """logits [B, V] float32 -> tokens [B] int32, row b sampled with row b's parameters (jittable).

    The sort of the filters and the random draw run only when some row needs them (`lax.cond`
    outside the per-row map: under vmap a cond would run both branches). A vocabulary sort costs
    more than a decode step's attention on a small batch, and serving is mostly greedy. On a GPU a
    program with a cond reads its predicate on the host: run this in a program of its own, not inside
    a model step (the serving engine's steps return logits), or the step's dispatch waits for the
    device."""
    temperature, top_k, top_p = sampling.temperature, sampling.top_k, sampling.top_p
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled(logits):
        scaled = logits.astype(jnp.float32) / jnp.where(temperature > 0, temperature, 1.0)[:, None]
        filters = jnp.any((temperature > 0) & (((top_k > 0) & (top_k < logits.shape[-1])) | (top_p < 1.0)))
        scaled = jax.lax.cond(filters, jax.vmap(_filter_one), lambda s, k, p: s, scaled, top_k, top_p)
        drawn = jax.vmap(_draw_one)(scaled, sampling.key_data, sampling.index)
        return jnp.where(temperature > 0, drawn, greedy)

    return jax.lax.cond(jnp.any(temperature > 0), sampled, lambda logits: greedy, logits)


__all__ = ["RowSampling", "sample_rows", "seed_key_data"]
