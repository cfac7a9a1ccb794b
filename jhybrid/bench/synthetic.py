"""A long context written directly, without a prefill: random KV in the device cache and the host store.

Prefilling 128K tokens through the model for every (mode, batch) point would take most of a
benchmark's time; decode speed only depends on how much KV there is and where it lives. So a
throughput point with `fill: synthetic` builds the state a prefill of `context` tokens would leave:

  full          every layer's K/V buffer [B, max_len, Hkv, D] filled with random values (a random
                tile repeated along the tokens, made on the device: no host copy, no 2x temporaries)
  other modes   GPU window (sinks + ring) random, MAW = 1 / window; offloaded blocks 0..e-1 of every
                (layer, sequence) appended to a host store from a pool of 64 random blocks (tiled);
                scout/topk key digests on the device = the digests of those blocks; recall's host
                mirror holds the same blocks; hgca's sparse context cache = the tokens whose MAW
                (1.0 for a `keep` share of the pool's tokens, else 0) passes beta / window. The
                backend's open runtime then adopts the store and the lengths (`HostRuntime.adopt`).

`fill: calibrated` is the same with the attention statistics of real text (measured on SmolLM2 by
`jhybrid.bench.selection_stats`): the digests give each (sequence, KV head) a stable set of
`overlap x k` hot blocks that every query selects (so scout's top-k keeps that share from one step to
the next, and recall can hold it on the GPU), the rest of the top-k drawn from weak blocks that
random queries rank differently at each step; hgca's kept share is the measured one (`hgca_keep`).

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
from host.sparsify import sparsify_evicted
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


def fill_full_cache(model, batch: int, max_len: int, context: int, seed: int = 1):
    """A full-attention KVCache holding `context` random tokens per sequence, built without first
    allocating the zero cache (so a batch at the device's limit does not need twice the memory)."""
    from jhybrid.attention.full import FullAttention
    from jhybrid.models.decoder import KVCache

    shapes = jax.eval_shape(lambda: model.init_cache(batch, max_len, FullAttention()))
    key = jax.random.key(seed)
    layers = []
    for state in shapes.layers:
        new = {}
        for name, spec in state.items():
            key, sub = jax.random.split(key)
            new[name] = tiled_normal(sub, tuple(spec.shape), spec.dtype, 1)  # [B, max_len, Hkv, D]
        layers.append(new)
    return KVCache(layers=tuple(layers), lengths=jnp.full((batch,), context, jnp.int32))


# ---------------------------------------------------------------------------- host context

@dataclasses.dataclass(frozen=True)
class HostShape:
    n_layers: int
    n_kv_heads: int
    head_dim: int
    block_size: int
    kv_dtype: str  # host store format: bf16 / fp16 / fp32 / int8
    dtype: str  # model dtype (recall's mirror)


class HostContext:
    """Random offloaded blocks in a KVStore (and recall's mirror), reusable across points."""

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
        self._mirror = None  # (key, {"k", "v"})
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
        self._mirror = None
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

    def rebuild_context_cache(self, batch: int, e: int, beta: float, window: int,
                              max_keep_share: float | None = None) -> None:
        """hgca: the sparse context cache of sequences 0..batch-1 = the salient tokens of blocks 0..e-1
        (at most max_keep_share of them per head: `host.sparsify.select_salient`)."""
        store = self.store
        with store.lock:
            for layer in range(self.shape.n_layers):
                for b in range(batch):
                    for h in range(self.shape.n_kv_heads):
                        store.context.clear_head_locked(layer, b, h)
        for layer in range(self.shape.n_layers):
            sparsify_evicted(store, layer, range(batch), [np.arange(e)] * batch, beta, window,
                             max_keep_share=max_keep_share)

    # ---- recall's mirror ----------------------------------------------------------------------
    def mirror(self, template: dict, batch: int, e: int) -> dict:
        """recall's host mirror ({"k", "v"} [L, B, Hkv, N, D], model dtype) with blocks 0..e-1 written
        into `template` (a new runtime's empty mirror), or the one written for an earlier point of
        the same shape (then `template` is dropped untouched)."""
        key = (template["k"].shape, str(template["k"].dtype), e)
        if self._mirror is not None and self._mirror[0] == key:
            return self._mirror[1]
        self._mirror = None
        start = time.perf_counter()
        s, bs = self.shape, self.shape.block_size
        dtype = template["k"].dtype
        out = {}
        for name in ("k", "v"):
            arr = template[name]  # the runtime's own (lazily zeroed) mirror: written, then kept
            pool = getattr(self, "pool_" + name)  # storage bits = the model dtype's bits
            if s.kv_dtype == "int8":  # the mirror holds the dequantized values in the model dtype
                pool = from_storage(pool, "int8").astype(dtype)
            if pool.dtype.itemsize != arr.dtype.itemsize:
                raise ValueError(f"recall mirror dtype {arr.dtype} does not match the store's {s.kv_dtype}")
            bits = arr.view(pool.dtype)
            tile = pool[np.arange(e + POOL) % POOL]

            def copy(layer: int, b: int) -> None:
                o = self.offset(layer, b)
                view = bits[layer, b, :, :e * bs].reshape(s.n_kv_heads, e, bs, s.head_dim)
                view[...] = tile[o:o + e].transpose(1, 0, 2, 3)

            _parallel(copy, [(layer, b) for layer in range(s.n_layers) for b in range(batch)])
            out[name] = arr
        seconds = time.perf_counter() - start
        FILL_RATE[0] += out["k"].nbytes * 2
        FILL_RATE[1] += seconds
        self.fill_seconds += seconds
        self._mirror = (key, out)
        return out

    def digests(self, layer: int, batch: int, e: int, nb: int, dtype,
                hot: int = 0) -> tuple[jax.Array, jax.Array]:
        """Device key digests (min, max) [B, Hkv, nb, D] of the blocks of `layer` (0 past block e).
        hot > 0 (calibrated fill): per (sequence, KV head) `hot` blocks get a digest that outscores any
        other block for any query (kmin = -A, kmax = +A in every channel), the others are weakened
        (scaled by 1/4); which blocks are hot is fixed per (layer, sequence, head)."""
        ids = np.stack([self.block_ids(layer, b, e) for b in range(batch)])  # [B, e]
        kmin, kmax = _gather_digests(jnp.asarray(self.pool_min), jnp.asarray(self.pool_max), jnp.asarray(ids),
                                     nb, jnp.dtype(dtype))
        if hot <= 0 or e == 0:
            return kmin, kmax
        hkv = kmin.shape[1]
        rng = np.random.default_rng(1000 + layer)
        mask = np.zeros((batch, hkv, nb), bool)
        for b in range(batch):
            for h in range(hkv):
                mask[b, h, rng.choice(e, size=min(hot, e), replace=False)] = True
        return _calibrate(kmin, kmax, jnp.asarray(mask))


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
def _calibrate(kmin, kmax, hot):
    """Hot blocks (mask [B, Hkv, nb]) -> -A / +A digests; the others scaled by 1/4."""
    a = 4.0 * jnp.max(jnp.abs(kmax.astype(jnp.float32)))
    mask = hot[..., None]
    return (jnp.where(mask, -a, 0.25 * kmin.astype(jnp.float32)).astype(kmin.dtype),
            jnp.where(mask, a, 0.25 * kmax.astype(jnp.float32)).astype(kmax.dtype))


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
                      overlap: float | None = None):
    """Writes the synthetic context into a fresh hybrid cache (from model.init_cache(.., backend),
    the backend opened for `batch` sequences) and has the backend's runtime adopt the host store
    (and recall's mirror). Returns the cache.

    Consumes `cache`: each device array it replaces is deleted as soon as its random replacement
    exists, so the fill never holds the zero window and the random one at once (at the device's
    largest batch that would need the window's memory twice). overlap (calibrated fill): the share
    of each step's top-k that stays selected at the next step (see HostContext.digests)."""
    cfg, runtime = backend.config, backend.runtime
    e = int(evicted_blocks(np.int64(context), cfg))
    nb = cfg.host_blocks(runtime.max_len)
    if cfg.mode == "hgca":
        host.rebuild_context_cache(batch, e, cfg.beta, cfg.window_tokens, max_keep_share=cfg.max_keep_share)
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
    hot = 0 if overlap is None else int(round(overlap * min(topk, e)))

    def digests_of(d, source: int):
        kmin, kmax = host.digests(source, batch, e, nb, d.kmin.dtype, hot=hot)
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
    mode_host = runtime.mode_host
    if hasattr(mode_host, "mirror_k"):  # recall: its host mirror of the offloaded KV
        mirror = host.mirror({"k": mode_host.mirror_k, "v": mode_host.mirror_v}, batch, e)
        mode_host.mirror_k, mode_host.mirror_v = mirror["k"], mirror["v"]
    runtime.adopt(np.full(batch, context), store=host.store)
    return cache.replace(layers=tuple(layers), lengths=jnp.full((batch,), context, jnp.int32),
                         meta=StepMeta(offloaded_blocks=jnp.full((batch,), e, jnp.int32)))
