"""Top-k selection of offloaded blocks (scout, topk) and its split between GPU pool and CPU.

Digests (per layer, device): kmin, kmax [B, Hkv, NB, D] of every offloaded block (Quest), written by
the manager at eviction. The recall pool (scout): pool_k/pool_v [B * R, Hkv, bs, D] hold R slots per
sequence; slot r of KV head h holds (for that head only) the host block pool_blocks[b, h, r]
(int32 [B, Hkv, R], -1 = empty). Slots are per (sequence, KV head) because Quest selects per KV
head: heads of one sequence rarely agree on their top-k blocks, and a per-sequence slot table would
cover at most R / (Hkv * k) of the selection. A selected block of head h that sits in one of h's
slots is attended by the GPU (block-sparse kernel); every other selected block by the CPU — each
token by exactly one producer.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.block_digest import block_scores, select_blocks


class Selection(NamedTuple):
    """gpu_ids [B, Hkv, k] int32 pool ids (b * R + slot), resident first (-1 after gpu_counts);
    gpu_counts [B, Hkv] int32; cpu_ids [B, Hkv, k] int32 host block numbers (-1 = none);
    ids [B, Hkv, k] int32 the whole top-k, best first (-1 past the sequence's blocks);
    pool_hit [B, Hkv, R] bool, slot selected this step (None without a pool)."""

    gpu_ids: jax.Array
    gpu_counts: jax.Array
    cpu_ids: jax.Array
    ids: jax.Array
    pool_hit: jax.Array | None = None


def select(q: jax.Array, kmin: jax.Array, kmax: jax.Array, n_blocks: jax.Array, k: int,
           pool_blocks: jax.Array | None, kernel_backend: str | None) -> Selection:
    """q [B, Hq, D]; n_blocks [B] offloaded blocks per sequence; k blocks per (sequence, KV head);
    pool_blocks int32 [B, Hkv, R] (or None / R = 0: no pool)."""
    b, hkv = kmin.shape[:2]
    scores = block_scores(q.astype(kmin.dtype), kmin, kmax, n_blocks, backend=kernel_backend)
    ids, _ = select_blocks(scores, n_blocks, k=k)  # [B, Hkv, k], -1 past counts
    if pool_blocks is None or pool_blocks.shape[-1] == 0:
        empty = jnp.full_like(ids, -1)
        return Selection(empty, jnp.zeros((b, hkv), jnp.int32), ids, ids)
    if pool_blocks.shape[:2] != (b, hkv):
        raise ValueError(f"pool_blocks shape {tuple(pool_blocks.shape)}; expected [B={b}, Hkv={hkv}, R]")
    r = pool_blocks.shape[-1]
    match = (ids[..., None] == pool_blocks[:, :, None, :]) & (ids[..., None] >= 0)  # [B, Hkv, k, R]
    resident = jnp.any(match, axis=-1)
    pool_id = jnp.arange(b, dtype=jnp.int32)[:, None, None] * r + jnp.argmax(match, axis=-1).astype(jnp.int32)
    order = jnp.argsort(~resident, axis=-1, stable=True)  # resident entries first
    gpu_ids = jnp.take_along_axis(jnp.where(resident, pool_id, -1), order, axis=-1)
    gpu_counts = jnp.sum(resident, axis=-1).astype(jnp.int32)
    cpu_ids = jnp.where(resident, -1, ids)
    return Selection(gpu_ids.astype(jnp.int32), gpu_counts, cpu_ids.astype(jnp.int32), ids,
                     jnp.any(match, axis=2))
