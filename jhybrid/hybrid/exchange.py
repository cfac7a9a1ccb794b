"""Device side of the host exchange: what a traced decode step calls to reach the host.

`CallbackExchange` traces `jax.pure_callback`s with small operands only (queries float32
[B, Tq, Hq, D], block ids int32 [B, Hkv, k], int32 tickets, and "dependency" arrays that only
order a collect after the GPU work producing them; KV never crosses). Each callback finds the host
side (`host.bridge.HostBridge`) through the backend's `HostSlot` when it RUNS, not when it is traced,
so a compiled step keeps working when the host runtime is reopened for a new batch.

Protocol, per layer (docs/design.md, "One decode step"):
    ticket = submit(layer, kind, q[, ids])      # the CPU starts on q
    q = after(q, ticket)                        # GPU work on q is ordered after the submit ...
    ... GPU window attention ...                # ... and runs while the CPU works
    o, lse = collect(ticket, q.shape, lse_gpu)  # waits for the CPU part, after the GPU part
`exchange` collects one layer and submits the next in one host visit (scout's layer-ahead
pipelining); `attend_now` computes synchronously; `record_tail` hands the host a prefill chunk's
last queries (hgca's re-evaluation) when no attention call carries them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


class HostSlot:
    """Where a traced step finds its host runtime when it runs. A backend owns one slot for its
    lifetime; `open` puts a runtime in it, `close` takes it out."""

    def __init__(self):
        self.runtime = None

    def bridge(self):
        if self.runtime is None:
            raise RuntimeError("hybrid backend: the host side is not open (call backend.open(...) before "
                               "running a step)")
        return self.runtime.bridge


def _partial_shapes(q_shape):
    b, t, hq, d = q_shape
    return (jax.ShapeDtypeStruct((b, t, hq, d), jnp.float32), jax.ShapeDtypeStruct((b, t, hq), jnp.float32))


def after(x, token):
    """x, ordered after the computation of `token` (an optimization barrier ties them)."""
    x, _ = jax.lax.optimization_barrier((x, token))
    return x


class CallbackExchange:
    """The exchange through `jax.pure_callback` (works on every backend). `kind` is the host
    attention kind: "context" (hgca's kept tokens), "all" (every offloaded token), "blocks"."""

    def __init__(self, slot: HostSlot):
        self.slot = slot

    def submit(self, layer: int, kind: str, q: jax.Array, block_ids: jax.Array | None = None):
        """Queue host attention of q [B, Tq, Hq, D]; returns an int32 ticket (scalar)."""
        slot = self.slot
        args = (q.astype(jnp.float32),) + (() if block_ids is None else (block_ids.astype(jnp.int32),))
        return jax.pure_callback(lambda *a: slot.bridge().cb_submit(layer, kind, *a),
                                 jax.ShapeDtypeStruct((), jnp.int32), *args)

    def collect(self, ticket: jax.Array, q_shape, *dependencies):
        """(o float32 [B, Tq, Hq, D], lse float32 [B, Tq, Hq]) of a ticket, after `dependencies`."""
        slot = self.slot
        return jax.pure_callback(lambda t, *deps: slot.bridge().cb_collect(t), _partial_shapes(q_shape),
                                 ticket, *dependencies)

    def attend_now(self, layer: int, kind: str, q: jax.Array, block_ids: jax.Array | None = None):
        """Synchronous host attention inside one callback -> (o, lse)."""
        slot = self.slot
        args = (q.astype(jnp.float32),) + (() if block_ids is None else (block_ids.astype(jnp.int32),))
        return jax.pure_callback(lambda *a: slot.bridge().cb_attend_now(layer, kind, *a),
                                 _partial_shapes(q.shape), *args)

    def exchange(self, ticket: jax.Array, q_shape, kind: str, next_layer: int | None,
                 next_q: jax.Array | None, next_ids: jax.Array | None, *dependencies):
        """One host visit: collect `ticket` and submit next_layer's work (layer-ahead pipelining).
        Returns (o, lse, next ticket int32; 0 when next_layer is None)."""
        slot = self.slot
        shapes = _partial_shapes(q_shape) + (jax.ShapeDtypeStruct((), jnp.int32),)
        if next_layer is None:
            return jax.pure_callback(lambda t, *deps: slot.bridge().cb_exchange(None, kind, t), shapes,
                                     ticket, *dependencies)
        return jax.pure_callback(
            lambda t, nq, ni, *deps: slot.bridge().cb_exchange(next_layer, kind, t, nq, ni), shapes,
            ticket, next_q.astype(jnp.float32), next_ids.astype(jnp.int32), *dependencies)

    def record_tail(self, layer: int, q: jax.Array, positions: jax.Array, keep: int):
        """Hand the host the last `keep` valid queries of each row of a chunk (hgca's re-evaluation
        queries) when no host attention call carries them: tail [B, keep, Hq, D] float32, row b's
        query at valid position p - keep + j in tail[b, j] (earlier slots repeat query 0; the host
        reads the last min(keep, valid) of them). Returns an int32 token to tie into the step's
        outputs (a pure callback whose result is unused would be dropped)."""
        valid = jnp.sum(positions >= 0, axis=1)  # [B]
        idx = jnp.clip(valid[:, None] - keep + jnp.arange(keep)[None, :], 0, q.shape[1] - 1)  # [B, keep]
        tail = jnp.take_along_axis(q, idx[:, :, None, None], axis=1).astype(jnp.float32)
        slot = self.slot
        return jax.pure_callback(lambda t, v: slot.bridge().cb_record_tail(layer, t, v),
                                 jax.ShapeDtypeStruct((), jnp.int32), tail, valid.astype(jnp.int32))


__all__ = ["HostSlot", "CallbackExchange", "after"]
