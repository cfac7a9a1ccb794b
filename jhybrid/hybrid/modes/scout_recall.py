"""scout's asynchronous, incremental recall of important offloaded blocks into the GPU pool (§3.4).

Three pieces, used by `ScoutHost` (jhybrid.hybrid.modes.scout):

  plan_recall   (host, NumPy)  which (sequence, KV head, slot) gets which host block: the blocks
                the CPU attended at the last step, best-scored first, go into the least recently
                used slots of the same (sequence, KV head) — never into a slot the last step used.
  stage_recall  (background thread)  gathers exactly those (block, head) rows from the host store
                into a staging buffer and starts their upload (host -> `pinned_host` -> device on a
                GPU; a plain device_put elsewhere, logged once). Nothing already resident moves.
  apply_recall  (main thread, between steps)  one small jitted scatter, donating the pool buffers:
                the layer's `Pool` (rows, table, last use), and next_pool_blocks of the layer before
                it (scout's layer-ahead selection of this layer reads that copy; the two tables are
                always written together so they never disagree).

The scout host applies a staged recall at the first step start at which its upload has finished and
never waits for it. Exactness does not depend on timing: a block is attended by the GPU iff it is
in pool_blocks when the step runs, and pool rows and table change in the same scatter.

Shapes (R = slots per (sequence, KV head), N = recalled (block, head) rows, padded to Np):
  Pool (jhybrid.hybrid.state), next_pool_blocks [B, Hkv, R] int32
  plan: b, h, r, block  int32 [N]
  staged k, v           [Np, bs, D] model dtype (rows past N: b = B, dropped by the scatter)
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from concurrent.futures import Future

import jax
import jax.numpy as jnp
import numpy as np

from jhybrid.hybrid.transfer import next_pow2, stored_as, to_device


@dataclasses.dataclass
class RecallPlan:
    """One layer's recall: rows (b[i], h[i]) of slot r[i] receive host block block[i] (int32 [N])."""

    layer: int
    b: np.ndarray
    h: np.ndarray
    r: np.ndarray
    block: np.ndarray
    trigger_step: int
    epoch: int
    warm: bool = False
    future: Future | None = None
    bg_s: float = 0.0  # background seconds (gather + conversion + upload)

    @property
    def n(self) -> int:
        return int(self.block.size)


def plan_recall(cpu_ids: np.ndarray, pool_ids: np.ndarray, pool_used: np.ndarray,
                last_pos: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Pick the recall of one layer.

    cpu_ids   int [B, Hkv, k]  blocks the CPU attended at the last step, best first (-1 = none);
                               by construction none of them is resident in (b, h)'s slots
    pool_ids  int [B, Hkv, R]  current pool table (-1 = empty)
    pool_used int [B, Hkv, R]  position of the last step that selected each slot (-1 = never)
    last_pos  int [B]          position of the last step's token (a slot with pool_used ==
                               last_pos was selected at that step and is kept)
    Returns (b, h, r, block) int32 [N]: for each (b, h), its best CPU blocks paired with its free or
    least recently used slots, as many as there are both.
    """
    bsz, hkv, k = cpu_ids.shape
    r_slots = pool_ids.shape[2]
    if r_slots == 0:
        empty = np.zeros(0, np.int32)
        return empty, empty, empty, empty
    valid = cpu_ids >= 0
    cand = np.take_along_axis(cpu_ids, np.argsort(~valid, axis=2, kind="stable"), axis=2)  # valid first
    n_cand = valid.sum(axis=2)
    # Slot priority: empty first, then least recently used; a slot used at the last step is not free.
    key = np.where(pool_ids < 0, -2, pool_used).astype(np.int64)
    free = (pool_ids < 0) | (pool_used < last_pos[:, None, None])
    order = np.argsort(key, axis=2, kind="stable")
    n_free = free.sum(axis=2)
    m = min(k, r_slots)
    n = np.minimum(np.minimum(n_cand, n_free), m)  # [B, Hkv]
    take = np.arange(m)[None, None, :] < n[..., None]  # [B, Hkv, m]
    bi, hi, ji = np.nonzero(take)
    return (bi.astype(np.int32), hi.astype(np.int32), order[bi, hi, ji].astype(np.int32),
            cand[bi, hi, ji].astype(np.int32))


def stage_recall(store, plan: RecallPlan, batch: int, dtype, device, hook=None, pool_specs=None):
    """Background: gather plan's (block, head) rows from the host store and upload them.

    Returns (staged, apply): staged = device arrays (b, h, r, block int32 [Np], k, v [Np, bs, D]
    dtype), Np = next power of two >= N (padding rows have b = batch, dropped by the scatter);
    apply = `apply_recall` compiled ahead of time for these shapes when pool_specs (the
    ShapeDtypeStructs of the pool and of next_pool_blocks, None when absent) are given,
    so the step start that applies it never compiles. `hook()` (tests) runs first.
    """
    start = time.perf_counter()
    if hook is not None:
        hook()
    c = store.config
    n = plan.n
    size = max(8, next_pow2(n))
    dtype = np.dtype(dtype)
    k_st = np.zeros((size, c.block_size, c.row_width), store.layers[plan.layer].arrays["k"].dtype)
    v_st = np.zeros_like(k_st)
    arena_slot = np.zeros(n, np.int64)
    for b in np.unique(plan.b):
        rows = np.nonzero(plan.b == b)[0]
        slots = store.block_slots(plan.layer, int(b))  # copy, under the store's lock
        if plan.block[rows].max() >= slots.shape[0]:
            raise RuntimeError(f"scout recall: block {int(plan.block[rows].max())} of sequence {int(b)} "
                               f"layer {plan.layer} is not in the host store ({slots.shape[0]} blocks)")
        arena_slot[rows] = slots[plan.block[rows]]
    with store.lock:  # the arena may be reallocated by a concurrent append; blocks never change
        arrays = store.layers[plan.layer].arrays
        k_st[:n] = arrays["k"][arena_slot, plan.h]
        v_st[:n] = arrays["v"][arena_slot, plan.h]
    k_host, v_host = stored_as(k_st, c.kv_dtype, dtype), stored_as(v_st, c.kv_dtype, dtype)
    pad = size - n
    idx = [np.concatenate([x, np.full(pad, fill, np.int32)]) for x, fill in
           ((plan.b, batch), (plan.h, 0), (plan.r, 0), (plan.block, -1))]
    out = tuple(jax.device_put(x, device) for x in idx) + (to_device(k_host, device), to_device(v_host, device))
    apply = None
    if pool_specs is not None:
        now = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=jax.sharding.SingleDeviceSharding(device))
        apply = compiled_apply(tuple(pool_specs) + tuple(_spec(x) for x in out) + (now,))
    jax.block_until_ready(out)
    plan.bg_s = time.perf_counter() - start
    return out, apply


def _spec(x):
    return None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


def pool_spec(x):
    """ShapeDtypeStructs (with shardings) of a pool argument (an array or a Pool), or None."""
    return None if x is None else jax.tree_util.tree_map(_spec, x)


_compiled: dict = {}
_compiled_lock = threading.Lock()


def compiled_apply(specs: tuple):
    """`apply_recall` lowered and compiled for these argument specs (cached per shapes/shardings)."""
    key = tuple(None if s is None else (s.shape, str(s.dtype), s.sharding)
                for s in jax.tree_util.tree_leaves(specs, is_leaf=lambda x: x is None))
    with _compiled_lock:
        exe = _compiled.get(key)
    if exe is None:
        exe = apply_recall.lower(*specs).compile()
        with _compiled_lock:
            _compiled[key] = exe
    return exe


@functools.partial(jax.jit, donate_argnums=(0, 1))
def apply_recall(pool, next_pool_blocks, b, h, r, block, k, v, now):
    """Scatter staged rows into one layer's `Pool` (buffers donated) -> (pool, next_pool_blocks).
    next_pool_blocks may be None. now int32 [B]: the position written to `used` of the new slots
    (recent, so the next plan does not evict a block before it had a chance to be selected)."""
    n_slots = pool.blocks.shape[2]
    row = b * n_slots + r  # >= B * R for padding rows (b = B): dropped
    stamp = now[jnp.minimum(b, now.shape[0] - 1)]
    pool = pool.replace(k=pool.k.at[row, h].set(k.astype(pool.k.dtype), mode="drop"),
                        v=pool.v.at[row, h].set(v.astype(pool.v.dtype), mode="drop"),
                        blocks=pool.blocks.at[b, h, r].set(block, mode="drop"),
                        used=pool.used.at[b, h, r].set(stamp, mode="drop"))
    if next_pool_blocks is not None:
        next_pool_blocks = next_pool_blocks.at[b, h, r].set(block, mode="drop")
    return pool, next_pool_blocks
