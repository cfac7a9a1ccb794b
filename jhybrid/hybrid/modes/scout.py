"""`scout` (ScoutAttention): top-k blocks by Quest digests, attended partly on the GPU (blocks
recalled into a per-layer pool) and partly on the CPU, whose part is started one layer ahead with a
predicted query; important blocks are recalled to the GPU asynchronously.

Device side, per layer of a decode step:
  exact layers (layer 0, `scout_exact_layers`, every layer without predict_query): select with the
      layer's own query, submit the CPU blocks, as `topk`;
  predicted layers: the selection and CPU work were submitted by the previous layer (the decoder
      hands them over as a `LayerAhead` carry).
  Then the window kernel + the block-sparse kernel over the selected blocks resident in the pool,
  then ONE exchange that collects this layer's CPU part and, if the next layer is predicted,
  submits its work, chosen with the next layer's norm + W_q + RoPE applied to this layer's input
  (the decoder computes that query when `wants_next_query` says so).
  Exchanges per decode step: L + |exact layers| (L + 1 with layer 0 only).
Host side (`ScoutHost`): asynchronous incremental recall into the pool (§3.4; "The recall"
below): at a step start, per layer, when the CPU's share of the
layer's selected blocks at the last step exceeded `recall_threshold` (and `recall_min_interval`
steps passed, and none of its recalls is in flight), a background thread plans, gathers and
uploads the recall, the layers triggered at one step start together (`RecallGroup`); the first
decode step start at which a group has finished applies it with one jitted, buffer-donating
scatter over every layer's pool (`recall_layers_per_step` bounds both per step start); no step
waits for it (recall_lag_steps None; an int N applies each one exactly N steps after its trigger,
for replayable runs). Warm start, as the paper's GPU keeps the
blocks selected after prefill: at the second decode step after a row's prefill (or an adopted store)
every layer recalls what its first decode step selected (like every recall, never waited for).
The share and the plans count only rows whose last step was a decode step of their own sequence
(not one just prefilled or reset: `ScoutHost.stale`), so a row's new prompt never delays the
others' recalls, and no recall moves a block of a row's previous sequence (continuous batching).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numba
import numpy as np

from host.exchange_worker import BlockPages
from host.gather import gather_rows
from host.targets import CHOSEN_BLOCKS
from jhybrid.hybrid.calibration import resolve_exact_layers
from jhybrid.hybrid.exchange import after
from jhybrid.hybrid.modes.base import DecodeStep, ModeHost, OffloadMode, SplitBudget
from jhybrid.hybrid.runtime import Counters
from jhybrid.hybrid.selection import budget_blocks, check_budget, gpu_parts, note_selection, select_for
from jhybrid.hybrid.state import Digests, LayerAhead, LayerState, Pool
from jhybrid.hybrid.transfer import log_once, stored_as, to_device
from pallas_kernels._common import next_pow2

log = logging.getLogger(__name__)


class Scout(OffloadMode):
    name = "scout"
    packs_decode = True
    settings = frozenset({"budget", "recall_blocks", "recall_threshold", "recall_min_interval", "recall_lag_steps",
                          "recall_layers_per_step", "predict_query", "scout_exact_layers", "scout_min_cos"})
    host_target = CHOSEN_BLOCKS

    default_window_tokens = 272  # the sinks + the last 256 tokens: the paper's regime (module docstring)
    grows_window = False  # the GPU keeps important blocks in the pool, not a longer window
    default_budget = 2048  # ScoutAttention's evaluation budget (tokens per sequence and KV head)

    @classmethod
    def defaults(cls, config):
        """recall_blocks None: a pool of twice the budget's blocks (8 with every block selected)."""
        if config.recall_blocks is not None:
            return {}
        k = config.topk_blocks
        return {"recall_blocks": 8 if k is None else 2 * k}

    @classmethod
    def config_problems(cls, config):
        exact = config.scout_exact_layers
        if not config.predict_query and isinstance(exact, tuple) and set(exact) - {0}:
            return [("scout_exact_layers", exact, "with predict_query=False every layer already uses its exact "
                     "query (set one of the two)")]
        return []

    def exact_layers(self) -> frozenset:
        """scout_exact_layers as a set of layer indices (layer 0 always included; "auto" left
        unresolved: layer 0 only, see `jhybrid.hybrid.calibration`)."""
        exact = self.config.scout_exact_layers
        if exact == "auto":
            return frozenset((0,))
        return frozenset(range(max(exact, 1)) if isinstance(exact, int) else (0, *exact))

    def selects_exactly(self, layer: int) -> bool:
        """Does `layer` select with its own exact query (False: the layer-ahead prediction)?"""
        return not self.config.predict_query or layer in self.exact_layers()

    def max_block_ids(self, max_len):
        return budget_blocks(self.config, max_len)

    def check(self, model_config, max_len):
        check_budget(self.config, max_len)
        n = model_config.num_layers
        over = sorted(x for x in self.exact_layers() if x >= n) if self.config.predict_query else []
        if over:
            raise ValueError(f"scout_exact_layers={self.config.scout_exact_layers!r}: layer(s) "
                             f"{', '.join(map(str, over))} out of range for a model of {n} layers (0..{n - 1})")
        if self.config.predict_query and self.config.scout_exact_layers == "auto":
            log_once("scout-auto-unresolved", logging.WARNING, "scout: scout_exact_layers='auto' was not "
                     "resolved (make_backend(..., model=, calibration_tokens=)): every layer but the first "
                     "selects with its layer-ahead predicted query")

    def wants_next_query(self, layer, num_layers):
        return layer + 1 < num_layers and not self.selects_exactly(layer + 1)

    def layer_state(self, layer, num_layers, batch, num_kv_heads, head_dim, max_len, dtype):
        nb, bs, r = self.config.host_blocks(max_len), self.config.block_size, self.config.recall_blocks
        digests = lambda: Digests(jnp.zeros((batch, num_kv_heads, nb, head_dim), dtype),  # noqa: E731
                                  jnp.zeros((batch, num_kv_heads, nb, head_dim), dtype))
        out = {"selected": jnp.full((batch, num_kv_heads, budget_blocks(self.config, max_len)), -1, jnp.int32)}
        if self.selects_exactly(layer):
            out["digests"] = digests()
        ahead = self.wants_next_query(layer, num_layers)
        if ahead:
            out["next_digests"] = digests()
        if r:
            out["pool"] = Pool(k=jnp.zeros((batch * r, num_kv_heads, bs, head_dim), dtype),
                               v=jnp.zeros((batch * r, num_kv_heads, bs, head_dim), dtype),
                               blocks=jnp.full((batch, num_kv_heads, r), -1, jnp.int32),
                               used=jnp.full((batch, num_kv_heads, r), -1, jnp.int32))
            if ahead:
                out["next_pool_blocks"] = jnp.full((batch, num_kv_heads, r), -1, jnp.int32)
        return out

    def decode(self, step: DecodeStep, state: LayerState):
        cfg, exchange, q = self.config, step.exchange, step.q
        pool_blocks = None if state.pool is None else state.pool.blocks
        if self.selects_exactly(step.layer):
            if step.carry is not None:
                raise RuntimeError(f"scout: layer {step.layer} selects with its exact query but a layer-ahead "
                                   "selection was handed to it")
            sel = select_for(cfg, q, state, step.offloaded, state.digests, pool_blocks)
            ticket = exchange.submit(step.layer, CHOSEN_BLOCKS, q, sel.cpu_ids)
            q = after(q, ticket)
        else:
            if step.carry is None:
                raise RuntimeError(f"scout: no layer-ahead selection for layer {step.layer} (layers run in order "
                                   "inside one traced step)")
            sel, ticket = step.carry
        ahead = self.wants_next_query(step.layer, step.num_layers)
        if ahead:
            next_sel = select_for(cfg, step.next_q, state, step.offloaded, state.next_digests, state.next_pool_blocks)
        parts, probs = gpu_parts(cfg, step, q, state, sel)
        lse_w = parts[0][1]
        carry = None
        if ahead:
            o_c, lse_c, next_ticket = exchange.collect_and_submit(step.layer, ticket, q.shape, CHOSEN_BLOCKS,
                                                                  step.layer + 1, step.next_q, next_sel.cpu_ids, lse_w)
            carry = LayerAhead(next_sel, next_ticket)
        else:
            o_c, lse_c = exchange.collect(step.layer, ticket, q.shape, lse_w)
        parts.append((o_c, lse_c))
        return parts, probs, note_selection(state, sel, step.positions), carry

    def host(self, context) -> "ScoutHost":
        return ScoutHost(context, self.max_block_ids(context.shape.max_len))

    # ---- around the core --------------------------------------------------------------------------
    def balanced(self, budget: SplitBudget) -> dict:
        """The budget stays the config's (an accuracy setting, not a speed one); the pool holds twice
        its blocks, so that the selection's stable part and its recent alternates are resident and
        the CPU attends only what drifts (the split reports whether the host keeps up:
        `SplitReport.cpu_tokens_per_seq_head` against the budget's CPU part)."""
        k = self.config.topk_blocks
        return {} if k is None else {"recall_blocks": 2 * k}

    @classmethod
    def needs_calibration(cls, config):
        return config.predict_query and config.scout_exact_layers == "auto"

    @classmethod
    def for_model(cls, config, model, calibration_tokens):
        return resolve_exact_layers(config, model, calibration_tokens)

    def row_fields(self) -> dict:
        cfg = self.config
        exact = cfg.scout_exact_layers
        return {"budget": cfg.effective_budget, "recall_blocks": cfg.recall_blocks, "predict_query": cfg.predict_query,
                "exact_layers_used": exact if isinstance(exact, (int, str)) else list(exact)}


# ---- the recall (§3.4) ---------------------------------------------------------------------------
# The asynchronous, incremental recall of important offloaded blocks into the GPU pool, in three
# pieces used by `ScoutHost`:
#
#   plan_recall    (host, NumPy)  which (sequence, KV head, slot) gets which host block: the blocks
#                  the CPU attended at the last step, best-scored first, go into the least recently
#                  used slots of the same (sequence, KV head) — never into a slot the last step used.
#   stage_recall   (background thread)  gathers exactly those (block, head) rows of a `RecallGroup`
#                  (the layers triggered together at one step start, at most GROUP_LAYERS) from the
#                  host store into one staging buffer and starts its upload (host -> `pinned_host` ->
#                  device on a GPU; a plain device_put elsewhere, logged once). Nothing resident moves.
#   apply_recalls  (main thread, between steps)  ONE jitted scatter per group, donating every layer's
#                  pool buffers: each layer's `Pool` (rows, table, last use) takes its own entries,
#                  and next_pool_blocks of the layer before it (scout's layer-ahead selection of this
#                  layer reads that copy; the two tables are always written together so they never
#                  disagree). One launch per group, not per layer: on the H200 each launch held the
#                  serving engine's thread ~3.5 ms (session q), and a warm start recalls every layer.
#
# The scout host applies a staged group at the first step start at which its upload has finished and
# never waits for it (recall_lag_steps None), or exactly recall_lag_steps after its trigger. Exactness does not depend on timing: a block is attended by the GPU iff it is
# in pool_blocks when the step runs, and pool rows and table change in the same scatter.
#
# Shapes (R = slots per (sequence, KV head), N = recalled (block, head) rows of a group, padded to Np):
#   Pool (jhybrid.hybrid.state), next_pool_blocks [B, Hkv, R] int32
#   plan (one layer): b, h, r, block  int32 [n]
#   staged (a group): b, h, r, block, layer  int32 [Np]; k, v [Np, bs, D] model dtype, or the int8
#                     store's rows [Np, bs, D + 4] (dequantized on the device); rows past N: b = B,
#                     layer = -1, dropped by the scatter

GROUP_LAYERS = 8  # layers per recall group: a warm start (every layer) stages and applies in 4 pieces
                  # of at most 8 x B x Hkv x min(k, R) rows, so its first layers land before the last gather


@dataclasses.dataclass
class RecallPlan:
    """One layer's part of a recall: rows (b[i], h[i]) of slot r[i] receive host block block[i]
    (int32 [n]); warm: a warm start (a row's first selection with CPU blocks since its prefill)."""

    layer: int
    b: np.ndarray
    h: np.ndarray
    r: np.ndarray
    block: np.ndarray
    warm: bool = False

    @property
    def n(self) -> int:
        return int(self.block.size)


@dataclasses.dataclass(eq=False)
class RecallGroup:
    """The layers' recalls triggered together at one step start: planned, gathered and uploaded by
    one background job (its `future`: (staged, apply) or None when nothing moves), applied by one
    `apply_recalls` scatter. plans by ascending layer."""

    plans: list[RecallPlan]
    trigger_step: int
    epoch: int
    resets: np.ndarray  # int64 [B]: the rows' reset counts at the trigger
    future: Future | None = None
    bg_s: float = 0.0  # background seconds (plan, gather, conversion, upload)
    void: np.ndarray | None = None  # rows reset since the trigger: their part is dropped when applied

    @property
    def layers(self) -> list[int]:
        return [plan.layer for plan in self.plans]

    @property
    def n(self) -> int:
        return sum(plan.n for plan in self.plans)


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


def stage_recall(store, group: RecallGroup, batch: int, dtype, device, hook=None, pool_specs=None, resets=None):
    """Background: gather the group's (layer, block, head) rows from the host store and upload them.

    `resets` int64 [B] (live, the rows' reset counts; with group.resets, the counts at the trigger):
    a row reset since the trigger is left out of the plans, its blocks unread (the runtime may have
    freed its sequence, or a new one may hold the row). Returns None when no row is left, else
    (staged, apply): staged = device arrays (b, h, r, block, layer int32 [Np], k, v [Np, bs, D]
    dtype), the plans' rows one after the other by layer, Np = next power of two >= N, at least 8
    (padding rows have b = batch and layer = -1, dropped by the scatter); apply = `apply_recalls`
    compiled ahead of time for these shapes when pool_specs (`_pool_specs` of the cache) are given,
    so the step start that applies it never compiles. `hook()` (tests) runs first.
    """
    start = time.perf_counter()
    if hook is not None:
        hook()
    c = store.config
    slots_of = []  # per plan: the arena slot of each of its rows
    for plan in group.plans:
        arena_slot = np.zeros(plan.n, np.int64)
        kept = np.ones(plan.n, bool)
        for b in np.unique(plan.b):
            rows = np.nonzero(plan.b == b)[0]
            with store.lock:  # a row's reset count moves before the runtime frees its sequence (under this lock)
                if resets is not None and resets[b] != group.resets[b]:
                    kept[rows] = False  # reset since the trigger: dropped when applied anyway
                    continue
                slots = store.block_slots(plan.layer, int(b))  # a copy
            if plan.block[rows].max() >= slots.shape[0]:
                raise RuntimeError(f"scout recall: block {int(plan.block[rows].max())} of sequence {int(b)} "
                                   f"layer {plan.layer} is not in the host store ({slots.shape[0]} blocks)")
            arena_slot[rows] = slots[plan.block[rows]]
        if not kept.all():
            plan.b, plan.h, plan.r, plan.block = (x[kept] for x in (plan.b, plan.h, plan.r, plan.block))
            arena_slot = arena_slot[kept]
        slots_of.append(arena_slot)
    n = group.n
    if n == 0:
        return None
    size = max(8, next_pow2(n))
    k_st = np.zeros((size, c.block_size, c.row_width), store.layers[group.plans[0].layer].arrays["k"].dtype)
    v_st = np.zeros_like(k_st)
    offset = 0
    for plan, arena_slot in zip(group.plans, slots_of):
        with store.lock:  # the arena may be reallocated by a concurrent append; blocks never change
            arrays = store.layers[plan.layer].arrays
            gather_rows(arrays["k"], arrays["v"], arena_slot, plan.h.astype(np.int64),
                        k_st[offset:offset + plan.n], v_st[offset:offset + plan.n])
        offset += plan.n
    pad = size - n
    columns = [np.concatenate([*[getattr(plan, name) for plan in group.plans], np.full(pad, fill, np.int32)])
               for name, fill in (("b", batch), ("h", 0), ("r", 0), ("block", -1))]
    layer = np.concatenate([*[np.full(plan.n, plan.layer, np.int32) for plan in group.plans],
                            np.full(pad, -1, np.int32)])
    out = _upload([*columns, layer], k_st, v_st, c.kv_dtype, np.dtype(dtype), device)
    apply = None if pool_specs is None else _apply_for(pool_specs, out, batch, device)
    jax.block_until_ready(out)
    group.bg_s = time.perf_counter() - start
    return out, apply


def _upload(idx: list, k_st: np.ndarray, v_st: np.ndarray, kv_dtype: str, dtype, device) -> tuple:
    """A staged recall on `device`: (b, h, r, block, layer int32 [Np], k, v [Np, bs, row]): the rows
    in the model dtype, or as stored when the store holds int8 rows (half the bytes; `apply_recalls`
    dequantizes them)."""
    if kv_dtype == "int8":
        k_host, v_host = k_st, v_st
    else:
        k_host, v_host = stored_as(k_st, kv_dtype, dtype), stored_as(v_st, kv_dtype, dtype)
    return tuple([jax.device_put(x, device) for x in idx]) + (to_device(k_host, device), to_device(v_host, device))


def _pool_specs(layers) -> tuple[tuple, tuple]:
    """The ShapeDtypeStructs (with shardings) of every layer's pool and next_pool_blocks (None where
    a layer has none): `apply_recalls`' first two arguments."""
    return (tuple([pool_spec(getattr(state, "pool", None)) for state in layers]),
            tuple([pool_spec(getattr(state, "next_pool_blocks", None)) for state in layers]))


def _apply_for(pool_specs: tuple, staged: tuple, batch: int, device):
    """`apply_recalls` compiled for a cache's pools (pool_specs: `_pool_specs`) and these staged
    arrays (or their ShapeDtypeStructs)."""
    now = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=jax.sharding.SingleDeviceSharding(device))
    return compiled_apply(tuple(pool_specs) + tuple([_spec(x) for x in staged]) + (now,))


def _spec(x):
    return None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


def pool_spec(x):
    """ShapeDtypeStructs (with shardings) of a pool argument (an array or a Pool), or None."""
    return None if x is None else jax.tree_util.tree_map(_spec, x)


_compiled: dict = {}
_compiled_lock = threading.Lock()


def compiled_apply(specs: tuple):
    """`apply_recalls` lowered and compiled for these argument specs (cached per shapes/shardings)."""
    # (tuples from lists, not generators, here and in the per-step paths: CPython keeps a tuple built
    # from a generator, resized, in the free list of its final size: slow growth over a long decode)
    key = tuple([None if s is None else (s.shape, str(s.dtype), s.sharding)
                 for s in jax.tree_util.tree_leaves(specs, is_leaf=lambda x: x is None)])
    with _compiled_lock:
        exe = _compiled.get(key)
    if exe is None:
        exe = apply_recalls.lower(*specs).compile()
        with _compiled_lock:
            _compiled[key] = exe
    return exe


def _dequantize_rows(rows: jax.Array, d: int) -> jax.Array:
    """int8 store rows [..., D + 4] (host.store_format) -> float32 values [..., D] on the device:
    the same values the CPU attends (host.store_format.from_storage)."""
    scale = jax.lax.bitcast_convert_type(rows[..., d:d + 4].reshape(*rows.shape[:-1], 4), jnp.float32)
    return rows[..., :d].astype(jnp.float32) * scale[..., None]


@functools.partial(jax.jit, donate_argnums=(0, 1))
def apply_recalls(pools, next_blocks, b, h, r, block, layer, k, v, now):
    """Scatter a staged group into every layer's `Pool` (buffers donated) -> (pools, next_blocks).

    pools        tuple [L] of Pool, None for a layer without one
    next_blocks  tuple [L] of int32 [B, Hkv, R] (layer l's copy of layer l + 1's table), or None
    b, h, r, block, layer  int32 [Np]: entry i goes to slot r of (b, h) in layer `layer`; rows with
                 b = B (padding, or a row reset since the trigger) are dropped
    k, v         [Np, bs, D] (or int8 store rows [Np, bs, D + 4])
    now          int32 [B]: the position written to `used` of the new slots (recent, so the next plan
                 does not evict a block before it had a chance to be selected)
    Each layer scatters the group's entries with the others' b moved out of range (dropped): a
    layer with no entry in the group is passed through (its donated buffers aliased)."""
    batch = now.shape[0]
    stamp = now[jnp.minimum(b, batch - 1)]
    first = next(p for p in pools if p is not None)
    if k.dtype == jnp.int8:  # int8 store rows [Np, bs, D + 4]: D values, then their float32 scale
        k, v = (_dequantize_rows(x, first.k.shape[-1]) for x in (k, v))
    pools, next_blocks = list(pools), list(next_blocks)
    for n, pool in enumerate(pools):
        if pool is None:
            continue
        mine = jnp.where(layer == n, b, batch)
        row = mine * pool.blocks.shape[2] + r  # >= B * R when dropped
        pools[n] = pool.replace(k=pool.k.at[row, h].set(k.astype(pool.k.dtype), mode="drop"),
                                v=pool.v.at[row, h].set(v.astype(pool.v.dtype), mode="drop"),
                                blocks=pool.blocks.at[mine, h, r].set(block, mode="drop"),
                                used=pool.used.at[mine, h, r].set(stamp, mode="drop"))
        if n > 0 and next_blocks[n - 1] is not None:
            next_blocks[n - 1] = next_blocks[n - 1].at[mine, h, r].set(block, mode="drop")
    return tuple(pools), tuple(next_blocks)


@dataclasses.dataclass(eq=False)
class ScoutCounters(Counters):
    recall_s: float = 0.0          # time spent triggering and applying recalls on the stepping thread (the two below)
    recall_trigger_s: float = 0.0  # ... of it, triggering (snapshots, the jobs submitted)
    recall_apply_s: float = 0.0    # ... of it, applying finished uploads (the scatters dispatched; at a
                                   # decode step start, or after a call's dispatch: `overlap_dispatch`)
    recall_bg_s: float = 0.0       # background time of the recalls (plan, gather, upload)
    n_recall_triggers: int = 0     # layers whose recall started
    n_recalls: int = 0             # layers' recalls applied
    n_recall_applies: int = 0      # ... in this many scatters (one per `RecallGroup`)
    n_recalls_after_dispatch: int = 0  # ... of them, right after a call's dispatch (`overlap_dispatch`)
    recall_rows: int = 0           # (block, head) rows recalled

    def __post_init__(self):
        Counters.__init__(self)


class ScoutHost(ModeHost):
    """The asynchronous recall of important blocks into each layer's GPU pool (see module doc)."""

    HISTORY = 1024  # entries kept in recall_log
    _LOG_FIELDS = ("layer", "trigger_step", "apply_step", "rows", "warm")

    def __init__(self, context, k: int):
        self.ctx, self.k = context, k
        cfg, shape = context.config, context.shape
        # host copy of every layer's pool table [L, B, Hkv, R] (updated when a recall is applied)
        self.pool_ids = np.full((shape.n_layers, shape.batch, shape.hkv, cfg.recall_blocks), -1, np.int32)
        self.pending: dict[int, RecallGroup] = {}  # layer -> the group of its in-flight recall
        self.last_recall = np.full(shape.n_layers, -10**9)
        self.next_trigger_layer = 0  # recall_layers_per_step: where the next step start's triggers begin
        # rows whose last CPU block ids are not their sequence's last decode step's (a prefill chunk
        # or a reset since): left out of the recall trigger and plans until their next decode step
        self.stale = np.ones(shape.batch, bool)
        self.warm = np.zeros((shape.n_layers, shape.batch), bool)  # (layer, row) warm-start recall still due
        self.epoch = 0  # bumped when the store is replaced: older recalls are void
        self.resets = np.zeros(shape.batch, np.int64)  # per row: how many times it was reset
        self.recall_hook = None  # tests: called at the start of each background recall job
        # the driver calls after_dispatch after every call (`overlap_dispatch`): finished recalls are
        # applied there, in the shadow of the call just dispatched, instead of at the decode step start
        self.applies_after_dispatch = False
        # tensor parallelism: {layer: CPU blocks [B] of the last step over every shard} and the shards' KV heads
        self.shared_counts: dict[int, np.ndarray | None] | None = None
        self.shared_heads = shape.hkv
        # the last HISTORY recalls applied, a preallocated ring (written now, so its memory does not
        # grow with the steps): layer, trigger_step, apply_step, rows, warm; read through `recall_log`
        self._log = np.full((self.HISTORY, len(self._LOG_FIELDS)), -1, np.int64)
        self._log_n = 0
        self.since_reset = 0  # decode step of the last counter reset (row_stats counts from there)
        # a quarter of the host's threads gather the recalled rows (the rest keep attending)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="jhybrid-recall", initializer=numba.set_num_threads,
                                          initargs=(max(1, context.n_threads // 4),))
        self.stats = ScoutCounters()

    @property
    def recall_log(self) -> list[dict]:
        """The last HISTORY recalls applied, oldest first: {"layer", "trigger_step", "apply_step",
        "rows": (block, head) rows moved, "warm": a warm start}."""
        n = min(self._log_n, self.HISTORY)
        rows = self._log[(np.arange(n) + self._log_n - n) % self.HISTORY].tolist()
        return [dict(zip(self._LOG_FIELDS[:4], r[:4]), warm=bool(r[4])) for r in rows]

    def exchange_pages(self, published):
        return BlockPages.of(self.ctx.store, self.k, self.ctx.slot_tables, published)

    def counters(self):
        return self.stats.as_dict()

    def reset_counters(self):
        self.stats.reset()
        self.since_reset = self.ctx.decode_steps

    def row_stats(self):
        """The recalls since the counters were reset: how many were triggered, and the measured
        per-layer interval between two triggers of a layer (decode steps; mean over the layers that
        recalled twice or more, and the shortest and longest layer mean)."""
        since = self.since_reset
        steps: dict[int, list[int]] = {}
        for entry in self.recall_log:
            if entry["trigger_step"] >= since and not entry["warm"]:
                steps.setdefault(entry["layer"], []).append(entry["trigger_step"])
        means = [float(np.mean(np.diff(sorted(s)))) for s in steps.values() if len(s) >= 2]
        return {"recalls": sum(len(s) for s in steps.values()),
                "recall_interval_mean": round(float(np.mean(means)), 2) if means else None,
                "recall_interval_min": round(min(means), 2) if means else None,
                "recall_interval_max": round(max(means), 2) if means else None}

    @classmethod
    def coordinate(cls, hosts):
        """Each shard's recall trigger reads the CPU's share of a layer's selection over every
        shard's heads, as a single device does (each shard then recalls its own heads' blocks).
        Read before any shard's exchange worker is armed for the coming step."""
        counts = {}
        for layer in range(hosts[0].ctx.shape.n_layers):
            parts = [host.cpu_blocks(layer) for host in hosts]
            counts[layer] = None if any(p is None for p in parts) else sum(parts)
        heads = sum(host.ctx.shape.hkv for host in hosts)
        for host in hosts:
            host.shared_counts, host.shared_heads = counts, heads

    def close(self):
        self.epoch += 1
        self.pending.clear()
        self._worker.shutdown(wait=False, cancel_futures=True)

    def adopted(self, store_replaced):
        self.epoch += 1
        self.pending.clear()
        self.pool_ids[:] = -1  # the cache handed in with the store has an empty pool
        self.stale[:] = True
        self.warm[:] = True

    def reset_rows(self, rows):
        """The rows' pool tables are empty (the device side empties their pools), their last CPU
        ids stale, no warm start due; an in-flight recall is not waited for: its gather skips the
        rows (their reset count moves here, before the runtime frees their sequences, and the gather
        checks it under the store's lock) and it drops them when applied; the other rows' part
        lands on schedule."""
        with self.ctx.store.lock:
            self.resets[rows] += 1
        for group in self._groups():
            group.void = rows.copy() if group.void is None else np.union1d(group.void, rows)
        self.pool_ids[:, rows] = -1
        self.stale[rows] = True
        self.warm[:, rows] = False

    def wait(self, timeout: float | None = 60.0) -> None:
        """Block until every in-flight recall is staged (tests); the next decode step start applies them
        (after the next call's dispatch when the driver `overlap_dispatch`es)."""
        for group in self._groups():
            group.future.exception(timeout=timeout)

    def precompile(self, cache) -> None:
        """`apply_recalls` compiled for every padded size a group can stage (8 up to the most (block,
        head) rows GROUP_LAYERS layers' recall moves, GROUP_LAYERS x B x Hkv x min(k, recall_blocks),
        in powers of two) and the cache's pool layout: otherwise each new size compiles on the recall
        thread in the middle of serving (seven in a scout serving load on the H100), its tracing
        holding the GIL."""
        ctx, cfg = self.ctx, self.ctx.config
        if not cfg.recall_blocks:
            return
        shape, c = ctx.shape, ctx.store.config
        with_pool = [state for state in cache.layers if getattr(state, "pool", None) is not None]
        if not with_pool:
            return
        layers = min(GROUP_LAYERS, len(with_pool), cfg.recall_layers_per_step or GROUP_LAYERS)
        most = max(8, next_pow2(layers * shape.batch * shape.hkv * min(self.k, cfg.recall_blocks)))
        device = next(iter(with_pool[0].pool.k.devices()))
        row_dtype = ctx.store.layers[0].arrays["k"].dtype
        # one tiny group staged as a recall stages it: the staged arrays' dtypes and shardings
        rows = np.zeros((8, c.block_size, c.row_width), row_dtype)
        tiny = _upload([np.zeros(8, np.int32)] * 5, rows, rows, c.kv_dtype, shape.dtype, device)
        specs = _pool_specs(cache.layers)
        _device_copy(_pool_used(cache.layers))  # the triggers' snapshot (`_trigger`)
        size = 8
        while size <= most:
            staged = [jax.ShapeDtypeStruct((size,) + x.shape[1:], x.dtype, sharding=x.sharding) for x in tiny]
            _apply_for(specs, staged, shape.batch, device)
            size *= 2

    def step_start(self, cache):
        return _commit(cache)

    def overlap_dispatch(self) -> bool:
        """With recall_after_dispatch set, finished recalls are applied right after each call's
        dispatch (`after_dispatch`), while the device runs the call (their scatters queue behind it:
        the next call sees them, as it would had they been applied at its start), no longer at
        decode step starts. Returns whether they moved."""
        cfg = self.ctx.config
        self.applies_after_dispatch = bool(cfg.recall_blocks) and cfg.recall_after_dispatch
        return self.applies_after_dispatch

    def dispatch_work_due(self) -> bool:
        return self.applies_after_dispatch and any(group.future.done() for group in self.pending.values())

    def after_dispatch(self, cache):
        before = self.stats.n_recalls
        cache = self._apply_ready(cache)
        self.stats.add(n_recalls_after_dispatch=self.stats.n_recalls - before)
        return cache

    def before_prefill_chunk(self, positions):
        rows = (positions >= 0).any(axis=1)
        self.stale |= rows
        self.warm[:, rows] = True

    def before_decode(self, cache, offloaded_before):
        # Recalls land at decode step starts only (unless the driver applies them after each call's
        # dispatch: `overlap_dispatch`): the pool serves decode steps, and a serving step's prefill
        # call starts with the device idle (its host work is the step's critical path), while its
        # decode call's host work overlaps the prefill on the device.
        if self.pending and not self.applies_after_dispatch:
            cache = self._apply_ready(cache)
        if self.ctx.config.recall_blocks and not self.stale.all():
            self._trigger(cache, offloaded_before)
        # this step's ids are the decoding rows' own; a row not decoding in it (still prefilling, or
        # its prefill ended in a step whose decode tokens rode without it) stays stale until it does
        self.stale[self.ctx.step_rows()] = False
        return cache

    # ---- recalls --------------------------------------------------------------------------------
    def cpu_blocks(self, layer: int) -> np.ndarray | None:
        """[B] (KV head, block) entries of `layer`'s selection the CPU attended at the last decode
        step per sequence, over this runtime's KV heads; 0 for stale rows (None: no decode step yet)."""
        ids = self.ctx.last_block_ids(layer)
        if ids is None:
            return None
        counts = (ids >= 0).sum(axis=(1, 2))
        counts[self.stale] = 0
        return counts

    def cpu_share(self, layer: int, n_blocks: np.ndarray) -> float | None:
        """CPU-attended blocks / selected blocks of `layer` at the last decode step over every KV
        head of the model (None: unknown). n_blocks [B]: offloaded blocks per sequence then. Under
        tensor parallelism the shards of this process count together (`shared_counts`, set before
        each step by jhybrid.parallel.offload), so each recalls exactly when a single device would."""
        if self.shared_counts is not None:
            cpu, heads = self.shared_counts.get(layer), self.shared_heads
        else:
            cpu, heads = self.cpu_blocks(layer), self.ctx.shape.hkv
        live = np.where(self.stale, 0, n_blocks)  # stale rows count neither way
        budget = int(np.minimum(self.ctx.config.topk_blocks or self.ctx.shape.nb_max, live).sum()) * heads
        if cpu is None or budget == 0:
            return None
        return int(cpu.sum()) / budget

    def _trigger(self, cache, n_blocks: np.ndarray) -> None:
        """Start the recalls due at this step start, in groups of at most GROUP_LAYERS layers (one
        background job and one scatter each); never blocks on one."""
        ctx, cfg = self.ctx, self.ctx.config
        start = time.perf_counter()
        cap = cfg.recall_layers_per_step
        n_layers = ctx.shape.n_layers
        first = self.next_trigger_layer if cap is not None else 0
        plans = []
        for layer in [(first + i) % n_layers for i in range(n_layers)]:
            if cap is not None and len(plans) == cap:  # the rest (their warm flags kept) at the next steps
                break
            if layer in self.pending:
                continue
            share = self.cpu_share(layer, n_blocks)
            if share is None or share == 0.0:
                continue
            live = ~self.stale
            warm = bool((self.warm[layer] & live).any())  # a row's first selection with CPU blocks since its prefill
            self.warm[layer, live] = False
            if not warm and (share <= cfg.recall_threshold
                             or ctx.decode_steps - self.last_recall[layer] < cfg.recall_min_interval):
                continue
            plans.append(RecallPlan(layer, *(np.zeros(0, np.int32),) * 4, warm=warm))
            self.last_recall[layer] = ctx.decode_steps
            self.next_trigger_layer = (layer + 1) % n_layers
        if not plans:
            return
        # Snapshots the jobs may use after this step has donated the cache: the CPU's ids, the host
        # pool tables, the slots' last use (device copies of every layer's, one launch, read by the
        # jobs: reading them here waited for the call before this step start, the prefill call a
        # serving step dispatches before its decode call, with the device idle behind this thread).
        last_pos = ctx.tokens() - 1  # the previous decode step's token positions [B]
        pool_used = _device_copy(_pool_used(cache.layers))
        device = next(iter(cache.layers[plans[0].layer].pool.k.devices()))
        specs = _pool_specs(cache.layers)
        plans.sort(key=lambda plan: plan.layer)
        for i in range(0, len(plans), GROUP_LAYERS):
            group = RecallGroup(plans[i:i + GROUP_LAYERS], trigger_step=ctx.decode_steps, epoch=self.epoch,
                                resets=self.resets.copy())
            cpu_ids, pool_ids = {}, {}
            for plan in group.plans:
                ids = ctx.last_block_ids(plan.layer)
                ids[self.stale] = -1  # (a copy) nothing recalled for a row whose ids are stale
                cpu_ids[plan.layer], pool_ids[plan.layer] = ids, self.pool_ids[plan.layer].copy()
            group.future = self._worker.submit(self._job, group, ctx.store, cpu_ids, pool_ids, pool_used,
                                               last_pos.copy(), device, specs)
            for plan in group.plans:
                self.pending[plan.layer] = group
        seconds = time.perf_counter() - start
        self.stats.add(n_recall_triggers=len(plans), recall_s=seconds, recall_trigger_s=seconds)

    def _job(self, group: RecallGroup, store, cpu_ids: dict, pool_ids: dict, pool_used: tuple, last_pos,
             device, specs):
        """Background thread: plan, gather and upload one group's recall, and compile its scatter
        -> (staged device arrays, compiled apply), or None when there is nothing to move.
        cpu_ids, pool_ids: {layer: [B, Hkv, k] / [B, Hkv, R]} snapshots; pool_used: every layer's
        [B, Hkv, R] device copy (None for a layer without a pool)."""
        start = time.perf_counter()
        for plan in group.plans:
            used = np.asarray(pool_used[plan.layer])  # int32, waited for here (`_trigger`)
            ids, table = cpu_ids[plan.layer], pool_ids[plan.layer]
            resident = (ids[..., None] == table[:, :, None, :]).any(-1) & (ids >= 0)
            ids = np.where(resident, -1, ids)  # recalled after this selection was made
            plan.b, plan.h, plan.r, plan.block = plan_recall(ids, table, used, last_pos)
        staged = None
        if group.n:
            staged = stage_recall(store, group, self.ctx.shape.batch, self.ctx.shape.dtype, device,
                                  hook=self.recall_hook, pool_specs=specs, resets=self.resets)
        group.bg_s = time.perf_counter() - start
        return staged

    def _groups(self) -> list[RecallGroup]:
        """The in-flight groups, each once, oldest trigger first."""
        groups = list({id(g): g for g in self.pending.values()}.values())
        return sorted(groups, key=lambda g: (g.trigger_step, g.layers[0]))

    def _apply_ready(self, cache):
        """Apply the in-flight groups that are due (one jitted scatter each): with recall_lag_steps
        None each one whose upload has finished (never waiting; at most recall_layers_per_step
        layers, the oldest triggers first), else each one exactly recall_lag_steps decode steps after
        its trigger (waiting for its upload if needed: a schedule that does not depend on timing, for
        accuracy runs and tests)."""
        ctx = self.ctx
        layers = list(cache.layers)
        lag = ctx.config.recall_lag_steps
        cap = ctx.config.recall_layers_per_step if lag is None else None
        applied, now = 0, None
        for group in self._groups():
            if cap is not None and applied + len(group.plans) > cap:
                break
            if lag is None and not group.future.done():
                continue
            if lag is not None and ctx.decode_steps < group.trigger_step + lag:
                continue
            applied += len(group.plans)
            start = time.perf_counter()
            for layer in group.layers:
                del self.pending[layer]
            exc = group.future.exception(timeout=ctx.config.exchange_timeout_s)
            if exc is not None:
                raise RuntimeError(f"scout recall of layers {group.layers} failed in the background") from exc
            result = group.future.result()
            self.stats.add(recall_bg_s=group.bg_s)
            if result is not None and group.epoch == self.epoch:
                staged, apply = result
                if group.void is not None:
                    staged = self._void_rows(group, staged)
                if now is None:
                    now = jax.device_put(np.asarray(ctx.tokens() - 1, np.int32), staged[0].sharding)
                pools = tuple([getattr(state, "pool", None) for state in layers])
                nexts = tuple([getattr(state, "next_pool_blocks", None) for state in layers])
                pools, nexts = apply(pools, nexts, *staged, now)
                for n, state in enumerate(layers):
                    if pools[n] is not None or nexts[n] is not None:
                        layers[n] = state.replace(pool=pools[n], next_pool_blocks=nexts[n])
                moved = [plan for plan in group.plans if plan.n]
                for plan in moved:
                    self.pool_ids[plan.layer][plan.b, plan.h, plan.r] = plan.block
                    self._log[self._log_n % self.HISTORY] = (plan.layer, group.trigger_step, ctx.decode_steps,
                                                             plan.n, plan.warm)
                    self._log_n += 1
                self.stats.add(n_recalls=len(moved), n_recall_applies=1, recall_rows=group.n)
                ctx.counters.add(bytes_to_device=staged[5].nbytes * 2)
            seconds = time.perf_counter() - start
            self.stats.add(recall_s=seconds, recall_apply_s=seconds)
        return cache.replace(layers=tuple(layers))

    def _void_rows(self, group: RecallGroup, staged: tuple) -> tuple:
        """A staged group without the rows reset since its trigger (`group.void`): their entries
        scatter nowhere (b = B, dropped) and leave the host pool tables alone."""
        for plan in group.plans:
            keep = ~np.isin(plan.b, group.void)
            plan.b, plan.h, plan.r, plan.block = (x[keep] for x in (plan.b, plan.h, plan.r, plan.block))
        b = np.array(staged[0])
        b[np.isin(b, group.void)] = self.ctx.shape.batch
        return (jax.device_put(b, staged[0].sharding),) + tuple(staged[1:])


def _pool_used(layers) -> tuple:
    """Every layer's pool `used` table [B, Hkv, R] int32 (None for a layer without a pool)."""
    return tuple([state.pool.used if getattr(state, "pool", None) is not None else None for state in layers])


@jax.jit
def _device_copy(x):
    """A copy of x (an array or a pytree of them) in buffers of its own (they outlive the donation of
    x's)."""
    return jax.tree_util.tree_map(jnp.copy, x)


def _commit(cache):
    """The cache with every array committed to its device (a no-copy re-wrap). Recalled blocks arrive
    committed, and a jitted step sees committed and uncommitted inputs as different signatures:
    committing everything up front keeps the decode step from recompiling at the first recall."""
    leaves = jax.tree_util.tree_leaves(cache)
    if all(getattr(x, "committed", True) for x in leaves):
        return cache
    return jax.tree_util.tree_map(
        lambda x: jax.device_put(x, x.sharding) if isinstance(x, jax.Array) and not x.committed else x, cache)
