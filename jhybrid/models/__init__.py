"""Decoder-only models in Flax NNX.

  jhybrid.models.config   ModelConfig (all families), from_hf_config, SUPPORTED_ARCHITECTURES
  jhybrid.models.rope     rotary embeddings (rotate-half / interleaved, partial, llama3 scaling)
  jhybrid.models.layers   norms, Attention (projections; attention via a backend), MLP
  jhybrid.models.decoder  DecoderLayer, CausalLM, KVCache, kv_from_hidden
"""

from flax import nnx

from jhybrid.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, from_hf_config
from jhybrid.models.decoder import CausalLM, DecoderLayer, KVCache, kv_from_hidden


def create_model(config: ModelConfig, seed: int = 0) -> CausalLM:
    """A randomly initialised model (tests); loaders in jhybrid.loading give real weights."""
    return CausalLM(config, rngs=nnx.Rngs(seed))


__all__ = ["ModelConfig", "from_hf_config", "SUPPORTED_ARCHITECTURES", "CausalLM", "DecoderLayer",
           "KVCache", "kv_from_hidden", "create_model"]
