"""Prefill over the offloaded part of the prompt on the device (`OffloadConfig.prefill_offloaded`).

A prefill chunk attends to every earlier token of its sequence. With a prompt longer than the GPU
window, the chunk's earlier tokens are partly offloaded already; the host path attends to them on the
CPU (`host.attention.attend_all`, built for a few decode queries, slow for a 1024-query chunk: 45x
the full-attention time to first token at 8K on the H100). The device path instead copies, before
each prefill chunk, the offloaded blocks of every layer to the device and attends to them there:

  offloaded_prompt(store, ...)  host store -> per layer (k, v [B, Hkv, P, D] model dtype), n_valid [B]
  offloaded_attention(q, ...)   exact attention of the chunk's queries over them -> (o, lse)
                                (the flash kernel `pallas_kernels.range_attention` on the GPU)

  PrefillCopies                 the runtime's helper that attaches the copies to each layer's
                                state (`LayerState.offloaded`) before a chunk, and EXTENDS the last
                                chunk's copies on the device with the blocks evicted before this
                                one (no host round trip) when chunks follow each other

P is the largest sequence's offloaded token count rounded up to a power of two of blocks (few
distinct shapes, so few compiles); keys at index >= n_valid[b] are masked. Every offloaded token
precedes every query of the chunk, so there is no causal mask. The copies are transient: the
step passes them through and the next step start drops them. Device memory: the batch's offloaded prompt KV
of all layers at once (what full attention would hold), plus, off the GPU kernel, the scores of one
layer [B, Hq, T, P] float32 — `OffloadConfig.prefill_upload_max_bytes` bounds the copy; above it the
chunk uses the host path (logged).
"""

from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from jhybrid.hybrid.state import DeviceCopy
from jhybrid.hybrid.transfer import stored_as, to_device
from pallas_kernels._common import next_pow2, resolve_backend
from pallas_kernels.range_attention import range_attention
from jhybrid.hybrid.window import evicted_blocks

log = logging.getLogger(__name__)


def offloaded_prompt_bytes(store, batch: int, itemsize: int) -> int:
    """Device bytes `offloaded_prompt` would upload now (K and V of every layer, padded)."""
    blocks = np.array([store.n_blocks(0, b) for b in range(batch)], np.int64)
    return copies_bytes(store.config, blocks, itemsize)


def copies_bytes(store_config, blocks: np.ndarray, itemsize: int) -> int:
    """Device bytes of copies of `blocks` [B] offloaded blocks per sequence (K and V of every
    layer, padded to a power of two of blocks)."""
    c, e = store_config, int(blocks.max(initial=0))
    if e == 0:
        return 0
    return 2 * c.n_layers * len(blocks) * c.n_kv_heads * next_pow2(e) * c.block_size * c.head_dim * itemsize


def offloaded_prompt(store, batch: int, dtype, device):
    """The offloaded tokens of sequences 0..batch-1, every layer, on `device`.

    Returns (layers, n_valid) with layers[l] = (k, v), each [B, Hkv, P, D] in `dtype` on the device
    (rows of sequence b beyond n_valid[b] are zeros), n_valid int32 [B] NumPy; None when nothing is
    offloaded yet. Every layer holds the same blocks per sequence (eviction is per step, all layers).
    """
    c = store.config
    bs, hkv, d = c.block_size, c.n_kv_heads, c.head_dim
    dtype = np.dtype(dtype)
    blocks = np.array([store.n_blocks(0, b) for b in range(batch)], np.int64)
    if blocks.max() == 0:
        return None
    p = next_pow2(int(blocks.max())) * bs
    layers = []
    with store.lock:
        for layer in range(c.n_layers):
            arrays = store.layers[layer].arrays
            pair = []
            for name in ("k", "v"):
                out = np.zeros((batch, hkv, p, d), dtype)
                for b in range(batch):
                    if blocks[b]:
                        rows = arrays[name][store.block_slots(layer, b)]  # [e, Hkv, bs, D] storage
                        rows = stored_as(rows, c.kv_dtype, dtype)
                        out[b, :, :blocks[b] * bs] = rows.transpose(1, 0, 2, 3).reshape(hkv, -1, d)
                pair.append(to_device(out, device))
            layers.append(tuple(pair))
    return layers, (blocks * bs).astype(np.int32)


def offloaded_attention(q: jax.Array, k: jax.Array, v: jax.Array, n_valid: jax.Array, scale: float,
                        positions: jax.Array | None = None, kernel_backend: str | None = None):
    """Attention of q [B, T, Hq, D] over the first n_valid[b] keys of k, v [B, Hkv, P, D].

    Returns (o [B, T, Hq, D] float32, lse [B, T, Hq] float32); a row with no valid key has o = 0 and
    lse = -inf (it merges as nothing). On the GPU (kernel_backend resolves to "triton", or
    "interpret") the flash kernel `range_attention` streams the keys instead of holding float32
    scores [B, Hq, T, P]; it then skips padding queries (positions [B, T] < 0: o = 0, lse = -inf),
    which the jnp path below attends like the others (their outputs are dropped by the caller)."""
    kernel = resolve_backend(kernel_backend)
    if kernel != "reference" and positions is not None:
        key_hi = jnp.where(positions >= 0, n_valid[:, None], 0).astype(jnp.int32)
        return range_attention(q, k, v, jnp.zeros_like(key_hi), key_hi, kv_layout="heads_tokens", scale=scale,
                               out_dtype=jnp.float32, backend=kernel)
    b, t, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    scores = jnp.einsum("btkgd,bkpd->bkgtp", qg, k, preferred_element_type=jnp.float32) * scale
    valid = jnp.arange(k.shape[2])[None, :] < n_valid[:, None]  # [B, P]
    scores = jnp.where(valid[:, None, None, None, :], scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(scores - m_safe)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bkgtp,bkpd->btkgd", p / jnp.where(denom > 0, denom, 1.0), v.astype(jnp.float32))
    lse = jnp.where(denom > 0, jnp.log(jnp.where(denom > 0, denom, 1.0)) + m_safe, -jnp.inf)[..., 0]
    return o.reshape(b, t, hq, d), jnp.transpose(lse, (0, 3, 1, 2)).reshape(b, t, hq)


class PrefillCopies:
    """The device path of `prefill_offloaded` for one runtime: before a prefill chunk whose
    sequences already have offloaded blocks, every layer gets a `DeviceCopy` of them; a chunk that
    follows another extends the previous copies with the blocks evicted since (on the device)."""

    def __init__(self, runtime):
        self.runtime = runtime
        self._blocks: np.ndarray | None = None  # [B] blocks per sequence the last copies hold
        self._previous: tuple | None = None  # the last chunk's copies, kept while chunks follow
        self._evicted: tuple | None = None  # (k, v, seq, blk, added [B]) evicted before this step

    def reset(self) -> None:
        """Forget the copies kept for extension (rows were reset: the next chunk copies from the store)."""
        self._blocks = self._previous = self._evicted = None

    def take_previous(self, cache, next_is_prefill: bool):
        """At a step start: drop every layer's copies from the cache (kept aside when this step is a
        prefill chunk that may extend them). Returns the cache without copies."""
        self._previous = self._evicted = None
        if next_is_prefill:
            self._previous = tuple([(s.offloaded.k, s.offloaded.v) for s in cache.layers])
        return cache.replace(layers=tuple([s.replace(offloaded=None) for s in cache.layers]))

    def note_evicted(self, k, v, seq, blk, added: np.ndarray) -> None:
        """This step start's evicted blocks, still on the device: k, v [L, N, bs, Hkv, D], seq, blk [N]."""
        self._evicted = (k, v, seq, blk, added)

    def uses_device(self, cache, after: np.ndarray) -> bool:
        """Does the prefill chunk that brings the sequences to `after` [B] tokens attend to its
        offloaded prompt on the device (copies) rather than on the host? (config.prefill_offloaded,
        the platform, and the copies' size against prefill_upload_max_bytes; nothing offloaded
        yet: the host path, which then attends to nothing.)"""
        runtime, cfg = self.runtime, self.runtime.config
        device = runtime.device
        if cfg.prefill_offloaded == "host" or (cfg.prefill_offloaded == "auto" and device.platform != "gpu"):
            return False
        nbytes = copies_bytes(runtime.store.config, evicted_blocks(after, cfg), runtime.dtype.itemsize)
        if nbytes == 0:
            return False
        limit = cfg.prefill_upload_max_bytes
        if limit is not None and nbytes > limit:
            if not runtime.core_counters.n_prefill_host_chunks:
                log.warning("hybrid %s: a prefill chunk's offloaded prompt (%d bytes on the device) exceeds "
                            "prefill_upload_max_bytes=%d; such chunks attend to it on the CPU (slower)",
                            cfg.mode, nbytes, limit)
            runtime.core_counters.add(n_prefill_host_chunks=1)
            return False
        return True

    def attach(self, cache, blocks: np.ndarray):
        """Before a prefill chunk on the device path: each layer's state gets the copies of `blocks`
        [B] offloaded blocks per sequence (the last chunk's copies extended on the device, else
        copied from the host store once every started eviction has landed there)."""
        runtime, cfg = self.runtime, self.runtime.config
        device = runtime.device
        start = time.perf_counter()
        blocks = blocks.astype(np.int64)
        layers_kv = self._extended(blocks)
        if layers_kv is None:  # the first chunk over offloaded tokens (or after decode): from the store
            runtime.evictor.publish_all()
            layers_kv, _ = offloaded_prompt(runtime.store, runtime.batch, runtime.dtype, device)
            runtime.core_counters.add(bytes_to_device=copies_bytes(runtime.store.config, blocks, runtime.dtype.itemsize))
        n_valid = (blocks * cfg.block_size).astype(np.int32)
        # one n_valid per layer: the step donates the cache, and a buffer cannot be donated twice
        layers = tuple(state.replace(offloaded=DeviceCopy(k, v, jax.device_put(n_valid, device)))
                       for state, (k, v) in zip(cache.layers, layers_kv))
        runtime.core_counters.add(transfer_s=time.perf_counter() - start, n_prefill_device_chunks=1)
        self._blocks = blocks
        return cache.replace(layers=layers)

    def _extended(self, blocks: np.ndarray):
        """The last chunk's copies plus the blocks evicted before this chunk, scattered in on the
        device; None when there are no copies to extend or they do not account for exactly
        `blocks` [B] offloaded blocks per sequence."""
        prev, evicted = self._previous, self._evicted
        self._previous = self._evicted = None
        if prev is None or self._blocks is None:
            return None
        if evicted is not None and self.runtime.store_rounds:
            # The evicted blocks on the device are the unrounded values; the store holds (and
            # decode attends) its rounded rows: copy those from the store instead.
            return None
        added = evicted[4] if evicted is not None else np.zeros_like(blocks)
        if not np.array_equal(self._blocks + added, blocks):
            log.debug("prefill copies hold %s blocks + %s evicted != %s stored: rebuilt from the store",
                      self._blocks.tolist(), added.tolist(), blocks.tolist())
            return None
        if evicted is None:  # nothing evicted since: same blocks, same padding
            return prev
        self.runtime.core_counters.add(n_prefill_extends=1)
        return _extend(prev, *evicted[:4], next_pow2(int(blocks.max())) * self.runtime.config.block_size)


def _extend(prev: tuple, k: jax.Array, v: jax.Array, seq: jax.Array, blk: jax.Array, p: int):
    """`_scatter_evicted`, jitted, with prev donated when its padding stays (the scatter then writes
    in place; a larger padding is a new array, which a donated input could not become)."""
    fn = _scatter_evicted_in_place if prev[0][0].shape[2] == p else _scatter_evicted_padded
    return fn(prev, k, v, seq, blk, p)


def _scatter_evicted(prev: tuple, k: jax.Array, v: jax.Array, seq: jax.Array, blk: jax.Array, p: int):
    """prev[l] = (k, v) [B, Hkv, P0, D], padded to p tokens, with the evicted blocks k, v
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
