"""Sliding-window layers under the offloading modes: their last W tokens stay on the GPU.

A sliding-window layer (Gemma 3's local layers) attends only to keys less than W = sliding_window
positions before each query, so nothing it will read again ever leaves its window: every
offloading mode keeps such a layer's last W tokens in a device ring (`SlidingWindow`) and offloads
nothing. Only the model's global layers get a GPU window + host store; `HybridAttention` runs them
as offloaded layers 0 .. G-1 (`LayerPlan`), so the host side (store, eviction, exchange, the
modes' layer-ahead hand-over) sees a model of G layers and never a sliding one.

Attention over the ring is exact: the keys are the ring (the W tokens before this step) and this
step's own tokens, masked by position (`masked_attention` with explicit key positions), so a
prefill chunk of any length sees, for each query, exactly the keys `full` shows it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from jhybrid.attention.full import masked_attention


@struct.dataclass
class SlidingWindow:
    """The device state of one sliding-window layer.

    k, v       [B, W, Hkv, D] model dtype; the token at position p lives in slot p % W
    positions  [B, W] int32 the position held by each slot (-1: empty)
    """

    k: jax.Array
    v: jax.Array
    positions: jax.Array


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """Which of a model's layers the offloading modes offload.

    global_layers: the model indices of the layers that attend the whole context; offloaded layer g
    is model layer global_layers[g]. Every other layer is a sliding-window layer.
    """

    num_layers: int
    global_layers: tuple[int, ...]

    @classmethod
    def of(cls, config) -> "LayerPlan":
        """The plan of a `ModelConfig`; a clear error when no layer attends the whole context."""
        plan = cls(config.num_layers, config.global_layers)
        if not plan.global_layers:
            raise ValueError(f"every layer of this model is a sliding-window layer (window {config.sliding_window}): "
                             "there is no KV to offload; use mode 'full'")
        return plan

    @property
    def mixed(self) -> bool:
        """True when some layers are sliding-window layers."""
        return len(self.global_layers) != self.num_layers

    def offloaded_index(self, layer: int) -> int | None:
        """Offloaded layer number of model layer `layer`; None for a sliding-window layer."""
        try:
            return self.global_layers.index(layer)
        except ValueError:
            return None

    def offloaded_view(self, config):
        """The ModelConfig the host side is built for: the global layers only, none sliding."""
        if not self.mixed:
            return config
        return config.replace(num_layers=len(self.global_layers), layer_types=None, sliding_window=None)

    def offloaded_layers(self, cache):
        """The KVCache with only the offloaded layers' states (what `HostRuntime` steps)."""
        if not self.mixed:
            return cache
        return cache.replace(layers=tuple([cache.layers[i] for i in self.global_layers]))

    def merge(self, cache, offloaded):
        """`cache` with its offloaded layers' states, lengths and meta taken from `offloaded`."""
        if not self.mixed:
            return offloaded
        layers = list(cache.layers)
        for g, i in enumerate(self.global_layers):
            layers[i] = offloaded.layers[g]
        return offloaded.replace(layers=tuple(layers))


def init_sliding(batch: int, window: int, num_kv_heads: int, head_dim: int, dtype) -> SlidingWindow:
    """An empty ring of `window` slots per sequence."""
    shape = (batch, window, num_kv_heads, head_dim)
    return SlidingWindow(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                         positions=jnp.full((batch, window), -1, jnp.int32))


def write_sliding(state: SlidingWindow, k: jax.Array, v: jax.Array, positions: jax.Array) -> SlidingWindow:
    """Writes this step's k, v [B, T, Hkv, D] at positions [B, T] (-1: padding) into the ring:
    only each sequence's last W tokens are written (an earlier token's slot is taken by a later
    one of the same step), so no two writes of a sequence hit one slot."""
    window = state.k.shape[1]
    last = jnp.max(positions, axis=1, keepdims=True)  # [B, 1]
    keep = (positions >= 0) & (positions > last - window)
    slot = jnp.where(keep, positions % window, window)  # out of bounds -> dropped
    rows = jnp.arange(positions.shape[0])[:, None]
    return SlidingWindow(k=state.k.at[rows, slot].set(k.astype(state.k.dtype), mode="drop"),
                         v=state.v.at[rows, slot].set(v.astype(state.v.dtype), mode="drop"),
                         positions=state.positions.at[rows, slot].set(positions, mode="drop"))


def sliding_attention(state: SlidingWindow, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
                      sliding_window: int, scale: float) -> tuple[jax.Array, SlidingWindow]:
    """Attends q [B, T, Hq, D] over the ring and this step's k, v [B, T, Hkv, D] (keys within
    `sliding_window` positions of each query, causal), then writes k, v into the ring.
    Returns o [B, T, Hq, D] in q's dtype (zero for padding queries) and the new state."""
    keys = jnp.concatenate([state.k, k.astype(state.k.dtype)], axis=1)
    values = jnp.concatenate([state.v, v.astype(state.v.dtype)], axis=1)
    key_positions = jnp.concatenate([state.positions, positions], axis=1)
    o, _ = masked_attention(q, keys, values, positions, None, scale, sliding_window, key_positions=key_positions)
    return o, write_sliding(state, k, v, positions)


__all__ = ["SlidingWindow", "LayerPlan", "init_sliding", "write_sliding", "sliding_attention"]
