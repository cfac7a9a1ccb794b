"""Top-k selection of offloaded blocks (scout, topk) and its split between GPU pool and CPU, and
what the selecting modes share on the device (their GPU parts, the record of a selection).

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

from jhybrid.hybrid.window import decode_attention
from pallas_kernels.block_digest import block_scores, select_blocks
from pallas_kernels.block_sparse_attention import block_sparse_attention


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


# ---- what the selecting modes (topk, scout) share ------------------------------------------------

def budget_blocks(config, max_len: int) -> int:
    """Blocks selected per (sequence, KV head): the budget's, at most every host block."""
    nb = config.host_blocks(max_len)
    return min(config.topk_blocks or nb, nb)


def check_budget(config, max_len: int) -> None:
    """ValueError when a top-k budget given (not "auto", which is clamped) exceeds the context."""
    k = config.topk_blocks
    if config.budget != "auto" and k is not None and k * config.block_size > max_len:
        raise ValueError(f"top-k budget of {k} blocks x {config.block_size} tokens is larger than the "
                         f"context of {max_len} tokens")


def select_for(config, q, state, offloaded, digests, pool_blocks) -> Selection:
    """The top-k of one layer for q [B, 1, Hq, D] over `digests` (a `Digests`), split against the
    pool table `pool_blocks` [B, Hkv, R] (None: no pool); k = the width of `state.selected`."""
    k = state.selected.shape[2]
    return select(q[:, 0], digests.kmin, digests.kmax, offloaded, k, pool_blocks, config.kernel_backend)


def gpu_parts(config, step, q, state, sel: Selection):
    """The window (+ the pool's selected blocks) on the GPU -> ([(o, lse), ...], ring probs)."""
    o_w, lse_w, probs = decode_attention(config, q, state.window, step.lengths, step.offloaded, step.scale)
    parts = [(o_w, lse_w)]
    if state.pool is not None:
        parts.append(block_sparse_attention(q, state.pool.k, state.pool.v, sel.gpu_ids, sel.gpu_counts,
                                            scale=step.scale, backend=config.kernel_backend))
    return parts, probs


def note_selection(state, sel: Selection, positions):
    """Record the selection in a LayerState: `selected` (the whole top-k) and, with a pool, each
    selected slot's last use (the recall planner evicts the least recently used slots)."""
    state = state.replace(selected=sel.ids.astype(jnp.int32))
    if state.pool is not None and sel.pool_hit is not None:
        pos = positions[:, 0].astype(jnp.int32)[:, None, None]
        used = jnp.where(sel.pool_hit & (pos >= 0), pos, state.pool.used)
        state = state.replace(pool=state.pool.replace(used=used))
    return state
