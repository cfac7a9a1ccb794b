"""Attention backends: where KV lives and how a layer attends over it.

  jhybrid.attention.base   the AttentionBackend interface, LayerContext, the position convention
  jhybrid.attention.full   `full`: all KV on the device, exact plain-jnp attention
  jhybrid.attention.hybrid `recall`, `hgca`, `scout`, `streaming`, `topk`: GPU window + host store
"""

from jhybrid.attention.base import AttentionBackend, LayerContext
from jhybrid.attention.full import FullAttention, masked_attention
from jhybrid.attention.hybrid import HybridAttention, make_backend
from jhybrid.hybrid.config import HOST_MODES

BACKENDS = {"full": FullAttention}
# Hybrid modes with their default HybridConfig; make_backend(mode, **fields) to change the policy.
BACKENDS.update({mode: (lambda mode=mode: make_backend(mode)) for mode in HOST_MODES})


def get_backend(name: str) -> AttentionBackend:
    """The backend registered under `name` (ValueError listing the known ones)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(BACKENDS)}")
    return BACKENDS[name]()


__all__ = ["AttentionBackend", "LayerContext", "FullAttention", "HybridAttention", "masked_attention",
           "get_backend", "make_backend", "BACKENDS"]
