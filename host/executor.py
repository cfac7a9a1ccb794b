"""Run CPU attention and sparsification in worker threads while JAX runs on the calling thread.

    executor = HostExecutor(store, n_workers=1, n_threads=15)
    handle = executor.submit(layer, queries, seq_ids, KEPT_TOKENS)                 # hgca's context cache
    handle = executor.submit(layer, queries, seq_ids, CHOSEN_BLOCKS, block_ids=ids)
    handle = executor.submit(layer, queries, seq_ids, ALL_OFFLOADED)               # every stored token
    o, lse = executor.collect(handle)                   # targets: host.targets
    executor.submit_sparsify(layer, seq_ids, blocks, beta, window_tokens)   # right after an eviction
    executor.submit_reevaluate(layer, seq_ids, new_queries, beta)            # after a new user turn

The Numba kernels release the GIL (`nogil=True`), so a worker computes while the caller's thread
keeps dispatching JAX work. Each worker sets its own `numba.set_num_threads` (the setting is
thread-local). Tasks run in submission order when `n_workers == 1` (the default), so attention
submitted after a sparsification task sees its result. A task's exception is re-raised by
`collect` as the same exception object (type kept: bad input stays a ValueError), its traceback
running through the worker's frames and the worker's formatted traceback added as a note.
Queries are validated on the caller's thread at submit. An abandoned
handle costs nothing: its task finishes on its own and its result is dropped with the handle.

Results are bitwise reproducible for a given `n_threads` (the work split, and so the float32
rounding, depends on it). Leave one core to the JAX thread: n_threads = cores - 1.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import traceback
from dataclasses import dataclass

import numba
import numpy as np

from host.attention import THREADING_LAYER, check_queries
from host.sparsify import reevaluate, sparsify_evicted
from host.targets import HostTarget

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Handle:
    future: cf.Future
    what: str


def _run_capturing(fn, args, kwargs):
    try:
        return fn(*args, **kwargs)
    except BaseException as exc:
        exc.add_note(f"--- raised in host worker thread ---\n{traceback.format_exc()}")
        raise


class HostExecutor:
    def __init__(self, store, n_workers: int = 1, n_threads: int | None = None):
        if not isinstance(n_workers, int) or n_workers < 1:
            raise ValueError(f"n_workers={n_workers!r}; expected an int >= 1")
        max_threads = numba.config.NUMBA_NUM_THREADS
        if n_threads is None:
            n_threads = max(1, max_threads // n_workers)
        if not isinstance(n_threads, int) or not 1 <= n_threads <= max_threads:
            raise ValueError(f"n_threads={n_threads!r}; expected an int in [1, {max_threads}] "
                             "(NUMBA_NUM_THREADS caps it)")
        self.store = store
        self.n_workers, self.n_threads = n_workers, n_threads
        self.threading_layer = THREADING_LAYER
        self._pool = cf.ThreadPoolExecutor(max_workers=n_workers, thread_name_prefix="host-attn",
                                           initializer=numba.set_num_threads, initargs=(n_threads,))
        log.info("HostExecutor: %d worker(s) x %d Numba threads, threading layer %s",
                 n_workers, n_threads, THREADING_LAYER)

    def submit(self, layer: int, queries: np.ndarray, seq_ids, target: HostTarget,
               block_ids: np.ndarray | None = None, scale: float | None = None) -> Handle:
        """Queue one attention over `target` (host.targets). `queries` is used as is by the worker:
        do not modify it until collected."""
        seq_ids = list(seq_ids)
        cfg = self.store.config
        check_queries(queries, len(seq_ids), cfg.n_kv_heads, cfg.head_dim)
        if target.needs_block_ids and block_ids is None:
            raise ValueError(f"{target.name} attention needs block_ids [B, Hkv, n]")
        return self.submit_task(target.attend, self.store, layer, seq_ids, queries, scale, block_ids,
                                what=f"host attention over {target.name} (layer {layer})")

    def submit_sparsify(self, layer: int, seq_ids, block_numbers, beta: float, window_tokens: int,
                        keep_after: int = 0, max_keep_share: float | None = None) -> Handle:
        """Queue `host.sparsify.sparsify_evicted` for blocks just appended (collect -> kept counts [B, Hkv])."""
        return self.submit_task(sparsify_evicted, self.store, layer, list(seq_ids), block_numbers, beta, window_tokens,
                                keep_after, max_keep_share, what=f"sparsify_evicted(layer={layer})")

    def submit_reevaluate(self, layer: int, seq_ids, queries: np.ndarray, beta: float,
                          scale: float | None = None, keep_after: int = 0,
                          max_keep_share: float | None = None) -> Handle:
        """Queue `host.sparsify.reevaluate` after an append (collect -> kept counts [B, Hkv])."""
        return self.submit_task(reevaluate, self.store, layer, list(seq_ids), queries, beta, scale, keep_after,
                                max_keep_share, what=f"reevaluate(layer={layer})")

    def submit_task(self, fn, *args, what: str | None = None, **kwargs) -> Handle:
        """Queue any host function (e.g. host.sparsify.sparsify_evicted) on a worker."""
        future = self._pool.submit(_run_capturing, fn, args, kwargs)
        return Handle(future, what or getattr(fn, "__name__", repr(fn)))

    def collect(self, handle: Handle, timeout: float | None = None):
        """Wait for a task and return its result ((o, lse) for attention). Re-raises the task's
        exception (with the worker traceback); TimeoutError after `timeout` seconds."""
        try:
            return handle.future.result(timeout)
        except cf.TimeoutError:
            raise TimeoutError(f"{handle.what} not done after {timeout} s") from None
        except BaseException as exc:
            log.error("host task %s failed: %s: %s", handle.what, type(exc).__name__, exc)
            raise

    def close(self, wait: bool = True) -> None:
        """Stop accepting work; with wait, let queued tasks finish first."""
        self._pool.shutdown(wait=wait, cancel_futures=not wait)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
