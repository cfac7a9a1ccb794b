"""Top-k selection of offloaded blocks (scout, topk) and its split between GPU pool and CPU.

Digests (per layer, device): kmin, kmax [B, Hkv, NB, D] of every offloaded block (Quest), written by
the manager at eviction. The recall pool (scout): pool_k/pool_v [B * R, Hkv, bs, D] hold copies of
R offloaded blocks per sequence, pool_blocks [B, R] int32 their host block numbers (-1 = empty).
A selected block that sits in the pool is attended by the GPU (block-sparse kernel); every other
selected block by the CPU — each token by exactly one producer.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.block_digest import block_scores, select_blocks


class Selection(NamedTuple):
    """gpu_ids [B, Hkv, k] int32 pool ids, resident first (-1 after gpu_counts); gpu_counts [B, Hkv];
    cpu_ids [B, Hkv, k] int32 host block numbers (-1 = none)."""

    gpu_ids: jax.Array
    gpu_counts: jax.Array
    cpu_ids: jax.Array


def select(q: jax.Array, kmin: jax.Array, kmax: jax.Array, n_blocks: jax.Array, k: int,
           pool_blocks: jax.Array | None, kernel_backend: str | None) -> Selection:
    """q [B, Hq, D]; n_blocks [B] offloaded blocks per sequence; k blocks per (sequence, KV head)."""
    b, hkv = kmin.shape[:2]
    scores = block_scores(q.astype(kmin.dtype), kmin, kmax, n_blocks, backend=kernel_backend)
    ids, _ = select_blocks(scores, n_blocks, k=k)  # [B, Hkv, k], -1 past counts
    if pool_blocks is None or pool_blocks.shape[1] == 0:
        empty = jnp.full_like(ids, -1)
        return Selection(empty, jnp.zeros((b, hkv), jnp.int32), ids)
    r = pool_blocks.shape[1]
    match = (ids[..., None] == pool_blocks[:, None, None, :]) & (ids[..., None] >= 0)  # [B, Hkv, k, R]
    resident = jnp.any(match, axis=-1)
    pool_id = jnp.arange(b, dtype=jnp.int32)[:, None, None] * r + jnp.argmax(match, axis=-1).astype(jnp.int32)
    order = jnp.argsort(~resident, axis=-1, stable=True)  # resident entries first
    gpu_ids = jnp.take_along_axis(jnp.where(resident, pool_id, -1), order, axis=-1)
    gpu_counts = jnp.sum(resident, axis=-1).astype(jnp.int32)
    cpu_ids = jnp.where(resident, -1, ids)
    return Selection(gpu_ids.astype(jnp.int32), gpu_counts, cpu_ids.astype(jnp.int32))
