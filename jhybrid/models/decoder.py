"""The decoder: DecoderLayer (one transformer block) and CausalLM (embeddings, layers, head).

One set of modules serves every family; ModelConfig's switches pick the norm, MLP, residual layout
and position handling. The cache is an explicit `KVCache` pytree that goes in and comes out of
every call, so a whole step can be jitted with the cache buffers donated.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jhybrid.attention.base import AttentionBackend, LayerContext
from jhybrid.attention.full import FullAttention
from jhybrid.models.config import ModelConfig
from jhybrid.models.layers import MLP, Attention, make_norm


@struct.dataclass
class KVCache:
    """Generation state: one backend-defined cache per layer + tokens held per sequence.

    layers: tuple (num_layers) of backend layer caches (for `full`: {"k", "v"} [B, max_len, Hkv, D];
        for the offloading modes: `jhybrid.hybrid.state.LayerState`).
    lengths: [B] int32, number of tokens each sequence has stored (= next position to write).
    meta: the backend's per-step metadata shared by every layer (None for `full`; the offloading
        modes' `StepMeta`), rebuilt by `backend.before_step`.
    """

    layers: tuple
    lengths: jax.Array
    meta: Any = None

    @property
    def max_len(self) -> int:
        return jax.tree_util.tree_leaves(self.layers)[0].shape[1]


class DecoderLayer(nnx.Module):
    """Attention + MLP with the family's residual layout:
    pre-LN (Llama, OPT, NeoX sequential): h = x + attn(n1(x)); out = h + mlp(n2(h))
    post-LN (OPT-350m style):             h = n1(x + attn(x)); out = n2(h + mlp(h))
    parallel (GPT-NeoX):                  out = x + attn(n1(x)) + mlp(n2(x))
    sandwich (Gemma 3):                   h = x + na(attn(n1(x))); out = h + nm(mlp(n2(h)))
    """

    def __init__(self, config: ModelConfig, layer_idx: int, *, rngs: nnx.Rngs):
        self.config = config
        self.layer_idx = layer_idx
        self.input_norm = make_norm(config, rngs)
        self.attention = Attention(config, layer_idx, rngs=rngs)
        self.pre_mlp_norm = make_norm(config, rngs)
        self.mlp = MLP(config, rngs=rngs)
        self.attn_output_norm = make_norm(config, rngs) if config.sandwich_norm else None
        self.mlp_output_norm = make_norm(config, rngs) if config.sandwich_norm else None

    def attention_input(self, x: jax.Array) -> jax.Array:
        """What the attention projections see: the normed input (or x itself for post-LN)."""
        return self.input_norm(x) if self.config.norm_before else x

    def __call__(self, x, positions, lengths, layer_cache, backend: AttentionBackend, ahead_layer,
                 meta=None, carry=None):
        """-> (output [B, T, d_model], new layer cache, carry for the next layer's attend).

        ahead_layer: the later DecoderLayer whose query the backend asked for (`query_ahead`), or
        None: its query is predicted from this layer's input (its norm + W_q + RoPE applied to x)."""
        config = self.config
        next_query = None
        if ahead_layer is not None:
            next_query = ahead_layer.attention.project_q(ahead_layer.attention_input(x), positions)
        sliding = config.is_sliding_layer(self.layer_idx)
        context = LayerContext(scale=config.attention_scale, num_layers=config.num_layers,
                               sliding_window=config.sliding_window if sliding else None,
                               meta=meta, carry=carry, next_query=next_query,
                               global_layers=config.global_layers if config.sliding_window is not None else None)
        attn, layer_cache, carry = self.attention(self.attention_input(x), positions, lengths, layer_cache,
                                                  backend, context)
        if config.parallel_residual:
            return x + attn + self.mlp(self.pre_mlp_norm(x)), layer_cache, carry
        if not config.norm_before:
            h = self.input_norm(x + attn)
            return self.pre_mlp_norm(h + self.mlp(h)), layer_cache, carry
        if self.attn_output_norm is not None:
            attn = self.attn_output_norm(attn)
        h = x + attn
        mlp = self.mlp(self.pre_mlp_norm(h))
        if self.mlp_output_norm is not None:
            mlp = self.mlp_output_norm(mlp)
        return h + mlp, layer_cache, carry


def kv_from_hidden(layer: DecoderLayer, hidden: jax.Array, positions: jax.Array):
    """Recomputes a layer's K, V from its saved input hidden state (HCache restore).

    layer: the DecoderLayer (NNX modules carry their parameters), e.g. `model.layers[i]`.
    hidden: [B, T, d_model] the layer's input as returned with `return_hidden_states=True`.
    positions: [B, T] int32. Returns k, v [B, T, Hkv, D] exactly as that layer stored them
    (norm, K/V projections with biases, RoPE on k).
    """
    return layer.attention.project_kv(layer.attention_input(hidden), positions)


class CausalLM(nnx.Module):
    """Decoder-only language model.

    Parameters: embed [vocab, d_model] (nnx.Embed), position_embed [max_pos + 2, d_model] (OPT only),
    layers (nnx.List of DecoderLayer), final_norm, lm_head [d_model, vocab] (absent when tied).
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embed = nnx.Embed(config.vocab_size, config.d_model, dtype=config.dtype, rngs=rngs)
        self.position_embed = (
            nnx.Embed(config.max_position_embeddings + config.learned_position_offset,
                      config.d_model, dtype=config.dtype, rngs=rngs)
            if config.position_type == "learned" else None)
        self.layers = nnx.List([DecoderLayer(config, i, rngs=rngs) for i in range(config.num_layers)])
        self.final_norm = make_norm(config, rngs) if config.norm_before else None
        self.lm_head = (
            None if config.tie_embeddings else
            nnx.Linear(config.d_model, config.vocab_size, use_bias=False, dtype=config.dtype,
                       rngs=rngs))

    def init_cache(self, batch_size: int, max_len: int, backend: AttentionBackend | None = None,
                   dtype=None) -> KVCache:
        """An empty cache for `batch_size` sequences of up to `max_len` tokens."""
        backend = backend or FullAttention()
        dtype = dtype or self.config.dtype
        layers = tuple(backend.init_layer_cache(self.config, i, batch_size, max_len, dtype)
                       for i in range(self.config.num_layers))
        return KVCache(layers=layers, lengths=jnp.zeros((batch_size,), jnp.int32),
                       meta=backend.init_meta(batch_size, max_len))

    def hidden_states(self, tokens, positions, cache: KVCache, backend: AttentionBackend | None = None,
                      *, return_hidden_states: bool = False):
        """Runs the decoder without the LM head.

        tokens, positions: [B, T] int32 (position -1 marks padding; see jhybrid.attention.base).
        Returns (final [B, T, d_model] after the final norm, new cache, layer_inputs), with
        layer_inputs [num_layers, B, T, d_model] (each layer's input) or None.
        """
        backend = backend or FullAttention()
        x = self.embed(tokens)
        if self.config.embed_scale is not None:
            x = x * jnp.asarray(self.config.embed_scale, x.dtype)
        if self.position_embed is not None:
            index = jnp.maximum(positions, 0) + self.config.learned_position_offset
            x = x + self.position_embed(index)
        lengths = jnp.maximum(cache.lengths, jnp.max(positions, axis=1) + 1).astype(jnp.int32)
        new_layers, layer_inputs = [], []
        carry = None  # what one layer's attend hands the next (scout's layer-ahead selection)
        for i, layer in enumerate(self.layers):
            layer_inputs.append(x)
            ahead = backend.query_ahead(i, self.config)
            ahead_layer = self.layers[ahead] if ahead is not None else None
            x, layer_cache, carry = layer(x, positions, lengths, cache.layers[i], backend, ahead_layer,
                                          cache.meta, carry)
            new_layers.append(layer_cache)
        if self.final_norm is not None:
            x = self.final_norm(x)
        stacked = jnp.stack(layer_inputs) if return_hidden_states else None
        return x, KVCache(layers=tuple(new_layers), lengths=lengths, meta=cache.meta), stacked

    def logits(self, hidden: jax.Array) -> jax.Array:
        """[..., d_model] -> [..., vocab] float32 (soft-capped when the config says so)."""
        if self.lm_head is None:
            logits = self.embed.attend(hidden).astype(jnp.float32)
        else:
            logits = self.lm_head(hidden).astype(jnp.float32)
        cap = self.config.final_logit_softcap
        return logits if cap is None else cap * jnp.tanh(logits / cap)

    def __call__(self, tokens, positions, cache: KVCache, backend: AttentionBackend | None = None,
                 *, return_hidden_states: bool = False):
        """Returns (logits [B, T, vocab] float32, new cache[, layer_inputs [L, B, T, d_model]])."""
        hidden, cache, layer_inputs = self.hidden_states(
            tokens, positions, cache, backend, return_hidden_states=return_hidden_states)
        if return_hidden_states:
            return self.logits(hidden), cache, layer_inputs
        return self.logits(hidden), cache
