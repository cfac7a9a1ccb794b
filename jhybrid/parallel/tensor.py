"""Tensor parallelism in the Megatron layout, by sharding annotations (GSPMD inserts the
collectives: one all-reduce after each attention output projection and after each MLP).

  q/k/v projections, gate/up (fc1)   columns sharded: each device computes whole heads / MLP columns
  o projection, down (fc2)            rows sharded: partial sums, all-reduced
  embedding [V, d], LM head [d, V]    vocabulary sharded (replicated when V does not divide)
  norms, biases of row-sharded layers replicated
  `full` cache {"k", "v"} [B, L, Hkv, D]   sharded by KV head

    tp = TensorParallel(model, tensor_mesh(2, model.config))
    step, params = tp.make_step()             # jitted, parameters placed on the mesh
    cache = tp.init_cache(batch, max_len)     # KV heads sharded
    logits, cache = step(params, tokens, positions, cache)

Only `full` runs tensor-parallel so far: the offloading modes' host stores, exchange and digests
are per device in the design (issue "Scale out") but not built; `TensorParallel` refuses them.
"""

from __future__ import annotations

import logging

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jhybrid.attention.full import FullAttention
from jhybrid.parallel.mesh import TP

log = logging.getLogger(__name__)

COLUMN = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "fc1"}  # outputs sharded
ROW = {"o_proj", "down_proj", "fc2"}  # inputs sharded


def param_spec(path: tuple, shape: tuple, tp: int) -> P:
    """The PartitionSpec of one parameter, from its path in the model's state."""
    names = [p for p in path if isinstance(p, str)]
    module, leaf = (names[-2] if len(names) > 1 else ""), names[-1]
    if module in COLUMN:
        return P(None, TP) if leaf == "kernel" else P(TP)
    if module in ROW:
        return P(TP, None) if leaf == "kernel" else P()
    if module == "embed" and leaf == "embedding":
        return P(TP, None) if shape[0] % tp == 0 else P()
    if module == "lm_head" and leaf == "kernel":
        return P(None, TP) if shape[1] % tp == 0 else P()
    return P()


def place(value, sharding: NamedSharding) -> jax.Array:
    """`value` (the same on every process) as a global array with `sharding`: each process supplies
    the shards of its addressable devices (single process: a device_put)."""
    if jax.process_count() == 1:
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


class TensorParallel:
    """A model placed over a ("tp",) mesh. backend: `full` only (see the module docstring)."""

    def __init__(self, model, mesh, backend=None):
        backend = backend or FullAttention()
        tp = mesh.shape[TP]
        if not isinstance(backend, FullAttention) and tp > 1:
            raise ValueError(f"tensor parallelism (degree {tp}) runs mode 'full' only so far; mode "
                             f"{backend.name!r} needs per-device host stores, which are not built yet")
        self.model, self.mesh, self.backend, self.tp = model, mesh, backend, tp
        self.graphdef, state = nnx.split(model)
        self.params = jax.tree_util.tree_map_with_path(self._place, state)
        vocab = model.config.vocab_size
        if vocab % tp:
            log.warning("vocabulary of %d does not divide over %d devices: embedding and LM head replicated",
                        vocab, tp)

    def _place(self, path, leaf):
        """One parameter on the mesh; each process puts only the shards of its own devices (the same
        values everywhere: every process loaded the same weights)."""
        keys = tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path)
        spec = param_spec(keys, leaf.shape, self.tp) if getattr(leaf, "ndim", 0) else P()
        return place(leaf, NamedSharding(self.mesh, spec))

    def cache_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P(None, None, TP, None))

    def init_cache(self, batch: int, max_len: int):
        """An empty `full` cache with its K, V sharded by KV head."""
        cache = self.model.init_cache(batch, max_len, self.backend)
        sharding = self.cache_sharding()
        layers = tuple({name: place(x, sharding) for name, x in layer.items()} for layer in cache.layers)
        replicated = NamedSharding(self.mesh, P())
        return cache.replace(layers=layers, lengths=place(cache.lengths, replicated))

    def make_step(self):
        """(step, params): `logits, cache = step(params, tokens, positions, cache)`, jitted with the
        cache donated; logits [B, T, V] float32 replicated, the cache keeps its sharding."""
        graphdef, backend = self.graphdef, self.backend
        kv, replicated = self.cache_sharding(), NamedSharding(self.mesh, P())

        def step(params, tokens, positions, cache):
            logits, cache = nnx.merge(graphdef, params)(tokens, positions, cache, backend)
            layers = tuple({name: jax.lax.with_sharding_constraint(x, kv) for name, x in layer.items()}
                           for layer in cache.layers)
            return jax.lax.with_sharding_constraint(logits, replicated), cache.replace(layers=layers)

        return jax.jit(step, donate_argnums=(3,)), self.params


__all__ = ["TensorParallel", "param_spec"]
