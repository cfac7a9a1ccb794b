"""Prefill over the offloaded part of the prompt on the device (`HybridConfig.prefill_offloaded`).

A prefill chunk attends to every earlier token of its sequence. With a prompt longer than the GPU
window, the chunk's earlier tokens are partly offloaded already; the host path attends to them on the
CPU (`host.attention.attend_all`, built for a few decode queries, slow for a 1024-query chunk: 45x
the full-attention time to first token at 8K on the H100). The device path instead copies, before
each prefill chunk, the offloaded blocks of every layer to the device and attends to them there:

  offloaded_prompt(store, ...)  host store -> per layer (k, v [B, Hkv, P, D] model dtype), n_valid [B]
  offloaded_attention(q, ...)   exact attention of the chunk's queries over them -> (o, lse)

P is the largest sequence's offloaded token count rounded up to a power of two of blocks (few
distinct shapes, so few compiles); keys at index >= n_valid[b] are masked. Every offloaded token
precedes every query of the chunk, so there is no causal mask. The copies are transient: the
step passes them through and the next step start drops them. Device memory: the batch's offloaded prompt KV
of all layers at once (what full attention would hold), plus the scores of one layer
[B, Hq, T, P] float32 — `HybridConfig.prefill_upload_max_bytes` bounds the copy; above it the chunk
uses the host path (logged).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from jhybrid.hybrid.recall import _next_pow2, _to_model_dtype, upload

log = logging.getLogger(__name__)


def offloaded_prompt_bytes(store, batch: int, itemsize: int) -> int:
    """Device bytes `offloaded_prompt` would upload now (K and V of every layer, padded)."""
    c = store.config
    e = max(store.n_blocks(0, b) for b in range(batch))
    if e == 0:
        return 0
    return 2 * c.n_layers * batch * c.n_kv_heads * _next_pow2(e) * c.block_size * c.head_dim * itemsize


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
    p = _next_pow2(int(blocks.max())) * bs
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
                        rows = _to_model_dtype(rows, c.kv_dtype, dtype)
                        out[b, :, :blocks[b] * bs] = rows.transpose(1, 0, 2, 3).reshape(hkv, -1, d)
                pair.append(upload(out, device))
            layers.append(tuple(pair))
    return layers, (blocks * bs).astype(np.int32)


def offloaded_attention(q: jax.Array, k: jax.Array, v: jax.Array, n_valid: jax.Array, scale: float):
    """Attention of q [B, T, Hq, D] over the first n_valid[b] keys of k, v [B, Hkv, P, D].

    Returns (o [B, T, Hq, D] float32, lse [B, T, Hq] float32); a row with no valid key has o = 0 and
    lse = -inf (it merges as nothing)."""
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
