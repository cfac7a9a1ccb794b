"""Known model shapes (for random-weight runs and the KV budget calculator) and model loading.

`model_config_for(name)`: a ModelConfig from a known shape name ('llama3-8b', 'smollm2', 'tiny',
...) or a Hugging Face config.json path. `load_model(spec)`: (model, tokenizer-ish Pretrained or
None) for a ModelSpec: real weights for 'smollm2' / 'gemma3' / a path, random weights for a shape.
"""

from __future__ import annotations

import json
import logging
import os

from jhybrid.models import ModelConfig, create_model
from jhybrid.models.config import from_hf_config

log = logging.getLogger(__name__)

SHAPES = {
    # SmolLM2-135M: 30 layers, 9 query heads, 3 KV heads of 64.
    "smollm2": ModelConfig(family="llama", vocab_size=49152, d_model=576, num_layers=30, num_heads=9,
                           num_kv_heads=3, head_dim=64, mlp_dim=1536, max_position_embeddings=8192,
                           rope_theta=100000.0, tie_embeddings=True),
    # Llama-3-8B: 32 layers, 32 query heads, 8 KV heads of 128 (GQA 4:1).
    "llama3-8b": ModelConfig(family="llama", vocab_size=128256, d_model=4096, num_layers=32,
                             num_heads=32, num_kv_heads=8, head_dim=128, mlp_dim=14336,
                             max_position_embeddings=131072, rope_theta=500000.0, dtype="bfloat16"),
    # Llama-3.1-70B, for the calculator.
    "llama3-70b": ModelConfig(family="llama", vocab_size=128256, d_model=8192, num_layers=80,
                              num_heads=64, num_kv_heads=8, head_dim=128, mlp_dim=28672,
                              max_position_embeddings=131072, rope_theta=500000.0, dtype="bfloat16"),
    # Gemma 3 270M: 18 layers, every 6th global, the others sliding over 512 tokens; one KV head of 256.
    "gemma3-270m": ModelConfig(
        family="gemma3", vocab_size=262144, d_model=640, num_layers=18, num_heads=4, num_kv_heads=1,
        head_dim=256, mlp_dim=2048, max_position_embeddings=32768, mlp_type="geglu", rope_theta=1e6,
        rope_local_theta=1e4, sliding_window=512,
        layer_types=tuple("sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(18)),
        qk_norm=True, sandwich_norm=True, embed_scale=640 ** 0.5, query_pre_attn_scalar=256.0,
        tie_embeddings=True, dtype="bfloat16"),
    # A tiny Gemma-3-like model (sliding, global, sliding, global; window 64) for tests and smoke runs.
    "tiny-gemma3": ModelConfig(
        family="gemma3", vocab_size=97, d_model=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
        mlp_dim=128, max_position_embeddings=4096, mlp_type="geglu", rope_theta=1e6, rope_local_theta=1e4,
        sliding_window=64, layer_types=("sliding_attention", "full_attention") * 2, qk_norm=True,
        sandwich_norm=True, embed_scale=128 ** 0.5, query_pre_attn_scalar=64.0),
    # A tiny random model for tests and smoke runs.
    "tiny": ModelConfig(family="llama", vocab_size=97, d_model=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=64, mlp_dim=128, max_position_embeddings=4096),
}
REAL_WEIGHTS = ("smollm2", "gemma3")


def model_config_for(name: str) -> ModelConfig:
    """ModelConfig of a known shape or of a Hugging Face config.json (file or its folder)."""
    if name in SHAPES:
        return SHAPES[name]
    path = os.path.join(name, "config.json") if os.path.isdir(name) else name
    if os.path.isfile(path) and path.endswith(".json"):
        with open(path) as f:
            return from_hf_config(json.load(f))
    raise ValueError(f"unknown model {name!r}: expected one of {', '.join(SHAPES)} or a config.json path")


def spec_config(spec) -> ModelConfig:
    """The ModelConfig a random-weight ModelSpec builds (shape, dtype, num_layers applied)."""
    config = model_config_for(spec.name)
    if spec.dtype is not None:
        config = config.replace(dtype=spec.dtype)
    if spec.num_layers is not None:
        if spec.num_layers > config.num_layers:
            raise ValueError(f"model.num_layers={spec.num_layers}: {spec.name} has only "
                             f"{config.num_layers} layers")
        layer_types = config.layer_types[:spec.num_layers] if config.layer_types else config.layer_types
        config = config.replace(num_layers=spec.num_layers, layer_types=layer_types)
    return config


def uses_real_weights(spec) -> bool:
    """Real weights for 'smollm2' / 'gemma3' / an existing non-config.json path, unless the spec
    says weights: random; weights: real on a bare shape is an error."""
    real_source = spec.name in REAL_WEIGHTS or (os.path.exists(spec.name) and not spec.name.endswith(".json"))
    if spec.weights == "random":
        return False
    if spec.weights == "real" and not real_source:
        raise ValueError(f"model.weights=real: {spec.name!r} is a shape without weights (known real "
                         f"models: {', '.join(REAL_WEIGHTS)}, or a checkpoint path)")
    return real_source


def check_model_spec(spec) -> None:
    """Fails at once (ValueError naming the model) for a spec `load_model` could never load: an
    unknown shape with random weights, or real weights asked of a bare shape. Cheap: nothing is
    loaded (missing weight files are found when the model loads)."""
    if uses_real_weights(spec):
        return
    if not (spec.name in SHAPES or spec.name.endswith(".json") or os.path.isdir(spec.name)):
        raise ValueError(f"unknown model {spec.name!r}: expected one of {', '.join(REAL_WEIGHTS + tuple(SHAPES))}, "
                         "a checkpoint folder or a config.json path")


def load_model(spec, tp: int = 1):
    """(model, pretrained or None) for a ModelSpec. Real weights when the name is 'smollm2',
    'gemma3' or an existing path other than a config.json (and weights is not 'random'); random
    weights (seed) of the shape otherwise. Missing real weights are an error that says how to ask
    for random ones, never a silent fallback. Random weights are cast to the config's dtype (so a
    bfloat16 shape holds bfloat16 parameters, as the memory predictions assume). tp > 1: random
    weights are created already sharded over `tp` devices (jhybrid.parallel.tensor.random_sharded_model)."""
    if uses_real_weights(spec):
        if spec.num_layers is not None:
            raise ValueError("model.num_layers applies to random-weight shapes only (set model.weights: random)")
        from jhybrid.loading.pretrained import load_pretrained

        try:
            pretrained = load_pretrained(spec.name, dtype=spec.dtype)
        except FileNotFoundError as error:
            raise FileNotFoundError(f"{error}. For a throughput run, random weights of the same shape "
                                    f"are enough: set model.weights: random "
                                    f"(--set model.weights=random)") from None
        return pretrained.model, pretrained
    if spec.name in SHAPES or spec.name.endswith(".json") or os.path.isdir(spec.name):
        config = spec_config(spec)
    else:
        raise ValueError(f"model.weights=random: no known shape for {spec.name!r} (expected one of "
                         f"{', '.join(SHAPES)} or a config.json path)")
    log.info("model %s: random weights (seed %d), %d layers, %s, no tokenizer", spec.name, spec.seed,
             config.num_layers, config.dtype)
    if tp > 1:  # created sharded over the devices: a shape larger than one device still builds
        from jhybrid.parallel import tensor_mesh
        from jhybrid.parallel.tensor import random_sharded_model

        return random_sharded_model(config, spec.seed, tensor_mesh(tp, config)), None
    return create_cast_on_host(config, spec.seed), None


def create_cast_on_host(config, seed: int):
    """A random-weight model whose parameters reach the accelerator already in config.dtype.

    Created and cast on the host CPU device, then copied over: creating float32 weights on the GPU
    and casting them there left a float32-sized hole below the bf16 weights, which fragmented GPU
    memory enough that large cache fills later failed (H100, throughput suite). Off-GPU: as before."""
    import jax
    from flax import nnx

    accelerator = jax.devices()[0]
    if accelerator.platform == "cpu":
        return cast_params(create_model(config, seed=seed), config.dtype)
    with jax.default_device(jax.devices("cpu")[0]):
        model = cast_params(create_model(config, seed=seed), config.dtype)
    graphdef, params = nnx.split(model)
    return nnx.merge(graphdef, jax.device_put(params, accelerator))


def cast_params(model, dtype: str):
    """The model with its floating-point parameters stored in `dtype` (nnx keeps float32 params
    and computes in config.dtype by default: 2x the bytes for a bfloat16 model)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    target = jnp.dtype(dtype)
    graphdef, params = nnx.split(model)
    params = jax.tree_util.tree_map(
        lambda x: x.astype(target) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != target else x, params)
    return nnx.merge(graphdef, params)
