"""Host side of the JAX host-callback exchange: what a callback inside the jitted decode step calls.

The device side (`jhybrid.hybrid.exchange`) wraps these methods in `jax.pure_callback`. Operands are
small NumPy arrays only (queries, block ids, tickets, LSE); KV never crosses a callback. Work runs
in the `HostExecutor` worker (Numba, `nogil`) *between* callbacks:

    ticket = bridge.submit(layer, queries, mode)        # returns at once; CPU attention starts
    ...   GPU attention of the layer runs meanwhile   ...
    o, lse = bridge.collect(ticket)                     # waits for the worker if it is not done

`exchange(layer, next_layer, ...)` is the one-callback-per-layer form: collect this layer's
result and submit the next layer's work in the same host visit (ScoutAttention's layer-ahead
pipelining). `attend_now` computes synchronously inside the callback (no overlap; for comparison).

Errors: a task's exception is re-raised by `collect` (the executor attaches the worker
traceback). Because an exception inside a callback reaches the user wrapped by XLA, the first one
is also kept in `self.error`; `raise_pending()` re-raises the original between steps. `collect`
waits at most `collect_timeout` seconds, so a lost ticket is a TimeoutError, never a hang.

Instrumentation (cumulative seconds, read with `counters()`, zeroed with `reset_counters()`):
  callback_s  wall time spent inside callbacks (on a GPU the stream is stalled meanwhile)
  wait_s      part of it spent blocked on an unfinished CPU task (GPU idle waiting for the host)
  cpu_attn_s  time the worker spent in attention kernels
  n_callbacks, n_tasks, cpu_tokens (blocks mode: tokens the CPU was asked to attend)
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

import numpy as np

from host.attention import attend_all, attend_blocks, check_queries, paged_attention
from host.exchange_worker import clip_to_published

log = logging.getLogger(__name__)

ATTEND_MODES = ("context", "all", "blocks")


class HostBridge:
    """Tickets, timing and error capture around a `HostExecutor` for one batch of sequences.

    store: `host.KVStore`; executor: `host.HostExecutor` over it; seq_ids: the store's sequence id
    of each batch row (row b of every query array belongs to seq_ids[b]); scale: score scale.
    """

    def __init__(self, store, executor, seq_ids, scale: float, collect_timeout: float = 300.0):
        self.store, self.executor = store, executor
        self.seq_ids = list(seq_ids)
        self.scale = float(scale)
        self.collect_timeout = collect_timeout
        self._tickets = itertools.count(1)
        self._pending: dict[int, object] = {}
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        self.last_block_ids: dict[int, np.ndarray] = {}  # layer -> last CPU block ids [B, Hkv, k]
        self.last_queries: dict[int, np.ndarray] = {}    # layer -> last queries [B, Tq, Hq, D]
        # layer -> (tail [B, keep, Hq, D], valid [B]) of the last prefill chunk attended on the device
        self.turn_tails: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        # "context" attention sees only the kept tokens of blocks the host side owns this step:
        # token_index < context_token_limits[b] (int64 [B], set before each decode step)
        self.context_token_limits: np.ndarray | None = None
        self.reset_counters()

    # ---- counters ----------------------------------------------------------------------------
    def reset_counters(self) -> None:
        self._c = dict(callback_s=0.0, wait_s=0.0, cpu_attn_s=0.0, n_callbacks=0, n_tasks=0, cpu_tokens=0)

    def counters(self) -> dict:
        return dict(self._c)

    # ---- work --------------------------------------------------------------------------------
    def _timed_attention(self, mode, layer, queries, block_ids):
        start = time.perf_counter()
        if mode == "context":
            out = self._attend_context(layer, queries)
        elif mode == "all":
            out = attend_all(self.store, layer, self.seq_ids, queries, self.scale)
        else:
            out = attend_blocks(self.store, layer, self.seq_ids, queries, block_ids, self.scale)
        self._c["cpu_attn_s"] += time.perf_counter() - start
        return out

    def _attend_context(self, layer: int, queries: np.ndarray):
        """hgca's CPU part: the layer's kept tokens, clipped to the published blocks."""
        store = self.store
        with store.lock:
            view = store.context.snapshot_locked(layer, self.seq_ids)
            if self.context_token_limits is not None:
                view = clip_to_published(view, store.context.layers[layer].arrays["token_index"],
                                         self.context_token_limits)
            store.begin_read()
        try:
            return paged_attention(queries, view, self.scale)
        finally:
            store.end_read()

    def submit(self, layer: int, queries: np.ndarray, mode: str, block_ids: np.ndarray | None = None) -> int:
        """Queue attention of queries [B, Tq, Hq, D] float32 for `layer`; returns a ticket (int > 0)."""
        if mode not in ATTEND_MODES:
            raise ValueError(f"mode={mode!r}; expected one of {ATTEND_MODES}")
        cfg = self.store.config
        queries = check_queries(np.array(queries, np.float32), len(self.seq_ids), cfg.n_kv_heads, cfg.head_dim)
        if mode == "blocks":
            block_ids = np.array(block_ids, np.int64)
            self.last_block_ids[layer] = block_ids
            self._c["cpu_tokens"] += int((block_ids >= 0).sum()) * cfg.block_size
        self.last_queries[layer] = queries
        handle = self.executor.submit_task(self._timed_attention, mode, layer, queries, block_ids,
                                           what=f"host attention {mode} (layer {layer})")
        ticket = next(self._tickets)
        with self._lock:
            self._pending[ticket] = handle
        self._c["n_tasks"] += 1
        return ticket

    def collect(self, ticket: int):
        """(o [B, Tq, Hq, D] float32, lse [B, Tq, Hq] float32) of a submitted ticket."""
        with self._lock:
            handle = self._pending.pop(int(ticket), None)
        if handle is None:
            raise RuntimeError(f"host bridge: unknown ticket {int(ticket)} (never submitted, or collected twice)")
        start = time.perf_counter()
        done = handle.future.done()
        o, lse = self.executor.collect(handle, timeout=self.collect_timeout)
        if not done:
            self._c["wait_s"] += time.perf_counter() - start
        return np.ascontiguousarray(o, np.float32), np.ascontiguousarray(lse, np.float32)

    def attend_now(self, layer: int, queries: np.ndarray, mode: str, block_ids=None):
        """Synchronous attention on the calling thread's Numba threads (no overlap)."""
        return self.collect(self.submit(layer, queries, mode, block_ids))

    def cancel_all(self) -> None:
        """Forget pending tickets (after an error); their tasks finish and are dropped."""
        with self._lock:
            self._pending.clear()

    # ---- callback entry points (what jax.pure_callback calls) --------------------------------
    def _guard(self, fn, *args):
        start = time.perf_counter()
        try:
            return fn(*args)
        except BaseException as exc:
            if self.error is None:
                self.error = exc
            log.error("host callback failed: %s: %s", type(exc).__name__, exc)
            raise
        finally:
            self._c["callback_s"] += time.perf_counter() - start
            self._c["n_callbacks"] += 1

    def cb_submit(self, layer: int, mode: str, queries, block_ids=None):
        """-> int32 ticket (a 0-d array)."""
        return self._guard(lambda: np.int32(self.submit(layer, queries, mode, block_ids)))

    def cb_collect(self, ticket, *_dependencies):
        """-> (o, lse). Extra operands only order the callback after the GPU work that made them."""
        return self._guard(self.collect, ticket)

    def cb_attend_now(self, layer: int, mode: str, queries, block_ids=None):
        return self._guard(self.attend_now, layer, queries, mode, block_ids)

    def cb_exchange(self, next_layer: int | None, mode: str, ticket, next_queries=None, next_block_ids=None,
                    *_dependencies):
        """One host visit per layer: collect `ticket` (this layer) and, when next_layer is not None,
        submit next_layer's work. -> (o, lse, next ticket int32; 0 if nothing was submitted)."""
        def run():
            nxt = np.int32(0)
            if next_layer is not None:
                nxt = np.int32(self.submit(next_layer, next_queries, mode, next_block_ids))
            o, lse = self.collect(ticket)
            return o, lse, nxt
        return self._guard(run)

    def cb_record_tail(self, layer: int, tail, valid):
        """Keep a prefill chunk's last queries (see jhybrid.hybrid.exchange.CallbackExchange.record_tail) -> int32 0."""
        def run():
            self.turn_tails[layer] = (np.array(tail, np.float32), np.array(valid, np.int64))
            return np.int32(0)
        return self._guard(run)

    def raise_pending(self) -> None:
        """Re-raise the first host error seen inside a callback (then forget it)."""
        if self.error is not None:
            exc, self.error = self.error, None
            self.cancel_all()
            raise exc
