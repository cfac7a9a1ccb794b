"""Placing a restored history into an open hybrid batch: GPU window (sinks + ring) + host store.

HCache (`jhybrid.hcache.restorer.restore_kv`) rebuilds every layer's K, V [1, n, Hkv, D] of a
history of n tokens on the device. `HybridCacheWriter` is the restore sink for the hybrid modes
(recall, hgca, scout, streaming, topk): it puts each layer, as soon as it arrives, where a plain
chunked prefill of the same n tokens would have left it, WITHOUT running attention:

  * GPU window: positions [0, sink) into the sinks, positions [sink + e * block_size, n) into the
    ring (slot (p - sink) % ring_capacity), with e = `window.evicted_blocks(n)` — the eviction
    policy is a function of the length alone, so the placement equals a prefill's for any chunking;
  * host store: blocks 0..e-1 (positions sink + b * block_size + [0, block_size)) appended with
    `HostRuntime.append_blocks` (so the mode hears of them: recall fills its mirror), after one bulk
    device -> host copy per layer (`transfer.to_host`, pinned_host on GPU);
  * scout / topk: the key digests (per block min / max of K over its tokens) of blocks 0..e-1, in
    the layer's own `digests` and in the previous layer's `next_digests` (scout's layer-ahead
    copy), as the runtime's eviction writes them;
  * the runtime adopts the history (`HostRuntime.adopt`: token and block counts) and the cache's
    `lengths` = n;
  * a sliding-window layer (Gemma 3's local layers) keeps its last `sliding_window` tokens on the
    device (`jhybrid.hybrid.sliding`) and nothing on the host; the global layers are the host
    side's layers 0 .. G-1 (`LayerPlan`).

Only one layer's restored K, V has to live on the device at a time (plus the window), so a
history longer than the device could hold all at once still restores.

MAW (moving-average attention weights) is attention HISTORY, which HCache does not save (it saves
K/V or what K/V are projected from, not what queries did). Restored tokens get MAW 0 in the host
store. In the ring, hgca layers restored from hidden states get the MAW the history's last queries
give them (`OffloadMode.restored_window`) (each ring slot's probability under those queries, summed over the KV group and averaged
over the queries: the same rule as the re-scoring of the offloaded tokens below), so a ring token
evicted by the first decode steps is judged by what the history attended, not dropped for a MAW of
0; other ring slots start at 0 (the next steps update them as usual, `window.update_maw`). hgca keeps an offloaded token for CPU attention iff MAW > beta / window, so with MAW
0 eviction-time sparsification would drop every restored token; it is therefore not run.
Instead the offloaded tokens are re-scored the way hgca re-scores them after every new turn
(`host.sparsify.reevaluate`, what hgca's host work submits after each new turn): with the queries of the last
`cfg.reevaluate_queries` positions of the history, per layer. Those are computed from the saved
hidden states in the same jitted projection as K/V (norm + W_q + RoPE of the last rows;
`restore_kv` hands them over through `sink.queries`), so the host context cache after a restore
equals the one a plain prefill has after its first decode step (its re-evaluation uses the same
queries), up to float rounding. Layers restored from KV or by recompute have no hidden states
to take queries from: their context cache stays empty (logged) until the next turn's
re-evaluation, which the next `generate` always triggers (its prefill is exact: it attends every
stored token, so nothing is lost before then). scout / topk select blocks by digests and recall
attends everything, so they need no MAW.

    writer = HybridCacheWriter(model, backend, max_len, n)   # opens backend (HybridAttention) for 1 sequence
    restore_kv(kernels, methods, tokens, fetch, writer)
    cache = writer.finish()                                  # KVCache for backend, lengths [n]
"""

from __future__ import annotations

import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from jhybrid.hybrid.sliding import LayerPlan, write_sliding
from jhybrid.hybrid.state import StepMeta
from jhybrid.hybrid.transfer import to_host
from jhybrid.hybrid.window import evicted_blocks, write_tokens

log = logging.getLogger(__name__)


@functools.partial(jax.jit, static_argnums=(0, 4, 5), donate_argnums=(1,))
def _place_window(cfg, window, k: jax.Array, v: jax.Array, n: int, evicted: int):
    """Writes the window part of k, v [1, n, Hkv, D] (sinks and the un-evicted ring tokens) into
    a layer's `Window` (its MAW slots reset to 0 by write_tokens)."""
    s, bs, w = cfg.sink, cfg.block_size, cfg.ring_tokens  # the window's ring: what a prefill leaves
    begin = s + evicted * bs  # first ring token
    count = n - begin  # <= ring_tokens
    sinks = min(s, n)
    positions = np.full((1, sinks + max(count, 0)), -1, np.int32)
    positions[0, :sinks] = np.arange(sinks)
    if count > 0:
        positions[0, sinks:] = np.arange(begin, n)
    if count > 0:
        k_part = jnp.concatenate([k[:, :sinks], k[:, begin:n]], axis=1)
        v_part = jnp.concatenate([v[:, :sinks], v[:, begin:n]], axis=1)
    else:
        k_part, v_part = k[:, :sinks], v[:, :sinks]
    assert count <= w
    return write_tokens(cfg, window, k_part, v_part, jnp.asarray(positions))


@functools.partial(jax.jit, static_argnums=(0, 3))
def _evicted_blocks_of(cfg, k: jax.Array, v: jax.Array, evicted: int):
    """k, v [1, n, Hkv, D] -> the evicted blocks in store layout k, v [e, bs, Hkv, D] and their
    key digests kmin, kmax [1, Hkv, e, D] (min / max over each block's tokens)."""
    s, bs = cfg.sink, cfg.block_size
    kb = k[0, s:s + evicted * bs].reshape(evicted, bs, *k.shape[2:])
    vb = v[0, s:s + evicted * bs].reshape(evicted, bs, *v.shape[2:])
    kmin = jnp.transpose(jnp.min(kb, axis=1), (1, 0, 2))[None]
    kmax = jnp.transpose(jnp.max(kb, axis=1), (1, 0, 2))[None]
    return kb, vb, kmin, kmax


@functools.partial(jax.jit, donate_argnums=(0,))
def _set_digests(digests, kmin, kmax):
    """The first e blocks of a `Digests` set to kmin, kmax [1, Hkv, e, D]."""
    e = kmin.shape[2]
    return digests.replace(kmin=digests.kmin.at[:, :, :e].set(kmin.astype(digests.kmin.dtype)),
                           kmax=digests.kmax.at[:, :, :e].set(kmax.astype(digests.kmax.dtype)))


class HybridCacheWriter:
    """Restore sink that places each restored layer into a hybrid backend's cache (see module
    docstring). Batch 1 (one session): store sequence 0.

    model: the CausalLM; backend: a `jhybrid.hybrid.HybridAttention` (opened here for one sequence
    of max_len tokens); num_tokens: n, the history length. `num_queries` (hgca:
    config.reevaluate_queries, else 0) tells restore_kv to hand over the last queries of
    hidden-restored layers.
    Counters after finish(): `seconds` (device->host copies + store appends), `bytes_to_host`,
    `n_blocks` (evicted blocks placed in the store, all layers).
    """

    def __init__(self, model, backend, max_len: int, num_tokens: int):
        cfg = backend.config
        if num_tokens > max_len:
            raise ValueError(f"restoring {num_tokens} tokens into a hybrid cache of max_len={max_len}")
        self.model, self.backend, self.cfg = model, backend, cfg
        self.num_tokens = num_tokens
        self.runtime = backend.open(model.config, 1, max_len).runtime
        self.plan = LayerPlan.of(model.config)
        self.cache = model.init_cache(1, max_len, backend)
        self.layers = list(self.cache.layers)
        self.evicted = int(evicted_blocks(np.int64(num_tokens), cfg))
        self.num_queries = backend.mode.restore_queries()
        self.last_queries: dict[int, np.ndarray] = {}
        self.placed: set[int] = set()
        self.seconds = 0.0
        self.bytes_to_host = 0
        self.n_blocks = 0

    def queries(self, layer: int, q: jax.Array) -> None:
        """restore_kv hands over q [1, R, Hq, D] of the last R history positions of a hidden layer."""
        self.last_queries[layer] = q

    def __call__(self, layer: int, k: jax.Array, v: jax.Array) -> None:
        n, cfg = self.num_tokens, self.cfg
        if k.shape[:2] != (1, n) or v.shape != k.shape:
            raise ValueError(f"layer {layer}: restored k {k.shape}, v {v.shape}; expected [1, {n}, Hkv, D]")
        if layer in self.placed:
            raise RuntimeError(f"layer {layer} restored twice")
        g = self.plan.offloaded_index(layer)
        if g is None:  # a sliding-window layer: its last window of tokens, on the device
            positions = jnp.arange(n, dtype=jnp.int32)[None]
            self.layers[layer] = write_sliding(self.layers[layer], k, v, positions)
            self.placed.add(layer)
            return
        e = self.evicted
        if e:
            kb, vb, kmin, kmax = _evicted_blocks_of(cfg, k, v, e)
            if self.layers[layer].digests is not None:
                self.layers[layer] = self.layers[layer].replace(
                    digests=_set_digests(self.layers[layer].digests, kmin, kmax))
            before = self.plan.global_layers[g - 1] if g > 0 else None  # the previous offloaded layer
            if before is not None and self.layers[before].next_digests is not None:
                self.layers[before] = self.layers[before].replace(
                    next_digests=_set_digests(self.layers[before].next_digests, kmin, kmax))
            start = time.perf_counter()
            kh, vh = to_host(kb), to_host(vb)
            maw = np.zeros((e, cfg.block_size, k.shape[2]), np.float32)
            self.runtime.append_blocks(g, 0, np.arange(e), kh, vh, maw)
            self.seconds += time.perf_counter() - start
            self.bytes_to_host += kh.nbytes + vh.nbytes
            self.n_blocks += e
        state = self.layers[layer]
        self.layers[layer] = state.replace(window=_place_window(cfg, state.window, k, v, n, e))
        self.placed.add(layer)

    def finish(self):
        """-> the KVCache (lengths [n]) after every layer was placed; the runtime adopts the history
        and, for hgca, queues the re-evaluation of the offloaded tokens."""
        num_layers = len(self.layers)
        missing = sorted(set(range(num_layers)) - self.placed)
        if missing:
            raise RuntimeError(f"HybridCacheWriter.finish: layers {missing} were never restored")
        cfg, runtime, mode = self.cfg, self.runtime, self.backend.mode
        for layer, q in self.last_queries.items():
            if self.plan.offloaded_index(layer) is not None:
                state = self.layers[layer]
                self.layers[layer] = state.replace(window=mode.restored_window(
                    state.window, q, self.num_tokens, self.evicted, self.model.config.attention_scale))
        runtime.adopt(np.array([self.num_tokens]))
        if self.num_queries and self.evicted:
            without = [layer for layer in self.plan.global_layers if layer not in self.last_queries]
            if without:
                log.info("hybrid ingest: layers %s were not restored from hidden states, so no "
                         "history queries re-score their %d offloaded blocks: their CPU context "
                         "stays empty until the next turn's re-evaluation", without, self.evicted)
            runtime.mode_host.restored({self.plan.offloaded_index(layer): q
                                        for layer, q in self.last_queries.items()
                                        if self.plan.offloaded_index(layer) is not None})
        cache = self.cache.replace(layers=tuple(self.layers), lengths=jnp.full((1,), self.num_tokens, jnp.int32),
                                   meta=StepMeta(offloaded_blocks=jnp.full((1,), self.evicted, jnp.int32)))
        self.cache = None
        log.info("hybrid ingest (%s): %d tokens, %d blocks per layer to the host store (%.1f MB, "
                 "%.1f ms host side)", cfg.mode, self.num_tokens, self.evicted,
                 self.bytes_to_host / 1e6, self.seconds * 1e3)
        return cache


__all__ = ["HybridCacheWriter"]
