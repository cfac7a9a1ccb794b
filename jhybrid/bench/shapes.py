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


def load_model(spec):
    """(model, pretrained or None) for a ModelSpec. Real weights when the name is 'smollm2',
    'gemma3' or an existing path other than a config.json; random weights (seed) for a shape."""
    if spec.name in REAL_WEIGHTS or (os.path.exists(spec.name) and not spec.name.endswith(".json")):
        from jhybrid.loading.pretrained import load_pretrained

        pretrained = load_pretrained(spec.name, dtype=spec.dtype)
        return pretrained.model, pretrained
    config = model_config_for(spec.name)
    if spec.dtype is not None:
        config = config.replace(dtype=spec.dtype)
    log.info("model %s: random weights (seed %d), no tokenizer", spec.name, spec.seed)
    return create_model(config, seed=spec.seed), None
