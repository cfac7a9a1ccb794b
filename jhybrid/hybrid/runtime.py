"""HostRuntime: the host side of an open hybrid backend for one batch, run between jitted steps.

`HybridAttention.open(...)` builds one; `close()` ends it. It owns the host store (`host.KVStore`),
the worker (`host.HostExecutor`), the host end of the exchange (`host.bridge.HostBridge`), each
sequence's token count and offloaded block count, the mode's host work (`ModeHost`), the prefill
copies (`jhybrid.hybrid.prefill`) and the counters. `before_step(cache, positions)` is the per-step
host work, in this order (docs/design.md, "One decode step"):

  1. re-raise a host error of the previous step; the mode's `step_start`; drop last step's device
     copies of offloaded tokens
  2. check the positions (contiguous appends, chunk fits the ring, max_len)
  3. eviction (`jhybrid.hybrid.eviction`): publish the background copies that are due, start the
     copies due at this step (one jitted gather, an asynchronous transfer, the store append and the
     mode's `blocks_stored` / `blocks_evicted` in a background thread), and fix the step's split
     between the GPU ring and the host side
  4. the mode's `every_step` (scout: apply finished recalls)
  5. prefill chunk: the mode's `before_prefill_chunk`, then the prefill copies;
     decode step: the mode's `before_decode` (hgca: re-evaluation; recall: upload; scout: recalls),
     then, with the native exchange, the step's plan to the exchange worker (which layers submit,
     with which sequence numbers, and the pages each may read)
  6. the step's `StepMeta` (offloaded blocks per sequence) into the cache

Counters (cumulative, `counters()`; `history` holds one dict of deltas per step plus wall_s, the
time between two step starts): evict_s, transfer_s, bytes_to_host, bytes_to_device,
n_evicted_blocks, n_prefill_device_chunks / n_prefill_extends / n_prefill_host_chunks, the
mode's own (e.g. n_reevaluations, n_recalls) and the bridge's (callback_s, wait_s, cpu_attn_s, ...).
"""

from __future__ import annotations

import logging
import threading
import time

import jax
import jax.numpy as jnp
import numba
import numpy as np

from host import HostExecutor, KVStore, StoreConfig
from host.bridge import HostBridge
from host.store_format import bytes_per_value, to_storage
from host.exchange_worker import BlockPages, ContextPages, ExchangeWorker, StepPlan, clip_to_published
from jhybrid.hybrid.config import OffloadConfig
from jhybrid.hybrid.eviction import Evictor
from jhybrid.hybrid.prefill import PrefillCopies
from jhybrid.hybrid.state import StepMeta
from jhybrid.hybrid.transfer import device_of, device_ordinal
from jhybrid.hybrid.window import evicted_blocks

log = logging.getLogger(__name__)

KV_DTYPE_OF = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def views_fmt(kv_dtype: str) -> int:
    """The attention kernels' storage format code of a store dtype."""
    from host.store_format import FORMAT_CODE

    return FORMAT_CODE[kv_dtype]


def required_host_bytes(config: OffloadConfig, n_layers: int, batch: int, max_len: int, n_kv_heads: int,
                        head_dim: int, kv_dtype: str) -> int:
    """KV bytes the host store needs for contexts of max_len tokens (K + V in the store's format
    `kv_dtype`, int8 scales included)."""
    values = n_layers * batch * config.host_blocks(max_len) * config.block_size * n_kv_heads * head_dim * 2
    return int(values * bytes_per_value(kv_dtype, head_dim))


class HostRuntime:
    """Host side of one open batch: sequences 0..batch-1 of the store are the cache's rows."""

    HISTORY = 4096  # steps kept in `history`

    def __init__(self, config: OffloadConfig, mode, model_config, batch: int, max_len: int, dtype, native=None,
                 device=None):
        self.config, self.mode = config, mode
        self.batch, self.max_len = batch, max_len
        self.n_layers = model_config.num_layers
        self.hkv, self.d = model_config.num_kv_heads, model_config.head_dim
        self.hq = model_config.num_heads
        self.scale = model_config.attention_scale
        self.dtype = np.dtype(jnp.dtype(dtype))
        self.nb_max = config.host_blocks(max_len)
        kv_dtype = KV_DTYPE_OF.get(self.dtype.name)
        if kv_dtype is None:
            raise ValueError(f"hybrid attention: model dtype {self.dtype} is not supported "
                             f"(expected one of {sorted(KV_DTYPE_OF)})")
        # A store format other than the model's (host_kv_dtype) rounds what it keeps: the CPU then
        # attends the stored rows, not the device's values, and every copy must come from them.
        self.store_rounds = config.host_kv_dtype not in (None, kv_dtype)
        kv_dtype = config.host_kv_dtype or kv_dtype
        need = required_host_bytes(config, self.n_layers, batch, max_len, self.hkv, self.d, kv_dtype)
        cap = config.host_memory_cap_bytes
        if cap is not None and cap < need:
            raise ValueError(f"host memory cap of {cap} bytes cannot hold the offloaded KV of {batch} sequence(s) "
                             f"x {max_len} tokens x {self.n_layers} layers ({need} bytes needed)")
        self.store = KVStore(StoreConfig(
            n_layers=self.n_layers, n_kv_heads=self.hkv, head_dim=self.d, block_size=config.block_size,
            kv_dtype=kv_dtype, host_memory_cap_bytes=cap,
            initial_blocks_per_layer=max(16, min(batch * self.nb_max, 4096))))
        for b in range(batch):
            self.store.add_sequence(b)
        self.n_threads = config.host_threads or max(1, numba.config.NUMBA_NUM_THREADS - 1)
        self._start_workers()
        self.n_tokens = np.zeros(batch, np.int64)  # tokens per sequence (= the cache's lengths)
        self.decode_steps = 0
        self._c: dict[str, float] = {}
        self._c_lock = threading.Lock()  # counters are also updated by background threads
        self.declare_counters("bytes_to_device", "n_prefill_device_chunks", "n_prefill_extends",
                              "n_prefill_host_chunks", "exchange_barrier_s", "exchange_snapshot_s")
        self.evictor = Evictor(self)
        self.history: list[dict] = []
        self._last_snapshot = None
        self.prefill = PrefillCopies(self)
        self.mode_host = mode.host(self)
        # the stream-ordered exchange (native library + worker), or None: pure callbacks
        self.native, self.worker = native, None
        self.slot_tables = np.zeros((self.n_layers, batch, self.nb_max), np.int64)  # store slot of each block
        if native is not None:
            device = device or jax.devices()[0]
            slots = native.open(self.n_layers, batch, self.hq, self.hkv, self.d, mode.max_block_ids(max_len),
                                gpu=device.platform == "gpu", device_ordinal=device_ordinal(device),
                                timeout_s=config.exchange_timeout_s, timing=config.exchange_timing)
            self.declare_counters("exchange_wait_s", "exchange_gpu_s", "exchange_timed_layers")
            self.worker = ExchangeWorker(native, slots, self.n_threads, self.scale, config.exchange_timeout_s)
        log.info("hybrid %s: %d layers x %d sequences, window %d (sink %d + %d x %d), host blocks <= %d",
                 config.mode, self.n_layers, batch, config.window_tokens, config.sink, config.blk_num,
                 config.block_size, self.nb_max)

    def _start_workers(self) -> None:
        self.executor = HostExecutor(self.store, n_workers=1, n_threads=self.n_threads)
        self.bridge = HostBridge(self.store, self.executor, range(self.batch), self.scale)

    def close(self) -> None:
        self.evictor.close()
        self.mode_host.close()
        self.executor.close(wait=False)
        if self.worker is not None:
            self.worker.close()
            self.native.close()
            self.worker = None

    # ---- state the modes read ---------------------------------------------------------------------
    def offloaded_blocks(self) -> np.ndarray:
        """[B] blocks per sequence owned by the host side (published; a copy)."""
        return self.evictor.published.copy()

    def last_block_ids(self, layer: int) -> np.ndarray | None:
        """The block ids [B, Hkv, k] int the CPU attended for `layer` at the last decode step (a copy;
        None before any), whichever transport carried them."""
        if self.worker is None:
            ids = self.bridge.last_block_ids.get(layer)
            return None if ids is None else ids.copy()
        if not self.worker.served_any:
            return None
        self.worker.wait_idle()
        k = self.mode.max_block_ids(self.max_len)
        return self.worker.last_ids[layer, :self.batch * self.hkv * k].reshape(self.batch, self.hkv, k).astype(np.int64)

    @staticmethod
    def device_of(cache):
        return device_of(cache.layers[0].window.k_ring)

    def adopt(self, n_tokens, store: KVStore | None = None) -> None:
        """Declare that the host store (this one, or `store`, already filled, e.g. a benchmark's
        synthetic context) holds the offloaded part of sequences of n_tokens [B] tokens, as the
        eviction policy places it, and the device cache holds the rest. The one way, besides
        stepping, to put a history into an open batch (HCache restore, synthetic fill)."""
        n_tokens = np.asarray(n_tokens, np.int64).reshape(-1)
        if n_tokens.shape != (self.batch,) or (n_tokens < 0).any() or (n_tokens > self.max_len).any():
            raise ValueError(f"adopt: n_tokens {n_tokens.tolist()}; expected {self.batch} lengths in [0, {self.max_len}]")
        if store is not None:
            c = store.config
            if (c.n_layers, c.block_size, c.n_kv_heads, c.head_dim) != (self.n_layers, self.config.block_size,
                                                                        self.hkv, self.d):
                raise ValueError("adopt: the store's layers / block size / heads differ from this runtime's")
            if c.kv_dtype != self.store.config.kv_dtype:
                raise ValueError(f"adopt: the store keeps K/V as {c.kv_dtype!r}; this runtime's host_kv_dtype "
                                 f"resolves to {self.store.config.kv_dtype!r}")
            self.executor.close(wait=True)
            self.store = store
            self._start_workers()
        expected = evicted_blocks(n_tokens, self.config)
        stored = np.array([self.store.n_blocks(0, b) for b in range(self.batch)])
        if not np.array_equal(stored, expected):
            raise ValueError(f"adopt: the host store holds {stored.tolist()} blocks per sequence; contexts of "
                             f"{n_tokens.tolist()} tokens offload {expected.tolist()}")
        self.n_tokens = n_tokens.copy()
        self.evictor.adopt(expected)
        for layer in range(self.n_layers):
            for b in range(self.batch):
                slots = self.store.block_slots(layer, b)
                self.slot_tables[layer, b, :slots.shape[0]] = slots
        self.mode_host.adopted()
        self.reset_counters()

    # ---- counters ---------------------------------------------------------------------------------
    def declare_counters(self, *names: str) -> None:
        for name in names:
            self._c.setdefault(name, 0)

    def count(self, name: str, amount: float = 1) -> None:
        with self._c_lock:
            self._c[name] = self._c.get(name, 0) + amount

    def reset_counters(self) -> None:
        self.history = []
        self._last_snapshot = None
        with self._c_lock:
            self._c = {name: 0 for name in self._c}
        self.bridge.reset_counters()
        if self.worker is not None:
            self.worker.reset_counters()

    def counters(self) -> dict:
        with self._c_lock:
            out = {**self._c, **self.bridge.counters()}
        if self.worker is not None:
            out.update(exchange_serve_s=self.worker.serve_s, exchange_steps=self.worker.steps)
            out["cpu_tokens"] += int(self.worker.stats[0])
        return out

    def _record_step(self) -> None:
        """Per-step instrumentation: the counters' change since the previous step began, and the
        wall time between the two step starts (bookkeeping + the jitted step + the caller's work)."""
        now, totals = time.perf_counter(), self.counters()
        if self._last_snapshot is not None:
            then, before = self._last_snapshot
            self.history.append({"wall_s": now - then, **{k: totals[k] - before.get(k, 0) for k in totals}})
            del self.history[:-self.HISTORY]
        self._last_snapshot = (now, totals)

    def host_kv_bytes(self) -> int:
        """Host bytes of this batch's offloaded K/V (+ hgca's sparse copies, + recall's mirror)."""
        c = self.store.config
        block = 2 * c.n_kv_heads * c.block_size * c.row_width * self.store.layers[0].arrays["k"].itemsize
        blocks = sum(self.store.n_blocks(layer, b) for layer in range(self.n_layers) for b in range(self.batch))
        extra = getattr(self.mode_host, "mirror_bytes", lambda: 0)()
        return blocks * block + self.store.context.bytes_used() + extra

    def append_blocks(self, layer: int, seq: int, blocks: np.ndarray, k: np.ndarray, v: np.ndarray,
                      maw: np.ndarray) -> np.ndarray:
        """Append ring blocks `blocks` [n] (their numbers, in order) of (layer, seq) to the host
        store: k, v [n, bs, Hkv, D], maw [n, bs, Hkv] float32 (hgca's salience; 0 for a restored
        history). Returns the store's block numbers (== blocks); the mode hears `blocks_stored`."""
        cfg = self.config
        blocks = np.asarray(blocks, np.int64)
        positions = cfg.sink + blocks[:, None] * cfg.block_size + np.arange(cfg.block_size)
        if self.store_rounds:  # rounded once, here: the store takes its rows as they are
            kv_dtype = self.store.config.kv_dtype
            k, v = to_storage(np.asarray(k), kv_dtype), to_storage(np.asarray(v), kv_dtype)
        got = self.store.append_blocks(layer, seq, k, v, maw, positions)
        if not np.array_equal(got, blocks):
            raise RuntimeError(f"host store numbered blocks {got.tolist()} for layer {layer} sequence {seq}; "
                               f"the GPU ring evicted {blocks.tolist()}")
        self.slot_tables[layer, seq, got] = self.store.block_slots(layer, seq)[got]
        self.mode_host.blocks_stored(layer, seq, got, k, v)
        return got

    # ---- the per-step host work -------------------------------------------------------------------
    def before_step(self, cache, positions):
        """Call with the cache and the step's positions [B, T] (-1 = padding) before the step."""
        self.bridge.raise_pending()
        if self.worker is not None:
            self.worker.raise_pending()
            timing = self.native.timing()  # the steps that have run since the last step start
            if timing is not None:
                self.count("exchange_wait_s", timing[0] / 1e3)
                self.count("exchange_gpu_s", timing[1] / 1e3)
                self.count("exchange_timed_layers", timing[2])
        pos = np.asarray(positions).astype(np.int64)
        if pos.ndim != 2 or pos.shape[0] != self.batch:
            raise ValueError(f"positions of shape {pos.shape}; expected [B={self.batch}, T]")
        prefill = pos.shape[1] > 1
        cache = self.mode_host.step_start(cache)
        cache = self.prefill.take_previous(cache, prefill)
        self._record_step()
        valid = pos >= 0
        n_new = valid.sum(axis=1)
        first = np.where(valid.any(axis=1), np.where(valid, pos, np.iinfo(np.int64).max).min(axis=1), self.n_tokens)
        if np.any(first != self.n_tokens):
            raise ValueError(f"positions start at {first.tolist()} but the sequences hold {self.n_tokens.tolist()} "
                             "tokens (hybrid attention needs contiguous appends)")
        if prefill and n_new.max() > self.config.max_prefill_chunk:
            raise ValueError(f"a prefill chunk of {int(n_new.max())} tokens does not fit the GPU ring of "
                             f"{self.config.ring_tokens} tokens; use chunks of at most {self.config.max_prefill_chunk}")
        after = self.n_tokens + n_new
        if np.any(after > self.max_len):
            raise ValueError(f"sequence lengths {after.tolist()} exceed the cache's max_len={self.max_len}")
        if not prefill and self.decode_steps == 0:
            self.evictor.precompile(cache.layers)  # no timed decode step compiles an eviction
        before = self.evictor.published.copy()
        device_prefill = prefill and self.prefill.uses_device(cache, after)
        cache, split = self.evictor.before_step(cache, after, prefill, device_prefill, self.decode_steps)
        cache = self.mode_host.every_step(cache)
        if prefill:
            self.mode_host.before_prefill_chunk(pos)
            if device_prefill:
                cache = self.prefill.attach(cache, split)
        else:
            cache = self.mode_host.before_decode(cache, before)
            self.decode_steps += 1
            self.bridge.context_token_limits = split * self.config.block_size  # the callback transport's clip
            if self.worker is not None:
                self.worker.arm(self._plan())
        self.n_tokens = after
        meta = StepMeta(offloaded_blocks=jax.device_put(split.astype(np.int32), self.device_of(cache)))
        return cache.replace(meta=meta)

    def _plan(self) -> StepPlan:
        """The decode step's work for the exchange worker: every layer submits, in layer order. The
        pages are snapshot on the worker thread once the host work queued before this step (hgca's
        sparsification and re-evaluation, on the executor's FIFO) is done."""
        layers = np.arange(self.n_layers, dtype=np.int32)
        barrier = self.executor.submit_task(lambda: None, what="exchange barrier")
        kind = self.mode.decode_host_kind()
        offloaded = self.evictor.published.copy()

        def pages():  # both parts delay the step's first layer: counted apart (the breakdown)
            start = time.perf_counter()
            self.executor.collect(barrier)
            store = self.store
            with store.lock:
                taken = time.perf_counter()
                snapshot = self._context_pages(offloaded) if kind == "context" else self._block_pages(offloaded)
                store.begin_read()
            self.count("exchange_barrier_s", taken - start)
            self.count("exchange_snapshot_s", time.perf_counter() - taken)
            return snapshot, store.end_read

        return StepPlan(layers=layers, pages=pages)

    def _context_pages(self, published: np.ndarray) -> ContextPages:
        """hgca: every layer's kept tokens of the `published` [B] blocks (store lock held)."""
        limit = published * self.config.block_size
        views = [clip_to_published(self.store.context.snapshot_locked(layer, range(self.batch)),
                                   self.store.context.layers[layer].arrays["token_index"], limit)
                 for layer in range(self.n_layers)]
        return ContextPages(
            fmt=views[0].fmt, k_pages=tuple(v.k_pages for v in views), v_pages=tuple(v.v_pages for v in views),
            page_ptr=np.concatenate([v.page_ptr for v in views]),
            ptr_off=np.cumsum([0] + [v.page_ptr.shape[0] for v in views]).astype(np.int64),
            page_ids=np.concatenate([v.page_ids for v in views]),
            ids_off=np.cumsum([0] + [v.page_ids.shape[0] for v in views]).astype(np.int64),
            unit_tokens=np.concatenate([v.unit_tokens for v in views]))

    def _block_pages(self, offloaded: np.ndarray) -> BlockPages:
        """topk / scout: every layer's store blocks (store lock held)."""
        c = self.store.config
        arenas = [self.store.layers[layer].arrays for layer in range(self.n_layers)]
        return BlockPages(k=self.mode.max_block_ids(self.max_len), fmt=views_fmt(c.kv_dtype), block_size=c.block_size,
                          k_pages=tuple(a["k"].reshape(-1, c.block_size, c.row_width) for a in arenas),
                          v_pages=tuple(a["v"].reshape(-1, c.block_size, c.row_width) for a in arenas),
                          slot_tables=self.slot_tables.copy(),
                          n_blocks=np.broadcast_to(offloaded, (self.n_layers, self.batch)).copy())


__all__ = ["HostRuntime", "required_host_bytes", "KV_DTYPE_OF"]
