"""Attention backends: where KV lives and how a layer attends over it.

  jhybrid.attention.base   the AttentionBackend interface, LayerContext, the position convention
  jhybrid.attention.full   `full`: all KV on the device, exact plain-jnp attention
"""

from jhybrid.attention.base import AttentionBackend, LayerContext
from jhybrid.attention.full import FullAttention, masked_attention

BACKENDS = {"full": FullAttention}


def get_backend(name: str) -> AttentionBackend:
    """The backend registered under `name` (ValueError listing the known ones)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(BACKENDS)}")
    return BACKENDS[name]()


__all__ = ["AttentionBackend", "LayerContext", "FullAttention", "masked_attention", "get_backend",
           "BACKENDS"]
