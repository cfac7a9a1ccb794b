"""Hybrid GPU-CPU attention: the pieces behind `jhybrid.attention.hybrid.HybridAttention`.

  config     HybridConfig (the mode switch and window / host policy), evicted-block arithmetic
  ring       the GPU window of one layer: sinks + ring buffer + moving-average attention weights
  selection  Quest top-k blocks from digests, split between the GPU recall pool and the CPU
  bridge     jax.pure_callback wrappers (small operands only) around host.bridge.HostBridge
  manager    KVManager: between-step eviction (pinned_host transfers), recall, re-evaluation

Switch a model to hybrid with one call: `make_backend("hgca", window_tokens=2048)` (or a
HybridConfig) and hand the backend to `Generator` / `make_step`; `jhybrid generate --mode scout`.
"""

from jhybrid.hybrid.config import EXCHANGES, HOST_MODES, MODES, HybridConfig


def make_backend(config="hgca", **overrides):
    """See jhybrid.attention.hybrid.make_backend."""
    from jhybrid.attention.hybrid import make_backend as _make

    return _make(config, **overrides)


__all__ = ["HybridConfig", "MODES", "HOST_MODES", "EXCHANGES", "make_backend"]
