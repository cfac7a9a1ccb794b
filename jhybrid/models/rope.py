"""Rotary position embeddings (RoPE): frequencies (plain and llama3-scaled) and their application.

Two pairings exist in the wild: Hugging Face checkpoints rotate dimension i with i + R/2
("rotate-half"), llama.cpp/GGUF and Meta's original code rotate (2i, 2i+1) ("interleaved").
The GGUF loader un-permutes Q/K rows so both sources end up rotate-half; `interleaved=True` is
there for weights kept in the interleaved layout.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jhybrid.models.config import ModelConfig


def inverse_frequencies(config: ModelConfig, local: bool = False) -> np.ndarray:
    """[rotary_dims // 2] float32 angular frequencies, llama3 scaling applied when configured.

    local: a sliding-window layer of a model with its own local theta (Gemma 3); no scaling.
    """
    dim = config.rotary_dims
    theta = config.rope_local_theta if local and config.rope_local_theta else config.rope_theta
    inv_freq = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    scaling = config.rope_scaling_dict
    if scaling is None or (local and config.rope_local_theta):
        return inv_freq.astype(np.float32)
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, config: ModelConfig,
               local: bool = False) -> jnp.ndarray:
    """Rotates the first `config.rotary_dims` features of every head.

    x: [B, T, H, D]; positions: [B, T] int32 (padding positions < 0 are harmless).
    Returns x with the same shape and dtype; the rotation is computed in float32.
    """
    rot = config.rotary_dims
    inv_freq = jnp.asarray(inverse_frequencies(config, local))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, rot/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x_rot, x_pass = x[..., :rot].astype(jnp.float32), x[..., rot:]
    if config.rope_interleaved:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x_rot.shape)
    else:
        x1, x2 = x_rot[..., : rot // 2], x_rot[..., rot // 2 :]
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return jnp.concatenate([out.astype(x.dtype), x_pass], axis=-1)
