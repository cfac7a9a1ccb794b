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
Host side (`ScoutHost`): asynchronous incremental recall into the pool
(`jhybrid.hybrid.modes.scout_recall`): at a step start, per layer, when the CPU's share of the
layer's selected blocks at the last step exceeded `recall_threshold` (and `recall_min_interval`
steps passed, and none of its recalls is in flight), a background thread plans, gathers and
uploads the recall; the first step start at which it has finished applies it with one jitted,
buffer-donating scatter. No step ever waits for it. Warm start: at the second decode step after a
prefill (or an adopted store), every layer recalls what its first decode step selected.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from jhybrid.hybrid.exchange import after
from jhybrid.hybrid.modes.base import DecodeStep, ModeHost
from jhybrid.hybrid.modes.scout_recall import RecallPlan, plan_recall, pool_spec, stage_recall
from jhybrid.hybrid.modes.topk import TopK
from jhybrid.hybrid.state import Digests, LayerAhead, LayerState, Pool

log = logging.getLogger(__name__)


class Scout(TopK):
    name = "scout"
    settings = frozenset({"budget", "recall_blocks", "recall_threshold", "recall_min_interval",
                          "predict_query", "scout_exact_layers", "scout_min_cos"})

    def exact_layers(self) -> frozenset:
        """scout_exact_layers as a set of layer indices (layer 0 always included; "auto" left
        unresolved: layer 0 only, see `jhybrid.hybrid.calibration`)."""
        exact = self.config.scout_exact_layers
        if exact == "auto":
            return frozenset((0,))
        return frozenset(range(max(exact, 1)) if isinstance(exact, int) else (0, *exact))

    def selects_exactly(self, layer: int) -> bool:
        return not self.config.predict_query or layer in self.exact_layers()

    def check(self, model_config, max_len):
        super().check(model_config, max_len)
        n = model_config.num_layers
        over = sorted(x for x in self.exact_layers() if x >= n) if self.config.predict_query else []
        if over:
            raise ValueError(f"scout_exact_layers={self.config.scout_exact_layers!r}: layer(s) "
                             f"{', '.join(map(str, over))} out of range for a model of {n} layers (0..{n - 1})")

    def wants_next_query(self, layer, num_layers):
        return layer + 1 < num_layers and not self.selects_exactly(layer + 1)

    def layer_state(self, layer, num_layers, batch, num_kv_heads, head_dim, max_len, dtype):
        out = super().layer_state(layer, num_layers, batch, num_kv_heads, head_dim, max_len, dtype)
        nb, bs, r = self.config.host_blocks(max_len), self.config.block_size, self.config.recall_blocks
        ahead = self.wants_next_query(layer, num_layers)
        if ahead:
            out["next_digests"] = Digests(jnp.zeros((batch, num_kv_heads, nb, head_dim), dtype),
                                          jnp.zeros((batch, num_kv_heads, nb, head_dim), dtype))
        if r:
            out["pool"] = Pool(k=jnp.zeros((batch * r, num_kv_heads, bs, head_dim), dtype),
                               v=jnp.zeros((batch * r, num_kv_heads, bs, head_dim), dtype),
                               blocks=jnp.full((batch, num_kv_heads, r), -1, jnp.int32),
                               used=jnp.full((batch, num_kv_heads, r), -1, jnp.int32))
            if ahead:
                out["next_pool_blocks"] = jnp.full((batch, num_kv_heads, r), -1, jnp.int32)
        return out

    def decode(self, step: DecodeStep, state: LayerState):
        exchange, q = step.exchange, step.q
        pool_blocks = None if state.pool is None else state.pool.blocks
        if self.selects_exactly(step.layer):
            if step.carry is not None:
                raise RuntimeError(f"scout: layer {step.layer} selects with its exact query but a layer-ahead "
                                   "selection was handed to it")
            sel = self._select(q, state, step.offloaded, state.digests, pool_blocks)
            ticket = exchange.submit(step.layer, "blocks", q, sel.cpu_ids)
            q = after(q, ticket)
        else:
            if step.carry is None:
                raise RuntimeError(f"scout: no layer-ahead selection for layer {step.layer} (layers run in order "
                                   "inside one traced step)")
            sel, ticket = step.carry
        ahead = self.wants_next_query(step.layer, step.num_layers)
        if ahead:
            next_sel = self._select(step.next_q, state, step.offloaded, state.next_digests, state.next_pool_blocks)
        parts, probs = self._gpu_parts(step, q, state, sel)
        lse_w = parts[0][1]
        carry = None
        if ahead:
            o_c, lse_c, next_ticket = exchange.exchange(step.layer, ticket, q.shape, "blocks", step.layer + 1, step.next_q,
                                                        next_sel.cpu_ids, lse_w)
            carry = LayerAhead(next_sel, next_ticket)
        else:
            o_c, lse_c = exchange.collect(step.layer, ticket, q.shape, lse_w)
        parts.append((o_c, lse_c))
        return parts, probs, self._note(state, sel, step.positions), carry

    def host(self, runtime) -> "ScoutHost | None":
        return ScoutHost(runtime) if self.config.recall_blocks else ModeHost()


class ScoutHost(ModeHost):
    """The asynchronous recall of important blocks into each layer's GPU pool (see module doc)."""

    HISTORY = 4096  # entries kept in recall_log

    def __init__(self, runtime):
        self.runtime = runtime
        cfg = runtime.config
        # host copy of every layer's pool table [L, B, Hkv, R] (updated when a recall is applied)
        self.pool_ids = np.full((runtime.n_layers, runtime.batch, runtime.hkv, cfg.recall_blocks), -1, np.int32)
        self.pending: dict[int, RecallPlan] = {}  # layer -> its in-flight recall
        self.last_recall = np.full(runtime.n_layers, -10**9)
        self.since_prefill = 0  # decode steps since the last prefill chunk (or adopted store)
        self.warm = np.zeros(runtime.n_layers, bool)  # layers whose warm-start recall is still due
        self.epoch = 0  # bumped when the store is replaced: older recalls are void
        self.recall_hook = None  # tests: called at the start of each background recall job
        # tensor parallelism: {layer: CPU blocks of the last step over every shard} and the shards' KV heads
        self.shared_counts: dict[int, int | None] | None = None
        self.shared_heads = runtime.hkv
        self.recall_log: list[dict] = []
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="jhybrid-recall")
        runtime.declare_counters("recall_s", "recall_bg_s", "n_recall_triggers", "n_recalls", "recall_rows")

    def close(self):
        self.epoch += 1
        self.pending.clear()
        self._worker.shutdown(wait=False, cancel_futures=True)

    def adopted(self):
        self.epoch += 1
        self.pending.clear()
        self.pool_ids[:] = -1  # the cache handed in with the store has an empty pool
        self.since_prefill = 0
        self.warm[:] = True

    def wait(self, timeout: float | None = 60.0) -> None:
        """Block until every in-flight recall is staged (tests); the next step start applies them."""
        for plan in list(self.pending.values()):
            plan.future.exception(timeout=timeout)

    def step_start(self, cache):
        return _commit(cache)

    def every_step(self, cache):
        return self._apply_ready(cache) if self.pending else cache

    def before_prefill_chunk(self, positions):
        self.since_prefill = 0
        self.warm[:] = True

    def before_decode(self, cache, offloaded_before):
        if self.since_prefill > 0:
            self._trigger(cache, offloaded_before)
        self.since_prefill += 1
        return cache

    # ---- recalls --------------------------------------------------------------------------------
    def cpu_blocks(self, layer: int) -> int | None:
        """(sequence, KV head, block) entries of `layer`'s selection the CPU attended at the last
        decode step, over this runtime's KV heads (None: no decode step yet)."""
        ids = self.runtime.last_block_ids(layer)
        return None if ids is None else int((ids >= 0).sum())

    def cpu_share(self, layer: int, n_blocks: np.ndarray) -> float | None:
        """CPU-attended blocks / selected blocks of `layer` at the last decode step over every KV
        head of the model (None: unknown). n_blocks [B]: offloaded blocks per sequence then. Under
        tensor parallelism the shards of this process count together (`shared_counts`, set before
        each step by jhybrid.parallel.offload), so each recalls exactly when a single device would."""
        runtime = self.runtime
        if self.shared_counts is not None:
            cpu, heads = self.shared_counts.get(layer), self.shared_heads
        else:
            cpu, heads = self.cpu_blocks(layer), runtime.hkv
        budget = int(np.minimum(runtime.config.topk_blocks or runtime.nb_max, n_blocks).sum()) * heads
        if cpu is None or budget == 0:
            return None
        return cpu / budget

    def _trigger(self, cache, n_blocks: np.ndarray) -> None:
        """Start the recalls due at this step start; never blocks on one."""
        runtime, cfg = self.runtime, self.runtime.config
        last_pos = runtime.n_tokens - 1  # the previous decode step's token positions [B]
        for layer in range(runtime.n_layers):
            if layer in self.pending:
                continue
            share = self.cpu_share(layer, n_blocks)
            if share is None or share == 0.0:
                continue
            warm = bool(self.warm[layer])  # the first selection with CPU blocks since the prefill
            self.warm[layer] = False
            if not warm and (share <= cfg.recall_threshold
                             or runtime.decode_steps - self.last_recall[layer] < cfg.recall_min_interval):
                continue
            start = time.perf_counter()
            state = cache.layers[layer]
            plan = RecallPlan(layer, *(np.zeros(0, np.int32),) * 4, trigger_step=runtime.decode_steps,
                              epoch=self.epoch, warm=warm)
            # Snapshots the job may use after this step has donated the cache: the CPU's ids, the
            # host pool table, the slots' last use.
            cpu_ids = runtime.last_block_ids(layer)
            pool_ids = self.pool_ids[layer].copy()
            pool_used = np.asarray(state.pool.used)
            device = next(iter(state.pool.k.devices()))
            prev = cache.layers[layer - 1].next_pool_blocks if layer > 0 else None
            specs = (pool_spec(state.pool), pool_spec(prev))
            plan.future = self._worker.submit(self._job, plan, runtime.store, cpu_ids, pool_ids, pool_used,
                                              last_pos.copy(), device, specs)
            self.pending[layer] = plan
            self.last_recall[layer] = runtime.decode_steps
            runtime.count("n_recall_triggers")
            runtime.count("recall_s", time.perf_counter() - start)

    def _job(self, plan: RecallPlan, store, cpu_ids, pool_ids, pool_used, last_pos, device, specs):
        """Background thread: plan, gather and upload one layer's recall, and compile its scatter
        -> (staged device arrays, compiled apply), or None when there is nothing to move."""
        start = time.perf_counter()
        resident = (cpu_ids[..., None] == pool_ids[:, :, None, :]).any(-1) & (cpu_ids >= 0)
        cpu_ids = np.where(resident, -1, cpu_ids)  # recalled after this selection was made
        plan.b, plan.h, plan.r, plan.block = plan_recall(cpu_ids, pool_ids, pool_used, last_pos)
        staged = None
        if plan.n:
            staged = stage_recall(store, plan, self.runtime.batch, self.runtime.dtype, device,
                                  hook=self.recall_hook, pool_specs=specs)
        plan.bg_s = time.perf_counter() - start
        return staged

    def _apply_ready(self, cache):
        """Apply every in-flight recall whose upload has finished (one jitted scatter per layer)."""
        runtime = self.runtime
        layers = list(cache.layers)
        for layer in sorted(self.pending):
            plan = self.pending[layer]
            if not plan.future.done():
                continue
            start = time.perf_counter()
            del self.pending[layer]
            exc = plan.future.exception()
            if exc is not None:
                raise RuntimeError(f"scout recall of layer {layer} failed in the background") from exc
            result = plan.future.result()
            runtime.count("recall_bg_s", plan.bg_s)
            if result is not None and plan.epoch == self.epoch:
                staged, apply = result
                state = layers[layer]
                prev = layers[layer - 1] if layer > 0 and layers[layer - 1].next_pool_blocks is not None else None
                now = jax.device_put(np.asarray(runtime.n_tokens - 1, np.int32), staged[0].sharding)
                pool, nxt = apply(state.pool, None if prev is None else prev.next_pool_blocks, *staged, now)
                layers[layer] = state.replace(pool=pool)
                if prev is not None:
                    layers[layer - 1] = prev.replace(next_pool_blocks=nxt)
                self.pool_ids[layer][plan.b, plan.h, plan.r] = plan.block
                runtime.count("n_recalls")
                runtime.count("recall_rows", plan.n)
                runtime.count("bytes_to_device", staged[4].nbytes * 2)
                self.recall_log.append(dict(layer=layer, trigger_step=plan.trigger_step,
                                            apply_step=runtime.decode_steps, rows=plan.n, warm=plan.warm))
                del self.recall_log[:-self.HISTORY]
            runtime.count("recall_s", time.perf_counter() - start)
        return cache.replace(layers=tuple(layers))


def _commit(cache):
    """The cache with every array committed to its device (a no-copy re-wrap). Recalled blocks arrive
    committed, and a jitted step sees committed and uncommitted inputs as different signatures:
    committing everything up front keeps the decode step from recompiling at the first recall."""
    leaves = jax.tree_util.tree_leaves(cache)
    if all(getattr(x, "committed", True) for x in leaves):
        return cache
    return jax.tree_util.tree_map(
        lambda x: jax.device_put(x, x.sharding) if isinstance(x, jax.Array) and not x.committed else x, cache)
