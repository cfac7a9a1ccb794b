"""The GPU window of one layer (`state.Window`): sinks + ring buffer + moving-average weights.

The ring buffer has W = `ring_capacity` slots (the window's ring plus `ring_slack_blocks`); non-sink
token p lives in slot (p - S) % W. Its bookkeeping follows from each sequence's length n and its
offloaded block count e (`StepMeta.offloaded_blocks`: the blocks the host side owns this step,
which lag the eviction policy's `evicted_blocks(n)` while their copies finish in the background):
the GPU attends the non-sink tokens p in [S + e * block_size, n), ring_len = (n - S) -
e * block_size of them, logical token 0 at slot ring_start = (e * block_size) % W. So the jitted step
carries no counters that Python must patch, and a token is attended by the GPU exactly when the host
side does not own it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jhybrid.hybrid.config import OffloadConfig
from jhybrid.hybrid.state import Window
from pallas_kernels.window_attention import window_attention


def evicted_blocks(n_tokens, cfg: OffloadConfig):
    """Blocks the eviction policy moves to the host once a sequence holds n_tokens tokens (NumPy or
    jnp int arrays): just enough whole blocks, oldest first, that the ring never holds more than
    `ring_tokens` tokens (HGCA Algorithm 1); since tokens only grow, a function of the length alone:
    e = max(0, ceil((n - sink - ring_tokens) / block_size))."""
    over = n_tokens - cfg.sink - cfg.ring_tokens
    return (over + cfg.block_size - 1) // cfg.block_size * (over > 0)


def init_window(cfg: OffloadConfig, batch: int, num_kv_heads: int, head_dim: int, dtype) -> Window:
    s, w = cfg.sink, cfg.ring_capacity
    return Window(sink_k=jnp.zeros((batch, num_kv_heads, s, head_dim), dtype),
                  sink_v=jnp.zeros((batch, num_kv_heads, s, head_dim), dtype),
                  k_ring=jnp.zeros((batch, num_kv_heads, w, head_dim), dtype),
                  v_ring=jnp.zeros((batch, num_kv_heads, w, head_dim), dtype),
                  maw=jnp.zeros((batch, num_kv_heads, w), jnp.float32))


def ring_meta(cfg: OffloadConfig, lengths: jax.Array, offloaded: jax.Array):
    """lengths, offloaded blocks [B] -> (ring_len, ring_start, sink_len), each int32 [B]."""
    n = lengths.astype(jnp.int32)
    e = offloaded.astype(jnp.int32)
    ring_len = jnp.maximum(n - cfg.sink, 0) - e * cfg.block_size
    ring_start = (e * cfg.block_size) % cfg.ring_capacity
    return ring_len, ring_start, jnp.minimum(n, cfg.sink)


def write_tokens(cfg: OffloadConfig, window: Window, k: jax.Array, v: jax.Array, positions: jax.Array) -> Window:
    """Stores new k, v [B, T, Hkv, D] at positions [B, T] (-1 dropped); resets their slots' MAW."""
    b, t, hkv, _ = k.shape
    s, w = cfg.sink, cfg.ring_capacity
    bi = jnp.arange(b)[:, None, None]
    hi = jnp.arange(hkv)[None, None, :]
    ring_slot = jnp.where(positions >= s, (positions - s) % w, w)[:, :, None]  # w: dropped
    sink_slot = jnp.where((positions >= 0) & (positions < s), positions, s)[:, :, None]
    dtype = window.k_ring.dtype
    out = window.replace(k_ring=window.k_ring.at[bi, hi, ring_slot].set(k.astype(dtype), mode="drop"),
                         v_ring=window.v_ring.at[bi, hi, ring_slot].set(v.astype(dtype), mode="drop"),
                         maw=window.maw.at[bi, hi, ring_slot].set(0.0, mode="drop"))
    if s:
        out = out.replace(sink_k=window.sink_k.at[bi, hi, sink_slot].set(k.astype(dtype), mode="drop"),
                          sink_v=window.sink_v.at[bi, hi, sink_slot].set(v.astype(dtype), mode="drop"))
    return out


def slot_positions(cfg: OffloadConfig, lengths: jax.Array, offloaded: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Absolute position of every sink and ring slot: ([B, S], [B, W]) int32, -1 where empty."""
    e = offloaded.astype(jnp.int32)
    ring_len, ring_start, sink_len = ring_meta(cfg, lengths, e)
    s, w = cfg.sink, cfg.ring_capacity
    sink_pos = jnp.where(jnp.arange(s)[None, :] < sink_len[:, None], jnp.arange(s)[None, :], -1)
    logical = (jnp.arange(w)[None, :] - ring_start[:, None]) % w  # 0 = oldest ring token
    ring_pos = jnp.where(logical < ring_len[:, None], s + e[:, None] * cfg.block_size + logical, -1)
    return sink_pos.astype(jnp.int32), ring_pos.astype(jnp.int32)


def update_maw(cfg: OffloadConfig, maw: jax.Array, probs: jax.Array, active: jax.Array) -> jax.Array:
    """A = (1 - alpha) A + alpha A_new for rows with a new token; probs [B, Hkv, W] float32."""
    new = (1.0 - cfg.alpha) * maw + cfg.alpha * probs.astype(jnp.float32)
    return jnp.where(active[:, None, None], new, maw)


def decode_attention(cfg: OffloadConfig, q: jax.Array, window: Window, lengths: jax.Array,
                     offloaded: jax.Array, scale: float):
    """Decode (T = 1): the Pallas window kernel over sinks + ring -> (o [B, 1, Hq, D] float32,
    lse [B, 1, Hq] float32, probs [B, Hkv, W] float32 per ring slot, summed over the group)."""
    ring_len, ring_start, sink_len = ring_meta(cfg, lengths, offloaded)
    sinks = dict(sink_k=window.sink_k, sink_v=window.sink_v, sink_lengths=sink_len) if cfg.sink else {}
    return window_attention(q, window.k_ring, window.v_ring, ring_len, ring_start, scale=scale,
                            return_probs=True, backend=cfg.kernel_backend, **sinks)


def exact_window_attention(cfg: OffloadConfig, q: jax.Array, window: Window, positions: jax.Array,
                           lengths: jax.Array, offloaded: jax.Array, scale: float):
    """Causal attention of q [B, T, Hq, D] over the sinks + ring by absolute positions (plain jnp).

    The prefill / append path: exact for any chunk, ragged rows and chunks that overlap the sinks.
    Returns (o [B, T, Hq, D] float32, lse [B, T, Hq] float32, probs [B, Hkv, W] float32: each ring
    slot's probability summed over the group's query heads, averaged over the row's valid queries).
    """
    b, t, hq, d = q.shape
    sink_pos, ring_pos = slot_positions(cfg, lengths, offloaded)
    keys = jnp.concatenate([window.sink_k, window.k_ring], axis=2)  # [B, Hkv, S + W, D]
    values = jnp.concatenate([window.sink_v, window.v_ring], axis=2)
    key_pos = jnp.concatenate([sink_pos, ring_pos], axis=1)  # [B, S + W]
    hkv = keys.shape[1]
    g = hq // hkv
    qg = q.reshape(b, t, hkv, g, d)
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, keys, preferred_element_type=jnp.float32) * scale
    visible = (key_pos[:, None, :] >= 0) & (key_pos[:, None, :] <= positions[:, :, None]) \
        & (positions[:, :, None] >= 0)  # [B, T, S + W]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(scores - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    o = jnp.einsum("bkgts,bksd->btkgd", p, values.astype(jnp.float32))
    lse = jnp.transpose((jnp.log(denom) + m)[..., 0], (0, 3, 1, 2)).reshape(b, t, hq)
    n_valid = jnp.maximum(jnp.sum(positions >= 0, axis=1), 1).astype(jnp.float32)
    probs = jnp.sum(p[..., cfg.sink:], axis=(2, 3)) / n_valid[:, None, None]  # [B, Hkv, W]
    return o.reshape(b, t, hq, d), lse, probs
