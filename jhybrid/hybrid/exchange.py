"""Device side of the host exchange: what a traced step calls to reach the host.

Protocol, per layer (docs/design.md, "One decode step"):
    ticket = submit(layer, target, q[, ids])           # the CPU starts on q (target: host.targets)
    q = after(q, ticket)                               # GPU work on q is ordered after the submit ...
    ... GPU window attention ...                       # ... and runs while the CPU works
    o, lse = collect(layer, ticket, q.shape, lse_gpu)  # the CPU part, ordered after the GPU part
`collect_and_submit` collects one layer and submits the next (scout's layer-ahead pipelining);
`attend_now` computes synchronously; `record_tail` hands the mode's host part a prefill chunk's last
queries (hgca's re-evaluation: `ModeHost.receive_queries`). Operands are small: queries float32
[B, Tq, Hq, D], block ids int32 [B, Hkv, k], int32 tickets, and "dependency" arrays that only order
a call after the GPU work producing them; KV never crosses.

Two transports with that interface:
  FfiExchange       decode steps through XLA FFI custom calls into the native library
                    (host/native/exchange.cc): stream-ordered copies and flags, no Python, no stream
                    synchronisation; the host worker is host.exchange_worker. Everything else
                    (prefill chunks, attend_now, record_tail) goes through its CallbackExchange.
  CallbackExchange  `jax.pure_callback`s into host.bridge.HostBridge (works everywhere; on a GPU
                    each callback stalls the stream and takes the GIL).
Both find the host side through the backend's `RuntimeHandle` when they RUN, not when they are
traced, so a compiled step keeps working when the host runtime is reopened for a new batch.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)


class RuntimeHandle:
    """Where a traced step finds its host runtime when it runs. A backend owns one handle for its
    lifetime; `open` puts a runtime in it, `close` takes it out."""

    axis = None  # a single runtime: host calls carry no shard index

    def __init__(self):
        self.runtime = None

    def open_runtime(self, shard: int | None = None):
        if self.runtime is None:
            raise RuntimeError("hybrid backend: the host side is not open (call backend.open(...) before "
                               "running a step)")
        return self.runtime


class ShardedRuntimes:
    """Tensor parallelism (`jhybrid.parallel.offload`): the same traced step runs on every device of
    a mesh axis, and each device's host calls must reach that device's own runtime. The calls pass
    their position on `axis` (`jax.lax.axis_index`) and find the runtime in `handles[position]`
    (the positions whose device this process owns)."""

    def __init__(self, axis: str, handles: dict[int, RuntimeHandle]):
        self.axis, self.handles = axis, dict(handles)

    def open_runtime(self, shard: int | None = None):
        handle = self.handles.get(-1 if shard is None else int(shard))
        if handle is None:
            raise RuntimeError(f"tensor-parallel host call from shard {shard}: this process holds the runtimes "
                               f"of shards {sorted(self.handles)} only")
        return handle.open_runtime()


def _partial_shapes(q_shape):
    b, t, hq, d = q_shape
    return (jax.ShapeDtypeStruct((b, t, hq, d), jnp.float32), jax.ShapeDtypeStruct((b, t, hq), jnp.float32))


def after(x, token):
    """x, ordered after the computation of `token` (an optimization barrier ties them)."""
    x, _ = jax.lax.optimization_barrier((x, token))
    return x


class CallbackExchange:
    """The exchange through `jax.pure_callback` (works on every backend). `target` is what the host
    attends (`host.targets`: hgca's kept tokens, every offloaded token, chosen blocks)."""

    def __init__(self, handle: RuntimeHandle | ShardedRuntimes):
        self.handle = handle

    def _call(self, fn, shapes, *args):
        """jax.pure_callback of fn(runtime, *args) on the runtime this device's call belongs to
        (under tensor parallelism, its shard's: `ShardedRuntimes`)."""
        handle = self.handle
        if handle.axis is None:
            return jax.pure_callback(lambda *a: fn(handle.open_runtime(), *a), shapes, *args)
        shard = jax.lax.axis_index(handle.axis).astype(jnp.int32)
        return jax.pure_callback(lambda s, *a: fn(handle.open_runtime(int(s)), *a), shapes, shard, *args)

    def submit(self, layer: int, target, q: jax.Array, block_ids: jax.Array | None = None,
               rows: jax.Array | None = None):
        """Queue host attention of q [B, Tq, Hq, D] over `target`; returns an int32 ticket (scalar).
        rows [B] bool (optional): the rows with a query in the step; the host attends only those
        (the others get o = 0, lse = -inf: a prefill chunk's rows that do not prefill)."""
        has_ids, has_rows = block_ids is not None, rows is not None
        args = ((q.astype(jnp.float32),) + ((block_ids.astype(jnp.int32),) if has_ids else ())
                + ((rows.astype(jnp.bool_),) if has_rows else ()))

        def fn(runtime, queries, *rest):
            return runtime.bridge.cb_submit(layer, target, queries, rest[0] if has_ids else None,
                                            rest[-1] if has_rows else None)
        return self._call(fn, jax.ShapeDtypeStruct((), jnp.int32), *args)

    def collect(self, layer: int, ticket: jax.Array, q_shape, *dependencies):
        """(o float32 [B, Tq, Hq, D], lse float32 [B, Tq, Hq]) of a ticket, after `dependencies`."""
        return self._call(lambda runtime, t, *deps: runtime.bridge.cb_collect(t), _partial_shapes(q_shape),
                          ticket, *dependencies)

    def attend_now(self, layer: int, target, q: jax.Array, block_ids: jax.Array | None = None):
        """Synchronous host attention inside one callback -> (o, lse)."""
        args = (q.astype(jnp.float32),) + (() if block_ids is None else (block_ids.astype(jnp.int32),))
        return self._call(lambda runtime, *a: runtime.bridge.cb_attend_now(layer, target, *a),
                          _partial_shapes(q.shape), *args)

    def collect_and_submit(self, layer: int, ticket: jax.Array, q_shape, target, next_layer: int | None,
                           next_q: jax.Array | None, next_ids: jax.Array | None, *dependencies):
        """One host visit: collect `ticket` (of `layer`) and submit next_layer's work (layer-ahead
        pipelining). Returns (o, lse, next ticket int32; 0 when next_layer is None)."""
        shapes = _partial_shapes(q_shape) + (jax.ShapeDtypeStruct((), jnp.int32),)
        if next_layer is None:
            return self._call(lambda runtime, t, *deps: runtime.bridge.cb_collect_and_submit(None, target, t),
                              shapes, ticket, *dependencies)
        return self._call(lambda runtime, t, nq, ni, *deps: runtime.bridge.cb_collect_and_submit(
            next_layer, target, t, nq, ni), shapes, ticket, next_q.astype(jnp.float32), next_ids.astype(jnp.int32),
            *dependencies)

    def record_tail(self, layer: int, q: jax.Array, positions: jax.Array, keep: int):
        """Hand the mode's host part the last `keep` valid queries of each row of a chunk (hgca's
        re-evaluation queries, `ModeHost.receive_queries`): tail [B, keep, Hq, D] float32, row b's
        query at valid position p - keep + j in tail[b, j] (earlier slots repeat query 0; the host
        reads the last min(keep, valid) of them). Returns an int32 token to tie into the step's
        outputs (a pure callback whose result is unused would be dropped)."""
        valid = jnp.sum(positions >= 0, axis=1)  # [B]
        idx = jnp.clip(valid[:, None] - keep + jnp.arange(keep)[None, :], 0, q.shape[1] - 1)  # [B, keep]
        tail = jnp.take_along_axis(q, idx[:, :, None, None], axis=1).astype(jnp.float32)

        def receive(runtime, t, v):
            runtime.bridge.cb_guard(runtime.mode_host.receive_queries, layer, np.array(t, np.float32),
                                    np.array(v, np.int64))
            return np.int32(0)

        return self._call(receive, jax.ShapeDtypeStruct((), jnp.int32), tail, valid.astype(jnp.int32))



# ---- the native transport ------------------------------------------------------------------------
SUBMIT, COLLECT = "jh_exchange_submit", "jh_exchange_collect"
_registered: set[str] = set()  # platforms whose FFI targets are registered in this process


def register_ffi_targets(lib, platform: str) -> None:
    """Register the native handlers for `platform` ("cpu" or "gpu") once per process."""
    if platform in _registered:
        return
    if platform == "cpu":
        handlers, xla_platform = (lib.JhExchangeSubmitCpu, lib.JhExchangeCollectCpu), "cpu"
    else:
        handlers, xla_platform = (lib.JhExchangeSubmitGpu, lib.JhExchangeCollectGpu), "CUDA"
    for name, handler in zip((SUBMIT, COLLECT), handlers):
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(handler), platform=xla_platform)
    _registered.add(platform)


class FfiExchange:
    """Decode steps (Tq = 1) through the native library's custom calls; prefill chunks, attend_now
    (hgca without host_overlap) and record_tail through `self.fallback` (a CallbackExchange). `exchange_id` is the
    backend's reserved native exchange (host.exchange_worker.NativeExchange); under tensor
    parallelism the library routes each device's calls to that device's exchange by its XLA device
    ordinal (`NativeExchange.route`)."""

    def __init__(self, handle: RuntimeHandle | ShardedRuntimes, exchange_id: int):
        self.handle, self.id = handle, int(exchange_id)
        self.fallback = CallbackExchange(handle)

    def _attrs(self, layer: int) -> dict:
        return {"exchange": np.int64(self.id), "slot": np.int64(layer)}  # "slot": the layer's mailbox

    def submit(self, layer: int, target, q: jax.Array, block_ids: jax.Array | None = None,
               rows: jax.Array | None = None):
        """Decode: the native worker attends what the mode's `exchange_pages` gives it (`target` is
        the mode's host_target); prefill chunks go through the callback fallback (with `rows`)."""
        if q.shape[1] != 1:
            return self.fallback.submit(layer, target, q, block_ids, rows)
        args = (q.astype(jnp.float32),) + (() if block_ids is None else (block_ids.astype(jnp.int32),))
        # Not marked side-effecting: every result is consumed (the ticket by the barrier and the
        # collect, the collect's outputs by the merge) and each call's (slot, operands) are unique in
        # a step, so XLA neither drops nor merges them; data dependencies order them. (A
        # side-effecting call would make JAX track a runtime token per dispatch.)
        return jax.ffi.ffi_call(SUBMIT, jax.ShapeDtypeStruct((), jnp.int32))(*args, **self._attrs(layer))

    def collect(self, layer: int, ticket: jax.Array, q_shape, *dependencies):
        if q_shape[1] != 1:
            return self.fallback.collect(layer, ticket, q_shape, *dependencies)
        return tuple(jax.ffi.ffi_call(COLLECT, _partial_shapes(q_shape))(ticket, *dependencies, **self._attrs(layer)))

    def collect_and_submit(self, layer: int, ticket: jax.Array, q_shape, target, next_layer: int | None,
                           next_q: jax.Array | None, next_ids: jax.Array | None, *dependencies):
        """Submit next_layer first (its CPU work starts during this layer's wait), then collect."""
        if q_shape[1] != 1:
            return self.fallback.collect_and_submit(layer, ticket, q_shape, target, next_layer, next_q, next_ids,
                                                    *dependencies)
        if next_layer is None:
            o, lse = self.collect(layer, ticket, q_shape, *dependencies)
            return o, lse, jnp.int32(0)
        next_ticket = self.submit(next_layer, target, next_q, next_ids)
        o, lse = self.collect(layer, ticket, q_shape, next_ticket, *dependencies)
        return o, lse, next_ticket

    def attend_now(self, layer: int, target, q: jax.Array, block_ids: jax.Array | None = None):
        return self.fallback.attend_now(layer, target, q, block_ids)

    def record_tail(self, layer: int, q: jax.Array, positions: jax.Array, keep: int):
        return self.fallback.record_tail(layer, q, positions, keep)


__all__ = ["RuntimeHandle", "ShardedRuntimes", "CallbackExchange", "FfiExchange", "register_ffi_targets", "after"]
