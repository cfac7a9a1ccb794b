"""A long context written directly, without a prefill: random KV in the device cache and the host store.

Prefilling 128K tokens through the model for every (mode, batch) point would take most of a
benchmark's time; decode speed only depends on how much KV there is and where it lives. So a
throughput point with `fill: synthetic` builds the state a prefill of `context` tokens would leave:

  device-only modes (full, ...)  every floating-point array of the cache filled with random values
                (a random tile repeated along the tokens, made on the device: no host copy, no 2x
                temporaries)
  offloading modes   GPU window (sinks + ring) random, MAW = 1 / window; offloaded blocks 0..e-1 of
                every (layer, sequence) appended to a host store from a pool of 64 random blocks
                (tiled), with MAW 1.0 for a `keep` share of the pool's tokens, else 0; key digests on
                the device = the digests of those blocks. The backend's open runtime then adopts the
                store and the lengths (`HostRuntime.adopt`), and the mode's host part builds what
                it keeps from the store (`ModeHost.adopted`: recall's mirror; hgca's sparse context
                cache = the tokens whose MAW passes beta / window).

`fill: calibrated` is the same with the attention statistics of real text (measured by
`jhybrid.bench.selection_stats`): the digests give each (sequence, KV head) a stable set of hot
blocks that every query selects and a set of warm alternates of which each query selects a
different part (`calibrated_tiers`: the two sizes that reproduce the measured step-to-step overlap
and drift; without a drift the rest of the top-k is drawn from every weak block); hgca's kept share
is the measured one (`hgca_keep`).

The host store of one (model shape, context, window) is kept and reused by the next points of the
same shape with a batch no larger (blocks appended by a point's decode steps are dropped first), so
a sweep pays the host fill (first touch of fresh memory is slow) once per context, not per point.
The same random blocks are used in every mode, which is all throughput needs; what they attend is
meaningless, and the hgca salient share is the `keep` parameter, not a property of a model.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from host import KVStore, StoreConfig
from host.store_format import from_storage, to_storage
from jhybrid.hybrid.runtime import KV_DTYPE_OF
from jhybrid.hybrid.sliding import SlidingWindow
from jhybrid.hybrid.state import StepMeta
from jhybrid.hybrid.window import evicted_blocks

log = logging.getLogger(__name__)

POOL = 64  # distinct random blocks the host context cycles through
APPEND_CHUNK = 1024  # blocks per append_blocks call (bounds the float32 digest temporaries)

# Host bytes written per second by the fills so far (to predict whether the next one fits the time
# budget): [bytes, seconds].
FILL_RATE = [0, 0.0]


def predicted_fill_seconds(nbytes: int) -> float | None:
    """Seconds to write nbytes of host context at the rate measured so far (None: nothing measured)."""
    done, seconds = FILL_RATE
    if done < 2**28 or seconds <= 0:
        return None
    return nbytes * seconds / done


# ---------------------------------------------------------------------------- device arrays

@functools.partial(jax.jit, static_argnames=("shape", "dtype", "axis"))
def tiled_normal(key, shape: tuple, dtype, axis: int):
    """A [shape] array of random values: a random tile of <= 256 positions along `axis` repeated,
    built on the device with no temporary larger than the output."""
    n = shape[axis]
    tile = next(t for t in (256, 128, 64, 32, 16, 8, 4, 2, 1) if n % t == 0)
    small_shape = shape[:axis] + (tile,) + shape[axis + 1:]
    small = jax.random.normal(key, small_shape, jnp.float32).astype(dtype)
    expanded = jnp.expand_dims(small, axis)
    reps = shape[:axis] + (n // tile, tile) + shape[axis + 1:]
    return jnp.broadcast_to(expanded, reps).reshape(shape)


def fill_device_cache(model, backend, batch: int, max_len: int, context: int, seed: int = 1):
    """The KVCache of a mode that keeps every token on the device (`full`, GPU-only modes) holding
    `context` random tokens per sequence: every floating-point array of the cache random (token axis
    1), built without first allocating the zero cache (so a batch at the device's limit does not need
    twice the memory); integer arrays as the backend initialises them."""
    from jhybrid.models.decoder import KVCache

    shapes = jax.eval_shape(lambda: model.init_cache(batch, max_len, backend))
    key = jax.random.key(seed)

    def fill(spec):
        nonlocal key
        if not jnp.issubdtype(spec.dtype, jnp.floating):
            return None
        key, sub = jax.random.split(key)
        return tiled_normal(sub, tuple(spec.shape), spec.dtype, 1)

    filled = jax.tree_util.tree_map(fill, shapes.layers)
    if any(x is None for x in jax.tree_util.tree_leaves(filled, is_leaf=lambda x: x is None)):
        fresh = model.init_cache(batch, max_len, backend).layers  # integer arrays: the backend's own
        filled = jax.tree_util.tree_map(lambda x, init: init if x is None else x, filled, fresh,
                                        is_leaf=lambda x: x is None)
    return KVCache(layers=filled, lengths=jnp.full((batch,), context, jnp.int32),
                   meta=backend.init_meta(batch, max_len))


# ---------------------------------------------------------------------------- host context

@dataclasses.dataclass(frozen=True)
class HostShape:
    n_layers: int
    n_kv_heads: int
    head_dim: int
    block_size: int
    kv_dtype: str  # host store format: bf16 / fp16 / fp32 / int8
    dtype: str  # model dtype


class HostContext:
    """Random offloaded blocks in a KVStore, reusable across points."""

    def __init__(self, shape: HostShape, sink: int, keep: float, seed: int = 0):
        self.shape, self.sink, self.keep = shape, sink, keep
        rng = np.random.default_rng(seed)
        hkv, bs, d = shape.n_kv_heads, shape.block_size, shape.head_dim
        k = rng.standard_normal((POOL, hkv, bs, d), dtype=np.float32)
        v = rng.standard_normal((POOL, hkv, bs, d), dtype=np.float32)
        self.pool_k = to_storage(k, shape.kv_dtype)  # [P, Hkv, bs, W] head-major, storage dtype
        self.pool_v = to_storage(v, shape.kv_dtype)
        self.pool_maw = np.where(rng.random((POOL, bs, hkv)) < keep, 1.0, 0.0).astype(np.float32)
        kf = from_storage(self.pool_k, shape.kv_dtype)
        self.pool_min, self.pool_max = kf.min(axis=2), kf.max(axis=2)  # [P, Hkv, D]
        self.store: KVStore | None = None
        self.batch = 0  # sequences filled
        self.blocks = 0  # blocks per (layer, sequence) filled
        self._tiles: dict = {}
        self.fill_seconds = 0.0  # of the last prepare

    @staticmethod
    def offset(layer: int, seq: int) -> int:
        """Where in the pool the blocks of (layer, seq) start: sequences and layers differ."""
        return (7 * seq + 13 * layer) % POOL

    def _tile(self, name: str, e: int) -> np.ndarray:
        """pool[name] repeated to e + POOL blocks, so that blocks (offset + i) % POOL for i < e are
        the contiguous slice [offset, offset + e) (a view, no copy per append)."""
        if self._tiles.get(name, (0, None))[0] < e + POOL:
            pool = getattr(self, "pool_" + name)
            self._tiles[name] = (e + POOL, pool[np.arange(e + POOL) % POOL])
        return self._tiles[name][1]

    def block_ids(self, layer: int, seq: int, e: int) -> np.ndarray:
        return (np.arange(e) + self.offset(layer, seq)) % POOL

    # ---- the store ----------------------------------------------------------------------------
    def prepare(self, batch: int, e: int, slack_blocks: int) -> float:
        """Sequences 0..batch-1 hold exactly blocks 0..e-1 in every layer; returns the seconds spent
        writing host memory (0 when the store was reused)."""
        start = time.perf_counter()
        if self.reusable_for(batch, e) and self._truncate(batch, e):
            self.fill_seconds = 0.0
            return 0.0
        s = self.shape
        self.store = None  # release the old one before allocating the new
        store = KVStore(StoreConfig(n_layers=s.n_layers, n_kv_heads=s.n_kv_heads, head_dim=s.head_dim,
                                    block_size=s.block_size, kv_dtype=s.kv_dtype,
                                    initial_blocks_per_layer=max(16, batch * (e + slack_blocks))))
        positions_all = self.sink + np.arange(e * s.block_size, dtype=np.int64).reshape(e, s.block_size)
        tk, tv, tm = self._tile("k", e), self._tile("v", e), self._tile("maw", e)
        for b in range(batch):
            store.add_sequence(b)

        def append(layer: int, b: int) -> None:
            o = self.offset(layer, b)
            for lo in range(0, e, APPEND_CHUNK):
                hi = min(e, lo + APPEND_CHUNK)
                # transposed views of head-major blocks: the store's own transpose is a memcpy
                store.append_blocks(layer, b, tk[o + lo:o + hi].transpose(0, 2, 1, 3),
                                    tv[o + lo:o + hi].transpose(0, 2, 1, 3), tm[o + lo:o + hi],
                                    positions_all[lo:hi])

        # NumPy releases the GIL in the conversions and digests append_blocks computes: threads help
        _parallel(append, [(layer, b) for layer in range(s.n_layers) for b in range(batch)])
        self.store, self.batch, self.blocks = store, batch, e
        seconds = time.perf_counter() - start
        FILL_RATE[0] += store.bytes_used()
        FILL_RATE[1] += seconds
        self.fill_seconds = seconds
        return seconds

    def reusable_for(self, batch: int, e: int) -> bool:
        """Can a point of `batch` sequences with e offloaded blocks reuse the filled store? Only when it
        holds at most twice the sequences: a store kept for many more would pin the host memory the
        smaller point needs for its own state (a 64K hgca point at batch 1 after scout at 18 was
        OOM-killed with the 18-sequence store still held)."""
        return self.store is not None and batch <= self.batch <= 2 * batch and self.blocks == e

    def _truncate(self, batch: int, e: int) -> bool:
        """Forget the blocks a previous point's decode steps appended (benchmark only: resets the
        store's per-sequence block counts; the dropped slots are not recycled). False where the
        store does not expose its counts (then the caller refills)."""
        counts = getattr(self.store, "_n_blocks", None)
        if not isinstance(counts, dict):
            return False
        with self.store.lock:
            for b in range(batch):
                if b not in counts or np.any(counts[b] < e):
                    return False
            for b in range(batch):
                counts[b][:] = e
        return True

    def digests(self, layer: int, batch: int, e: int, nb: int, dtype, hot: int = 0,
                warm: int = 0) -> tuple[jax.Array, jax.Array]:
        """Device key digests (min, max) [B, Hkv, nb, D] of the blocks of `layer` (0 past block e).
        Calibrated fill, per (sequence, KV head), fixed per (layer, sequence, head): `hot` blocks get a
        digest that outscores any other block for any query (kmin = -A, kmax = +A in every channel);
        `warm` blocks outscore every other block but rank among themselves by a random part (-A/2,
        +A/2 plus a quarter of their own digest), so each query selects a different subset of them;
        the others are weakened (scaled by 1/4)."""
        ids = np.stack([self.block_ids(layer, b, e) for b in range(batch)])  # [B, e]
        kmin, kmax = _gather_digests(jnp.asarray(self.pool_min), jnp.asarray(self.pool_max), jnp.asarray(ids),
                                     nb, jnp.dtype(dtype))
        if hot + warm <= 0 or e == 0:
            return kmin, kmax
        hkv = kmin.shape[1]
        rng = np.random.default_rng(1000 + layer)
        tier = np.zeros((batch, hkv, nb), np.int8)
        n_hot, n_warm = min(hot, e), min(warm, max(0, e - hot))
        for b in range(batch):
            for h in range(hkv):
                chosen = rng.choice(e, size=n_hot + n_warm, replace=False)
                tier[b, h, chosen[:n_hot]] = 2
                tier[b, h, chosen[n_hot:]] = 1
        return _calibrate(kmin, kmax, jnp.asarray(tier))


def _parallel(fn, args: list[tuple]) -> None:
    """fn(*a) for every a, on up to 8 threads (first error re-raised)."""
    import concurrent.futures
    import os

    workers = max(1, min(8, os.cpu_count() or 1, len(args)))
    if workers == 1:
        for a in args:
            fn(*a)
        return
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for future in [pool.submit(fn, *a) for a in args]:
            future.result()


@functools.partial(jax.jit, static_argnames=("nb", "dtype"))
def _gather_digests(pool_min, pool_max, ids, nb: int, dtype):
    def one(pool):
        x = jnp.take(pool, ids, axis=0)  # [B, e, Hkv, D]
        x = jnp.transpose(x, (0, 2, 1, 3)).astype(dtype)
        return jnp.pad(x, ((0, 0), (0, 0), (0, nb - x.shape[2]), (0, 0)))
    return one(pool_min), one(pool_max)


@jax.jit
def _calibrate(kmin, kmax, tier):
    """tier [B, Hkv, nb] int8: 2 (hot) -> -A / +A digests; 1 (warm) -> -A/2 / +A/2 plus a quarter of
    the block's own; 0 (the rest) -> a quarter of the block's own."""
    a = 4.0 * jnp.max(jnp.abs(kmax.astype(jnp.float32)))
    t = tier[..., None]
    low, high = 0.25 * kmin.astype(jnp.float32), 0.25 * kmax.astype(jnp.float32)
    return (jnp.where(t == 2, -a, jnp.where(t == 1, low - a / 2, low)).astype(kmin.dtype),
            jnp.where(t == 2, a, jnp.where(t == 1, high + a / 2, high)).astype(kmax.dtype))


def calibrated_tiers(k: int, overlap: float, drift: float | None) -> tuple[int, int]:
    """(hot, warm) blocks per (sequence, KV head) that reproduce a measured step-to-step top-k
    `overlap` and `drift` (distinct blocks a (sequence, head) selects over many steps / k;
    jhybrid.bench.selection_stats) for a top-k of k blocks: every step selects the hot blocks and
    k - hot of the warm ones at random, so the expected overlap is (hot + (k - hot)^2 / warm) / k
    and the distinct blocks hot + warm. drift None: hot = overlap x k, the rest drawn from every
    other block (warm = 0)."""
    if drift is None:
        return int(round(overlap * k)), 0
    distinct = max(k, int(round(drift * k)))
    best = None
    for hot in range(0, k + 1):
        warm = max(distinct - hot, k - hot)
        expected = (hot + ((k - hot) ** 2 / warm if warm else 0)) / k
        if best is None or abs(expected - overlap) < best[0]:
            best = (abs(expected - overlap), hot, warm)
    return best[1], best[2]


def host_shape(model_config, block_size: int, host_kv_dtype: str | None = None) -> HostShape:
    """The host store's shape for a model; host_kv_dtype: OffloadConfig.host_kv_dtype (None: the
    model dtype's format)."""
    dtype = jnp.dtype(model_config.dtype).name
    kv = KV_DTYPE_OF.get(dtype)
    if kv is None:
        raise ValueError(f"synthetic fill: model dtype {dtype} has no host KV format ({sorted(KV_DTYPE_OF)})")
    kv = host_kv_dtype or kv
    # only the global layers offload (sliding-window layers keep their window on the device)
    return HostShape(len(model_config.global_layers), model_config.num_kv_heads, model_config.head_dim, block_size,
                     kv, dtype)


def load_hybrid_cache(cache, backend, host: HostContext, batch: int, context: int, seed: int = 1,
                      overlap: float | None = None, drift: float | None = None):
    """Writes the synthetic context into a fresh hybrid cache (from model.init_cache(.., backend),
    the backend opened for `batch` sequences) and has the backend's runtime adopt the host store
    (the mode's host part builds its own state from it). Returns the cache.

    Consumes `cache`: each device array it replaces is deleted as soon as its random replacement
    exists, so the fill never holds the zero window and the random one at once (at the device's
    largest batch that would need the window's memory twice). overlap, drift (calibrated fill): the
    share of each step's top-k that stays selected at the next step, and the distinct blocks selected
    over many steps / k (see calibrated_tiers, HostContext.digests)."""
    cfg, runtime = backend.config, backend.runtime
    e = int(evicted_blocks(np.int64(context), cfg))
    nb = cfg.host_blocks(runtime.max_len)
    key = jax.random.key(seed)

    def fresh(old: jax.Array, new: jax.Array) -> jax.Array:
        new.block_until_ready()  # the old buffer is free to go only once the new one is written
        old.delete()
        return new

    def random_like(x: jax.Array) -> jax.Array:
        nonlocal key
        key, sub = jax.random.split(key)
        return fresh(x, tiled_normal(sub, tuple(x.shape), x.dtype, 2))  # [B, Hkv, T, D]

    topk = backend.config.topk_blocks or nb
    hot, warm = (0, 0) if overlap is None else calibrated_tiers(min(topk, e), overlap, drift)

    def digests_of(d, source: int):
        kmin, kmax = host.digests(source, batch, e, nb, d.kmin.dtype, hot=hot, warm=warm)
        return d.replace(kmin=fresh(d.kmin, kmin), kmax=fresh(d.kmax, kmax))

    def sliding(state: SlidingWindow) -> SlidingWindow:
        nonlocal key
        w = state.k.shape[1]
        held = np.arange(max(0, context - w), context)  # each sequence's last w positions, slot p % w
        table = np.full((batch, w), -1, np.int32)
        table[:, held % w] = held
        k1, k2, key = jax.random.split(key, 3)
        return SlidingWindow(k=fresh(state.k, tiled_normal(k1, tuple(state.k.shape), state.k.dtype, 1)),
                             v=fresh(state.v, tiled_normal(k2, tuple(state.v.shape), state.v.dtype, 1)),
                             positions=fresh(state.positions, jnp.asarray(table)))

    layers = []
    layer = -1  # the offloaded (global) layer number
    for state in cache.layers:
        if isinstance(state, SlidingWindow):
            layers.append(sliding(state))
            continue
        layer += 1
        w = state.window
        window = w.replace(k_ring=random_like(w.k_ring), v_ring=random_like(w.v_ring),
                           maw=fresh(w.maw, jnp.full_like(w.maw, 1.0 / cfg.window_tokens)))
        if w.sink_k.size:
            window = window.replace(sink_k=random_like(w.sink_k), sink_v=random_like(w.sink_v))
        state = state.replace(window=window)
        if state.digests is not None:
            state = state.replace(digests=digests_of(state.digests, layer))
        if state.next_digests is not None:
            state = state.replace(next_digests=digests_of(state.next_digests, layer + 1))
        layers.append(state)
    runtime.adopt(np.full(batch, context), store=host.store)  # the mode's host part builds its own state
    return cache.replace(layers=tuple(layers), lengths=jnp.full((batch,), context, jnp.int32),
                         meta=StepMeta(offloaded_blocks=jnp.full((batch,), e, jnp.int32)))
