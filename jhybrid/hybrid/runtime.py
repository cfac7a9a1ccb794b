"""HostRuntime: the host side of an open hybrid backend for one batch, run between jitted steps.

`HybridAttention.open(...)` builds one; `close()` ends it. It owns the host store (`host.KVStore`),
the worker (`host.HostExecutor`), the host end of the callback exchange (`host.bridge.HostBridge`),
the native exchange worker, each sequence's token count and offloaded block count, the mode's host
work (`ModeHost`, which sees only a `ModeHostContext`), the prefill copies (`jhybrid.hybrid.prefill`)
and the counters (`HostCounters`). `before_step(cache, positions)` is the per-step host work, in
this order (docs/design.md, "One decode step"):

  1. re-raise a host error of the previous step; the mode's `step_start`; drop last step's device
     copies of offloaded tokens
  2. check the positions (contiguous appends, chunk fits the ring, max_len)
  3. eviction (`jhybrid.hybrid.eviction`): publish the background copies that are due, start the
     copies due at this step (one jitted gather, an asynchronous transfer, the store append and the
     mode's `blocks_stored` / `blocks_evicted` in a background thread), and fix the blocks the host
     side owns during the step
  4. prefill chunk: the mode's `before_prefill_chunk`, then the prefill copies (or, when the
     chunk's rows have nothing offloaded, `NothingOffloaded`: no host call);
     decode step: the mode's `before_decode` (hgca: re-evaluation; recall: upload; scout: apply
     finished recalls, start new ones),
     then, with the native exchange, the step's plan to the exchange worker (which layers submit,
     and the pages each may read: `ModeHost.exchange_pages`)
  5. the step's `StepMeta` (offloaded blocks per sequence) into the cache

Counters (cumulative, `counters()`; `history` holds one dict of deltas per step plus wall_s, the
time between two step starts): the core's `HostCounters` fields, the mode's own (e.g.
n_reevaluations, n_recalls) and the callback exchange's (callback_s, wait_s, cpu_attn_s, ...).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import jax
import jax.numpy as jnp
import numba
import numpy as np

from host import HostExecutor, KVStore, StoreConfig
from host.bridge import HostBridge
from host.exchange_worker import ExchangeWorker, StepPlan
from host.context_cache import page_nbytes
from host.kv_store import block_nbytes
from host.store_format import to_storage
from jhybrid.hybrid.config import OffloadConfig
from jhybrid.hybrid.eviction import Evictor
from jhybrid.hybrid.prefill import PrefillCopies
from jhybrid.hybrid.state import NothingOffloaded, StepMeta
from jhybrid.hybrid.transfer import device_ordinal
from jhybrid.hybrid.window import evicted_blocks

log = logging.getLogger(__name__)

KV_DTYPE_OF = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def store_kv_dtype(config: OffloadConfig, model_dtype) -> str:
    """The host store's format for a model dtype: config.host_kv_dtype, else the model's own."""
    name = np.dtype(jnp.dtype(model_dtype)).name
    own = KV_DTYPE_OF.get(name)
    if own is None:
        raise ValueError(f"hybrid attention: model dtype {name} is not supported (expected one of "
                         f"{sorted(KV_DTYPE_OF)})")
    return config.host_kv_dtype or own


def required_host_bytes(store: StoreConfig, blocks_per_sequence: int, batch: int) -> int:
    """Host bytes the store reserves for `batch` sequences of `blocks_per_sequence` offloaded blocks
    per layer: its arenas' slots (K, V, MAW, positions: host.kv_store.block_nbytes) and the context
    cache's first pages (host.context_cache), as the store will reserve them."""
    pages = max(4, store.initial_blocks_per_layer * store.n_kv_heads * store.block_size // store.context_page_tokens)
    slots = max(store.initial_blocks_per_layer, batch * blocks_per_sequence)
    return store.n_layers * (slots * block_nbytes(store) + pages * page_nbytes(store))


class Counters:
    """Typed cumulative counters: subclasses declare float / int fields (all 0 at start); `add`
    is safe from any thread (eviction, recall and worker threads count too)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    @classmethod
    def _fields(cls) -> tuple:
        """dataclasses.fields of the class, looked up once: `as_dict` runs every step, and each
        dataclasses.fields call builds its tuple from a generator (CPython then parks a resized
        tuple in its free list, a slow creep of interpreter memory over thousands of steps)."""
        fields = cls.__dict__.get("_fields_once")
        if fields is None:
            fields = dataclasses.fields(cls)
            cls._fields_once = fields
        return fields

    def reset(self) -> None:
        with self._lock:
            for field in self._fields():
                setattr(self, field.name, 0 if field.type in ("int", int) else 0.0)

    def add(self, **amounts) -> None:
        """counters.add(evict_s=0.01, n_evicted_blocks=4): each name must be a declared field."""
        with self._lock:
            for name, amount in amounts.items():
                setattr(self, name, getattr(self, name) + amount)

    def as_dict(self) -> dict:
        with self._lock:
            return {field.name: getattr(self, field.name) for field in self._fields()}


@dataclasses.dataclass(eq=False)
class HostCounters(Counters):
    """The core's counters (seconds, bytes, events) of one open batch."""

    evict_s: float = 0.0            # step-start time spent starting and publishing evictions
    evict_bg_s: float = 0.0         # background time of the eviction jobs (transfer, store, mode work)
    n_evict_waits: int = 0          # publications that had to wait for their job
    evict_wait_s: float = 0.0
    transfer_s: float = 0.0         # device <-> host copies (evictions, uploads)
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    n_evicted_blocks: int = 0       # (block, layer) pairs evicted
    n_prefill_device_chunks: int = 0
    n_prefill_extends: int = 0      # device chunks that extended the kept copies with evicted blocks
    n_prefill_row_uploads: int = 0  # rows a device chunk copied from the host store (not current)
    n_prefill_rows_from_evicted: int = 0  # rows whose first copies were their blocks evicted at that chunk
    n_prefill_host_chunks: int = 0
    n_prefill_window_chunks: int = 0  # chunks of rows with nothing offloaded: the window alone, no host call
    exchange_barrier_s: float = 0.0  # before a decode step's first host layer: waiting for host work
    exchange_snapshot_s: float = 0.0  # ... and snapshotting the pages
    exchange_wait_s: float = 0.0     # (exchange_timing) the GPU stream waiting for the host
    exchange_gpu_s: float = 0.0      # (exchange_timing) the exchange's own GPU work
    exchange_timed_layers: int = 0

    def __post_init__(self):
        Counters.__init__(self)


@dataclasses.dataclass(frozen=True)
class BatchShape:
    """The open batch as the host side sees it: n_layers offloaded (global) layers, batch sequences
    of up to max_len tokens, hq query / hkv KV heads of head_dim, nb_max host blocks per (layer,
    sequence) at most, the model dtype (NumPy) and the score scale."""

    n_layers: int
    batch: int
    hq: int
    hkv: int
    head_dim: int
    max_len: int
    nb_max: int
    dtype: np.dtype
    scale: float


class ModeHostContext:
    """What a mode's host part (`ModeHost`) may read and use of its open batch; a view of the runtime.

    config, shape (`BatchShape`), counters (the core's `HostCounters`: bytes_to_device, transfer_s),
    n_threads (the host's Numba threads)
    store            the host store (replaced when the runtime adopts a filled one)
    store_rounds     the store keeps a format other than the model's (int8): its rows, not the
                     device's values, are what the CPU attends
    published()      [B] blocks each sequence's host side owns (a copy)
    tokens()         [B] tokens each sequence holds (a copy)
    step_rows()      [B] bool: the rows with a token in the step being started (a copy)
    decode_steps     decode steps run so far
    slot_tables      [L, B, nb_max] int64 the store slot of each block (read only)
    last_block_ids(layer)   the block ids [B, Hkv, k] the CPU attended at the last decode step
    background(fn, *args) / wait_background()   work on the eviction thread, after the started copies
    """

    def __init__(self, runtime: "HostRuntime"):
        self._runtime = runtime
        self.config = runtime.config
        self.shape = runtime.shape
        self.counters = runtime.core_counters
        self.n_threads = runtime.n_threads  # the host's Numba threads

    @property
    def store(self) -> KVStore:
        return self._runtime.store

    @property
    def store_rounds(self) -> bool:
        return self._runtime.store_rounds

    @property
    def decode_steps(self) -> int:
        return self._runtime.decode_steps

    @property
    def slot_tables(self) -> np.ndarray:
        return self._runtime.slot_tables

    def published(self) -> np.ndarray:
        return self._runtime.offloaded_blocks()

    def tokens(self) -> np.ndarray:
        return self._runtime.n_tokens.copy()

    def step_rows(self) -> np.ndarray:
        """[B] bool: the rows with a token in the step being started (a copy; valid from its
        eviction on, e.g. in `before_prefill_chunk` / `before_decode`)."""
        return self._runtime.step_rows.copy()

    def last_block_ids(self, layer: int) -> np.ndarray | None:
        return self._runtime.last_block_ids(layer)

    def background(self, fn, *args):
        return self._runtime.evictor.background(fn, *args)

    def wait_background(self) -> None:
        self._runtime.evictor.wait_background()


class HostRuntime:
    """Host side of one open batch: sequences 0..batch-1 of the store are the cache's rows."""

    HISTORY = 1024  # steps kept in `history` (a preallocated ring: its memory does not grow with the steps)

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
        self.device = device or jax.devices()[0]
        self.shape = BatchShape(self.n_layers, batch, self.hq, self.hkv, self.d, max_len, self.nb_max, self.dtype,
                                self.scale)
        kv_dtype = store_kv_dtype(config, self.dtype)
        # A store format other than the model's (host_kv_dtype) rounds what it keeps: the CPU then
        # attends the stored rows, not the device's values, and every copy must come from them.
        self.store_rounds = kv_dtype != KV_DTYPE_OF[self.dtype.name]
        cap = config.host_memory_cap_bytes
        store_config = StoreConfig(
            n_layers=self.n_layers, n_kv_heads=self.hkv, head_dim=self.d, block_size=config.block_size,
            kv_dtype=kv_dtype, host_memory_cap_bytes=cap,
            initial_blocks_per_layer=max(16, min(batch * self.nb_max, 4096)))
        need = required_host_bytes(store_config, self.nb_max, batch)
        if cap is not None and cap < need:
            raise ValueError(f"host memory cap of {cap} bytes cannot hold the offloaded KV of {batch} sequence(s) "
                             f"x {max_len} tokens x {self.n_layers} layers ({need} bytes needed)")
        self.store = KVStore(store_config)
        for b in range(batch):
            self.store.add_sequence(b)
        self.n_threads = config.host_threads or max(1, numba.config.NUMBA_NUM_THREADS - 1)
        self._host_error: BaseException | None = None  # the first error inside a host callback
        self._start_workers()
        self.n_tokens = np.zeros(batch, np.int64)  # tokens per sequence (= the cache's lengths)
        self.step_rows = np.zeros(batch, bool)  # rows with a token in the step being started
        self.decode_steps = 0
        self.core_counters = HostCounters()
        self.evictor = Evictor(self)
        self._history: np.ndarray | None = None  # [HISTORY, 1 + counters] float64 ring of per-step deltas
        self._history_keys: tuple[str, ...] = ()
        self._history_steps = 0
        self._last_snapshot = None
        self.prefill = PrefillCopies(self)
        self.slot_tables = np.zeros((self.n_layers, batch, self.nb_max), np.int64)  # store slot of each block
        self.max_ids = mode.max_block_ids(max_len)  # block ids per (sequence, KV head) a decode submit carries
        self.mode_host = mode.host(ModeHostContext(self))
        # the stream-ordered exchange (native library + worker), or None: pure callbacks
        self.native, self.worker = native, None
        if native is not None:
            mailboxes = native.open(self.n_layers, batch, self.hq, self.hkv, self.d, self.max_ids,
                                    gpu=self.device.platform == "gpu", device_ordinal=device_ordinal(self.device),
                                    timeout_s=config.exchange_timeout_s, timing=config.exchange_timing)
            self.worker = ExchangeWorker(native, mailboxes, self.n_threads, self.scale, config.exchange_timeout_s)
        log.info("hybrid %s: %d layers x %d sequences, window %d (sink %d + %d x %d), host blocks <= %d",
                 config.mode, self.n_layers, batch, config.window_tokens, config.sink, config.blk_num,
                 config.block_size, self.nb_max)

    def _start_workers(self) -> None:
        self.executor = HostExecutor(self.store, n_workers=1, n_threads=self.n_threads)
        self.bridge = HostBridge(self.store, self.executor, range(self.batch), self.scale,
                                 published_tokens=lambda: self.evictor.published * self.config.block_size,
                                 on_error=self._host_failed)

    def _host_failed(self, error: BaseException) -> None:
        if self._host_error is None:
            self._host_error = error

    def close(self) -> None:
        self.evictor.close()
        self.mode_host.close()
        self.executor.close(wait=False)
        if self.worker is not None:
            if self.worker.close():
                self.native.close()
            else:  # freeing the pinned mailboxes under a running thread would crash the process
                log.warning("hybrid runtime: the host exchange worker did not stop within %.0f s; its pinned "
                            "memory is left allocated", self.config.exchange_timeout_s)
            self.worker = None

    # ---- state the modes read (through ModeHostContext) ---------------------------------------------
    def offloaded_blocks(self) -> np.ndarray:
        """[B] blocks per sequence owned by the host side (published; a copy)."""
        return self.evictor.published.copy()

    def last_block_ids(self, layer: int) -> np.ndarray | None:
        """The block ids [B, Hkv, k] int the CPU attended for `layer` at the last decode step (a copy;
        None before any), whichever transport carried them."""
        if self.worker is None:
            ids = self.bridge.last_block_ids.get(layer)
            return None if ids is None else ids.copy()
        # idle first: the step that just ran may have handed its last layer to the device and not yet
        # marked itself served (a loaded machine: scout's first recall trigger then saw no ids)
        self.worker.wait_idle()
        if not self.worker.served_any:
            return None
        k = self.max_ids
        return self.worker.last_ids[layer, :self.batch * self.hkv * k].reshape(self.batch, self.hkv, k).astype(np.int64)

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
        self.mode_host.adopted(store is not None)
        self.reset_counters()

    def adopt_row(self, row: int, n_tokens: int) -> None:
        """Declare that row `row`, empty (never used, or emptied by `reset_rows`), holds a history of
        n_tokens tokens placed as the eviction policy places it: its offloaded blocks appended to the
        store with `append_blocks` (published), the rest on the device (`jhybrid.hybrid.ingest`). The
        other rows, their pending copies and the mode's state of them are untouched; the row's mode
        state stays an empty row's (a prefill of the rest follows: it gives the mode what it needs).
        Counters stay."""
        expected = int(evicted_blocks(np.int64(n_tokens), self.config))
        if not 0 <= n_tokens <= self.max_len or self.n_tokens[row] != 0:
            raise ValueError(f"adopt_row: row {row} holds {int(self.n_tokens[row])} tokens; expected an empty "
                             f"row and a history of at most max_len={self.max_len} tokens, got {n_tokens}")
        stored = [self.store.n_blocks(layer, row) for layer in range(self.n_layers)]
        if stored != [expected] * self.n_layers:
            raise ValueError(f"adopt_row: the host store holds {stored} blocks per layer for row {row}; a "
                             f"history of {n_tokens} tokens offloads {expected}")
        self.n_tokens[row] = n_tokens
        self.evictor.published[row] = self.evictor.started[row] = expected  # pending jobs hold 0 for it
        self.prefill.forget_rows([row])  # the next chunk copies the row from the store

    def reset_rows(self, rows: np.ndarray) -> None:
        """Rows `rows` ([n] int, checked) hold no sequence any more: a new one starts in each at
        position 0 (continuous batching). Call between steps, once the last step has run (the
        backend waits for it). In this order:
          1. the exchange worker is idle (the last step's pages are released)
          2. the eviction thread: every started copy and queued background work has landed (a copy
             of an old sequence's blocks lands before its store rows are freed, never in the new
             sequence's); the rows' block counts are 0 and the pending jobs publish none for them
          3. the mode's host state of the rows (`ModeHost.reset_rows`: its own background work on
             them either waits or, like scout's recalls, skips rows reset since it began, checked
             under the store's lock against this reset)
          4. the store: the rows' sequences are freed (their slots and context pages recycled, so
             reusing a row does not grow host memory) and added again empty, in one critical section
          5. token counts, slot tables, the prefill copies, the transports' last block ids
        Counters are cumulative over the batch and stay."""
        if self.worker is not None and not self.worker.wait_idle(self.config.exchange_timeout_s):
            raise RuntimeError(f"reset_rows: the host exchange worker did not finish the last step within "
                               f"{self.config.exchange_timeout_s} s")
        self.evictor.reset_rows(rows)
        self.mode_host.reset_rows(rows)
        with self.store.lock:
            for b in rows.tolist():
                self.store.free_sequence(b)
                self.store.add_sequence(b)
            self.slot_tables[:, rows] = 0
        self.n_tokens[rows] = 0
        self.prefill.forget_rows(rows)
        self.bridge.forget_rows(rows)
        if self.worker is not None:
            self.worker.forget_rows(rows)

    # ---- counters ---------------------------------------------------------------------------------
    def reset_counters(self) -> None:
        self._history, self._history_steps = None, 0
        self._last_snapshot = None
        self.core_counters.reset()
        self.mode_host.reset_counters()
        self.bridge.reset_counters()
        if self.worker is not None:
            self.worker.reset_counters()

    def counters(self) -> dict:
        out = {**self.core_counters.as_dict(), **self.mode_host.counters(), **vars(self.bridge.stats)}
        if self.worker is not None:
            out.update(exchange_serve_s=self.worker.serve_s, exchange_idle_s=self.worker.idle_s,
                       exchange_steps=self.worker.steps)
            out["cpu_tokens"] += int(self.worker.stats[0])
        return out

    def _record_step(self) -> None:
        """Per-step instrumentation: the counters' change since the previous step began, and the
        wall time between the two step starts (bookkeeping + the jitted step + the caller's work)."""
        now, totals = time.perf_counter(), self.counters()
        if self._last_snapshot is not None:
            then, before = self._last_snapshot
            if self._history is None or tuple(totals) != self._history_keys:
                self._history_keys = tuple(totals)
                self._history = np.zeros((self.HISTORY, 1 + len(totals)))
                self._history_steps = 0
            row = self._history[self._history_steps % self.HISTORY]
            row[0] = now - then
            row[1:] = [totals[k] - before.get(k, 0) for k in self._history_keys]
            self._history_steps += 1
        self._last_snapshot = (now, totals)

    @property
    def history(self) -> list[dict]:
        """The last HISTORY steps, oldest first: {"wall_s": time between two step starts, counter:
        its change over the step}."""
        if self._history is None:
            return []
        n = min(self._history_steps, self.HISTORY)
        order = (np.arange(n) + self._history_steps - n) % self.HISTORY
        keys = ("wall_s",) + self._history_keys
        return [dict(zip(keys, self._history[i].tolist())) for i in order]

    def host_kv_bytes(self) -> int:
        """Host bytes of this batch's offloaded K/V (+ hgca's sparse copies, + recall's mirror)."""
        c = self.store.config
        block = 2 * c.n_kv_heads * c.block_size * c.row_width * self.store.layers[0].arrays["k"].itemsize
        blocks = sum(self.store.n_blocks(layer, b) for layer in range(self.n_layers) for b in range(self.batch))
        return blocks * block + self.store.context.bytes_used() + self.mode_host.host_bytes()

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
    def _raise_pending(self) -> None:
        """Re-raise a host error of an earlier step (a callback's, or the exchange worker's)."""
        if self._host_error is not None:
            error, self._host_error = self._host_error, None
            self.bridge.cancel_all()
            raise error
        if self.worker is not None:
            self.worker.raise_pending()
            timing = self.native.timing()  # the steps that have run since the last step start
            if timing is not None:
                self.core_counters.add(exchange_wait_s=timing[0] / 1e3, exchange_gpu_s=timing[1] / 1e3,
                                       exchange_timed_layers=timing[2])

    def precompile(self, cache) -> None:
        """Compile the evictor's gathers and the mode's lazily compiled host work (`ModeHost.precompile`)
        for this batch's cache layout, so that no step compiles them."""
        self.evictor.precompile(cache.layers)
        self.mode_host.precompile(cache)

    def before_step(self, cache, positions, decode_positions=None):
        """Call with the cache and the step's positions [B, T] (-1 = padding) before the step.
        decode_positions [B] (-1 = none): a packed step (`packable`; the serving engine's
        `PackedRows`), whose prefill chunks at `positions` (T > 1) and decode tokens (each in a row
        without a chunk token) run in one call: each group gets its own host work as in a call of
        its own (eviction, the mode's `before_prefill_chunk` and `before_decode`, the chunks'
        device copies, the exchange plan)."""
        self._raise_pending()
        pos = np.asarray(positions).astype(np.int64)
        if pos.ndim != 2 or pos.shape[0] != self.batch:
            raise ValueError(f"positions of shape {pos.shape}; expected [B={self.batch}, T]")
        packed = decode_positions is not None
        decode_pos = np.full(self.batch, -1, np.int64)
        if packed:
            decode_pos = np.asarray(decode_positions).astype(np.int64).reshape(-1)
            if decode_pos.shape != (self.batch,) or pos.shape[1] < 2:
                raise ValueError(f"a packed step of chunk positions {pos.shape} and decode positions "
                                 f"{decode_pos.shape}; expected [B={self.batch}, C > 1] and [{self.batch}]")
        prefill = pos.shape[1] > 1
        cache = self.mode_host.step_start(cache)
        if prefill or self.prefill.holds_copies or cache.layers[0].offloaded is not None:
            cache = self.prefill.step_start(cache, prefill)  # last step's device copies (prefill, recall)
        self._record_step()
        valid = pos >= 0
        decode_rows = decode_pos >= 0
        chunk_rows = valid.any(axis=1)
        if np.any(chunk_rows & decode_rows):
            raise ValueError(f"rows {np.flatnonzero(chunk_rows & decode_rows).tolist()} both prefill and decode "
                             "in a packed step; a row is in at most one group")
        n_chunk = valid.sum(axis=1)
        n_new = n_chunk + decode_rows
        self.step_rows = n_new > 0
        first = np.where(chunk_rows, np.where(valid, pos, np.iinfo(np.int64).max).min(axis=1),
                         np.where(decode_rows, decode_pos, self.n_tokens))
        if np.any(first != self.n_tokens):
            raise ValueError(f"positions start at {first.tolist()} but the sequences hold {self.n_tokens.tolist()} "
                             "tokens (hybrid attention needs contiguous appends)")
        if prefill and n_chunk.max() > self.config.max_prefill_chunk:
            raise ValueError(f"a prefill chunk of {int(n_chunk.max())} tokens does not fit the GPU ring of "
                             f"{self.config.ring_tokens} tokens; use chunks of at most {self.config.max_prefill_chunk}")
        after = self.n_tokens + n_new
        if np.any(after > self.max_len):
            raise ValueError(f"sequence lengths {after.tolist()} exceed the cache's max_len={self.max_len}")
        if (packed or not prefill) and self.decode_steps == 0:
            self.evictor.precompile(cache.layers)  # no timed decode step compiles an eviction
        before = self.evictor.published.copy()
        # a chunk whose rows have nothing offloaded (their prompts still inside the window) needs
        # no host call and no published block; one with an offloaded part attends to it on the device
        # (prefill copies) or on the host
        window_only = prefill and not np.any(evicted_blocks(after, self.config)[chunk_rows])
        device_prefill = prefill and not window_only and self.prefill.uses_device(cache, after, chunk_rows)
        if packed:
            if not (window_only or device_prefill):
                raise RuntimeError("a packed step's chunks must attend to their offloaded prompt on the device "
                                   "or have none (check `packable` first)")
            cache, owned = self.evictor.before_packed_step(cache, after, chunk_rows, decode_rows, self.decode_steps,
                                                           width=pos.shape[1])
        else:
            cache, owned = self.evictor.before_step(cache, after, prefill, device_prefill or window_only,
                                                    self.decode_steps, width=pos.shape[1], rows=n_new > 0)
        if prefill:
            self.step_rows = chunk_rows
            self.mode_host.before_prefill_chunk(pos)
            if device_prefill:
                cache = self.prefill.attach(cache, owned, chunk_rows)
            elif window_only:
                cache = cache.replace(layers=tuple([s.replace(offloaded=NothingOffloaded()) for s in cache.layers]))
                self.core_counters.add(n_prefill_window_chunks=1)
        if not prefill or packed:
            self.step_rows = decode_rows if packed else n_new > 0
            cache = self.mode_host.before_decode(cache, before)
            self.decode_steps += 1
            if self.worker is not None and self.mode.host_target is not None:
                self.worker.arm(self._plan())
        self.step_rows = n_new > 0
        self.n_tokens = after
        if packed:
            owned_d, decoding_d = jax.device_put([owned.astype(np.int32), np.where(chunk_rows, 0, owned).astype(np.int32)],
                                                 self.device)
            return cache.replace(meta=StepMeta(offloaded_blocks=owned_d, decode_offloaded_blocks=decoding_d))
        meta = StepMeta(offloaded_blocks=jax.device_put(owned.astype(np.int32), self.device))
        return cache.replace(meta=meta)

    def after_dispatch(self, cache):
        """Right after a call's dispatch (the driver `overlap_dispatch`ed): the mode's host work in the
        call's shadow (`ModeHost.after_dispatch`; a host error of the call is raised at the next step
        start, as ever)."""
        return self.mode_host.after_dispatch(cache)

    def packable(self, positions) -> bool:
        """May the prefill chunks of positions [B, C] (-1 = padding) ride in one call with the other
        rows' decode tokens (`before_step` with decode_positions)? When the mode `packs_decode` and
        the chunks attend to their offloaded prompt on the device (its copies fit
        prefill_upload_max_bytes) or have none; no side effect."""
        pos = np.asarray(positions)
        if not self.mode.packs_decode or pos.ndim != 2 or pos.shape != (self.batch, pos.shape[1]) or pos.shape[1] < 2:
            return False
        active = (pos >= 0).any(axis=1)
        after = self.n_tokens + (pos >= 0).sum(axis=1)
        if not np.any(evicted_blocks(after, self.config)[active]):
            return True
        return self.prefill.may_use_device() and self.prefill.fits_device(after, active)[0]

    def _plan(self) -> StepPlan:
        """The decode step's work for the exchange worker: every layer submits, in layer order; the
        pages (the mode's, `ModeHost.exchange_pages`) are snapshot on the worker thread under the
        store's lock, of the blocks published for this step."""
        layers = np.arange(self.n_layers, dtype=np.int32)
        published = self.evictor.published.copy()
        store, mode_host, counters = self.store, self.mode_host, self.core_counters

        def pages():  # delays the step's first layer: counted apart (the breakdown)
            start = time.perf_counter()
            with store.lock:
                taken = time.perf_counter()
                snapshot = mode_host.exchange_pages(published)
                store.begin_read()
            counters.add(exchange_barrier_s=taken - start, exchange_snapshot_s=time.perf_counter() - taken)
            return snapshot, store.end_read

        return StepPlan(layers=layers, pages=pages)


__all__ = ["HostRuntime", "ModeHostContext", "BatchShape", "HostCounters", "Counters", "required_host_bytes",
           "store_kv_dtype", "KV_DTYPE_OF"]
