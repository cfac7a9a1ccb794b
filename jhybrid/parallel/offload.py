"""The offloading modes under tensor parallelism: every device has its own host side.

A ("tp",) mesh of n devices splits the KV heads into n groups (the Megatron layout of
`jhybrid.parallel.tensor`): device i holds KV heads [i Hkv/n, (i+1) Hkv/n) and their query heads.
Everything of those heads lives with device i: its slice of the GPU window, digests, recall pool
and device copies (the `LayerState` arrays, sharded on their KV-head axis), and a whole
`HybridAttention` host side of its own over Hkv/n heads — host-store shard, eviction, the mode's
host work, native exchange and worker, and 1/n of the host threads. No host state is shared between
shards: each shard is the single-device system on a model of Hkv/n KV heads (docs/design.md,
"Tensor parallelism").

  device side   `ShardedOffload.attend` runs one layer's attend under `shard_map`: q, k, v, the layer
                state and scout's layer-ahead carry split by head, positions and the step metadata
                replicated. The traced host calls carry the shard they come from (callbacks:
                `jax.lax.axis_index`, `exchange.ShardedRuntimes`; native custom calls: routed by the XLA
                device ordinal to that device's exchange, `NativeExchange.route`).
  host side     `before_step` hands each shard's runtime its device's slice of the cache (views, no
                copy), runs the shards' per-step host work in parallel threads and reassembles the
                global arrays from the slices they return (no copy).

    tp = TensorParallel(model, tensor_mesh(2, model.config), make_backend("hgca", window_tokens=4096))
    tp.backend.open(model.config, batch, max_len)      # one host side per device
    cache = tp.init_cache(batch, max_len); step, params = tp.make_step()
    cache = tp.backend.before_step(cache, positions); logits, cache = step(params, tokens, positions, cache)

In a run of several processes (`jax.distributed`) each process builds and serves the shards of its
own devices.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numba
from jax.sharding import NamedSharding, PartitionSpec as P

from jhybrid.attention.base import AttentionBackend, LayerContext
from jhybrid.hybrid.backend import HybridAttention
from jhybrid.hybrid.config import OffloadConfig
from jhybrid.hybrid.exchange import ShardedRuntimes
from jhybrid.hybrid.registry import mode_class
from jhybrid.hybrid.rows import check_rows
from jhybrid.hybrid.sliding import SlidingWindow
from jhybrid.hybrid.state import LayerAhead, LayerState, StepMeta
from jhybrid.hybrid.transfer import device_ordinal
from jhybrid.parallel.mesh import TP, place

HEADS = P(None, None, TP, None)  # q, k, v, o [B, T, H, D]


def head_specs(tree):
    """The PartitionSpecs of a piece of hybrid device state: KV heads over "tp", per-sequence
    bookkeeping replicated. tree: a LayerState, SlidingWindow, LayerAhead (its ticket as a [tp]
    array, one per shard), StepMeta or None (arrays or ShapeDtypeStructs)."""
    if tree is None:
        return None
    if isinstance(tree, SlidingWindow):  # k, v [B, W, Hkv, D]; positions [B, W]
        return SlidingWindow(k=HEADS, v=HEADS, positions=P())
    if isinstance(tree, LayerState):  # every array [B | B*R, Hkv, ...] but DeviceCopy.n_valid [B]
        return jax.tree_util.tree_map(lambda x: P(None, TP) if len(x.shape) >= 2 else P(), tree)
    if isinstance(tree, LayerAhead):  # Selection arrays [B, Hkv, ...]
        return LayerAhead(selection=jax.tree_util.tree_map(lambda x: P(None, TP), tree.selection), ticket=P(TP))
    if isinstance(tree, StepMeta):
        return jax.tree_util.tree_map(lambda x: P(), tree)
    raise TypeError(f"no tensor-parallel layout for {type(tree).__name__}")


def cache_specs(cache):
    """PartitionSpecs of a whole hybrid `KVCache` (layers by head, lengths and meta replicated)."""
    return cache.replace(layers=tuple(head_specs(layer) for layer in cache.layers), lengths=P(),
                         meta=head_specs(cache.meta))


def _is_spec(x) -> bool:
    return isinstance(x, P)


class ShardedOffload(AttentionBackend):
    """An offloading mode over the devices of a ("tp",) mesh (see the module docstring). Built by
    `TensorParallel` from a `HybridAttention`; `shards[i]` is mesh position i's own backend (the
    positions of this process's devices)."""

    handles_long_context = True
    reuses_rows = True

    def __init__(self, config: OffloadConfig, mesh):
        if not mode_class(config.mode).offloads:
            raise ValueError(f"mode {config.mode!r} needs no per-device host side; TensorParallel runs it directly")
        self.config, self.mesh, self.tp = config, mesh, mesh.shape[TP]
        self.name = config.mode
        devices = list(mesh.devices.flat)
        self.devices = {i: d for i, d in enumerate(devices) if d.process_index == jax.process_index()}
        threads = config.host_threads or max(1, numba.config.NUMBA_NUM_THREADS - 1)
        shard_config = dataclasses.replace(config, host_threads=max(1, threads // len(self.devices)))
        self.shards = {i: HybridAttention(shard_config) for i in self.devices}
        transports = {shard.native is not None for shard in self.shards.values()}
        if len(transports) != 1:
            raise RuntimeError("tensor-parallel hybrid backend: the native exchange loaded for some shards only")
        if transports == {False}:  # every shard on the callback transport: so must the template be
            shard_config = dataclasses.replace(shard_config, host_exchange="callback")
        # The device-side template: the traced attend of every shard, its host calls routed by shard.
        handles = ShardedRuntimes(TP, {i: shard._handle for i, shard in self.shards.items()})
        self.template = HybridAttention(shard_config, handles)
        if (self.template.native is not None) != (transports == {True}):
            raise RuntimeError("tensor-parallel hybrid backend: the shards and their device-side template would use "
                               "different exchange transports")
        if self.template.native is not None:
            for i, shard in self.shards.items():
                self.template.native.route(device_ordinal(self.devices[i]), shard.native)
        self._pool: ThreadPoolExecutor | None = None
        self._opened = False

    # ---- host side --------------------------------------------------------------------------------
    def local_config(self, config):
        """The model as one shard sees it: Hq / tp query heads and Hkv / tp KV heads."""
        hq, hkv = config.num_heads, config.num_kv_heads
        if hkv % self.tp or hq % self.tp:
            raise ValueError(f"tensor-parallel degree {self.tp} does not divide the model's {hkv} KV heads / "
                             f"{hq} query heads (expected a divisor of both)")
        return config.replace(num_heads=hq // self.tp, num_kv_heads=hkv // self.tp)

    def open(self, config, batch_size, max_len, dtype=None):
        local = self.local_config(config)
        self.close()
        for i, shard in self.shards.items():
            shard.open(local, batch_size, max_len, dtype, device=self.devices[i])
        self._pool = ThreadPoolExecutor(len(self.shards), thread_name_prefix="jhybrid-tp-host")
        self._opened = True
        return self

    def close(self):
        for shard in self.shards.values():
            shard.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._opened = False

    @property
    def runtimes(self) -> dict:
        """Mesh position -> that shard's HostRuntime (None before open)."""
        return {i: shard.runtime for i, shard in self.shards.items()}

    def before_step(self, cache, positions):
        if not self._opened:
            raise RuntimeError("tensor-parallel hybrid backend: call backend.open(model_config, batch, max_len) "
                               "before stepping")
        if positions.shape[1] == 1:  # decisions a single device takes over all its heads: over every shard
            hosts = [shard.runtime.mode_host for _, shard in sorted(self.shards.items())]
            type(hosts[0]).coordinate(hosts)
        pieces = {i: self._slice(cache, device) for i, device in self.devices.items()}
        futures = {i: self._pool.submit(shard.before_step, pieces[i], positions) for i, shard in self.shards.items()}
        return self._assemble({i: future.result() for i, future in futures.items()})

    def reset_rows(self, cache, rows):
        """Every shard empties the rows (`HybridAttention.reset_rows`: its host side, and its device's
        slice of the cache) in parallel; the global arrays are reassembled from the slices (no copy)."""
        if not self._opened:
            raise RuntimeError("tensor-parallel hybrid backend: call backend.open(model_config, batch, max_len) "
                               "before reset_rows")
        rows = check_rows(rows, cache.lengths.shape[0])
        if rows.size == 0:
            return cache
        pieces = {i: self._slice(cache, device) for i, device in self.devices.items()}
        futures = {i: self._pool.submit(shard.reset_rows, pieces[i], rows) for i, shard in self.shards.items()}
        return self._assemble({i: future.result() for i, future in futures.items()})

    def _slice(self, cache, device):
        """The cache as `device` holds it: each array's shard on that device (no copy)."""
        def local(x):
            for shard in x.addressable_shards:
                if shard.device == device:
                    return shard.data
            raise ValueError(f"a cache array of sharding {x.sharding} has no shard on {device}")
        return jax.tree_util.tree_map(local, cache)

    def _assemble(self, pieces: dict):
        """Global arrays from the shards' caches (same structure; KV-head axes concatenated)."""
        order = sorted(pieces)
        specs = cache_specs(pieces[order[0]])

        def build(spec, *parts):
            shape = list(parts[0].shape)
            if TP in spec:
                shape[spec.index(TP)] *= self.tp
            return jax.make_array_from_single_device_arrays(tuple(shape), NamedSharding(self.mesh, spec), list(parts))

        return jax.tree_util.tree_map(build, specs, *(pieces[i] for i in order), is_leaf=_is_spec)

    @property
    def max_prefill_chunk(self) -> int:
        return self.template.max_prefill_chunk

    def counters(self) -> dict:
        """The shards' counters: seconds are the slowest shard's (shards work in parallel); bytes,
        tokens and rows are summed over the shards; event counts (n_*: evicted blocks, steps, recalls
        of a layer, ...) are the largest shard's (evictions and steps happen on every shard alike; a
        layer's recall moves rows on the shards whose heads need them)."""
        per_shard = [shard.counters() for _, shard in sorted(self.shards.items())]
        if not per_shard or not per_shard[0]:
            return {}
        out = {}
        for key in per_shard[0]:
            values = [c.get(key, 0) for c in per_shard]
            summed = key.startswith("bytes") or "tokens" in key or key.endswith("_rows")
            out[key] = sum(values) if summed else max(values)
        return out

    def query_ahead(self, layer_idx, config):
        return self.template.query_ahead(layer_idx, config)

    def reset_counters(self) -> None:
        for shard in self.shards.values():
            shard.reset_counters()

    def host_bytes(self) -> int:
        return sum(shard.host_bytes() for shard in self.shards.values())

    def selections(self, cache):
        return self.template.selections(cache)

    def row_fields(self) -> dict:
        """The mode's columns, with what the hosts measured averaged over the shards."""
        per_shard = [shard.row_fields() for _, shard in sorted(self.shards.items())]
        out = dict(per_shard[0])
        for key, value in out.items():
            if isinstance(value, float):
                out[key] = round(sum(f[key] for f in per_shard) / len(per_shard), 4)
        return out

    # ---- device side ------------------------------------------------------------------------------
    def _place(self, tree):
        return jax.tree_util.tree_map(lambda spec, x: place(x, NamedSharding(self.mesh, spec)), head_specs(tree),
                                      tree, is_leaf=_is_spec)

    def init_meta(self, batch_size, max_len):
        return self._place(self.template.init_meta(batch_size, max_len))

    def init_layer_cache(self, config, layer_idx, batch_size, max_len, dtype):
        self.local_config(config)  # the divisibility check, before anything is allocated
        return self._place(self.template.init_layer_cache(config, layer_idx, batch_size, max_len, dtype))

    def attend(self, layer_idx, q, k, v, positions, lengths, layer_cache, context: LayerContext):
        template = self.template

        def body(q, k, v, positions, lengths, state, meta, carry, next_query):
            if carry is not None:  # one ticket per shard: [1] here
                carry = carry._replace(ticket=carry.ticket[0])
            local = dataclasses.replace(context, meta=meta, carry=carry, next_query=next_query)
            o, state, carry = template.attend(layer_idx, q, k, v, positions, lengths, state, local)
            if carry is not None:
                carry = carry._replace(ticket=jnp.reshape(carry.ticket, (1,)))
            return o, state, carry

        args = (q, k, v, positions, lengths, layer_cache, context.meta, context.carry, context.next_query)
        in_specs = (HEADS, HEADS, HEADS, P(), P(), head_specs(layer_cache), head_specs(context.meta),
                    head_specs(context.carry), None if context.next_query is None else HEADS)
        # The outputs' structure (scout hands a carry on from some layers only) from an abstract trace.
        probe = jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=P(), check_vma=False)
        o, state, carry = jax.eval_shape(probe, *args)
        out_specs = (HEADS, head_specs(state), head_specs(carry))
        return jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)


__all__ = ["ShardedOffload", "head_specs", "cache_specs"]
