"""Device meshes for tensor parallelism ("tp": KV heads, MLP columns, vocabulary) and sequence
parallelism ("seq": a prompt's tokens), with the checks that make a bad mesh a one-line error."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

TP, SEQ = "tp", "seq"


def _devices(n: int, devices=None) -> list:
    devices = list(devices if devices is not None else jax.devices())
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"parallel degree {n!r}: expected a positive int")
    if n > len(devices):
        raise ValueError(f"a mesh of {n} devices, but only {len(devices)} are visible "
                         f"({devices[0].platform}); on CPU, XLA_FLAGS=--xla_force_host_platform_device_count={n}")
    return devices[:n]


def tensor_mesh(tp: int, model_config, devices=None) -> Mesh:
    """A 1-D mesh ("tp",) of `tp` devices for `model_config`: every device holds whole KV heads."""
    hkv = model_config.num_kv_heads
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tensor-parallel degree {tp!r}: expected a positive int")
    if tp > hkv:
        raise ValueError(f"tensor-parallel degree {tp} > the model's {hkv} KV heads: each device needs a "
                         "whole KV head (expected a divisor of the KV heads)")
    if hkv % tp:
        raise ValueError(f"tensor-parallel degree {tp} does not divide the model's {hkv} KV heads "
                         f"(expected one of {[d for d in range(1, hkv + 1) if hkv % d == 0]})")
    if model_config.mlp_dim % tp:
        raise ValueError(f"tensor-parallel degree {tp} does not divide the MLP width {model_config.mlp_dim}")
    return Mesh(_devices(tp, devices), (TP,))


def sequence_mesh(n: int, devices=None) -> Mesh:
    """A 1-D mesh ("seq",) of n devices over which a prompt's tokens are split (ring prefill)."""
    return Mesh(_devices(n, devices), (SEQ,))


def place(value, sharding: NamedSharding) -> jax.Array:
    """`value` (the same on every process) as a global array with `sharding`: each process supplies
    the shards of its addressable devices (single process: a device_put)."""
    if isinstance(value, jax.Array) and value.sharding.is_equivalent_to(sharding, value.ndim):
        return value  # placed already (e.g. a tensor-parallel backend's own cache arrays)
    if jax.process_count() == 1:
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


__all__ = ["tensor_mesh", "sequence_mesh", "place", "TP", "SEQ"]
