"""GGUF files (llama.cpp) through the `gguf` package: config, dequantised weights, tokenizer data.

llama.cpp's converter permutes the rows of attn_q / attn_k so that RoPE pairs are interleaved
((2i, 2i+1) instead of HF's (i, i + D/2)). We un-permute them on load, so a GGUF model runs with
the same rotate-half RoPE as its Hugging Face original (and the two give the same logits).
"""

from __future__ import annotations

import os

import numpy as np

from jhybrid.loading.params import ParamSource, build_model, transpose
from jhybrid.models.config import ModelConfig
from jhybrid.models.decoder import CausalLM

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "gemma3")
# llama.cpp's Gemma 3 graph: every 6th layer is global, sliding layers use RoPE theta 10k.
_GEMMA3_SLIDING_PATTERN, _GEMMA3_LOCAL_THETA = 6, 10000.0


def open_gguf(path: str):
    """A gguf.GGUFReader with file errors that name the path."""
    import gguf

    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: GGUF file not found")
    try:
        return gguf.GGUFReader(path)
    except Exception as error:  # the reader raises ValueError/IndexError on short files
        raise ValueError(f"{path}: cannot read GGUF file ({type(error).__name__}: {error}); "
                         "is it truncated or not a GGUF file?") from error


def field(reader, key: str, default=None):
    """A metadata value (scalar, string or list), or default when the key is absent."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(reader, path: str) -> ModelConfig:
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; supported: "
                         f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError(f"{path}: rope_freqs (llama3 RoPE scaling in GGUF) is not supported yet; "
                         "load the Hugging Face folder instead")

    def need(key):
        value = field(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"{path}: GGUF metadata {arch}.{key} is missing")
        return value

    d_model, heads = int(need("embedding_length")), int(need("attention.head_count"))
    tokens = field(reader, "tokenizer.ggml.tokens")
    vocab = field(reader, f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    if vocab is None:
        vocab = next(t for t in reader.tensors if t.name == "token_embd.weight").shape[-1]
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    head_dim = int(field(reader, f"{arch}.attention.key_length") or d_model // heads)
    rotary = int(field(reader, f"{arch}.rope.dimension_count") or head_dim)
    num_layers = int(need("block_count"))
    extra = {}
    if arch == "gemma3":
        extra = dict(
            mlp_type="geglu", qk_norm=True, sandwich_norm=True,
            embed_scale=float(d_model) ** 0.5, query_pre_attn_scalar=float(head_dim),
            sliding_window=int(need("attention.sliding_window")),
            rope_local_theta=_GEMMA3_LOCAL_THETA,
            layer_types=tuple("sliding_attention" if (i + 1) % _GEMMA3_SLIDING_PATTERN
                              else "full_attention" for i in range(num_layers)))
    return ModelConfig(
        family="gemma3" if arch == "gemma3" else "llama",
        vocab_size=int(vocab),
        d_model=d_model,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(field(reader, f"{arch}.attention.head_count_kv") or heads),
        head_dim=head_dim,
        mlp_dim=int(need("feed_forward_length")),
        max_position_embeddings=int(need("context_length")),
        norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rotary_dim=None if rotary == head_dim else rotary,
        qkv_bias=any(t.name == "blk.0.attn_q.bias" for t in reader.tensors),
        tie_embeddings=not has_output,
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        **extra,
    )


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K permutation: rows [H, D/2, 2] (interleaved) -> [H, 2, D/2]."""
    rows = w.shape[0]
    return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def permute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's permutation (HF rotate-half rows -> interleaved); used to write test GGUFs."""
    rows = w.shape[0]
    return (w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def gguf_param_sources(config: ModelConfig) -> dict[tuple, ParamSource]:
    """Our parameter path -> GGUF tensor. Gemma 3: llama.cpp stores its norms as 1 + weight
    already (our convention too) and does not permute Q/K (its RoPE is rotate-half)."""
    gemma = config.family == "gemma3"

    def linear_t(name, heads=None):
        if heads is None or gemma:
            return ParamSource(name, transpose)
        return ParamSource(name, lambda w: transpose(unpermute_rope_rows(w, heads)))

    def rope_bias(name, heads):
        return ParamSource(name, lambda b: unpermute_rope_rows(b, heads))

    sources = {("embed", "embedding"): ParamSource("token_embd.weight"),
               ("final_norm", "scale"): ParamSource("output_norm.weight")}
    if not config.tie_embeddings:
        sources[("lm_head", "kernel")] = linear_t("output.weight")
    for i in range(config.num_layers):
        p, ours = f"blk.{i}", ("layers", i)
        attn = ours + ("attention",)
        sources[ours + ("input_norm", "scale")] = ParamSource(f"{p}.attn_norm.weight")
        sources[ours + ("pre_mlp_norm", "scale")] = ParamSource(f"{p}.ffn_norm.weight")
        sources[attn + ("q_proj", "kernel")] = linear_t(f"{p}.attn_q.weight", config.num_heads)
        sources[attn + ("k_proj", "kernel")] = linear_t(f"{p}.attn_k.weight", config.num_kv_heads)
        sources[attn + ("v_proj", "kernel")] = linear_t(f"{p}.attn_v.weight")
        sources[attn + ("o_proj", "kernel")] = linear_t(f"{p}.attn_output.weight")
        if config.qkv_bias:
            sources[attn + ("q_proj", "bias")] = rope_bias(f"{p}.attn_q.bias", config.num_heads)
            sources[attn + ("k_proj", "bias")] = rope_bias(f"{p}.attn_k.bias", config.num_kv_heads)
            sources[attn + ("v_proj", "bias")] = ParamSource(f"{p}.attn_v.bias")
        if gemma:
            sources[attn + ("q_norm", "scale")] = ParamSource(f"{p}.attn_q_norm.weight")
            sources[attn + ("k_norm", "scale")] = ParamSource(f"{p}.attn_k_norm.weight")
            sources[ours + ("attn_output_norm", "scale")] = ParamSource(f"{p}.post_attention_norm.weight")
            sources[ours + ("mlp_output_norm", "scale")] = ParamSource(f"{p}.post_ffw_norm.weight")
        for ours_name, name in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"),
                                ("down_proj", "ffn_down")):
            sources[ours + ("mlp", ours_name, "kernel")] = linear_t(f"{p}.{name}.weight")
    return sources


def load_gguf_model(path: str, dtype: str | None = None, progress=None, reader=None) -> CausalLM:
    """Loads a llama or gemma3 GGUF (any quantisation gguf can dequantise) as float32 weights."""
    from gguf.quants import dequantize

    reader = reader or open_gguf(path)
    config = gguf_config(reader, path)
    if dtype is not None:
        config = config.replace(dtype=str(dtype))
    tensors = {t.name: t for t in reader.tensors}

    def read(name: str) -> np.ndarray:
        tensor = tensors[name]
        try:
            return dequantize(tensor.data, tensor.tensor_type)
        except Exception as error:
            raise ValueError(f"{path}: cannot dequantise tensor {name} ({error}); "
                             "is the file truncated?") from error

    return build_model(config, gguf_param_sources(config), read, path, param_dtype=dtype,
                       progress=progress)
