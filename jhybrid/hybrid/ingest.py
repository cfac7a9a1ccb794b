"""Placing a history into an open hybrid batch: GPU window (sinks + ring) + host store.

A history of n tokens whose every layer's K, V [1, n, Hkv, D] is known (HCache rebuilds them on the
device, `jhybrid.hcache.restorer.restore_kv`; the serving engine's prefix cache keeps them on the
host, `jhybrid.serving.prefix_cache`) is placed by `HybridCacheWriter`, for the hybrid modes
(recall, hgca, scout, streaming, topk), layer by layer as each arrives, where a plain chunked
prefill of the same n tokens would have left it, WITHOUT running attention:

  * GPU window: positions [0, sink) into the sinks, positions [sink + e * block_size, n) into the
    ring (slot (p - sink) % ring_capacity), with e = `window.evicted_blocks(n)` — the eviction
    policy is a function of the length alone, so the placement equals a prefill's for any chunking
    (ring slots a prefill would have left holding evicted tokens are never read);
  * host store: blocks 0..e-1 (positions sink + b * block_size + [0, block_size)) appended with
    `HostRuntime.append_blocks` (so the mode hears of them: recall fills its mirror), from one
    device -> host copy per layer (`transfer.to_host`, pinned_host on GPU) when K, V are on the device;
  * scout / topk: the key digests (per block min / max of K over its tokens) of blocks 0..e-1, in
    the layer's own `digests` and in the previous layer's `next_digests` (scout's layer-ahead
    copy), as the runtime's eviction writes them;
  * the runtime adopts the history (token and block counts) and the cache's `lengths` = n;
  * a sliding-window layer (Gemma 3's local layers) keeps its last `sliding_window` tokens on the
    device (`jhybrid.hybrid.sliding`) and nothing on the host; the global layers are the host
    side's layers 0 .. G-1 (`LayerPlan`).

The window, digests and sliding ring are assembled on the host (at most a window of tokens per
layer) and written into the row by one jitted call of fixed shapes (compiled once per cache shape,
the cache donated), so placing histories of any length never recompiles. Two targets:

  HybridCacheWriter(model, backend, max_len, n)   a new batch of ONE sequence (HCache restore):
                                                  opens the backend, `HostRuntime.adopt`
  HybridCacheWriter.into_row(backend, model_config, cache, row, n)
                                                  row `row` of an open batch, empty (never used or
                                                  emptied by `backend.reset_rows`): the other rows
                                                  go on untouched; `HostRuntime.adopt_row`

MAW (moving-average attention weights) is attention HISTORY, which neither HCache nor the prefix
cache saves (they keep K/V or what K/V are projected from, not what queries did). Placed tokens
get MAW 0 in the host store and the ring. HCache restore (a new batch): in the ring, hgca layers
restored from hidden states get the MAW the history's last queries give them
(`OffloadMode.restored_window`) (each ring slot's probability under those queries, summed over the
KV group and averaged over the queries: the same rule as the re-scoring of the offloaded tokens
below), so a ring token evicted by the first decode steps is judged by what the history attended,
not dropped for a MAW of 0; other ring slots start at 0 (the next steps update them as usual,
`window.update_maw`). hgca keeps an offloaded token for CPU attention iff MAW > beta / window, so
with MAW 0 eviction-time sparsification would drop every restored token; it is therefore not run.
Instead the offloaded tokens are re-scored the way hgca re-scores them after every new turn
(`host.sparsify.reevaluate`, what hgca's host work submits after each new turn): with the queries
of the last `cfg.reevaluate_queries` positions of the history, per layer. Those are computed from
the saved hidden states in the same jitted projection as K/V (norm + W_q + RoPE of the last rows;
`restore_kv` hands them over through `sink.queries`), so the host context cache after a restore
equals the one a plain prefill has after its first decode step (its re-evaluation uses the same
queries), up to float rounding. Layers restored from KV or by recompute have no hidden states
to take queries from: their context cache stays empty (logged) until the next turn's
re-evaluation, which the next `generate` always triggers (its prefill is exact: it attends every
stored token, so nothing is lost before then). scout / topk select blocks by digests and recall
attends everything, so they need no MAW.

A row placement (`into_row`) takes no queries: the prefill of the rest of the prompt that follows
it hands the mode the turn's queries. For a mode that reads MAW (`OffloadMode.reads_maw`: hgca)
the placement is then exact, not approximate, when `reusable_prefix` bounds it: every placed
non-sink token leaves the ring during that prefill (so its MAW never decides anything: the first
decode step re-scores every offloaded token with the turn's last queries, which the prefill of at
least `restore_queries()` tokens computes), and the prefill's chunks start where a plain prefill's
would (the ring MAW of the prompt's own tokens depends on its chunks).

    writer = HybridCacheWriter(model, backend, max_len, n)   # opens backend (HybridAttention) for 1 sequence
    restore_kv(kernels, methods, tokens, fetch, writer)
    cache = writer.finish()                                  # KVCache for backend, lengths [n]

    cache = place_history(backend, model_config, cache, row, kv)   # kv [L, 2, n, Hkv, D] host
    kv = read_tokens(backend, cache, row, start, count, width)     # a step's tokens, from the window
    reads = start_read_rows(backend, cache, rows, starts, counts, width)  # several rows, one dispatch
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from jhybrid.hybrid.sliding import LayerPlan, SlidingWindow
from jhybrid.hybrid.state import StepMeta
from jhybrid.hybrid.transfer import start_to_host, to_host
from jhybrid.hybrid.window import evicted_blocks
from pallas_kernels._common import next_pow2

log = logging.getLogger(__name__)


def _put_row(x: jax.Array, value, row) -> jax.Array:
    """x with its entry `row` (axis 0, traced) replaced by value."""
    return jax.lax.dynamic_update_index_in_dim(x, jnp.asarray(value).astype(x.dtype), row, 0)


@functools.partial(jax.jit, donate_argnums=(0,))
def _place_window(window, row, sink_k, sink_v, ring_k, ring_v):
    """Row `row` of a layer's `Window` := sinks [Hkv, S, D] and ring [Hkv, W, D]; its MAW 0."""
    return window.replace(sink_k=_put_row(window.sink_k, sink_k, row), sink_v=_put_row(window.sink_v, sink_v, row),
                          k_ring=_put_row(window.k_ring, ring_k, row), v_ring=_put_row(window.v_ring, ring_v, row),
                          maw=_put_row(window.maw, jnp.zeros(window.maw.shape[1:], window.maw.dtype), row))


@functools.partial(jax.jit, donate_argnums=(0,))
def _place_digests(digests, row, kmin, kmax):
    """Row `row` of a `Digests` := kmin, kmax [Hkv, NB, D] (zeros past the row's blocks)."""
    return digests.replace(kmin=_put_row(digests.kmin, kmin, row), kmax=_put_row(digests.kmax, kmax, row))


@functools.partial(jax.jit, donate_argnums=(0,))
def _place_sliding(state, row, k, v, positions):
    """Row `row` of a `SlidingWindow` := k, v [W, Hkv, D] and positions [W]."""
    return SlidingWindow(k=_put_row(state.k, k, row), v=_put_row(state.v, v, row),
                         positions=_put_row(state.positions, positions, row))


@jax.jit
def _set_counts(lengths, offloaded, row, n, e):
    return lengths.at[row].set(n), offloaded.at[row].set(e)


def _host(x) -> np.ndarray:
    """K or V [1, n, Hkv, D] (device or NumPy) -> NumPy [n, Hkv, D]."""
    return (to_host(x) if isinstance(x, jax.Array) else np.asarray(x))[0]


class HybridCacheWriter:
    """Restore sink that places each layer of a history into a hybrid backend's cache (see module
    docstring): a new batch of one sequence (HCache), or one empty row of an open batch (`into_row`).

    model: the CausalLM; backend: a `jhybrid.hybrid.HybridAttention` (opened here for one sequence
    of max_len tokens); num_tokens: n, the history length. `num_queries` (hgca:
    config.reevaluate_queries, else 0; 0 for a row) tells restore_kv to hand over the last queries
    of hidden-restored layers.
    Counters after finish(): `seconds` (device->host copies + store appends), `bytes_to_host`,
    `n_blocks` (evicted blocks placed in the store, all layers).
    """

    def __init__(self, model, backend, max_len: int, num_tokens: int):
        if num_tokens > max_len:
            raise ValueError(f"restoring {num_tokens} tokens into a hybrid cache of max_len={max_len}")
        backend.open(model.config, 1, max_len)
        self._setup(backend, model.config, model.init_cache(1, max_len, backend), 0, num_tokens, own_batch=True)
        self.num_queries = backend.mode.restore_queries()

    @classmethod
    def into_row(cls, backend, model_config, cache, row: int, num_tokens: int) -> "HybridCacheWriter":
        """A writer that places a history of num_tokens tokens into row `row` of `cache`, the open
        batch of `backend`; the row must be empty (never used, or emptied by `backend.reset_rows`)."""
        runtime = backend.runtime
        if runtime is None:
            raise RuntimeError("HybridCacheWriter.into_row: the backend is not open")
        if not 0 <= row < runtime.batch:
            raise ValueError(f"HybridCacheWriter.into_row: row {row} is out of range for a batch of {runtime.batch}")
        if runtime.n_tokens[row] != 0:
            raise ValueError(f"HybridCacheWriter.into_row: row {row} holds {int(runtime.n_tokens[row])} tokens; "
                             "reset it first (backend.reset_rows)")
        if num_tokens > runtime.max_len:
            raise ValueError(f"placing {num_tokens} tokens into a hybrid cache of max_len={runtime.max_len}")
        self = cls.__new__(cls)
        self._setup(backend, model_config, cache, row, num_tokens, own_batch=False)
        self.num_queries = 0
        return self

    def _setup(self, backend, model_config, cache, row: int, num_tokens: int, own_batch: bool) -> None:
        cfg = backend.config
        self.backend, self.cfg, self.model_config = backend, cfg, model_config
        self.runtime = backend.runtime
        self.row, self.own_batch = row, own_batch
        self.num_tokens = num_tokens
        self.plan = LayerPlan.of(model_config)
        self.cache = cache
        self.layers = list(cache.layers)
        self.evicted = int(evicted_blocks(np.int64(num_tokens), cfg))
        self.last_queries: dict[int, np.ndarray] = {}
        self.placed: set[int] = set()
        self.seconds = 0.0
        self.bytes_to_host = 0
        self.n_blocks = 0

    def queries(self, layer: int, q: jax.Array) -> None:
        """restore_kv hands over q [1, R, Hq, D] of the last R history positions of a hidden layer."""
        if not self.own_batch:
            raise RuntimeError("HybridCacheWriter.into_row takes no history queries (num_queries is 0)")
        self.last_queries[layer] = q

    def __call__(self, layer: int, k, v) -> None:
        """Places layer `layer`'s K, V [1, n, Hkv, D] (device arrays or NumPy)."""
        n, cfg, row = self.num_tokens, self.cfg, self.row
        if tuple(k.shape[:2]) != (1, n) or tuple(v.shape) != tuple(k.shape):
            raise ValueError(f"layer {layer}: restored k {k.shape}, v {v.shape}; expected [1, {n}, Hkv, D]")
        if layer in self.placed:
            raise RuntimeError(f"layer {layer} restored twice")
        start = time.perf_counter()
        kh, vh = _host(k), _host(v)
        if isinstance(k, jax.Array):
            self.bytes_to_host += kh.nbytes + vh.nbytes
        state = self.layers[layer]
        g = self.plan.offloaded_index(layer)
        if g is None:  # a sliding-window layer: its last window of tokens, on the device
            w = state.k.shape[1]
            positions = np.arange(max(0, n - w), n)
            k_ring, v_ring = (np.zeros((w,) + x.shape[1:], x.dtype) for x in (kh, vh))
            p_ring = np.full(w, -1, np.int32)
            slots = positions % w
            k_ring[slots], v_ring[slots], p_ring[slots] = kh[positions], vh[positions], positions
            self.layers[layer] = _place_sliding(state, np.int32(row), k_ring, v_ring, p_ring)
            self.placed.add(layer)
            self.seconds += time.perf_counter() - start
            return
        e, s, bs = self.evicted, cfg.sink, cfg.block_size
        if e:
            kb = kh[s:s + e * bs].reshape(e, bs, *kh.shape[1:])
            vb = vh[s:s + e * bs].reshape(e, bs, *vh.shape[1:])
            maw = np.zeros((e, bs, kh.shape[1]), np.float32)
            self.runtime.append_blocks(g, row, np.arange(e), kb, vb, maw)
            self.n_blocks += e
            before = self.plan.global_layers[g - 1] if g > 0 else None  # the previous offloaded layer
            targets = [(layer, "digests")] + ([(before, "next_digests")] if before is not None else [])
            targets = [(i, name) for i, name in targets if getattr(self.layers[i], name) is not None]
            if targets:
                nb = getattr(self.layers[targets[0][0]], targets[0][1]).kmin.shape[2]
                kmin, kmax = (np.zeros((kh.shape[1], nb, kh.shape[2]), kh.dtype) for _ in range(2))
                kmin[:, :e] = kb.min(axis=1).transpose(1, 0, 2)  # [Hkv, e, D]: min / max over each block's tokens
                kmax[:, :e] = kb.max(axis=1).transpose(1, 0, 2)
                for i, name in targets:
                    placed = _place_digests(getattr(self.layers[i], name), np.int32(row), kmin, kmax)
                    self.layers[i] = self.layers[i].replace(**{name: placed})
        sink_k, sink_v = (np.zeros((kh.shape[1], s) + kh.shape[2:], kh.dtype) for _ in range(2))
        sinks = min(s, n)
        sink_k[:, :sinks], sink_v[:, :sinks] = kh[:sinks].transpose(1, 0, 2), vh[:sinks].transpose(1, 0, 2)
        cap = cfg.ring_capacity
        ring_k, ring_v = (np.zeros((kh.shape[1], cap) + kh.shape[2:], kh.dtype) for _ in range(2))
        begin = s + e * bs  # the first ring token
        if n > begin:
            assert n - begin <= cfg.ring_tokens
            slots = (np.arange(begin, n) - s) % cap
            ring_k[:, slots], ring_v[:, slots] = kh[begin:n].transpose(1, 0, 2), vh[begin:n].transpose(1, 0, 2)
        state = self.layers[layer]
        self.layers[layer] = state.replace(window=_place_window(state.window, np.int32(row), sink_k, sink_v,
                                                                ring_k, ring_v))
        self.placed.add(layer)
        self.seconds += time.perf_counter() - start

    def finish(self):
        """-> the KVCache after every layer was placed (lengths[row] = n); the runtime adopts the
        history and, for a new batch of hgca, queues the re-evaluation of the offloaded tokens."""
        num_layers = len(self.layers)
        missing = sorted(set(range(num_layers)) - self.placed)
        if missing:
            raise RuntimeError(f"HybridCacheWriter.finish: layers {missing} were never restored")
        cfg, runtime, mode = self.cfg, self.runtime, self.backend.mode
        if not self.own_batch:
            runtime.adopt_row(self.row, self.num_tokens)
            lengths, offloaded = _set_counts(self.cache.lengths, self.cache.meta.offloaded_blocks, np.int32(self.row),
                                             np.int32(self.num_tokens), np.int32(self.evicted))
            cache = self.cache.replace(layers=tuple(self.layers), lengths=lengths,
                                       meta=self.cache.meta.replace(offloaded_blocks=offloaded))
            self.cache = None
            log.debug("hybrid ingest (%s): %d tokens into row %d, %d blocks per layer to the host store",
                      cfg.mode, self.num_tokens, self.row, self.evicted)
            return cache
        for layer, q in self.last_queries.items():
            if self.plan.offloaded_index(layer) is not None:
                state = self.layers[layer]
                self.layers[layer] = state.replace(window=mode.restored_window(
                    state.window, q, self.num_tokens, self.evicted, self.model_config.attention_scale))
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


def place_history(backend, model_config, cache, row: int, kv: np.ndarray):
    """The cache (its layers donated) with a history placed into row `row` (empty: never used, or
    emptied by `backend.reset_rows`) of the open batch: kv [L, 2, n, Hkv, D] (host; index 0: K, 1:
    V) of every model layer, n tokens. The other rows are untouched. Follow it with a prefill of
    the rest of the prompt (`reusable_prefix` says how much of a prompt a placement may cover)."""
    writer = HybridCacheWriter.into_row(backend, model_config, cache, row, kv.shape[2])
    for layer in range(kv.shape[0]):
        writer(layer, kv[layer, 0][None], kv[layer, 1][None])
    return writer.finish()


def reusable_prefix(backend, prompt_len: int, cached: int, chunk: int, block: int) -> int:
    """How many of a prompt's first `cached` tokens (a multiple of `block`) a placement may cover so
    that placing them (`place_history`) and prefilling the rest leaves the row as a plain chunked
    prefill of the whole prompt does, for `backend`'s mode, when a plain prefill's calls end at
    multiples of `chunk` tokens (a multiple of `block`, at most `cached`; 0: none):

      * at least the mode's `restore_queries()` last prompt tokens are prefilled (hgca re-scores the
        offloaded tokens with the turn's last queries: they must be computed);
      * a mode that reads MAW (`OffloadMode.reads_maw`): every placed non-sink token is evicted by
        the prompt's own prefill (its MAW, which a placement does not carry, then never decides:
        the first decode step re-scores every offloaded token), and the placement ends at a chunk
        boundary of a plain prefill (the ring MAW of the tokens prefilled after it depends on the
        chunks), i.e. a multiple of `chunk`."""
    cfg, mode = backend.config, backend.mode
    limit = min(cached, prompt_len - mode.restore_queries())
    step = block
    if mode.reads_maw:
        limit = min(limit, cfg.sink + int(evicted_blocks(np.int64(prompt_len), cfg)) * cfg.block_size)
        step = math.lcm(block, chunk)
    return max(0, limit) // step * step


def _token_sources(cfg, layers) -> tuple[tuple[bool, ...], tuple[tuple[jax.Array, ...], ...]]:
    """What a read of window tokens gathers from, per layer (only these arrays go to the jitted read,
    not the whole layer states: fewer leaves to flatten at each dispatch): (whether the layer is a
    sliding-window one, its arrays): a `SlidingWindow`'s k, v [B, W, Hkv, D]; else its `Window`'s
    k_ring, v_ring [B, Hkv, C, D] and, when cfg.sink, sink_k, sink_v [B, Hkv, S, D] (model dtype)."""
    sliding, sources = [], []
    for state in layers:
        if isinstance(state, SlidingWindow):
            sliding.append(True)
            sources.append((state.k, state.v))
        else:
            w = state.window
            sliding.append(False)
            sources.append((w.k_ring, w.v_ring) + ((w.sink_k, w.sink_v) if cfg.sink else ()))
    return tuple(sliding), tuple(sources)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _read_rows(cfg, sliding, sources, rows, positions):
    """K, V [R, L, 2, T, Hkv, D] (model dtype) of rows [R] int32 at positions [R, T] int32 (each
    still in its layer's window), gathered from `_token_sources`' arrays; row r's part [L, 2, T,
    Hkv, D] is contiguous."""
    r = rows[:, None]  # [R, 1], against the positions' [R, T]
    out = []
    for is_sliding, arrays in zip(sliding, sources):
        if is_sliding:
            slots = positions % arrays[0].shape[1]
            k, v = (x[r, slots] for x in arrays)  # [R, T, Hkv, D]
        else:
            ring = (positions - cfg.sink) % cfg.ring_capacity
            k, v = (x[r, :, ring] for x in arrays[:2])  # [R, T, Hkv, D]: the gathered axes lead
            if cfg.sink:
                sink = jnp.clip(positions, 0, cfg.sink - 1)
                in_sink = (positions < cfg.sink)[:, :, None, None]
                k = jnp.where(in_sink, arrays[2][r, :, sink], k)
                v = jnp.where(in_sink, arrays[3][r, :, sink], v)
        out.append(jnp.stack([k, v], axis=1))  # [R, 2, T, Hkv, D]
    return jnp.stack(out, axis=1)


def read_tokens(backend, cache, row: int, start: int, count: int, width: int) -> np.ndarray:
    """K, V [L, 2, count, Hkv, D] (host, model dtype) of positions start .. start + count - 1 of row
    `row`, every layer, read from the device windows: valid right after the step that wrote them (a
    step's tokens are all in its layers' windows until the next step start evicts; a sliding-window
    layer holds a step's last `sliding_window` tokens). width >= count: the read's padded length
    (one compile per width)."""
    (pending,) = start_read_rows(backend, cache, [row], [start], [count], width)
    return pending()


class _HostCopy:
    """A started device -> host copy (`start_to_host`) of a batched read, made a NumPy array once,
    by whichever thread asks first (the store worker calls its rows' `PendingTokens`); the device
    reference is dropped then."""

    def __init__(self, copy: jax.Array):
        self._copy, self._host = copy, None
        self._lock = threading.Lock()

    def __call__(self) -> np.ndarray:
        with self._lock:
            if self._host is None:
                self._host, self._copy = np.asarray(self._copy), None
            return self._host


class PendingTokens:
    """One row of a dispatched `start_read_rows` whose device -> host copy is under way: calling it
    waits for that copy and returns the row's K, V [L, 2, count, Hkv, D] host array (a view of the
    read's shared host copy [R, L, 2, width, Hkv, D]). The read is its own device buffer, taken when
    dispatched: later steps (evictions, a reset row) do not change it."""

    def __init__(self, copy: _HostCopy, index: int, count: int):
        self._copy, self.index, self.count = copy, index, count

    def __call__(self) -> np.ndarray:
        return self._copy()[self.index, :, :, :self.count]


def read_rows_padded(n: int, batch: int) -> int:
    """The row count a batched read of n rows of a batch of `batch` is padded to: min(next_pow2(n),
    batch), so at most log2(batch) + 1 shapes are ever compiled (`start_read_rows`)."""
    return min(next_pow2(n), batch)


def start_read_rows(backend, cache, rows, starts, counts, width: int) -> list[PendingTokens]:
    """`read_tokens` of several rows in ONE dispatch, without waiting for it (nor for the step that
    wrote the tokens): row rows[i]'s positions starts[i] .. starts[i] + counts[i] - 1 (rows, starts,
    counts: int sequences of one length n, 1 <= n <= batch; 0 < counts[i] <= width, the reads'
    padded length). One jitted gather of [R, L, 2, width, Hkv, D] (R = `read_rows_padded(n, batch)`;
    the padding rows read row rows[0] at starts[0]) and one device -> host copy, queued behind that
    step (the serving engine dispatches its next call before it needs them). Returns each row's
    `PendingTokens`, in order."""
    n = len(rows)
    if n == 0:
        raise ValueError("start_read_rows: no rows to read")
    if len(starts) != n or len(counts) != n:
        raise ValueError(f"start_read_rows: {n} rows, {len(starts)} starts and {len(counts)} counts; "
                         "expected one of each per row")
    sliding, sources = _token_sources(backend.config, cache.layers)
    batch = sources[0][0].shape[0]
    if n > batch:
        raise ValueError(f"start_read_rows: {n} rows read from a batch of {batch}")
    padded = read_rows_padded(n, batch)
    row_index = np.full(padded, int(rows[0]), np.int32)
    positions = np.full((padded, width), int(starts[0]), np.int32)
    for i, (row, start, count) in enumerate(zip(rows, starts, counts)):
        if not 0 <= int(row) < batch:
            raise ValueError(f"start_read_rows: row {row} is out of range for a batch of {batch}")
        if int(start) < 0:
            raise ValueError(f"start_read_rows: row {row} starts at position {start}; expected >= 0")
        if not 0 < int(count) <= width:
            raise ValueError(f"start_read_rows: {count} tokens of row {row} in a read of width {width}")
        row_index[i] = row
        positions[i] = start
        positions[i, :count] = np.arange(start, start + count)
    copy = _HostCopy(start_to_host(_read_rows(backend.config, sliding, sources, row_index, positions)))
    return [PendingTokens(copy, i, int(count)) for i, count in enumerate(counts)]


__all__ = ["HybridCacheWriter", "place_history", "reusable_prefix", "read_tokens", "start_read_rows",
           "read_rows_padded", "PendingTokens"]
