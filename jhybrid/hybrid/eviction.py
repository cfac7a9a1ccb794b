"""Eviction from the GPU ring to the host store, off the critical path.

Per sequence three block counts (all int64 [B], blocks of `block_size` tokens after the sinks):

  target     what the eviction policy has moved out (`window.evicted_blocks(n)`, HGCA Algorithm 1)
  started    blocks whose copy to the host has started
  published  blocks the host side owns (`StepMeta.offloaded_blocks` of a decode step): the CPU may
             attend them, the GPU no longer does

At a step start (`Evictor.before_step`, called by the runtime):
  1. publish the jobs that are due (a decode step waits for a job only when its publication step
     has come and the background is late: `n_waits`, `wait_s`); jobs started by prefill chunks are
     published at the next decode step that carries one of their rows (a row still prefilling while
     other rows decode, the serving engine's steps, is not attended there: its blocks publish at its
     own first decode step, as when it runs alone, and the others' decode steps do not wait for
     them), or before a chunk that attends to the host store
  2. start copies: one jitted gather takes the blocks of every layer out of the ring (K, V, MAW; it
     also writes their key digests where a layer keeps digests), an asynchronous device -> pinned
     host transfer starts, and a background thread appends them to the host store and runs the
     mode's work on them (hgca: sparsification). Decode steps spread the sequences' starts over
     block_size steps (sequence b at steps where (step + b) % block_size == 0, earlier when its
     slack would run out); a prefill chunk starts all its due blocks at once.
  3. the blocks the host side owns during the step (`owned`): the GPU ring attends tokens
     [S + owned * bs, n); owned = published on decode steps and prefill chunks on the host path,
     started on prefill chunks whose offloaded prompt is attended on the device (its copies include
     every started block). The ring buffer holds `ring_capacity` tokens, so it must keep
     n - S - owned * bs <= capacity; the eviction
     policy plus `ring_slack_blocks` guarantees it unless the background is very late (then the
     step start waits).

Deterministic: which blocks start and when they are published depend on step counts and on the rows
each step carries only, never on thread timing, so runs are reproducible and both exchange
transports see the same blocks owned.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import traceback
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from jhybrid.hybrid.config import OffloadConfig
from jhybrid.hybrid.transfer import log_once, to_host
from pallas_kernels._common import next_pow2
from jhybrid.hybrid.window import evicted_blocks

log = logging.getLogger(__name__)


@dataclasses.dataclass
class EvictionJob:
    """Blocks whose copy started together: rows (seq[i], block[i]); `started` [B] the started counts
    once this job is in; publication at decode step `publish_step` (None: at the next decode step
    or host-path chunk)."""

    seq: np.ndarray
    block: np.ndarray
    started: np.ndarray
    publish_step: int | None
    future: Future


class Evictor:
    """The eviction state of one open batch (see the module docstring)."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.config: OffloadConfig = runtime.config
        batch = runtime.batch
        self.published = np.zeros(batch, np.int64)
        self.started = np.zeros(batch, np.int64)
        self.jobs: deque[EvictionJob] = deque()
        self._extra: deque[Future] = deque()  # other work on the eviction thread (hgca re-evaluation)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="jhybrid-evict")
        self._compiled: dict = {}  # padded row count -> the gather compiled for this batch's cache

    def close(self) -> None:
        self.jobs.clear()
        self._thread.shutdown(wait=False, cancel_futures=True)

    def adopt(self, blocks: np.ndarray) -> None:
        """The store holds blocks 0..blocks[b]-1 of every sequence (published)."""
        self.publish_all()
        self.published = blocks.astype(np.int64).copy()
        self.started = blocks.astype(np.int64).copy()

    def reset_rows(self, rows: np.ndarray) -> None:
        """Rows `rows` start new sequences: wait until every started copy and the queued background
        work have landed in the store (the old sequences' blocks must be in before their rows are
        freed), then forget the rows' blocks: their counts are 0 and the jobs not yet published
        publish nothing for them (which jobs publish when, for the other rows, is unchanged)."""
        for job in self.jobs:
            job.future.exception()  # waits; a failed job's error is raised at its publication
        self.wait_background()
        for job in self.jobs:
            job.started[rows] = 0
        self.published[rows] = 0
        self.started[rows] = 0

    # ---- the step start --------------------------------------------------------------------------
    def before_step(self, cache, after: np.ndarray, prefill: bool, host_free: bool, step: int, width: int = 1,
                    rows: np.ndarray | None = None):
        """Publish what is due, start the copies due at this step, and return (cache, owned [B]):
        the blocks the host side owns during this step (the GPU ring attends the tokens after them). `after` [B]: tokens once the step has run;
        `step`: the index of this decode step (prefill: of the next one); `host_free`: the prefill
        chunk reads no block from the host store (it attends to device copies of its offloaded
        prompt, or its rows have none): it waits for no copy to land there; `width`: the call's
        tokens per row (a prefill chunk's gather is padded to at least a chunk of every row: one
        compiled gather, and one compiled extension of the prefill copies, per chunk width); `rows`
        [B] bool: the rows with a token in the step (None: every row); a decode step publishes only
        jobs with one of them, and makes only their rings fit (the other rows' are not read)."""
        cfg, bs = self.config, self.config.block_size
        start_time = time.perf_counter()
        if prefill:  # decode-started jobs that are due; a prefill's own wait for the next decode step
            self._publish(lambda job: job.publish_step is not None and job.publish_step <= step)
        else:
            self._publish(lambda job: job.publish_step is None or job.publish_step <= step, rows)
        target = evicted_blocks(after, cfg).astype(np.int64)
        due = target > self.started
        start = due if prefill else self._spread(due, after, step)
        if start.any():
            min_rows = self.runtime.batch * -(-width // bs) if prefill else 1
            cache = self._start(cache, np.where(start, target, self.started), keep_on_device=prefill,
                                publish_step=None if prefill else step + cfg.eviction_lag_steps, min_rows=min_rows)
        if prefill and not host_free:
            self.publish_all()  # the chunk attends to the offloaded prompt on the host
        owned = self.started.copy() if (prefill and host_free) else self.published.copy()
        need = self._needed(after)
        read = rows if (rows is not None and not prefill) else True  # the rings the step reads
        if np.any((owned < need) & read):  # the background is very late: wait
            self.publish_all()
            owned = self.started.copy() if (prefill and host_free) else self.published.copy()
        self.runtime.core_counters.add(evict_s=time.perf_counter() - start_time)
        return cache, owned

    def before_packed_step(self, cache, after: np.ndarray, chunk_rows: np.ndarray, decode_rows: np.ndarray,
                           step: int, width: int):
        """`before_step` of a packed step (the serving engine's `PackedRows`): the prefill chunks of
        `chunk_rows` [B] bool, which attend to device copies of their offloaded prompt or have none
        (host-free), and the decode tokens of `decode_rows` [B] bool (disjoint), in one call. Each
        group is evicted and owns blocks as it would in a call of its own at this step start: the
        decode rows publish what is due for them (the chunk rows' jobs stay deferred), the chunk
        rows start all their due blocks (kept on the device for their copies), the decode rows
        theirs spread over steps (published eviction_lag_steps later); owned [B] = started for the
        chunk rows, published for the others. Returns (cache, owned)."""
        cfg, bs = self.config, self.config.block_size
        start_time = time.perf_counter()
        self._publish(lambda job: job.publish_step is None or job.publish_step <= step, decode_rows)
        target = evicted_blocks(after, cfg).astype(np.int64)
        due = target > self.started
        start = due & chunk_rows
        if start.any():
            cache = self._start(cache, np.where(start, target, self.started), keep_on_device=True,
                                publish_step=None, min_rows=self.runtime.batch * -(-width // bs))
        start = self._spread(due & decode_rows, after, step)
        if start.any():
            cache = self._start(cache, np.where(start, target, self.started), keep_on_device=False,
                                publish_step=step + cfg.eviction_lag_steps)
        need = self._needed(after)
        owned = np.where(chunk_rows, self.started, self.published)
        if np.any((owned < need) & (chunk_rows | decode_rows)):  # the background is very late: wait
            self.publish_all()
            owned = np.where(chunk_rows, self.started, self.published)
        self.runtime.core_counters.add(evict_s=time.perf_counter() - start_time)
        return cache, owned

    def _spread(self, due: np.ndarray, after: np.ndarray, step: int) -> np.ndarray:
        """The rows of `due` [B] bool whose decode-step copies start at `step`: with eviction_spread,
        sequence b at steps where (step + b) % block_size == 0, earlier when its slack would run out
        before publication; else all of them."""
        cfg, bs = self.config, self.config.block_size
        if not cfg.eviction_spread:
            return due
        phase = (step + np.arange(self.runtime.batch)) % bs == 0
        soon = after + cfg.eviction_lag_steps + 1 - cfg.sink - cfg.ring_capacity
        return due & (phase | (-(-np.maximum(soon, 0) // bs) > self.started))

    def _needed(self, after: np.ndarray) -> np.ndarray:
        """[B] the blocks the host side must own for `after` [B] tokens to fit the GPU ring."""
        cfg = self.config
        return -(-np.maximum(after - cfg.sink - cfg.ring_capacity, 0) // cfg.block_size)

    def background(self, fn, *args) -> Future:
        """Run fn(*args) on the eviction thread, after the copies already started (its errors are
        raised by the next `wait_background` or publication)."""
        future = self._thread.submit(fn, *args)
        self._extra.append(future)
        return future

    def wait_background(self) -> None:
        """Wait for everything queued with `background` (re-raising the first error)."""
        while self._extra:
            error = self._extra.popleft().exception()
            if error is not None:
                raise RuntimeError(f"host work failed in the background: {type(error).__name__}: {error}") from error

    def publish_all(self) -> None:
        """Wait for every started copy and publish it."""
        self._publish(lambda job: True)

    def _publish(self, due, rows: np.ndarray | None = None) -> None:
        """Publish, in order, the jobs for which due(job) (waiting for them if needed), up to the
        first that is not due; with rows [B] bool, a due job none of whose rows is among them stays
        (deferred, in its place)."""
        deferred = []
        while self.jobs and due(self.jobs[0]):
            job = self.jobs.popleft()
            if rows is not None and not rows[job.seq].any():
                deferred.append(job)
                continue
            if not job.future.done():
                start = time.perf_counter()
                job.future.exception()
                self.runtime.core_counters.add(n_evict_waits=1, evict_wait_s=time.perf_counter() - start)
            error = job.future.exception()
            if error is not None:
                self.close()
                raise RuntimeError(f"eviction of {len(job.block)} block(s) to the host store failed in the "
                                   f"background: {type(error).__name__}: {error}") from error
            self.published = np.maximum(self.published, job.started)
        self.jobs.extendleft(reversed(deferred))

    def _start(self, cache, started: np.ndarray, keep_on_device: bool, publish_step: int | None,
               min_rows: int = 1):
        """Start the copies of blocks self.started[b] .. started[b] - 1 of every sequence, gathered
        in a power of two of at least `min_rows` padded rows."""
        runtime = self.runtime
        rows = [(b, blk) for b in range(runtime.batch) for blk in range(int(self.started[b]), int(started[b]))]
        n = len(rows)
        size = next_pow2(max(n, min_rows))
        seq = np.full(size, runtime.batch, np.int32)  # out of range: dropped by the digest scatter
        blk = np.full(size, runtime.nb_max, np.int32)
        seq[:n] = [r[0] for r in rows]
        blk[:n] = [r[1] for r in rows]
        seq_d, blk_d = jnp.asarray(seq), jnp.asarray(blk)
        layers, k, v, maw = self._gather(cache.layers, size)(cache.layers, seq_d, blk_d)
        if keep_on_device:  # a device-path prefill chunk extends its copies with them
            runtime.prefill.note_evicted(k, v, seq_d, blk_d, started - self.started)
        transfer = [_to_pinned(x) for x in (k, v, maw)]  # asynchronous on a GPU
        future = self._thread.submit(self._store_job, transfer, seq[:n].copy(), blk[:n].copy())
        self.jobs.append(EvictionJob(seq[:n].copy(), blk[:n].copy(), started.copy(), publish_step, future))
        self.started = started.copy()
        runtime.core_counters.add(n_evicted_blocks=n * runtime.n_layers)
        return cache.replace(layers=layers)

    def precompile(self, layers) -> None:
        """Compile the gather for every padded row count a decode step can need (1 .. the batch's
        power of two), so that no timed step compiles (called at the first decode step)."""
        size = 1
        while True:
            self._gather(layers, size)
            if size >= self.runtime.batch:
                return
            size *= 2

    def _gather(self, layers, size: int):
        """`_gather_blocks` compiled ahead of time for `size` padded rows and this cache's layout."""
        if size not in self._compiled:
            spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa: E731
            rows = jax.ShapeDtypeStruct((size,), jnp.int32)
            self._compiled[size] = _gather_blocks.lower(self.config, jax.tree_util.tree_map(spec, layers),
                                                        rows, rows).compile()
        return self._compiled[size]

    def _store_job(self, transfer, seq: np.ndarray, blk: np.ndarray) -> None:
        """Background thread: wait for the transfer, append to the store, the mode's work."""
        runtime = self.runtime
        start = time.perf_counter()
        try:
            k, v, maw = (np.asarray(x) for x in transfer)  # [L, N, bs, Hkv, D], ..., [L, N, bs, Hkv]
            runtime.core_counters.add(transfer_s=time.perf_counter() - start, bytes_to_host=k.nbytes + v.nbytes + maw.nbytes)
            by_seq: dict[int, np.ndarray] = {}
            for b in np.unique(seq):
                by_seq[int(b)] = np.nonzero(seq == b)[0]
            for layer in range(runtime.n_layers):
                numbers = {b: runtime.append_blocks(layer, b, blk[idx], k[layer, idx], v[layer, idx], maw[layer, idx])
                           for b, idx in by_seq.items()}
                runtime.mode_host.blocks_evicted(layer, numbers)
        except BaseException as exc:
            exc.add_note(f"--- raised in the eviction thread ---\n{traceback.format_exc()}")
            raise
        finally:
            runtime.core_counters.add(evict_bg_s=time.perf_counter() - start)


def _to_pinned(x: jax.Array):
    """Start an asynchronous device -> pinned host copy (a GPU); elsewhere the array itself."""
    device = next(iter(x.devices()))
    if device.platform != "gpu":
        return x
    try:
        return jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))
    except Exception as exc:  # noqa: BLE001 - logged, and the slower path is named
        log_once("evict-pinned-failed", logging.WARNING, "eviction: device -> pinned_host copy failed (%s: %s); "
                 "copying synchronously", type(exc).__name__, exc)
        return to_host(x)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(1,))
def _gather_blocks(config: OffloadConfig, layers: tuple, seq: jax.Array, blk: jax.Array):  # noqa: D417
    """Gather ring blocks (seq[n], block number blk[n]) of every layer; write their key digests.

    Returns (layers, k, v [L, N, bs, Hkv, D], maw [L, N, bs, Hkv] float32). Padding rows have
    seq = B (their gathers clamp, their digest writes are dropped).
    """
    bs = config.block_size
    slots = (blk % config.ring_blocks)[:, None] * bs + jnp.arange(bs)[None, :]  # [N, bs]
    rows = jnp.minimum(seq, layers[0].window.k_ring.shape[0] - 1)[:, None]
    ks, vs, maws, digests = [], [], [], []
    for state in layers:
        k = state.window.k_ring[rows, :, slots]  # [N, bs, Hkv, D]
        ks.append(k)
        vs.append(state.window.v_ring[rows, :, slots])
        maws.append(state.window.maw[rows, :, slots])
        digests.append((jnp.min(k, axis=1), jnp.max(k, axis=1)))  # [N, Hkv, D]

    def write(d, source):
        kmin, kmax = digests[source]
        return d.replace(kmin=d.kmin.at[seq, :, blk].set(kmin, mode="drop"),
                         kmax=d.kmax.at[seq, :, blk].set(kmax, mode="drop"))

    new_layers = []
    for i, state in enumerate(layers):
        if state.digests is not None:
            state = state.replace(digests=write(state.digests, i))
        if state.next_digests is not None:
            state = state.replace(next_digests=write(state.next_digests, i + 1))
        new_layers.append(state)
    return tuple(new_layers), jnp.stack(ks), jnp.stack(vs), jnp.stack(maws)


__all__ = ["Evictor", "EvictionJob"]
