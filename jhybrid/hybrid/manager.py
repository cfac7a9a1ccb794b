"""KVManager: the per-batch host runtime of a hybrid backend, run in Python *between* jitted steps.

It owns the host store (`host.KVStore`), the executor and the callback bridge (`host.bridge.
HostBridge`), a NumPy mirror of each sequence's length, and does the bookkeeping that is not
per-token work:

  * eviction: before a step that would overflow a ring, one jitted gather takes the oldest whole
    blocks of every layer (K, V and per-token MAW, store layout [n, bs, Hkv, D]) and, for
    scout/topk, writes their key digests; the blocks go device -> `pinned_host` memory in one
    transfer (plain host copy on CPU, logged once) and into `KVStore.append_blocks`; hgca then
    queues `submit_sparsify` on the worker. With blk_size-token blocks this happens once every
    blk_size decode steps per sequence.
  * re-evaluation (hgca): on the first decode step after a prefill or append, each layer's
    offloaded tokens are re-scored with the turn's last queries (`submit_reevaluate`).
  * prefill over the offloaded prompt (`cfg.prefill_offloaded`): before a prefill chunk whose
    sequences already have offloaded blocks, either nothing (the step's callbacks attend to them on
    the CPU) or, on the device path, every layer's offloaded blocks are copied to the device into
    the layer states as pf_k, pf_v [B, Hkv, P, D] and pf_len [B] (`jhybrid.hybrid.prefill_upload`);
    the step attends to them there and passes them through (donated, no copy). The next chunk
    extends them on the device with the blocks evicted before it (`_extend_prompt`: no host round
    trip); a decode step drops them.
  * recall (recall mode): the whole offloaded KV is uploaded to the device before every step.
  * recall (scout, `jhybrid.hybrid.recall`): asynchronous and incremental (ScoutAttention §3.4).
    At a step start, per layer: when the CPU's share of the layer's selected blocks at the last
    step exceeded `recall_threshold` (and at least `recall_min_interval` steps passed since the
    layer's last recall, and none of its recalls is in flight), a background thread plans the
    recall (the blocks the CPU attended, best first, into the least recently used slots of the
    same sequence and KV head), gathers only those (block, head) rows from the host store and
    uploads them (pinned_host on a GPU). The first step start at which the upload has finished
    applies it with one jitted, buffer-donating scatter; no step ever waits for it. Warm start:
    at the second decode step after a prefill (or `use_store`), every layer recalls the blocks its
    first decode step selected (the paper's "important blocks identified after the prefill"),
    by the same asynchronous path, threshold and interval ignored.

Instrumentation: `history` holds one dict per step (its counter deltas + wall_s, the time
between two step starts); cumulative counters (seconds): evict_s, transfer_s (device<->host bulk
copies), recall_s (scout recall work on the critical path: deciding, snapshotting, applying),
recall_bg_s (background: planning, gathering, uploading), bytes_to_host, bytes_to_device,
n_evicted_blocks, n_recall_triggers, n_recalls (applied), recall_rows ((block, head) rows moved),
n_reevaluations; plus the bridge's. `recall_log` lists each applied recall (layer, trigger_step,
apply_step, rows, warm).
"""

from __future__ import annotations

import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from host import HostExecutor, KVStore, StoreConfig
from host.bridge import HostBridge
from jhybrid.hybrid.config import HybridConfig, evicted_blocks
from jhybrid.hybrid.prefill_upload import offloaded_prompt, offloaded_prompt_bytes
from jhybrid.hybrid.recall import RecallPlan, _next_pow2, plan_recall, pool_spec, stage_recall

log = logging.getLogger(__name__)

KV_DTYPE_OF = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_logged_cpu_copy = False


def to_host(x: jax.Array) -> np.ndarray:
    """Bulk device -> host copy: via `pinned_host` memory on GPU (~50 GB/s measured), plain elsewhere."""
    global _logged_cpu_copy
    device = next(iter(x.devices()))
    if device.platform == "gpu":
        try:
            pinned = jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))
            return np.asarray(pinned)
        except Exception as exc:  # noqa: BLE001 - logged, and the slow path is named
            log.warning("KV manager: pinned_host transfer failed (%s: %s); using np.asarray (~2 GB/s)",
                        type(exc).__name__, exc)
            return np.asarray(x)
    if not _logged_cpu_copy:
        log.info("KV manager: device is %r, not a GPU: evicted blocks reach the host by a plain copy "
                 "(no pinned_host memory kind)", device.platform)
        _logged_cpu_copy = True
    return np.asarray(x)


def required_host_bytes(cfg: HybridConfig, n_layers: int, batch: int, max_len: int, n_kv_heads: int,
                        head_dim: int, itemsize: int) -> int:
    """KV bytes the host store needs for contexts of max_len tokens (K + V, storage dtype)."""
    return n_layers * batch * cfg.host_blocks(max_len) * cfg.block_size * n_kv_heads * head_dim * 2 * itemsize


class KVManager:
    """Host runtime for one batch. `batch` rows map to store sequences 0..batch-1."""

    def __init__(self, cfg: HybridConfig, model_config, batch: int, max_len: int, dtype):
        self.cfg, self.model_config = cfg, model_config
        self.batch, self.max_len = batch, max_len
        self.n_layers = model_config.num_layers
        self.hkv, self.d = model_config.num_kv_heads, model_config.head_dim
        self.dtype = jnp.dtype(dtype)
        self.nb_max = cfg.host_blocks(max_len)
        kv_dtype = KV_DTYPE_OF.get(self.dtype.name)
        if kv_dtype is None:
            raise ValueError(f"hybrid attention: model dtype {self.dtype} is not supported "
                             f"(expected one of {sorted(KV_DTYPE_OF)})")
        need = required_host_bytes(cfg, self.n_layers, batch, max_len, self.hkv, self.d, self.dtype.itemsize)
        if cfg.host_memory_cap_bytes is not None and cfg.host_memory_cap_bytes < need:
            raise ValueError(
                f"host memory cap of {cfg.host_memory_cap_bytes} bytes cannot hold the offloaded KV of "
                f"{batch} sequence(s) x {max_len} tokens x {self.n_layers} layers ({need} bytes needed)")
        self.store = KVStore(StoreConfig(
            n_layers=self.n_layers, n_kv_heads=self.hkv, head_dim=self.d, block_size=cfg.block_size,
            kv_dtype=kv_dtype, host_memory_cap_bytes=cfg.host_memory_cap_bytes,
            initial_blocks_per_layer=max(16, min(batch * self.nb_max, 4096))))
        for b in range(batch):
            self.store.add_sequence(b)
        import numba
        n_threads = cfg.n_threads or max(1, numba.config.NUMBA_NUM_THREADS - 1)
        self.executor = HostExecutor(self.store, n_workers=1, n_threads=n_threads)
        self.bridge = HostBridge(self.store, self.executor, range(batch), model_config.attention_scale)
        self.n_tokens = np.zeros(batch, np.int64)
        self.decode_steps = 0
        self._prefill_queries: list[np.ndarray | None] = [None] * self.n_layers  # hgca re-evaluation
        self._needs_reevaluate = False
        self._tails_in_flight = False
        # device path of prefill_offloaded: the last chunk's copies (kept while chunks follow each
        # other) with the blocks per sequence they hold, and this step's evicted blocks on the device
        self._pf_prev: tuple | None = None
        self._pf_blocks: np.ndarray | None = None
        self._pf_evicted: tuple | None = None
        self._last_recall = np.full(self.n_layers, -10**9)
        # scout recall: host copy of every layer's pool table [L, B, Hkv, R] (updated when a recall
        # is applied), the in-flight recall of each layer, and the background thread.
        r = cfg.pool_blocks()
        self._pool_ids = np.full((self.n_layers, batch, self.hkv, r), -1, np.int32) if r else None
        self._pending: dict[int, RecallPlan] = {}
        self._recaller = ThreadPoolExecutor(1, thread_name_prefix="jhybrid-recall") if r else None
        self._epoch = 0              # bumped when the store or batch changes: older recalls are void
        self._since_prefill = 0      # decode steps since the last prefill chunk (or use_store)
        self.recall_hook = None      # tests: called at the start of each background recall job
        self.recall_log: list[dict] = []
        self.mirror = None
        if cfg.mode == "recall":
            shape = (self.n_layers, batch, self.hkv, self.nb_max * cfg.block_size, self.d)
            self.mirror = {"k": np.zeros(shape, self.dtype), "v": np.zeros(shape, self.dtype)}
        self.reset_counters()
        log.info("hybrid %s: %d layers x %d sequences, window %d (sink %d + %d x %d), host blocks <= %d",
                 cfg.mode, self.n_layers, batch, cfg.window_tokens, cfg.sink, cfg.blk_num,
                 cfg.block_size, self.nb_max)

    def close(self) -> None:
        self.executor.close(wait=False)
        self._drop_recalls()
        if self._recaller is not None:
            self._recaller.shutdown(wait=False, cancel_futures=True)

    def _drop_recalls(self) -> None:
        """Forget in-flight recalls (a new store or a closed batch): they are never applied."""
        self._epoch += 1
        self._pending.clear()

    def wait_recalls(self, timeout: float | None = 60.0) -> None:
        """Block until every in-flight recall is staged (tests); the next step start applies them."""
        for plan in list(self._pending.values()):
            plan.future.exception(timeout=timeout)

    def use_store(self, store: KVStore, n_tokens: np.ndarray) -> None:
        """Adopt an already filled host store holding sequences 0..B-1 (benchmarks: a context
        written directly instead of prefilled). n_tokens [B]: each sequence's total length."""
        if store.config.n_layers != self.n_layers or store.config.block_size != self.cfg.block_size:
            raise ValueError("use_store: the store's layers / block size differ from this manager's")
        self.executor.close(wait=True)
        self.store = store
        self.executor = HostExecutor(store, n_workers=1, n_threads=self.executor.n_threads)
        self.bridge = HostBridge(store, self.executor, range(self.batch), self.model_config.attention_scale)
        self.n_tokens = np.asarray(n_tokens, np.int64).copy()
        self._needs_reevaluate = False
        self._drop_recalls()
        if self._pool_ids is not None:  # the cache handed in with it must have an empty pool
            self._pool_ids[:] = -1
        self._since_prefill = 0
        self.reset_counters()

    # ---- counters ----------------------------------------------------------------------------
    HISTORY = 4096  # steps kept in `history`

    def reset_counters(self) -> None:
        self.history: list[dict] = []
        self._last_snapshot = None
        self._c = dict(evict_s=0.0, transfer_s=0.0, recall_s=0.0, recall_bg_s=0.0, bytes_to_host=0,
                       bytes_to_device=0, n_evicted_blocks=0, n_recall_triggers=0, n_recalls=0, recall_rows=0,
                       n_reevaluations=0, n_prefill_device_chunks=0, n_prefill_extends=0,
                       n_prefill_host_chunks=0)
        self.bridge.reset_counters()

    def counters(self) -> dict:
        return {**self._c, **self.bridge.counters()}

    def _record_step(self) -> None:
        """Per-step instrumentation: the counters' change since the previous step began, and the
        wall time between the two step starts (bookkeeping + the jitted step + the caller's work)."""
        now, totals = time.perf_counter(), self.counters()
        if self._last_snapshot is not None:
            then, before = self._last_snapshot
            self.history.append({"wall_s": now - then,
                                 **{k: totals[k] - before.get(k, 0) for k in totals}})
            del self.history[:-self.HISTORY]
        self._last_snapshot = (now, totals)

    def host_kv_bytes(self) -> int:
        """Host bytes of this batch's offloaded K/V (+ hgca's sparse copies, + recall's mirror)."""
        c = self.store.config
        block = 2 * c.n_kv_heads * c.block_size * c.head_dim * np.dtype(self.dtype).itemsize
        blocks = sum(self.store.n_blocks(layer, b) for layer in range(self.n_layers) for b in range(self.batch))
        mirror = 0 if self.mirror is None else self.mirror["k"].nbytes * 2
        context = self.store.context.bytes_used() if self.cfg.mode == "hgca" else 0
        return blocks * block + context + mirror

    def stored_tokens(self, layer: int, seq: int) -> int:
        return self.store.n_tokens(layer, seq)

    # ---- the per-step hook -------------------------------------------------------------------
    def before_step(self, cache, positions):
        """Call with the cache and the step's positions [B, T] before running the step."""
        self.bridge.raise_pending()
        if self._tails_in_flight:  # the last chunk handed its query tails over inside the step
            jax.block_until_ready(cache)
            self._tails_in_flight = False
        self._pf_prev, self._pf_evicted = None, None
        if "pf_k" in cache.layers[0]:  # the last chunk's copies of the offloaded prompt: a following
            if np.shape(positions)[1] > 1:  # chunk extends them on the device, a decode step drops them
                self._pf_prev = tuple((state["pf_k"], state["pf_v"]) for state in cache.layers)
            cache = cache.replace(layers=tuple({name: x for name, x in state.items() if not name.startswith("pf_")}
                                               for state in cache.layers))
        self._record_step()
        if self._recaller is not None:
            cache = _commit(cache)
        pos = np.asarray(positions).astype(np.int64)
        valid = pos >= 0
        n_new = valid.sum(axis=1)
        first = np.where(valid.any(axis=1), np.where(valid, pos, np.iinfo(np.int64).max).min(axis=1), self.n_tokens)
        if np.any(first != self.n_tokens):
            raise ValueError(f"positions start at {first.tolist()} but the sequences hold "
                             f"{self.n_tokens.tolist()} tokens (hybrid attention needs contiguous appends)")
        if pos.shape[1] > 1 and n_new.max() > self.cfg.max_prefill_chunk:
            raise ValueError(f"a prefill chunk of {int(n_new.max())} tokens does not fit the GPU ring of "
                             f"{self.cfg.ring_tokens} tokens; use chunks of at most {self.cfg.max_prefill_chunk}")
        after = self.n_tokens + n_new
        if np.any(after > self.max_len):
            raise ValueError(f"sequence lengths {after.tolist()} exceed the cache's max_len={self.max_len}")
        e0, e1 = evicted_blocks(self.n_tokens, self.cfg), evicted_blocks(after, self.cfg)
        if np.any(e1 > e0):
            cache = self._evict(cache, e0, e1)
            if pos.shape[1] == 1:
                self._pf_evicted = None  # only a prefill chunk extends its copies with them
        if self._pending:
            cache = self._apply_ready_recalls(cache)
        if pos.shape[1] > 1:
            self._remember_turn_queries(pos)
            self._since_prefill = 0
            cache = self._attach_offloaded_prompt(cache)
        else:
            if self._needs_reevaluate:
                self._reevaluate()
            if self.cfg.mode == "recall":
                cache = self._upload_offloaded(cache)
            if self.cfg.pool_blocks() and self._since_prefill > 0:
                self._trigger_recalls(cache, e0)
            self._since_prefill += 1
            self.decode_steps += 1
        self.n_tokens = after
        return cache

    # ---- eviction ----------------------------------------------------------------------------
    def _evict(self, cache, e0, e1):
        start = time.perf_counter()
        rows = [(b, blk) for b in range(self.batch) for blk in range(int(e0[b]), int(e1[b]))]
        n = len(rows)
        size = _next_pow2(n)
        seq = np.full(size, self.batch, np.int32)  # out of range: dropped by the digest scatter
        blk = np.full(size, self.nb_max, np.int32)
        seq[:n] = [r[0] for r in rows]
        blk[:n] = [r[1] for r in rows]
        seq_d, blk_d = jnp.asarray(seq), jnp.asarray(blk)
        layers, k, v, maw = _gather_blocks(self.cfg, cache.layers, seq_d, blk_d)
        self._pf_evicted = (k, v, seq_d, blk_d, e1 - e0)  # a device-path prefill chunk extends with them
        t0 = time.perf_counter()
        k, v, maw = to_host(k), to_host(v), to_host(maw)  # [L, N, bs, Hkv, D], ..., [L, N, bs, Hkv]
        self._c["transfer_s"] += time.perf_counter() - t0
        self._c["bytes_to_host"] += k.nbytes + v.nbytes + maw.nbytes
        bs, s = self.cfg.block_size, self.cfg.sink
        by_seq: dict[int, list[int]] = {}
        for i, (b, _) in enumerate(rows):
            by_seq.setdefault(b, []).append(i)
        for layer in range(self.n_layers):
            numbers = []
            for b, idx in by_seq.items():
                blocks = blk[idx]
                positions = s + blocks[:, None].astype(np.int64) * bs + np.arange(bs)[None, :]
                got = self.store.append_blocks(layer, b, k[layer, idx], v[layer, idx], maw[layer, idx], positions)
                if not np.array_equal(got, blocks):
                    raise RuntimeError(f"host store numbered blocks {got.tolist()} for layer {layer} "
                                       f"sequence {b}; the GPU ring evicted {blocks.tolist()}")
                numbers.append(got)
                if self.mirror is not None:
                    for j, i in enumerate(idx):
                        lo = int(blocks[j]) * bs
                        self.mirror["k"][layer, b, :, lo:lo + bs] = k[layer, i].transpose(1, 0, 2)
                        self.mirror["v"][layer, b, :, lo:lo + bs] = v[layer, i].transpose(1, 0, 2)
            if self.cfg.mode == "hgca":
                self.executor.submit_sparsify(layer, list(by_seq), numbers, self.cfg.beta, self.cfg.window_tokens,
                                              self.cfg.keep_after)
        self._c["n_evicted_blocks"] += n * self.n_layers
        self._c["evict_s"] += time.perf_counter() - start
        return cache.replace(layers=layers)

    # ---- hgca re-evaluation ------------------------------------------------------------------
    def _remember_turn_queries(self, pos: np.ndarray) -> None:
        """Called before a prefill chunk: keep the previous chunk's queries (recorded by the bridge)."""
        self._collect_turn_queries()
        self._last_chunk_valid = (pos >= 0).sum(axis=1)
        self._needs_reevaluate = self.cfg.mode == "hgca"

    def _collect_turn_queries(self) -> None:
        valid = getattr(self, "_last_chunk_valid", None)
        if valid is None:
            return
        keep = self.cfg.reevaluate_queries
        for layer in range(self.n_layers):
            q = self.bridge.last_queries.get(layer)
            tail = self.bridge.turn_tails.pop(layer, None)  # the chunk ran on the device path
            if tail is None and (q is None or q.shape[1] == 1):
                continue
            old = self._prefill_queries[layer]
            rows = []
            for b in range(self.batch):
                if tail is not None:
                    mine = tail[0][b, keep - min(keep, int(tail[1][b])):]
                else:
                    mine = q[b, max(0, int(valid[b]) - keep):int(valid[b])]
                if old is not None:
                    mine = np.concatenate([old[b], mine])[-keep:] if mine.shape[0] < keep else mine
                rows.append(mine)
            tq = min(r.shape[0] for r in rows)
            if tq > 0:
                self._prefill_queries[layer] = np.stack([r[-tq:] for r in rows])
        self._last_chunk_valid = None

    def _reevaluate(self) -> None:
        self._collect_turn_queries()
        self._needs_reevaluate = False
        if all(self.store.n_blocks(0, b) == 0 for b in range(self.batch)):
            return
        for layer in range(self.n_layers):
            q = self._prefill_queries[layer]
            if q is not None:
                self.executor.submit_reevaluate(layer, range(self.batch), q, self.cfg.beta,
                                                self.model_config.attention_scale, self.cfg.keep_after)
                self._c["n_reevaluations"] += 1
        self._prefill_queries = [None] * self.n_layers

    # ---- prefill over the offloaded part of the prompt -------------------------------------------
    def _attach_offloaded_prompt(self, cache):
        """Device path of cfg.prefill_offloaded: put every layer's offloaded blocks in its state (pf_k,
        pf_v, pf_len) for the coming prefill chunk; unchanged cache on the host path."""
        choice = self.cfg.prefill_offloaded
        device = next(iter(cache.layers[0]["k_ring"].devices()))
        if choice == "host" or (choice == "auto" and device.platform != "gpu"):
            return cache
        nbytes = offloaded_prompt_bytes(self.store, self.batch, self.dtype.itemsize)
        if nbytes == 0:
            return cache
        limit = self.cfg.prefill_upload_max_bytes
        if limit is not None and nbytes > limit:
            if not self._c["n_prefill_host_chunks"]:
                log.warning("hybrid %s: a prefill chunk's offloaded prompt (%d bytes on the device) exceeds "
                            "prefill_upload_max_bytes=%d; such chunks attend to it on the CPU (slower)",
                            self.cfg.mode, nbytes, limit)
            self._c["n_prefill_host_chunks"] += 1
            return cache
        start = time.perf_counter()
        blocks = np.array([self.store.n_blocks(0, b) for b in range(self.batch)], np.int64)
        layers_kv = self._extend_offloaded_prompt(blocks)
        if layers_kv is None:  # the first chunk over offloaded tokens (or after decode): from the store
            layers_kv, _ = offloaded_prompt(self.store, self.batch, self.dtype, device)
            self._c["bytes_to_device"] += nbytes
        n_valid = (blocks * self.cfg.block_size).astype(np.int32)
        # one pf_len per layer: the step donates the cache, and a buffer cannot be donated twice
        layers = tuple(dict(state, pf_k=k, pf_v=v, pf_len=jax.device_put(n_valid, device))
                       for state, (k, v) in zip(cache.layers, layers_kv))
        self._c["transfer_s"] += time.perf_counter() - start
        self._pf_blocks = blocks
        self._c["n_prefill_device_chunks"] += 1
        self._tails_in_flight = self.cfg.mode == "hgca"
        return cache.replace(layers=layers)

    def _extend_offloaded_prompt(self, blocks: np.ndarray):
        """The last chunk's device copies plus the blocks evicted before this chunk, scattered in on
        the device (no host round trip); None when there are no copies to extend or they do not
        account for exactly `blocks` [B] offloaded blocks per sequence."""
        prev, evicted = self._pf_prev, self._pf_evicted
        self._pf_prev = self._pf_evicted = None
        if prev is None or self._pf_blocks is None:
            return None
        added = evicted[4] if evicted is not None else np.zeros_like(blocks)
        if not np.array_equal(self._pf_blocks + added, blocks):
            log.debug("prefill copies hold %s blocks + %s evicted != %s stored: rebuilt from the store",
                      self._pf_blocks.tolist(), added.tolist(), blocks.tolist())
            return None
        if evicted is None:  # nothing evicted since: same blocks, same padding
            return prev
        self._c["n_prefill_extends"] += 1
        return _extend_prompt(prev, *evicted[:4], _next_pow2(int(blocks.max())) * self.cfg.block_size)

    # ---- recall mode: everything back, every step --------------------------------------------
    def _upload_offloaded(self, cache):
        t0 = time.perf_counter()
        layers = []
        for layer, state in enumerate(cache.layers):
            state = dict(state)
            state["off_k"] = jax.device_put(self.mirror["k"][layer])
            state["off_v"] = jax.device_put(self.mirror["v"][layer])
            layers.append(state)
        self._c["transfer_s"] += time.perf_counter() - t0
        self._c["bytes_to_device"] += self.mirror["k"].nbytes * 2
        return cache.replace(layers=tuple(layers))

    # ---- scout: asynchronous incremental recall into the GPU pool (jhybrid.hybrid.recall) -------
    def cpu_share(self, layer: int, n_blocks: np.ndarray) -> float | None:
        """CPU-attended blocks / selected blocks of `layer` at the last decode step (None: unknown).
        n_blocks [B]: offloaded blocks per sequence when the selection was made."""
        ids = self.bridge.last_block_ids.get(layer)
        budget = int(np.minimum(self.cfg.topk_blocks or self.nb_max, n_blocks).sum()) * self.hkv
        if ids is None or budget == 0:
            return None
        return float((ids >= 0).sum()) / budget

    def _trigger_recalls(self, cache, n_blocks: np.ndarray) -> None:
        """Start the recalls due at this step start (see the module docstring); never blocks on one."""
        cfg = self.cfg
        warm = self._since_prefill == 1
        last_pos = self.n_tokens - 1  # the previous decode step's token positions [B]
        for layer in range(self.n_layers):
            if layer in self._pending:
                continue
            share = self.cpu_share(layer, n_blocks)
            if share is None or share == 0.0:
                continue
            if not warm and (share <= cfg.recall_threshold
                             or self.decode_steps - self._last_recall[layer] < cfg.recall_min_interval):
                continue
            start = time.perf_counter()
            state = cache.layers[layer]
            plan = RecallPlan(layer, *(np.zeros(0, np.int32),) * 4, trigger_step=self.decode_steps,
                              epoch=self._epoch, warm=warm)
            # Snapshots the job may use after this step has donated the cache: the CPU's ids (the
            # bridge replaces, never mutates, them), the host pool table, the slots' last use.
            cpu_ids = self.bridge.last_block_ids[layer]
            pool_ids = self._pool_ids[layer].copy()
            pool_used = np.asarray(state["pool_used"])
            device = next(iter(state["pool_k"].devices()))
            prev = cache.layers[layer - 1] if layer > 0 else {}
            specs = [pool_spec(state[name]) for name in ("pool_k", "pool_v", "pool_blocks", "pool_used")]
            specs.append(pool_spec(prev.get("next_pool_blocks")))
            plan.future = self._recaller.submit(self._recall_job, plan, self.store, cpu_ids, pool_ids, pool_used,
                                                last_pos.copy(), device, specs)
            self._pending[layer] = plan
            self._last_recall[layer] = self.decode_steps
            self._c["n_recall_triggers"] += 1
            self._c["recall_s"] += time.perf_counter() - start

    def _recall_job(self, plan: RecallPlan, store, cpu_ids, pool_ids, pool_used, last_pos, device, specs):
        """Background thread: plan, gather and upload one layer's recall, and compile its scatter
        -> (staged device arrays, compiled apply), or None when there is nothing to move."""
        start = time.perf_counter()
        resident = (cpu_ids[..., None] == pool_ids[:, :, None, :]).any(-1) & (cpu_ids >= 0)
        cpu_ids = np.where(resident, -1, cpu_ids)  # recalled after this selection was made
        plan.b, plan.h, plan.r, plan.block = plan_recall(cpu_ids, pool_ids, pool_used, last_pos)
        staged = None
        if plan.n:
            staged = stage_recall(store, plan, self.batch, self.dtype, device, hook=self.recall_hook,
                                  pool_specs=specs)
        plan.bg_s = time.perf_counter() - start
        return staged

    def _apply_ready_recalls(self, cache):
        """Apply every in-flight recall whose upload has finished (one jitted scatter per layer)."""
        layers = list(cache.layers)
        for layer in sorted(self._pending):
            plan = self._pending[layer]
            if not plan.future.done():
                continue
            start = time.perf_counter()
            del self._pending[layer]
            exc = plan.future.exception()
            if exc is not None:
                raise RuntimeError(f"scout recall of layer {layer} failed in the background") from exc
            result = plan.future.result()
            self._c["recall_bg_s"] += plan.bg_s
            if result is not None and plan.epoch == self._epoch:
                staged, apply = result
                state = dict(layers[layer])
                prev = dict(layers[layer - 1]) if layer > 0 and "next_pool_blocks" in layers[layer - 1] else None
                now = jax.device_put(np.asarray(self.n_tokens - 1, np.int32), staged[0].sharding)
                (state["pool_k"], state["pool_v"], state["pool_blocks"], state["pool_used"],
                 nxt) = apply(state["pool_k"], state["pool_v"], state["pool_blocks"], state["pool_used"],
                                     None if prev is None else prev["next_pool_blocks"], *staged, now)
                layers[layer] = state
                if prev is not None:
                    prev["next_pool_blocks"] = nxt
                    layers[layer - 1] = prev
                self._pool_ids[layer][plan.b, plan.h, plan.r] = plan.block
                self._c["n_recalls"] += 1
                self._c["recall_rows"] += plan.n
                self._c["bytes_to_device"] += staged[4].nbytes * 2
                self.recall_log.append(dict(layer=layer, trigger_step=plan.trigger_step,
                                            apply_step=self.decode_steps, rows=plan.n, warm=plan.warm))
                del self.recall_log[:-self.HISTORY]
            self._c["recall_s"] += time.perf_counter() - start
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


def _extend_prompt(prev: tuple, k: jax.Array, v: jax.Array, seq: jax.Array, blk: jax.Array, p: int):
    """`_scatter_evicted`, jitted, with prev donated when its padding stays (the scatter then writes
    in place; a larger padding is a new array, which a donated input could not become)."""
    fn = _scatter_evicted_in_place if prev[0][0].shape[2] == p else _scatter_evicted_padded
    return fn(prev, k, v, seq, blk, p)


def _scatter_evicted(prev: tuple, k: jax.Array, v: jax.Array, seq: jax.Array, blk: jax.Array, p: int):
    """prev[l] = (pf_k, pf_v) [B, Hkv, P0, D], padded to p tokens, with the evicted blocks k, v
    [L, N, bs, Hkv, D] (sequence seq[n], offloaded block number blk[n]) written at their offsets.
    Padding rows (seq = B) are dropped."""
    bs = k.shape[2]
    tokens = blk[:, None] * bs + jnp.arange(bs)[None, :]  # [N, bs]
    out = []
    for layer, pair in enumerate(prev):
        new = []
        for x, rows in zip(pair, (k[layer], v[layer])):
            x = jnp.pad(x, ((0, 0), (0, 0), (0, p - x.shape[2]), (0, 0)))
            new.append(x.at[seq[:, None], :, tokens].set(rows.astype(x.dtype), mode="drop"))
        out.append(tuple(new))
    return tuple(out)


_scatter_evicted_in_place = jax.jit(_scatter_evicted, static_argnums=(5,), donate_argnums=(0,))
_scatter_evicted_padded = jax.jit(_scatter_evicted, static_argnums=(5,))


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(1,))
def _gather_blocks(cfg: HybridConfig, layers: tuple, seq: jax.Array, blk: jax.Array):
    """Gather ring blocks (seq[n], block number blk[n]) of every layer; write their key digests.

    Returns (layers, k, v [L, N, bs, Hkv, D], maw [L, N, bs, Hkv] float32). Padding rows have
    seq = B (their gathers clamp, their digest writes are dropped).
    """
    bs = cfg.block_size
    slots = (blk % cfg.blk_num)[:, None] * bs + jnp.arange(bs)[None, :]  # [N, bs]
    rows = jnp.minimum(seq, layers[0]["k_ring"].shape[0] - 1)[:, None]
    ks, vs, maws, digests = [], [], [], []
    for state in layers:
        k = state["k_ring"][rows, :, slots]  # [N, bs, Hkv, D]
        ks.append(k)
        vs.append(state["v_ring"][rows, :, slots])
        maws.append(state["maw"][rows, :, slots])
        digests.append((jnp.min(k, axis=1), jnp.max(k, axis=1)))  # [N, Hkv, D]
    new_layers = []
    for i, state in enumerate(layers):
        state = dict(state)
        for prefix, source in (("", i), ("next_", i + 1)):
            if prefix + "kmin" in state:
                kmin, kmax = digests[source]
                state[prefix + "kmin"] = state[prefix + "kmin"].at[seq, :, blk].set(kmin, mode="drop")
                state[prefix + "kmax"] = state[prefix + "kmax"].at[seq, :, blk].set(kmax, mode="drop")
        new_layers.append(state)
    return tuple(new_layers), jnp.stack(ks), jnp.stack(vs), jnp.stack(maws)
