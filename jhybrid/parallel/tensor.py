"""Tensor parallelism in the Megatron layout, by sharding annotations (GSPMD inserts the
collectives: one all-reduce after each attention output projection and after each MLP).

  q/k/v projections, gate/up (fc1)   columns sharded: each device computes whole heads / MLP columns
  o projection, down (fc2)            rows sharded: partial sums, all-reduced
  embedding [V, d], LM head [d, V]    vocabulary sharded (replicated when V does not divide)
  norms, biases of row-sharded layers replicated
  `full` cache {"k", "v"} [B, L, Hkv, D]   sharded by KV head
  offloading modes                          every LayerState array sharded by KV head, one host side
                                            per device (`jhybrid.parallel.offload.ShardedOffload`)

    tp = TensorParallel(model, tensor_mesh(2, model.config))      # or (..., backend=make_backend("hgca", ...))
    tp.backend.open(model.config, batch, max_len)                  # host side per device (no-op for full)
    step, params = tp.make_step()             # jitted, parameters placed on the mesh
    cache = tp.init_cache(batch, max_len)     # KV heads sharded
    cache = tp.backend.before_step(cache, positions)               # per-step host work (no-op for full)
    logits, cache = step(params, tokens, positions, cache)
"""

from __future__ import annotations

import logging

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jhybrid.attention.full import FullAttention
from jhybrid.hybrid.backend import HybridAttention
from jhybrid.parallel.mesh import TP, place
from jhybrid.parallel.offload import ShardedOffload, cache_specs

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


class TensorParallel:
    """A model placed over a ("tp",) mesh. backend: `full` (default) or an offloading mode's
    backend (`make_backend(...)`), which becomes a `ShardedOffload` over the mesh (`self.backend`)."""

    def __init__(self, model, mesh, backend=None):
        backend = backend or FullAttention()
        tp = mesh.shape[TP]
        if isinstance(backend, HybridAttention):
            backend = ShardedOffload(backend.config, mesh)
        elif not isinstance(backend, (FullAttention, ShardedOffload)):
            raise ValueError(f"tensor parallelism runs `full` or an offloading mode's backend, not {backend.name!r}")
        if isinstance(backend, ShardedOffload) and backend.mesh is not mesh:
            raise ValueError("the tensor-parallel backend was built for another mesh")
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
        spec = param_spec(_path_names(path), leaf.shape, self.tp) if getattr(leaf, "ndim", 0) else P()
        return place(leaf, NamedSharding(self.mesh, spec))

    def _cache_specs(self, cache):
        if isinstance(self.backend, FullAttention):
            kv = P(None, None, TP, None)
            return cache.replace(layers=tuple({name: kv for name in layer} for layer in cache.layers), lengths=P())
        return cache_specs(cache)

    def init_cache(self, batch: int, max_len: int):
        """An empty cache with every KV-head axis sharded over the mesh."""
        cache = self.model.init_cache(batch, max_len, self.backend)
        return jax.tree_util.tree_map(lambda spec, x: place(x, NamedSharding(self.mesh, spec)),
                                      self._cache_specs(cache), cache, is_leaf=lambda x: isinstance(x, P))

    def make_step(self):
        """(step, params): `logits, cache = step(params, tokens, positions, cache)`, jitted with the
        cache donated; logits [B, T, V] float32 replicated, the cache keeps its sharding."""
        graphdef, backend, mesh = self.graphdef, self.backend, self.mesh
        replicated = NamedSharding(mesh, P())

        def step(params, tokens, positions, cache):
            logits, cache = nnx.merge(graphdef, params)(tokens, positions, cache, backend)
            cache = jax.tree_util.tree_map(
                lambda spec, x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec)),
                self._cache_specs(cache), cache, is_leaf=lambda x: isinstance(x, P))
            return jax.lax.with_sharding_constraint(logits, replicated), cache

        return jax.jit(step, donate_argnums=(3,)), self.params


def _path_names(path) -> tuple:
    """A parameter's path in the model's state as names and indices ('layers', 0, 'mlp', 'up_proj',
    'kernel'). The attribute steps (flax's Variable `.value`) are left out: counted as names they made
    every parameter's module 'kernel' and so replicated the whole model on every device."""
    return tuple(k.key if isinstance(k, jax.tree_util.DictKey) else k.idx
                 for k in path if isinstance(k, (jax.tree_util.DictKey, jax.tree_util.SequenceKey)))


def random_sharded_model(config, seed: int, mesh):
    """A random-weight model of `config` whose parameters are created on `mesh` already sharded in
    the Megatron layout and in config.dtype: no device (nor the host) ever holds a whole copy, so a
    shape larger than one device (the Llama-3.1-70B shape on two 80 GiB GPUs) can be built.

    The values are not create_model's (that would need the whole model first): kernels and
    embeddings ~ N(0, 1/fan_in) drawn per leaf on the mesh, norm scales 1, biases 0 — random weights
    for throughput, not for comparing against another build of the same seed."""
    import jax.numpy as jnp

    from jhybrid.models import create_model

    abstract = nnx.eval_shape(lambda: create_model(config, seed=seed))
    graphdef, state = nnx.split(abstract)
    tp, dtype = mesh.shape[TP], jnp.dtype(config.dtype)
    key = jax.random.key(seed)
    drawn = 0  # leaves drawn so far: each draws from its own key

    def build(path, leaf):
        names = [n for n in _path_names(path) if isinstance(n, str)]
        sharding = NamedSharding(mesh, param_spec(_path_names(path), leaf.shape, tp))
        kind = names[-1] if names else ""
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            return jax.jit(lambda: jnp.zeros(leaf.shape, leaf.dtype), out_shardings=sharding)()
        if kind in ("scale", "bias") or len(leaf.shape) < 2:
            fill = 1.0 if kind == "scale" else 0.0
            return jax.jit(lambda: jnp.full(leaf.shape, fill, dtype), out_shardings=sharding)()
        nonlocal drawn
        std = 1.0 / float(np.sqrt(leaf.shape[0] if kind == "kernel" else leaf.shape[1]))
        leaf_key, drawn = jax.random.fold_in(key, drawn), drawn + 1
        draw = jax.jit(lambda k: (std * jax.random.normal(k, leaf.shape, jnp.float32)).astype(dtype),
                       out_shardings=sharding)
        return draw(leaf_key)

    params = jax.tree_util.tree_map_with_path(build, state)
    return nnx.merge(graphdef, params)


__all__ = ["TensorParallel", "param_spec", "random_sharded_model"]
