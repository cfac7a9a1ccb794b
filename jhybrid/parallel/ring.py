"""Ring-attention prefill (context parallelism): one long prompt split over the devices of a
("seq",) mesh, exact against chunked prefill, its KV then handed to any mode's decode layout.

Each device holds a contiguous slice of the prompt (front-padded with position -1 to a multiple of
the device count, so the last device ends on the prompt's last token) and runs every per-token part
of the model (embedding, norms, projections, MLP) on it. Attention is the only part that needs
other tokens: `ring_attention` attends the local queries over the local K/V, then passes the K/V
block (and its positions) to the next device of the ring (`jax.lax.ppermute`) n - 1 times, merging
the n partial states exactly (`jhybrid.merge`, natural-log LSE, float32). Masks come from global
positions, so causality, padding and sliding windows hold across devices.

    logits, cache = ring_prefill_cache(model, backend, prompt_ids, sequence_mesh(2), max_len)

hands the K/V to `full` (a dense cache) or to an offloading mode through the HCache ingest path
(`jhybrid.hybrid.ingest.HybridCacheWriter`: GPU window + host store, hgca re-scored with the
prompt's last queries), for one sequence. Every device computes all n blocks, including those a
causal mask hides entirely (no load balancing such as zig-zag ordering yet).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jhybrid.attention.base import AttentionBackend, LayerContext
from jhybrid.attention.full import FullAttention, masked_attention
from jhybrid.merge import merge_partials
from jhybrid.parallel.mesh import SEQ


def ring_attention(q, k, v, positions, scale: float, axis_name: str, axis_size: int, sliding_window=None):
    """Inside `shard_map` over `axis_name` (axis_size devices): causal GQA attention of this device's
    queries q [B, T, Hq, D] over every device's keys. k, v [B, T, Hkv, D] and positions [B, T] int32
    (global; -1 = padding) are this device's. Returns o [B, T, Hq, D] in q's dtype (0 for padding)."""
    perm = [(j, (j + 1) % axis_size) for j in range(axis_size)]
    o = jnp.zeros(q.shape, jnp.float32)
    lse = jnp.full(q.shape[:3], -jnp.inf, jnp.float32)
    keys, values, key_positions = k, v, positions
    for step in range(axis_size):
        o_i, lse_i = masked_attention(q.astype(jnp.float32), keys, values, positions, None, scale, sliding_window,
                                      key_positions=key_positions)
        o, lse = merge_partials([o, o_i], [lse, lse_i], out_dtype=jnp.float32)
        if step + 1 < axis_size:
            keys, values, key_positions = jax.lax.ppermute((keys, values, key_positions), axis_name, perm)
    return jnp.where((positions >= 0)[:, :, None, None], o, 0.0).astype(q.dtype)


class RingAttention(AttentionBackend):
    """The backend of a ring prefill, used inside `shard_map`: attends by `ring_attention` and
    returns this step's k, v (and the last `keep_queries` queries, for hgca's re-scoring) as the
    layer's cache."""

    name = "ring"

    def __init__(self, axis_name: str, axis_size: int, keep_queries: int = 0):
        self.axis_name, self.axis_size, self.keep_queries = axis_name, axis_size, keep_queries

    def __eq__(self, other):
        return isinstance(other, RingAttention) and (other.axis_name, other.axis_size, other.keep_queries) == (
            self.axis_name, self.axis_size, self.keep_queries)

    def __hash__(self):
        return hash((RingAttention, self.axis_name, self.axis_size, self.keep_queries))

    def init_layer_cache(self, config, layer_idx, batch_size, max_len, dtype):
        return {}

    def attend(self, layer_idx, q, k, v, positions, lengths, layer_cache, context: LayerContext):
        o = ring_attention(q, k, v, positions, context.scale, self.axis_name, self.axis_size, context.sliding_window)
        cache = {"k": k, "v": v}
        if self.keep_queries:
            cache["q"] = q[:, -self.keep_queries:]
        return o, cache, None


@functools.lru_cache(maxsize=8)
def _ring_fn(graphdef, mesh, n_layers: int, keep_queries: int):
    n = mesh.shape[SEQ]
    backend = RingAttention(SEQ, n, keep_queries)

    def local(state, tokens, positions):
        from jhybrid.models.decoder import KVCache

        model = nnx.merge(graphdef, state)
        cache = KVCache(layers=tuple({} for _ in range(n_layers)), lengths=jnp.zeros(tokens.shape[:1], jnp.int32))
        hidden, cache, _ = model.hidden_states(tokens, positions, cache, backend)
        k = jnp.stack([layer["k"] for layer in cache.layers])  # [L, B, t, Hkv, D]
        v = jnp.stack([layer["v"] for layer in cache.layers])
        q = jnp.stack([layer["q"] for layer in cache.layers]) if keep_queries else jnp.zeros((n_layers, 0))
        return hidden, k, v, q

    q_spec = P(None, None, SEQ) if keep_queries else P()
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(None, SEQ), P(None, SEQ)),
                                 out_specs=(P(None, SEQ), P(None, None, SEQ), P(None, None, SEQ), q_spec),
                                 check_vma=False))


def ring_prefill(model, tokens, mesh, keep_queries: int = 0):
    """Prefill tokens [B, T] int32 split over the ("seq",) mesh. Returns (logits of the last prompt
    token [B, V] float32, k, v [L, B, T, Hkv, D] of every layer, and the last `keep_queries` queries
    of every layer [L, B, keep_queries, Hq, D] or None)."""
    tokens = np.asarray(tokens, np.int32)
    if tokens.ndim != 2 or tokens.shape[1] == 0:
        raise ValueError(f"tokens of shape {tokens.shape}; expected [B, T] with T >= 1")
    n = mesh.shape[SEQ]
    batch, t = tokens.shape
    local = -(-t // n)
    pad = local * n - t  # at the front: the last device ends on the last prompt token
    if keep_queries > local:
        raise ValueError(f"keep_queries={keep_queries} > the {local} tokens each of the {n} devices holds")
    positions = np.concatenate([np.full((batch, pad), -1, np.int32), np.broadcast_to(np.arange(t, dtype=np.int32),
                                                                                    (batch, t))], axis=1)
    padded = np.concatenate([np.zeros((batch, pad), np.int32), tokens], axis=1)
    graphdef, state = nnx.split(model)
    hidden, k, v, q = _ring_fn(graphdef, mesh, model.config.num_layers, keep_queries)(state, padded, positions)
    logits = model.logits(hidden[:, -1])
    queries = q[:, :, -keep_queries:] if keep_queries else None
    return logits, k[:, :, pad:], v[:, :, pad:], queries


def ring_prefill_cache(model, backend, prompt, mesh, max_len: int):
    """Ring-prefill one prompt (a list / [T] of ids) and hand its KV to `backend`'s decode layout:
    a `full` cache, or an opened offloading mode's window + host store (HCache ingest path).
    Returns (logits of the last prompt token [1, V] float32, the KVCache on the default device)."""
    tokens = np.asarray(prompt, np.int32).reshape(1, -1)
    t = tokens.shape[1]
    if t > max_len:
        raise ValueError(f"a prompt of {t} tokens does not fit max_len={max_len}")
    if backend is None or isinstance(backend, FullAttention):
        logits, k, v, _ = ring_prefill(model, tokens, mesh)
        cache = model.init_cache(1, max_len, FullAttention())
        device = jax.devices()[0]
        layers = tuple({"k": layer["k"].at[:, :t].set(jax.device_put(k[i], device).astype(layer["k"].dtype)),
                        "v": layer["v"].at[:, :t].set(jax.device_put(v[i], device).astype(layer["v"].dtype))}
                       for i, layer in enumerate(cache.layers))
        return logits, cache.replace(layers=layers, lengths=jnp.full((1,), t, jnp.int32))
    from jhybrid.hybrid.ingest import HybridCacheWriter
    from jhybrid.parallel.offload import ShardedOffload

    if isinstance(backend, ShardedOffload):
        raise ValueError("ring_prefill_cache hands the prompt's KV to one device's backend; handing it to a "
                         "tensor-parallel offloading backend is not supported (prefill through TensorParallel's "
                         "step instead)")
    writer = HybridCacheWriter(model, backend, max_len, t)
    keep = min(writer.num_queries, -(-t // mesh.shape[SEQ]))
    logits, k, v, q = ring_prefill(model, tokens, mesh, keep_queries=keep)
    device = jax.devices()[0]
    for layer in range(model.config.num_layers):
        if keep:
            writer.queries(layer, jax.device_put(q[layer], device))
        writer(layer, jax.device_put(k[layer], device), jax.device_put(v[layer], device))
    return logits, writer.finish()


__all__ = ["ring_attention", "RingAttention", "ring_prefill", "ring_prefill_cache"]
