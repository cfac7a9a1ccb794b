"""Device side of the host exchange: `jax.pure_callback` wrappers with small operands only.

Each function traces one callback into the jitted step. The callback looks the `host.bridge.
HostBridge` up through `get_bridge()` at run time (not at trace time), so a compiled step keeps
working when the runtime is rebuilt for a new batch. Operands: queries float32 [B, Tq, Hq, D],
block ids int32 [B, Hkv, k], tickets int32 scalars, and "dependency" arrays that only order a
collect after the GPU work producing them (they are not read on the host).

Ordering: `after(x, token)` returns x through an optimization barrier together with a callback
result, so GPU work that consumes the returned x cannot be scheduled before that callback.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def _partial_shapes(q_shape):
    b, t, hq, d = q_shape
    return (jax.ShapeDtypeStruct((b, t, hq, d), jnp.float32), jax.ShapeDtypeStruct((b, t, hq), jnp.float32))


def after(x, token):
    """x, ordered after the computation of `token` (an optimization barrier ties them)."""
    x, _ = jax.lax.optimization_barrier((x, token))
    return x


def submit(get_bridge: Callable, layer: int, mode: str, q: jax.Array, block_ids: jax.Array | None = None):
    """Queue host attention of q [B, Tq, Hq, D]; returns an int32 ticket (scalar)."""
    args = (q.astype(jnp.float32),) + (() if block_ids is None else (block_ids.astype(jnp.int32),))
    return jax.pure_callback(lambda *a: get_bridge().cb_submit(layer, mode, *a),
                             jax.ShapeDtypeStruct((), jnp.int32), *args)


def collect(get_bridge: Callable, ticket: jax.Array, q_shape, *dependencies):
    """(o float32 [B, Tq, Hq, D], lse float32 [B, Tq, Hq]) of a ticket, after `dependencies`."""
    return jax.pure_callback(lambda t, *deps: get_bridge().cb_collect(t), _partial_shapes(q_shape),
                             ticket, *dependencies)


def attend_now(get_bridge: Callable, layer: int, mode: str, q: jax.Array, block_ids: jax.Array | None = None):
    """Synchronous host attention inside one callback -> (o, lse)."""
    args = (q.astype(jnp.float32),) + (() if block_ids is None else (block_ids.astype(jnp.int32),))
    return jax.pure_callback(lambda *a: get_bridge().cb_attend_now(layer, mode, *a),
                             _partial_shapes(q.shape), *args)


def exchange(get_bridge: Callable, ticket: jax.Array, q_shape, mode: str, next_layer: int | None,
             next_q: jax.Array | None, next_ids: jax.Array | None, *dependencies):
    """One host visit: collect `ticket` and submit next_layer's work (layer-ahead pipelining).
    Returns (o, lse, next ticket int32; 0 when next_layer is None)."""
    shapes = _partial_shapes(q_shape) + (jax.ShapeDtypeStruct((), jnp.int32),)
    if next_layer is None:
        return jax.pure_callback(lambda t, *deps: get_bridge().cb_exchange(None, mode, t), shapes,
                                 ticket, *dependencies)
    return jax.pure_callback(
        lambda t, nq, ni, *deps: get_bridge().cb_exchange(next_layer, mode, t, nq, ni), shapes,
        ticket, next_q.astype(jnp.float32), next_ids.astype(jnp.int32), *dependencies)


def record_tail(get_bridge: Callable, layer: int, q: jax.Array, positions: jax.Array, keep: int):
    """Hand the host the last `keep` valid queries of each row of a chunk (hgca's re-evaluation
    queries) when no host attention call carries them: tail [B, keep, Hq, D] float32, row b's
    query at valid position p - keep + j in tail[b, j] (earlier slots repeat query 0; the host
    reads the last min(keep, valid) of them). Returns an int32 token to tie into the step's outputs
    (a pure callback whose result is unused would be dropped)."""
    valid = jnp.sum(positions >= 0, axis=1)  # [B]
    idx = jnp.clip(valid[:, None] - keep + jnp.arange(keep)[None, :], 0, q.shape[1] - 1)  # [B, keep]
    tail = jnp.take_along_axis(q, idx[:, :, None, None], axis=1).astype(jnp.float32)
    return jax.pure_callback(lambda t, v: get_bridge().cb_record_tail(layer, t, v),
                             jax.ShapeDtypeStruct((), jnp.int32), tail, valid.astype(jnp.int32))
