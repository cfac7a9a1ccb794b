"""jhybrid: long-context LLM inference in JAX with hybrid GPU/CPU attention over offloaded KV.

Package map (one concept per module):
  jhybrid.models       Flax NNX decoder models (Llama family, OPT, GPT-NeoX, Gemma 3) and configs
  jhybrid.attention    the attention backend interface and its backends (`full`, the hybrid modes)
  jhybrid.hybrid       KV manager (GPU ring, eviction to host), callback bridge, mode configs
  jhybrid.hcache       session save/restore from per-layer hidden states (HCache), planner
  jhybrid.loading      Hugging Face / GGUF / Orbax weights, tokenizers, chat templates
  jhybrid.generation   chunked prefill, jitted decode, sampling, the step API
  jhybrid.merge        exact log-sum-exp merge of partial attention states (o, lse)
  jhybrid.cli          the `jhybrid` console script
GPU kernels live in the top-level package `pallas_kernels`, CPU-side code in `host`.
"""

from jhybrid.merge import PartialState, merge_partials, merge_two

__all__ = ["PartialState", "merge_partials", "merge_two"]
__version__ = "0.1.0"
