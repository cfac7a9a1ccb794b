"""Prefill over the offloaded part of the prompt on the device (`OffloadConfig.prefill_offloaded`).

A prefill chunk attends to every earlier token of its sequence. With a prompt longer than the GPU
window, the chunk's earlier tokens are partly offloaded already; the host path attends to them on the
CPU (`host.attention.attend_all`, built for a few decode queries, slow for a 1024-query chunk: 45x
the full-attention time to first token at 8K on the H100). The device path instead copies, before
each prefill chunk, the offloaded blocks of every layer to the device and attends to them there:

  offloaded_prompt(store, ...)  host store -> per layer (k, v [B, Hkv, P, D] model dtype), n_valid [B]
  offloaded_attention(q, ...)   exact attention of the chunk's queries over them -> (o, lse)
                                (the flash kernel `pallas_kernels.range_attention` on the GPU)

  PrefillCopies                 the runtime's helper that attaches the copies of the chunk's rows
                                to each layer's state (`LayerState.offloaded`) before a chunk, keeps
                                them (out of the cache) while chunks follow each other, with at most
                                one decode step between them (the serving engine), and EXTENDS them on
                                the device with the blocks evicted before each chunk (no host round
                                trip); only a row whose copies are not current is copied from the host

P is the chunk's rows' largest offloaded token count rounded up to a power of two of blocks, at
least an eighth of a row's host capacity and at most all of it (few distinct shapes, so few
compiles of the prefill step; never below the kept copies'); keys at index >= n_valid[b] are
masked (n_valid 0 for a row without a token in the chunk). Every offloaded token precedes every query
of the chunk, so there is no causal mask. The step passes the copies through; the next step start
takes them out of the cache. Device memory: [B, Hkv, P, D] K and V of all layers at once (what full
attention would hold), plus, off the GPU kernel, the scores of one layer [B, Hq, T, P] float32 —
`OffloadConfig.prefill_upload_max_bytes` bounds the copy; above it the chunk uses the host path
(logged).
"""

from __future__ import annotations

import functools
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


def copies_bytes(store_config, blocks: np.ndarray, itemsize: int, tokens: int | None = None) -> int:
    """Device bytes of copies of `blocks` [B] offloaded blocks per sequence (K and V of every
    layer), padded to `tokens` per sequence (default: a power of two of blocks)."""
    c, e = store_config, int(blocks.max(initial=0))
    if e == 0:
        return 0
    tokens = next_pow2(e) * c.block_size if tokens is None else tokens
    return 2 * c.n_layers * len(blocks) * c.n_kv_heads * tokens * c.head_dim * itemsize


def offloaded_prompt(store, batch: int, dtype, device, rows: np.ndarray | None = None, tokens: int | None = None):
    """The offloaded tokens of sequences `rows` (default 0..batch-1), every layer, on `device`.

    Returns (layers, n_valid) with layers[l] = (k, v), each [len(rows), Hkv, P, D] in `dtype` on the
    device (rows of sequence b beyond n_valid[b] are zeros), n_valid int32 [len(rows)] NumPy; None
    when nothing is offloaded yet. P = `tokens` (a multiple of the block size at least the largest
    offloaded count), by default that count rounded up to a power of two of blocks. Every layer holds
    the same blocks per sequence (eviction is per step, all layers).
    """
    c = store.config
    bs, hkv, d = c.block_size, c.n_kv_heads, c.head_dim
    dtype = np.dtype(dtype)
    rows = np.arange(batch) if rows is None else np.asarray(rows, np.int64)
    blocks = np.array([store.n_blocks(0, int(b)) for b in rows], np.int64)
    if blocks.max(initial=0) == 0:
        return None
    p = next_pow2(int(blocks.max())) * bs if tokens is None else tokens
    if p < blocks.max() * bs or p % bs:
        raise ValueError(f"offloaded_prompt: tokens={p} does not hold {int(blocks.max())} blocks of {bs} tokens")
    layers = []
    with store.lock:
        for layer in range(c.n_layers):
            arrays = store.layers[layer].arrays
            pair = []
            for name in ("k", "v"):
                out = np.zeros((len(rows), hkv, p, d), dtype)
                for i, b in enumerate(rows.tolist()):
                    if blocks[i]:
                        stored = arrays[name][store.block_slots(layer, b)]  # [e, Hkv, bs, D] storage
                        stored = stored_as(stored, c.kv_dtype, dtype)
                        out[i, :, :blocks[i] * bs] = stored.transpose(1, 0, 2, 3).reshape(hkv, -1, d)
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
    sequences already have offloaded blocks, every layer gets a `DeviceCopy` of the offloaded blocks
    of the chunk's rows (the rows with a valid position; the others attend to nothing).

    The copies outlive their chunk, kept aside out of the cache, while chunks follow each other with
    at most `DECODE_GAP` decode steps between them (the serving engine's step: prefill calls, then a
    decode call of the other requests). The next chunk then extends them on the device with the
    blocks evicted before it and copies from the host store only the rows whose copies are not
    current (reset, adopted, or one whose decode steps evicted), each its own blocks only (padded to
    a power of two, not to P); a row new to the device path, all of whose offloaded blocks were
    evicted at that chunk's start, takes them from the evicted blocks (no host round trip, no wait
    for the store). A prompt is uploaded at most once, not once per chunk. Per row, `_held[b]` is
    the number of offloaded blocks its copies hold (-1: not current)."""

    DECODE_GAP = 1

    def __init__(self, runtime):
        self.runtime = runtime
        self._kept: tuple | None = None  # per layer (k, v) [B, Hkv, P, D]: the last chunk's copies
        self._held: np.ndarray | None = None  # [B] int64 blocks each row's kept copies hold; -1 stale
        self._attached = False  # the cache holds copies attach() made (the last step was a device chunk)
        self._decode_steps = 0  # decode steps since the kept copies' chunk
        self._evicted: tuple | None = None  # (k, v, seq, blk, added [B]) evicted at this step's start
        self.holds_copies = False  # copies attached to the cache or kept aside: step_start has work to do

    def reset(self) -> None:
        """Forget every kept copy (the next chunk copies from the store)."""
        self._kept = self._held = self._evicted = None
        self._attached = self.holds_copies = False

    def forget_rows(self, rows) -> None:
        """Rows `rows` hold another sequence now (reset, adopted): their copies are not current."""
        if self._held is not None:
            self._held[np.asarray(rows, np.int64)] = -1

    def step_start(self, cache, prefill: bool):
        """At a step start (every prefill step; a decode step when the cache has copies or
        `holds_copies`): take the copies out of the cache (a decode step runs without them; a recall
        mode's copies of the last step are dropped too) and keep attach()'s aside for the next chunk,
        or drop them after DECODE_GAP decode steps with no prefill step between (a chunk inside the
        window counts: a prompt paused by another's such chunks resumes with its copies). Returns
        the cache without copies."""
        self._evicted = None
        if self._attached:
            self._kept = tuple([(s.offloaded.k, s.offloaded.v) for s in cache.layers])
            self._attached, self._decode_steps = False, 0
        if prefill:  # a chunk of any row (inside the window too): the prefill goes on, the copies stay
            self._decode_steps = 0
        elif self._kept is not None:
            self._decode_steps += 1
            if self._decode_steps > self.DECODE_GAP:
                self._kept = self._held = None  # frees their device memory for the decode steps
        self.holds_copies = self._kept is not None
        if cache.layers[0].offloaded is None:
            return cache
        return cache.replace(layers=tuple([s.replace(offloaded=None) for s in cache.layers]))

    def note_evicted(self, k, v, seq, blk, added: np.ndarray) -> None:
        """This step start's evicted blocks, still on the device: k, v [L, N, bs, Hkv, D], seq, blk [N]."""
        self._evicted = (k, v, seq, blk, added)

    def _tokens(self, blocks: np.ndarray) -> int:
        """P of the next copies: the chunk's rows' blocks [B] padded to a power of two of at least an
        eighth of the row's capacity (nb_max), at most nb_max, never below the kept copies' (they keep
        their rows' tokens; a shorter padding would cut them). Each P compiles the prefill step
        anew: a prompt of the whole max_len meets four of them, not log2(nb_max)."""
        nb_max = self.runtime.nb_max
        floor = max(1, next_pow2(nb_max) // 8)
        p = min(max(next_pow2(int(blocks.max(initial=0))), floor), nb_max) * self.runtime.config.block_size
        return max(p, self._kept[0][0].shape[2]) if self._kept is not None else p

    def sizes(self) -> list[int]:
        """Every P `_tokens` can give a prefill chunk (the copies' token counts, ascending): the step
        compiles once for each. A chunk's rows hold at most evicted_blocks(max_len) offloaded blocks
        (the ring keeps the last ring_tokens), so the sizes stop at the first that covers it: with
        max_len just past a power of two of blocks (the serving benchmark's 16448 tokens = 257
        blocks) nb_max itself is out of reach, and its steps (6 shapes, ~50 s of tracing on the
        H200) are not compiled."""
        runtime = self.runtime
        nb_max, bs = runtime.nb_max, runtime.config.block_size
        reach = int(evicted_blocks(np.int64(runtime.max_len), runtime.config))
        blocks, out = max(1, next_pow2(nb_max) // 8), []
        while True:
            out.append(min(blocks, nb_max) * bs)
            if blocks >= nb_max or blocks >= reach:
                return out
            blocks *= 2

    def may_use_device(self) -> bool:
        """Can a prefill chunk take the device path at all (config.prefill_offloaded and the platform)?
        `uses_device` decides per chunk."""
        choice = self.runtime.config.prefill_offloaded
        return choice == "device" or (choice == "auto" and self.runtime.device.platform == "gpu")

    def uses_device(self, cache, after: np.ndarray, active: np.ndarray) -> bool:
        """Does the prefill chunk that brings the sequences to `after` [B] tokens attend to its
        offloaded prompt on the device (copies) rather than on the host? `active` [B] bool: the rows
        with a token in the chunk, some of which have offloaded tokens (a chunk of rows with none
        attends to the window alone: the runtime's `NothingOffloaded`). (config.prefill_offloaded,
        the platform, and the copies' size against prefill_upload_max_bytes.)"""
        runtime, cfg = self.runtime, self.runtime.config
        if not self.may_use_device():
            return False
        fits, nbytes = self.fits_device(after, active)
        limit = cfg.prefill_upload_max_bytes
        if not fits:
            if not runtime.core_counters.n_prefill_host_chunks:
                log.warning("hybrid %s: a prefill chunk's offloaded prompt (%d bytes on the device) exceeds "
                            "prefill_upload_max_bytes=%d; such chunks attend to it on the CPU (slower)",
                            cfg.mode, nbytes, limit)
            runtime.core_counters.add(n_prefill_host_chunks=1)
            self.reset()
            return False
        return True

    def fits_device(self, after: np.ndarray, active: np.ndarray) -> tuple[bool, int]:
        """(whether the copies of a chunk that brings the sequences to `after` [B] tokens fit
        prefill_upload_max_bytes, their device bytes) for its `active` [B] rows; no side effect."""
        runtime, cfg = self.runtime, self.runtime.config
        blocks = np.where(active, evicted_blocks(after, cfg), 0)
        nbytes = copies_bytes(runtime.store.config, blocks, runtime.dtype.itemsize, self._tokens(blocks))
        limit = cfg.prefill_upload_max_bytes
        return limit is None or nbytes <= limit, nbytes

    def attach(self, cache, blocks: np.ndarray, active: np.ndarray):
        """Before a prefill chunk on the device path: each layer's state gets the copies of `blocks`
        [B] offloaded blocks per sequence for the `active` [B] rows (n_valid 0 for the others). The
        kept copies are extended on the device with the blocks evicted at this step's start; the
        rows of the chunk whose copies are not current are copied from the host store, once every
        started eviction has landed there (a row whose blocks were all evicted at this step start
        takes them from the evicted blocks instead)."""
        runtime, cfg = self.runtime, self.runtime.config
        device, batch = runtime.device, runtime.batch
        start = time.perf_counter()
        blocks = blocks.astype(np.int64)
        p = self._tokens(np.where(active, blocks, 0))
        kept, held = self._kept, self._held
        evicted, self._evicted, self._kept = self._evicted, None, None
        if kept is None or held is None:
            kept, held = None, np.full(batch, -1, np.int64)
        if evicted is not None and not runtime.store_rounds:
            # a row whose every offloaded block was evicted at this step start (its first chunk past
            # the window) takes them from the evicted blocks, still on the device: no host round trip
            whole = (held < 0) & (evicted[4] > 0) & (evicted[4] == blocks)
            if whole.any():
                if kept is None:
                    n_layers, _, _, hkv, d = evicted[0].shape  # [L, N, bs, Hkv, D]
                    with jax.default_device(device):
                        kept = _zeros(n_layers, (batch, hkv, p, d), np.dtype(runtime.dtype))
                held = np.where(whole, 0, held)
                runtime.core_counters.add(n_prefill_rows_from_evicted=int(whole.sum()))
        if kept is None:
            pass  # nothing kept: every active row with offloaded blocks is stale (copied below)
        elif evicted is not None and runtime.store_rounds:
            # The evicted blocks on the device are the unrounded values; the store holds (and
            # decode attends) its rounded rows: the rows that evicted copy them from the store.
            held = np.where(evicted[4] > 0, -1, held)
            kept = _pad(kept, p) if kept[0][0].shape[2] != p else kept
        elif evicted is not None:
            held = np.where(held >= 0, held + evicted[4], -1)
            kept = _extend(kept, *evicted[:4], p)
            runtime.core_counters.add(n_prefill_extends=1)
        elif kept[0][0].shape[2] != p:
            kept = _pad(kept, p)
        stale = active & (blocks > 0) & (held != blocks)
        if stale.any():
            runtime.evictor.publish_all()
        for row in np.flatnonzero(stale).tolist():  # a row at a time: one shape per (P, its own size)
            # its own blocks padded to a power of two, not to P: the rest of its copy is masked (n_valid)
            own = min(next_pow2(int(blocks[row])) * cfg.block_size, p)
            fresh, _ = offloaded_prompt(runtime.store, batch, runtime.dtype, device, rows=np.array([row]), tokens=own)
            kept = _set_rows(kept, tuple(fresh), np.array([row], np.int32), batch, p)
            held[row] = blocks[row]
            runtime.core_counters.add(bytes_to_device=sum(x.nbytes for pair in fresh for x in pair),
                                      n_prefill_row_uploads=1)
        n_valid = (np.where(active, blocks, 0) * cfg.block_size).astype(np.int32)
        # one n_valid per layer (the step donates the cache, and a buffer cannot be donated twice),
        # in one batched transfer
        valid = jax.device_put([n_valid] * len(kept), device)
        layers = tuple(state.replace(offloaded=DeviceCopy(k, v, n))
                       for state, (k, v), n in zip(cache.layers, kept, valid))
        runtime.core_counters.add(transfer_s=time.perf_counter() - start, n_prefill_device_chunks=1)
        self._held, self._attached, self.holds_copies = held, True, True
        return cache.replace(layers=layers)


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


@functools.partial(jax.jit, static_argnums=(1,))
def _pad(prev: tuple, p: int):
    """prev[l] = (k, v) [B, Hkv, P0, D] padded with zeros to p >= P0 tokens."""
    return jax.tree_util.tree_map(lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, p - x.shape[2]), (0, 0))), prev)


def _set_rows(prev: tuple | None, fresh: tuple, rows: np.ndarray, batch: int, p: int):
    """prev[l] = (k, v) [B, Hkv, P, D] (None: zeros of P = p tokens) with the first P' tokens of
    rows `rows` [n] replaced by fresh[l] [n, Hkv, P', D], P' <= P (prev donated: written in place;
    the row's tokens past P' keep what they held: masked by n_valid)."""
    if prev is None:
        return _new_with_rows(fresh, rows, batch, p)
    return _replace_rows(prev, fresh, rows)


@functools.partial(jax.jit, donate_argnums=(0,))
def _replace_rows(prev: tuple, fresh: tuple, rows: jax.Array):
    return jax.tree_util.tree_map(lambda x, new: x.at[rows, :, :new.shape[2]].set(new.astype(x.dtype)), prev, fresh)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _new_with_rows(fresh: tuple, rows: jax.Array, batch: int, p: int):
    return jax.tree_util.tree_map(
        lambda new: jnp.zeros((batch,) + new.shape[1:2] + (p,) + new.shape[3:], new.dtype)
        .at[rows, :, :new.shape[2]].set(new), fresh)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _zeros(n_layers: int, shape: tuple, dtype) -> tuple:
    """Copies of nothing yet: per layer (k, v) zeros of `shape` [B, Hkv, P, D]."""
    return tuple([(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(n_layers)])
