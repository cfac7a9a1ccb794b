"""Decode speed of every attention mode, side by side: full, recall, hgca, scout, streaming, topk.

    PYTHONPATH=. python3 benchmarks/bench_hybrid.py --out benchmarks/results/hybrid-h100.json
    PYTHONPATH=. python3 benchmarks/bench_hybrid.py --quick       # CPU smoke run (tiny model)

Model: Llama-3-8B-shaped (d_model 4096, 32 query / 8 KV heads of dim 128, MLP 14336, vocab 128256),
random bf16 weights, `--layers` decoder layers (default 4, not 32: the KV of 32 layers x 32K tokens x
batch 32 is 128 GiB, more than the 80 GB GPU holds for `full` and than the 128 GiB host holds for
the store; per-layer costs scale linearly, so tokens/s of a 32-layer model is ~ layers/32 of ours).

Context: the 32K-token context is written directly with random KV (GPU window, host store, digests,
hgca's sparse context cache with `--hgca-keep` of the offloaded tokens salient, recall's mirror)
instead of running a 32K prefill; then `--steps` decode steps are timed after `--warmup` steps.

Row keys: mode, batch, context, gpu_window, tokens_per_s, step_ms, gpu_attn_ms, cpu_attn_ms,
callback_ms, gpu_idle_frac, gpu_kv_bytes, host_kv_bytes, plus callbacks_per_step,
callback_us_per_call, callback_share (of the step), wait_ms (GPU blocked on an unfinished CPU task),
evict_ms, transfer_ms, recall_ms, cpu_share (scout/topk: CPU-attended tokens / selected budget).
  tokens_per_s batch / mean step time (every timed step counts: recalls and evictions included)
  step_ms      mean wall time of one decode step of the whole batch (bookkeeping, eviction and
               recall included; step_ms_median beside it)
  gpu_attn_ms  the step's GPU attention kernels alone, timed in a separate jitted probe over all layers
  cpu_attn_ms  worker time in the Numba attention kernels per step
  callback_ms  time inside host callbacks per step; on a GPU the stream is stalled meanwhile, so
  gpu_idle_frac = sum of callback time / sum of step time over all timed steps (the GPU idles while
               the host holds it); gpu_idle_frac_median = median over steps of (that step's callback
               time / that step's time). Neither counts hook_ms, the host bookkeeping between steps
               (eviction, recall decisions), during which a synchronously driven GPU also idles.
  callback_ms_per_layer, callback_overhead_us (callback time not spent waiting for the CPU, per call)
  cpu_share    scout/topk: CPU-attended tokens / selected tokens, over the timed steps
  drift        scout/topk: mean fraction of a (layer, sequence, KV head)'s top-k blocks that were
               not in its top-k at the previous step (0 = the same blocks every step)
  recall_ms    scout: recall work on the critical path per step (deciding, snapshotting, applying);
               recall_bg_ms the background work (planning, gathering, uploading) per step;
               n_recalls recalls applied in the timed steps, recall_rows (block, head) rows moved

Extra rows `scout-stable` (default --stable-modes): scout with the decode input token held fixed
(token 0 every step) instead of feeding back the argmax. With random weights the argmax token, and
so the query, jumps every step and the top-k drifts almost completely (no recall policy can help);
real models keep >85% of their important blocks from one step to the next (ScoutAttention Fig. 6a).
A fixed input keeps queries close (only the position moves) and so approximates that locality;
its measured drift is reported beside it. scout rows warm up for --scout-warmup steps (the warm-start
recall after the first decode step is staged in the background meanwhile).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, write_results  # noqa: E402

from host import KVStore, StoreConfig  # noqa: E402
from host.kv_store import from_storage  # noqa: E402
from host.sparsify import sparsify_evicted  # noqa: E402
from jhybrid.attention.full import masked_attention  # noqa: E402
from jhybrid.attention.hybrid import make_backend  # noqa: E402
from jhybrid.hybrid import HybridConfig  # noqa: E402
from jhybrid.hybrid.config import evicted_blocks  # noqa: E402
from jhybrid.hybrid.manager import KV_DTYPE_OF  # noqa: E402
from jhybrid.hybrid.ring import ring_meta  # noqa: E402
from jhybrid.hybrid.selection import select  # noqa: E402
from jhybrid.models import ModelConfig, create_model  # noqa: E402
from pallas_kernels.block_sparse_attention import block_sparse_attention  # noqa: E402
from pallas_kernels.window_attention import window_attention  # noqa: E402

MODES = ("full", "recall", "hgca", "scout", "streaming", "topk")
KEYS = ["mode", "batch", "context", "gpu_window", "tokens_per_s", "step_ms", "step_ms_median", "gpu_attn_ms",
        "cpu_attn_ms", "callback_ms", "gpu_idle_frac", "gpu_idle_frac_median", "gpu_kv_bytes", "host_kv_bytes"]
EXTRA = ["callbacks_per_step", "callback_us_per_call", "callback_overhead_us", "callback_ms_per_layer",
         "callback_share", "wait_ms", "hook_ms", "evict_ms", "transfer_ms", "recall_ms", "recall_bg_ms",
         "n_recalls", "cpu_share", "drift"]


def base_mode(mode: str) -> str:
    """scout-stable -> scout (the same backend; only the benchmark's input tokens differ)."""
    return mode[:-len("-stable")] if mode.endswith("-stable") else mode


def selection_drift(prev: list, cur: list) -> float | None:
    """Mean over (layer, sequence, KV head) rows of the fraction of the current top-k ids [B, Hkv, k]
    (valid, >= 0) that were not in the previous step's; None when no row has both."""
    fractions = []
    for p, c in zip(prev, cur):
        valid = c >= 0
        rows = valid.any(-1) & (p >= 0).any(-1)
        if not rows.any():
            continue
        present = (c[..., :, None] == p[..., None, :]).any(-1) & valid
        fractions.append((1.0 - present.sum(-1) / np.maximum(valid.sum(-1), 1))[rows])
    return float(np.mean(np.concatenate(fractions))) if fractions else None


def model_config(args) -> ModelConfig:
    if args.quick:
        return ModelConfig(family="llama", vocab_size=512, d_model=256, num_layers=2, num_heads=4, num_kv_heads=2,
                           head_dim=128, mlp_dim=512, max_position_embeddings=args.context + 512,
                           dtype="bfloat16")
    return ModelConfig(family="llama", vocab_size=128256, d_model=4096, num_layers=args.layers, num_heads=32,
                       num_kv_heads=8, head_dim=128, mlp_dim=14336, max_position_embeddings=args.context + 1024,
                       rope_theta=500000.0, dtype="bfloat16")


def window_for(fraction: float, context: int, sink: int, block: int) -> int:
    """sink + a ring of ~fraction * context tokens, a multiple of 64 (the kernels' KV tile)."""
    step = max(64, block)
    ring = max(step, int(round(fraction * context / step)) * step)
    return sink + ring


# ---------------------------------------------------------------------------- context fill

def random_blocks(rng, n: int, hkv: int, bs: int, d: int):
    """n random blocks [n, Hkv, bs, D] as bf16 bits (uint16), head-major like the store's arena."""
    x = rng.standard_normal((n, hkv, bs, d), dtype=np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16)


class Context:
    """A random context shared by every mode and configuration: one host store filled once for the
    largest batch and the most offloaded blocks; each (batch, window) uses sequences 0..batch-1 and
    a prefix of their blocks (`prepare`). Blocks cycle through a pool of 64 random blocks."""

    POOL = 64

    def __init__(self, mcfg: ModelConfig, block_size: int, sink: int, batch: int, context: int, e_max: int,
                 keep: float, seed=0):
        self.mcfg, self.batch, self.context, self.e_max = mcfg, batch, context, e_max
        self.bs, self.sink = block_size, sink
        rng = np.random.default_rng(seed)
        hkv, d, nl = mcfg.num_kv_heads, mcfg.head_dim, mcfg.num_layers
        self.pool_k = random_blocks(rng, self.POOL, hkv, block_size, d)
        self.pool_v = random_blocks(rng, self.POOL, hkv, block_size, d)
        # MAW 1.0 (above beta / window for any window, beta <= 1) for `keep` of the tokens, else 0.
        self.pool_maw = np.where(rng.random((self.POOL, block_size, hkv)) < keep, 1.0, 0.0).astype(np.float32)
        kf = from_storage(self.pool_k, "bf16")  # [P, Hkv, bs, D]
        self.pool_min, self.pool_max = kf.min(axis=2), kf.max(axis=2)  # [P, Hkv, D]
        t0 = time.perf_counter()
        self.store = KVStore(StoreConfig(n_layers=nl, n_kv_heads=hkv, head_dim=d, block_size=block_size,
                                         kv_dtype="bf16", initial_blocks_per_layer=max(16, batch * e_max)))
        positions = sink + np.arange(e_max * block_size, dtype=np.int64).reshape(e_max, block_size)
        for b in range(batch):
            self.store.add_sequence(b)
        for layer in range(nl):
            for b in range(batch):
                idx = self.index(layer, b, e_max)
                # A transposed view of head-major blocks: the store's own transpose is then a memcpy.
                self.store.append_blocks(layer, b, self.pool_k[idx].transpose(0, 2, 1, 3),
                                         self.pool_v[idx].transpose(0, 2, 1, 3), self.pool_maw[idx], positions)
        self.fill_s = time.perf_counter() - t0
        self.prepared = None

    def mirror(self, empty: dict, batch: int) -> dict:
        """recall's host mirror of the offloaded KV ({"k", "v"} [L, B, Hkv, N, D]) with all e_max
        blocks written; built once per batch and reused (a run with fewer offloaded blocks masks
        the rest by length)."""
        cached = getattr(self, "_mirrors", {})
        self._mirrors = cached
        if batch not in cached:
            t0 = time.perf_counter()
            for layer in range(self.mcfg.num_layers):
                for b in range(batch):
                    idx = self.index(layer, b, self.e_max)
                    for name, pool in (("k", self.pool_k), ("v", self.pool_v)):
                        x = pool[idx].view(ml_dtypes.bfloat16).transpose(1, 0, 2, 3).reshape(
                            self.mcfg.num_kv_heads, self.e_max * self.bs, self.mcfg.head_dim)
                        empty[name][layer, b, :, :x.shape[1]] = x
            cached[batch] = empty
            print(f"  recall mirror written in {time.perf_counter() - t0:.1f} s", flush=True)
        return cached[batch]

    def index(self, layer: int, b: int, e: int) -> np.ndarray:
        return (np.arange(e) + 7 * b + 13 * layer) % self.POOL

    def prepare(self, e: int, beta: float, window_tokens: int) -> float:
        """Offloaded blocks 0..e-1 per sequence; hgca's sparse context cache rebuilt for them. Also
        forgets blocks a previous mode's decode steps evicted (benchmark only: sets the store's
        block counts directly; the dropped slots simply leak)."""
        t0 = time.perf_counter()
        store = self.store
        with store.lock:
            for b in range(self.batch):
                store._n_blocks[b][:] = e
        if self.prepared != (e, beta, window_tokens):
            with store.lock:
                for layer in range(self.mcfg.num_layers):
                    for b in range(self.batch):
                        for h in range(self.mcfg.num_kv_heads):
                            store.context.clear_head_locked(layer, b, h)
            for layer in range(self.mcfg.num_layers):
                sparsify_evicted(store, layer, range(self.batch), [np.arange(e)] * self.batch, beta, window_tokens)
            self.prepared = (e, beta, window_tokens)
        return time.perf_counter() - t0

    def digests(self, layer: int, batch: int, e: int, nb: int) -> tuple[np.ndarray, np.ndarray]:
        shape = (batch, self.mcfg.num_kv_heads, nb, self.mcfg.head_dim)
        kmin, kmax = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        for b in range(batch):
            idx = self.index(layer, b, e)
            kmin[b, :, :e] = self.pool_min[idx].transpose(1, 0, 2)
            kmax[b, :, :e] = self.pool_max[idx].transpose(1, 0, 2)
        return kmin, kmax

    def load(self, backend, cache, key, batch: int):
        """Write the context into a fresh hybrid cache and hand the store to the backend's manager."""
        hcfg, manager = backend.config, backend.manager
        e = int(evicted_blocks(np.int64(self.context), hcfg))
        print(f"  host context ready in {self.prepare(e, hcfg.beta, hcfg.window_tokens):.1f} s", flush=True)
        nb = hcfg.host_blocks(manager.max_len)
        layers = []
        for layer, state in enumerate(cache.layers):
            state = dict(state)
            for name in ("sink_k", "sink_v", "k_ring", "v_ring"):
                key, sub = jax.random.split(key)
                state[name] = jax.random.normal(sub, state[name].shape, state[name].dtype)
            state["maw"] = jnp.full_like(state["maw"], 1.0 / hcfg.window_tokens)
            for prefix, source in (("", layer), ("next_", layer + 1)):
                if prefix + "kmin" in state:
                    kmin, kmax = self.digests(source, batch, e, nb)
                    dtype = state[prefix + "kmin"].dtype
                    state[prefix + "kmin"] = jnp.asarray(kmin, dtype)
                    state[prefix + "kmax"] = jnp.asarray(kmax, dtype)
            layers.append(state)
        if manager.mirror is not None:
            manager.mirror = self.mirror(manager.mirror, batch)
        manager.use_store(self.store, np.full(batch, self.context))
        return cache.replace(layers=tuple(layers), lengths=jnp.full((batch,), self.context, jnp.int32))


def load_full(cache, context: int, key):
    layers = []
    for state in cache.layers:
        new = {}
        for name, x in state.items():
            key, sub = jax.random.split(key)
            mask = (jnp.arange(x.shape[1]) < context)[None, :, None, None]
            new[name] = jnp.where(mask, jax.random.normal(sub, x.shape, x.dtype), 0).astype(x.dtype)
        layers.append(new)
    b = cache.lengths.shape[0]
    return cache.replace(layers=tuple(layers), lengths=jnp.full((b,), context, jnp.int32))


# ---------------------------------------------------------------------------- GPU attention probe

def gpu_attention_probe(mode, backend, mcfg, cache, batch):
    """Median ms of the step's GPU attention kernels alone (all layers), in one jitted function."""
    scale = mcfg.attention_scale
    q = jax.random.normal(jax.random.key(3), (batch, 1, mcfg.num_heads, mcfg.head_dim), jnp.bfloat16)
    lengths = cache.lengths
    positions = (lengths - 1)[:, None]

    def probe(q, layers):
        outs = []
        for state in layers:
            if mode == "full":
                outs.append(masked_attention(q, state["k"], state["v"], positions, lengths, scale)[1])
                continue
            outs.append(backend._window(q, state, lengths, scale)[1])
            cfg = backend.config
            if mode == "recall":
                e = ring_meta(cfg, lengths)[0]
                outs.append(window_attention(q, state["off_k"], state["off_v"], e * cfg.block_size,
                                             jnp.zeros_like(e), scale=scale, backend=cfg.kernel_backend)[1])
            if mode in ("scout", "topk"):
                e = ring_meta(cfg, lengths)[0]
                kmin = state.get("kmin", state.get("next_kmin"))
                kmax = state.get("kmax", state.get("next_kmax"))
                if kmin is not None:
                    sel = select(q[:, 0], kmin, kmax, e, backend._k(state), state.get("pool_blocks"),
                                 cfg.kernel_backend)
                    outs.append(sel.cpu_ids.astype(jnp.float32))
                if "pool_k" in state:  # upper bound: every pool block selected
                    r = state["pool_blocks"].shape[-1]
                    ids = jnp.broadcast_to(jnp.arange(batch * r, dtype=jnp.int32).reshape(batch, 1, r),
                                           (batch, mcfg.num_kv_heads, r))
                    counts = jnp.full((batch, mcfg.num_kv_heads), r, jnp.int32)
                    outs.append(block_sparse_attention(q, state["pool_k"], state["pool_v"], ids, counts,
                                                       scale=scale, backend=cfg.kernel_backend)[1])
        return [jnp.sum(o.astype(jnp.float32)) for o in outs]

    fn = jax.jit(probe)
    jax.block_until_ready(fn(q, cache.layers))
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(q, cache.layers))
        samples.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(samples))


# ---------------------------------------------------------------------------- one mode

def run_mode(mode, args, mcfg, model_parts, batch, window, ctx):
    hcfg = HybridConfig(window_tokens=window, block_size=args.block_size, sink=args.sink, beta=args.beta,
                        topk_blocks=args.topk_tokens // args.block_size, recall_blocks=args.recall_blocks,
                        n_threads=args.threads)
    if mode == "hgca-sync":
        backend = make_backend(dataclasses.replace(hcfg, mode="hgca", exchange="sync"))
    else:
        backend = make_backend(dataclasses.replace(hcfg, mode=base_mode(mode)))
    try:
        return _run_mode(mode, args, mcfg, model_parts, batch, window, ctx, backend)
    finally:
        manager = getattr(backend, "manager", None)
        if manager is not None:  # compiled steps may outlive this call: drop the big host buffers now
            manager.close()
            manager.mirror = None


def _run_mode(mode, args, mcfg, model_parts, batch, window, ctx, backend):
    graphdef, params = model_parts
    max_len = args.context + args.warmup + args.steps + 8
    model = nnx.merge(graphdef, params)
    cache = model.init_cache(batch, max_len, backend)
    key = jax.random.key(1)
    stable = mode.endswith("-stable")
    mode = base_mode(mode)
    if mode == "full":
        cache = load_full(cache, args.context, key)
    else:
        cache = ctx.load(backend, cache, key, batch)
    jax.block_until_ready(cache)

    def decode(params, tokens, positions, cache):
        m = nnx.merge(graphdef, params)
        logits, cache = m(tokens[:, None], positions[:, None], cache, backend)
        return jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32), cache

    step = jax.jit(decode, donate_argnums=(3,))
    hook = getattr(backend, "before_step", None)
    tokens = np.zeros(batch, np.int32)
    held = args.context
    times = []
    warmup, steps = args.warmup, args.steps
    if mode == "recall":  # every step uploads the whole offloaded KV: a few steps say enough
        warmup, steps = 1, min(steps, args.recall_steps)
    if mode == "scout":  # let the warm-start recall land before timing (it never blocks a step)
        warmup = max(warmup, args.scout_warmup)
    fixed = np.zeros(batch, np.int32)
    per_step, sel_prev, drifts = [], None, []
    for i in range(warmup + steps):
        if i == warmup and hook is not None:
            backend.manager.reset_counters()
        t0 = time.perf_counter()
        positions = np.full(batch, held, np.int32)
        if hook is not None:
            cache = hook(cache, positions[:, None])
        t_hook = time.perf_counter() - t0
        tokens, cache = step(params, fixed if stable else tokens, positions, cache)
        tokens = np.asarray(tokens)
        times.append(time.perf_counter() - t0)
        held += 1
        # Untimed: per-step counters and the selection drift (read before the next step donates the cache).
        if hook is not None:
            per_step.append(dict(backend.manager.counters(), hook_s=t_hook))
        if mode in ("scout", "topk"):
            sel = [np.asarray(state["sel_ids"]) for state in cache.layers]
            if sel_prev is not None and i >= warmup:
                d = selection_drift(sel_prev, sel)
                if d is not None:
                    drifts.append(d)
            sel_prev = sel
    # Mean, not median: scout's recalls and hgca's evictions land on a few steps, and a median would
    # hide them; the median is reported beside it.
    timed = np.asarray(times[warmup:])
    step_s = float(np.mean(timed))
    row = dict(mode=mode + ("-stable" if stable else ""), batch=batch, context=args.context,
               gpu_window=args.context if mode == "full" else window, warmup_steps=warmup, timed_steps=steps,
               tokens_per_s=batch / step_s, step_ms=1e3 * step_s,
               step_ms_median=1e3 * float(np.median(timed)))
    row["gpu_attn_ms"] = gpu_attention_probe(mode, backend, mcfg, cache, batch)
    row["gpu_kv_bytes"] = int(sum(x.nbytes for x in jax.tree_util.tree_leaves(cache.layers)))
    if hook is None:
        row.update(cpu_attn_ms=0.0, callback_ms=0.0, gpu_idle_frac=0.0, host_kv_bytes=0, callbacks_per_step=0)
        return row
    c = backend.manager.counters()
    total_s = float(np.sum(timed))
    # per_step[i] holds the counters after step i (reset at the first timed step's start).
    deltas = [{k: after[k] - (before[k] if j else 0) for k in ("callback_s",)}
              for j, (before, after) in enumerate(zip([None] + per_step[warmup:-1], per_step[warmup:]))]
    idle = [d["callback_s"] / t for d, t in zip(deltas, timed)]
    row.update(
        cpu_attn_ms=1e3 * c["cpu_attn_s"] / steps,
        callback_ms=1e3 * c["callback_s"] / steps,
        gpu_idle_frac=c["callback_s"] / total_s,
        gpu_idle_frac_median=float(np.median(idle)),
        host_kv_bytes=int(backend.manager.host_kv_bytes()),
        callbacks_per_step=c["n_callbacks"] / steps,
        callback_us_per_call=1e6 * c["callback_s"] / max(c["n_callbacks"], 1),
        callback_overhead_us=1e6 * (c["callback_s"] - c["wait_s"]) / max(c["n_callbacks"], 1),
        callback_ms_per_layer=1e3 * c["callback_s"] / steps / mcfg.num_layers,
        callback_share=c["callback_s"] / total_s,
        wait_ms=1e3 * c["wait_s"] / steps,
        hook_ms=1e3 * float(np.mean([p["hook_s"] for p in per_step[warmup:]])),
        evict_ms=1e3 * c["evict_s"] / steps,
        transfer_ms=1e3 * c["transfer_s"] / steps,
        recall_ms=1e3 * c["recall_s"] / steps,
    )
    if mode == "scout":
        row.update(recall_bg_ms=1e3 * c["recall_bg_s"] / steps, n_recalls=c["n_recalls"],
                   n_recall_triggers=c["n_recall_triggers"], recall_rows=c["recall_rows"],
                   recalls_in_flight=len(backend.manager._pending))
    if mode in ("scout", "topk"):
        offloaded = int(evicted_blocks(np.int64(args.context), backend.config)) * args.block_size
        budget = steps * mcfg.num_layers * batch * mcfg.num_kv_heads * min(args.topk_tokens, offloaded)
        row["cpu_share"] = c["cpu_tokens"] / max(budget, 1)
        row["drift"] = float(np.mean(drifts)) if drifts else None
    return row


def _error_tail(exc: BaseException, limit: int = 1500) -> str:
    """The end of an exception's message: a host-callback error wraps the host traceback, whose
    cause is at the end, so keep the last `limit` characters rather than the first."""
    text = str(exc)
    return text if len(text) <= limit else "..." + text[-limit:]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="JSON output (default benchmarks/results/hybrid-<device>.json)")
    p.add_argument("--quick", action="store_true", help="tiny model and context: a CPU smoke run")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--batches", default="8,32")
    p.add_argument("--windows", default="0.25,0.05", help="GPU window as fractions of the context")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--stable-modes", default="scout-stable",
                   help="extra rows after the default modes of every (batch, window): a mode with the suffix "
                        "-stable holds the decode input token fixed (stable queries, real-model-like locality)")
    p.add_argument("--scout-warmup", type=int, default=8, help="warm-up decode steps of scout rows")
    p.add_argument("--first-config-modes", default="hgca-sync",
                   help="extra modes run for the first (batch, window) only: hgca-sync = hgca with one "
                        "synchronous callback per layer instead of submit/collect around the GPU window")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--sink", type=int, default=16)
    p.add_argument("--beta", type=float, default=1.0)
    p.add_argument("--hgca-keep", type=float, default=0.1, help="fraction of offloaded tokens hgca keeps")
    p.add_argument("--topk-tokens", type=int, default=2048, help="scout/topk budget in tokens")
    p.add_argument("--recall-blocks", type=int, default=128, help="scout GPU pool blocks per sequence")
    p.add_argument("--threads", type=int, default=None, help="Numba threads (default cores - 1)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--recall-steps", type=int, default=3, help="timed steps of recall (after 1 warm-up)")
    p.add_argument("--budget-s", type=float, default=390.0, help="skip what is left after this many seconds")
    args = p.parse_args(argv)
    if args.quick:
        args.context, args.batches, args.steps, args.warmup = 1024, "2", 3, 2
        args.topk_tokens, args.recall_blocks = 256, 8
        args.layers = 2
    start = time.perf_counter()
    mcfg = model_config(args)
    model = create_model(mcfg, seed=0)
    graphdef, params = nnx.split(model)
    params = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, params)
    del model
    rows = []
    first = True
    batches = [int(b) for b in args.batches.split(",")]
    windows = [window_for(float(w), args.context, args.sink, args.block_size) for w in args.windows.split(",")]
    e_max = max(int(evicted_blocks(np.int64(args.context),
                                   HybridConfig(window_tokens=w, block_size=args.block_size, sink=args.sink)))
                for w in windows)
    ctx = Context(mcfg, args.block_size, args.sink, max(batches), args.context, e_max, args.hgca_keep)
    print(f"host store: {max(batches)} sequences x {e_max} blocks x {mcfg.num_layers} layers written in "
          f"{ctx.fill_s:.1f} s ({ctx.store.bytes_used() / 2**30:.1f} GiB)", flush=True)
    for batch in batches:
        for window in windows:
            modes = (args.modes.split(",") + args.stable_modes.split(",")
                     + (args.first_config_modes.split(",") if first else []))
            first = False
            for mode in [m for m in modes if m]:
                if time.perf_counter() - start > args.budget_s:
                    print(f"time budget of {args.budget_s:.0f} s spent: skipping {mode} batch {batch} window {window}", flush=True)
                    rows.append(dict(mode=mode, batch=batch, context=args.context, gpu_window=window,
                                     error=f"skipped: time budget of {args.budget_s:.0f} s spent after {time.perf_counter() - start:.0f} s"))
                    continue
                print(f"{mode}: batch {batch}, context {args.context}, window {window}", flush=True)
                try:
                    row = run_mode(mode, args, mcfg, (graphdef, params), batch, window, ctx)
                except Exception as exc:  # noqa: BLE001 - an OOM in one mode must not lose the others
                    traceback.print_exc()
                    row = dict(mode=mode, batch=batch, context=args.context, gpu_window=window,
                               error=f"{type(exc).__name__}: {_error_tail(exc)}")
                rows.append(row)
                print("  " + ", ".join(f"{k}={row.get(k)}" for k in KEYS[4:] if k in row), flush=True)
                gc.collect()
    print_table(rows, KEYS + EXTRA)
    config = dict(vars(args), model=dataclasses.asdict(mcfg), kv_dtype=KV_DTYPE_OF["bfloat16"],
                  note=("random weights and a random context written directly (no prefill); "
                        f"{mcfg.num_layers} of Llama-3-8B's 32 layers"))
    device = "cpu" if jax.devices()[0].platform == "cpu" else "h100"
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"hybrid-{device}{'-quick' if args.quick else ''}.json")
    write_results(out, "hybrid attention modes: decode speed and per-step breakdown", config, rows)
    print(f"wrote {out} in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
