"""What one sequence of a mode costs in device and host memory, from the layouts the code allocates.

Device bytes come from the shapes the mode's backend allocates (`jax.eval_shape` of every layer's
`init_layer_cache`, the step metadata and the lengths: nothing is allocated and nothing is
rebuilt by hand), so a new LayerState group or a new mode is counted the day it exists. Host bytes
come from the host store's own slot layout (`host.kv_store.block_nbytes`,
`host.context_cache.page_nbytes`) and the mode (`OffloadMode.host_bytes_per_sequence`).

    per_seq, fixed = device_bytes(config, model_config, max_len)      # config resolved (a window)
    host = host_bytes_per_sequence(config, model_config, context, max_len, Workload(kept_share=0.4))
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from host import StoreConfig
from host.context_cache import page_nbytes
from host.kv_store import block_nbytes
from jhybrid.hybrid.backend import make_backend
from jhybrid.hybrid.config import OffloadConfig
from jhybrid.hybrid.modes.base import HostLayout, Workload
from jhybrid.hybrid.registry import mode_class
from jhybrid.hybrid.runtime import store_kv_dtype
from jhybrid.hybrid.window import evicted_blocks


def _tree_bytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))


def cache_bytes(backend, model_config, batch: int, max_len: int, dtype=None) -> int:
    """Device bytes of `model.init_cache(batch, max_len, backend)`: every layer's state, the step
    metadata and the int32 lengths (shapes only)."""
    dtype = dtype or model_config.dtype

    def build():
        layers = tuple(backend.init_layer_cache(model_config, i, batch, max_len, dtype)
                       for i in range(model_config.num_layers))
        return layers, backend.init_meta(batch, max_len), jnp.zeros((batch,), jnp.int32)

    return _tree_bytes(jax.eval_shape(build))


@functools.lru_cache(maxsize=256)
def device_bytes(config: OffloadConfig, model_config, max_len: int) -> tuple[int, int]:
    """(bytes per sequence, bytes independent of the batch) of the device cache of `config` (a
    resolved config) for contexts of up to max_len tokens: fitted exactly through batches 1 and 2."""
    backend = make_backend(config)
    one, two = (cache_bytes(backend, model_config, b, max_len) for b in (1, 2))
    return two - one, 2 * one - two


@functools.lru_cache(maxsize=256)
def step_rebuilt_bytes(config: OffloadConfig, model_config, max_len: int) -> int:
    """Device bytes per sequence a step start builds anew while the previous step's copy still exists
    (`OffloadMode.rebuilt_each_step`, e.g. recall's upload of the offloaded KV)."""
    mode = mode_class(config.mode)(config)
    if not mode.rebuilt_each_step:
        return 0
    n_global = len(model_config.global_layers)
    groups = jax.eval_shape(lambda: mode.layer_state(0, n_global, 1, model_config.num_kv_heads,
                                                     model_config.head_dim, max_len, model_config.dtype))
    return n_global * sum(_tree_bytes(groups[name]) for name in mode.rebuilt_each_step)


def host_layout(config: OffloadConfig, model_config) -> HostLayout:
    """The host store's layout for this model and config (its format: config.host_kv_dtype, else
    the model's)."""
    store = StoreConfig(n_layers=len(model_config.global_layers), n_kv_heads=model_config.num_kv_heads,
                        head_dim=model_config.head_dim, block_size=config.block_size,
                        kv_dtype=store_kv_dtype(config, model_config.dtype))
    return HostLayout(n_layers=store.n_layers, block_bytes=block_nbytes(store), n_kv_heads=store.n_kv_heads,
                      head_dim=store.head_dim, dtype=jnp.dtype(model_config.dtype).name,
                      page_tokens=store.context_page_tokens, page_bytes=page_nbytes(store))


def host_bytes_per_sequence(config: OffloadConfig, model_config, context: int, max_len: int,
                            workload: Workload = Workload()) -> int:
    """Host bytes one sequence of `context` tokens holds in a resolved config's mode (0 for modes
    that offload nothing)."""
    mode = mode_class(config.mode)(config)
    if not mode.offloads:
        return 0
    offloaded = int(evicted_blocks(np.int64(context), config))
    return mode.host_bytes_per_sequence(host_layout(config, model_config), offloaded, max_len, workload)


__all__ = ["cache_bytes", "device_bytes", "step_rebuilt_bytes", "host_layout", "host_bytes_per_sequence"]
