"""jhybrid: long-context LLM inference in JAX with hybrid GPU/CPU attention over offloaded KV.

The public API (docs/design.md explains the architecture):

    from jhybrid import load_pretrained, Generator, SamplingParams, make_backend, OffloadConfig
    lm = load_pretrained("smollm2")
    backend = make_backend(OffloadConfig(mode="hgca", gpu_ratio=0.25), context=4096)
    out = Generator(lm.model, backend).generate([lm.encode("Hello")], max_new_tokens=32)

Package map (one concept per module):
  jhybrid.models       Flax NNX decoder models (Llama family, OPT, GPT-NeoX, Gemma 3) and configs
  jhybrid.attention    the attention backend interface and `full`
  jhybrid.hybrid       the offloading modes: OffloadConfig, HybridAttention, modes/, host runtime
  jhybrid.hcache       session save/restore from per-layer hidden states (HCache), planner
  jhybrid.loading      Hugging Face / GGUF / Orbax weights, tokenizers, chat templates
  jhybrid.generation   chunked prefill, jitted decode, sampling, the step API
  jhybrid.merge        exact log-sum-exp merge of partial attention states (o, lse)
  jhybrid.bench        benchmarks and accuracy tasks behind `jhybrid bench` / `jhybrid budget`
  jhybrid.cli          the `jhybrid` console script
GPU kernels live in the top-level package `pallas_kernels`, CPU-side code in `host`.
"""

from jhybrid.merge import PartialState, merge_partials, merge_two

__version__ = "0.1.0"

_LAZY = {  # public names imported on first use (keeps `import jhybrid` light)
    "load_pretrained": "jhybrid.loading.pretrained",
    "Generator": "jhybrid.generation",
    "SamplingParams": "jhybrid.generation",
    "make_step": "jhybrid.generation",
    "make_backend": "jhybrid.hybrid",
    "OffloadConfig": "jhybrid.hybrid",
    "HCacheEngine": "jhybrid.hcache",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jhybrid' has no attribute {name!r}")


__all__ = ["PartialState", "merge_partials", "merge_two", *_LAZY]
