"""Host side of the JAX host-callback exchange: what a callback inside the jitted decode step calls.

The device side (`jhybrid.hybrid.exchange`) wraps these methods in `jax.pure_callback`. Operands are
small NumPy arrays only (queries, block ids, tickets, LSE); KV never crosses a callback. Work runs
in the `HostExecutor` worker (Numba, `nogil`) *between* callbacks:

    ticket = bridge.submit(layer, queries, target)      # returns at once; CPU attention starts
    ...   GPU attention of the layer runs meanwhile   ...
    o, lse = bridge.collect(ticket)                     # waits for the worker if it is not done

`cb_collect_and_submit(next_layer, ...)` is the one-callback-per-layer form: collect this layer's
result and submit the next layer's work in the same host visit (ScoutAttention's layer-ahead
pipelining). `attend_now` computes synchronously inside the callback (no overlap; for comparison).

`target` is what the call attends (`host.targets`: the kept tokens, every offloaded token, chosen
blocks); "kept tokens" sees only the blocks the host side owns at this step (`published_tokens()`,
given by the owner).

Errors: a task's exception is re-raised by `collect` (the executor attaches the worker
traceback). Because an exception inside a callback reaches the user wrapped by XLA, the first one
is also handed to `on_error` (the owner re-raises the original between steps). `collect` waits at
most `collect_timeout` seconds, so a lost ticket is a TimeoutError, never a hang.

Instrumentation (cumulative seconds, read with `counters()`, zeroed with `reset_counters()`):
  callback_s  wall time spent inside callbacks (on a GPU the stream is stalled meanwhile)
  wait_s      part of it spent blocked on an unfinished CPU task (GPU idle waiting for the host)
  cpu_attn_s  time the worker spent in attention kernels
  n_callbacks, n_tasks, cpu_tokens (chosen blocks: tokens the CPU was asked to attend)
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time

import numpy as np

from host.attention import check_queries
from host.targets import HostTarget

log = logging.getLogger(__name__)


@dataclasses.dataclass
class BridgeStats:
    """The bridge's cumulative counters (module docstring); read directly by the owner."""

    callback_s: float = 0.0
    wait_s: float = 0.0
    cpu_attn_s: float = 0.0
    n_callbacks: int = 0
    n_tasks: int = 0
    cpu_tokens: int = 0


class HostBridge:
    """Tickets, timing and error capture around a `HostExecutor` for one batch of sequences.

    store: `host.KVStore`; executor: `host.HostExecutor` over it; seq_ids: the store's sequence id
    of each batch row (row b of every query array belongs to seq_ids[b]); scale: score scale;
    published_tokens() -> int64 [B]: tokens of the blocks the host side owns now (None: every stored
    token); on_error(exc): called with the first exception raised inside a callback.
    """

    def __init__(self, store, executor, seq_ids, scale: float, collect_timeout: float = 300.0,
                 published_tokens=None, on_error=None):
        self.store, self.executor = store, executor
        self.seq_ids = list(seq_ids)
        self.scale = float(scale)
        self.collect_timeout = collect_timeout
        self.published_tokens = published_tokens
        self.on_error = on_error
        self._tickets = itertools.count(1)
        self._pending: dict[int, object] = {}
        self._lock = threading.Lock()
        self.last_block_ids: dict[int, np.ndarray] = {}  # layer -> last CPU block ids [B, Hkv, k]
        self.reset_counters()

    # ---- counters ----------------------------------------------------------------------------
    def reset_counters(self) -> None:
        self.stats = BridgeStats()

    def counters(self) -> dict:
        return dataclasses.asdict(self.stats)

    def forget_rows(self, rows) -> None:
        """Rows `rows` start new sequences: their last block ids are none (-1)."""
        for ids in self.last_block_ids.values():
            ids[rows] = -1

    # ---- work --------------------------------------------------------------------------------
    def _timed_attention(self, target: HostTarget, layer, queries, block_ids, rows=None):
        start = time.perf_counter()
        published = None if self.published_tokens is None else self.published_tokens()
        if rows is None or rows.all():
            out = target.attend(self.store, layer, self.seq_ids, queries, self.scale, block_ids, published)
        else:  # only the rows with a query in the step: the others attend nothing (o = 0, lse = -inf)
            b, tq, hq, d = queries.shape
            o = np.zeros((b, tq, hq, d), np.float32)
            lse = np.full((b, tq, hq), -np.inf, np.float32)
            idx = np.flatnonzero(rows)
            if idx.size:
                o_r, lse_r = target.attend(self.store, layer, [self.seq_ids[i] for i in idx.tolist()],
                                           np.ascontiguousarray(queries[idx]), self.scale,
                                           None if block_ids is None else block_ids[idx],
                                           None if published is None else np.asarray(published)[idx])
                o[idx], lse[idx] = o_r, lse_r
            out = o, lse
        self.stats.cpu_attn_s += time.perf_counter() - start
        return out

    def submit(self, layer: int, queries: np.ndarray, target: HostTarget, block_ids: np.ndarray | None = None,
               rows: np.ndarray | None = None) -> int:
        """Queue attention of queries [B, Tq, Hq, D] float32 over `target` for `layer`; returns a ticket (int > 0).
        rows [B] bool (optional): attend only these rows (the others: o = 0, lse = -inf), e.g. the
        rows of a prefill chunk, not the ones decoding in their own call."""
        cfg = self.store.config
        queries = check_queries(np.array(queries, np.float32), len(self.seq_ids), cfg.n_kv_heads, cfg.head_dim)
        if rows is not None:
            rows = np.asarray(rows, bool).reshape(-1)
            if rows.shape[0] != len(self.seq_ids):
                raise ValueError(f"rows of shape {rows.shape}; expected [B={len(self.seq_ids)}]")
        if target.needs_block_ids:
            if block_ids is None:
                raise ValueError(f"{target.name} attention needs block_ids [B, Hkv, k]")
            block_ids = np.array(block_ids, np.int64)
            self.last_block_ids[layer] = block_ids
            attended = block_ids if rows is None else block_ids[rows]
            self.stats.cpu_tokens += int((attended >= 0).sum()) * cfg.block_size
        handle = self.executor.submit_task(self._timed_attention, target, layer, queries, block_ids, rows,
                                           what=f"host attention over {target.name} (layer {layer})")
        ticket = next(self._tickets)
        with self._lock:
            self._pending[ticket] = handle
        self.stats.n_tasks += 1
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
            self.stats.wait_s += time.perf_counter() - start
        return np.ascontiguousarray(o, np.float32), np.ascontiguousarray(lse, np.float32)

    def attend_now(self, layer: int, queries: np.ndarray, target: HostTarget, block_ids=None):
        """Attention computed on the spot (waits for it: no overlap)."""
        return self.collect(self.submit(layer, queries, target, block_ids))

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
            if self.on_error is not None:
                self.on_error(exc)
            log.error("host callback failed: %s: %s", type(exc).__name__, exc)
            raise
        finally:
            self.stats.callback_s += time.perf_counter() - start
            self.stats.n_callbacks += 1

    def cb_submit(self, layer: int, target: HostTarget, queries, block_ids=None, rows=None):
        """-> int32 ticket (a 0-d array)."""
        return self._guard(lambda: np.int32(self.submit(layer, queries, target, block_ids, rows)))

    def cb_collect(self, ticket, *_dependencies):
        """-> (o, lse). Extra operands only order the callback after the GPU work that made them."""
        return self._guard(self.collect, ticket)

    def cb_attend_now(self, layer: int, target: HostTarget, queries, block_ids=None):
        return self._guard(self.attend_now, layer, queries, target, block_ids)

    def cb_collect_and_submit(self, next_layer: int | None, target: HostTarget, ticket, next_queries=None,
                              next_block_ids=None, *_dependencies):
        """One host visit per layer: collect `ticket` (this layer) and, when next_layer is not None,
        submit next_layer's work. -> (o, lse, next ticket int32; 0 if nothing was submitted)."""
        def run():
            nxt = np.int32(0)
            if next_layer is not None:
                nxt = np.int32(self.submit(next_layer, next_queries, target, next_block_ids))
            o, lse = self.collect(ticket)
            return o, lse, nxt
        return self._guard(run)

    def cb_guard(self, fn, *args):
        """Any other host call from inside a step (e.g. a mode receiving queries): timed and its
        errors reported like the attention calls'."""
        return self._guard(fn, *args)
