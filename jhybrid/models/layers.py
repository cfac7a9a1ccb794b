"""Building blocks shared by every family: norms, the attention layer, the MLP (Flax NNX)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jhybrid.attention.base import AttentionBackend, LayerContext
from jhybrid.models.config import ModelConfig
from jhybrid.models.rope import apply_rope


def make_norm(config: ModelConfig, rngs: nnx.Rngs, features: int | None = None) -> nnx.Module:
    """RMSNorm (Llama family, Gemma 3) or LayerNorm with bias (OPT, GPT-NeoX).

    Gemma's RMSNorm multiplies by (1 + weight): its loaders store 1 + weight as the scale.
    """
    features = features or config.d_model
    if config.norm_type == "rms":
        return nnx.RMSNorm(features, epsilon=config.norm_eps, dtype=config.dtype, rngs=rngs)
    return nnx.LayerNorm(features, epsilon=config.norm_eps, dtype=config.dtype, rngs=rngs)


class Attention(nnx.Module):
    """Q/K/V/O projections + RoPE; the attention itself is delegated to an AttentionBackend.

    Weights (NNX Linear kernels are [in, out]): q_proj [d_model, Hq*D], k_proj and v_proj
    [d_model, Hkv*D], o_proj [Hq*D, d_model]; biases when the family has them; q_norm and
    k_norm [D] with QK-norm (Gemma 3).
    """

    def __init__(self, config: ModelConfig, layer_idx: int, *, rngs: nnx.Rngs):
        self.config = config
        self.layer_idx = layer_idx
        d, dh = config.d_model, config.head_dim

        def linear(n_in, n_out, bias):
            return nnx.Linear(n_in, n_out, use_bias=bias, dtype=config.dtype, rngs=rngs)

        self.q_proj = linear(d, config.num_heads * dh, config.qkv_bias)
        self.k_proj = linear(d, config.num_kv_heads * dh, config.qkv_bias)
        self.v_proj = linear(d, config.num_kv_heads * dh, config.qkv_bias)
        self.o_proj = linear(config.num_heads * dh, d, config.o_bias)
        self.q_norm = make_norm(config, rngs, dh) if config.qk_norm else None
        self.k_norm = make_norm(config, rngs, dh) if config.qk_norm else None
        # Sliding-window layers of Gemma 3 use their own RoPE theta.
        self.local_rope = config.is_sliding_layer(layer_idx) and config.rope_local_theta is not None

    def _heads(self, x: jax.Array, num_heads: int) -> jax.Array:
        return x.reshape(*x.shape[:2], num_heads, self.config.head_dim)

    def _rotate(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        if self.config.position_type != "rope":
            return x
        return apply_rope(x, positions, self.config, self.local_rope)

    def project_q(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """x: [B, T, d_model] (already normed) -> q [B, T, Hq, D] with RoPE."""
        q = self._heads(self.q_proj(x), self.config.num_heads)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return self._rotate(q, positions)

    def project_kv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x: [B, T, d_model] (already normed) -> k, v [B, T, Hkv, D], RoPE on k."""
        k = self._heads(self.k_proj(x), self.config.num_kv_heads)
        if self.k_norm is not None:
            k = self.k_norm(k)
        k = self._rotate(k, positions)
        v = self._heads(self.v_proj(x), self.config.num_kv_heads)
        return k, v

    def __call__(self, x, positions, lengths, layer_cache, backend: AttentionBackend,
                 context: LayerContext):
        q = self.project_q(x, positions)
        k, v = self.project_kv(x, positions)
        out, layer_cache, carry = backend.attend(self.layer_idx, q, k, v, positions, lengths, layer_cache,
                                                 context)
        return self.o_proj(out.reshape(*out.shape[:2], -1)), layer_cache, carry


class MLP(nnx.Module):
    """Gated (gate_proj, up_proj, down_proj; SiLU = SwiGLU, tanh-GELU = GeGLU) or a two-layer
    ReLU/GELU MLP (fc1, fc2)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.mlp_type = config.mlp_type
        d, f, bias = config.d_model, config.mlp_dim, config.mlp_bias

        def linear(n_in, n_out):
            return nnx.Linear(n_in, n_out, use_bias=bias, dtype=config.dtype, rngs=rngs)

        if config.mlp_type in ("swiglu", "geglu"):
            self.gate_proj, self.up_proj, self.down_proj = linear(d, f), linear(d, f), linear(f, d)
        else:
            self.fc1, self.fc2 = linear(d, f), linear(f, d)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.mlp_type == "swiglu":
            return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
        if self.mlp_type == "geglu":  # HF "gelu_pytorch_tanh"
            return self.down_proj(jax.nn.gelu(self.gate_proj(x), approximate=True) * self.up_proj(x))
        hidden = self.fc1(x)
        # HF "gelu" is the exact erf form.
        hidden = jax.nn.relu(hidden) if self.mlp_type == "relu" else jax.nn.gelu(hidden, approximate=False)
        return self.fc2(hidden)
