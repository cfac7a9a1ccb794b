"""Attention backends: where KV lives and how a layer attends over it.

  jhybrid.attention.base   the AttentionBackend interface, LayerContext, the position convention
  jhybrid.attention.full   `full`: all KV on the device, exact plain-jnp attention
The offloading modes live in `jhybrid.hybrid` (`make_backend` builds any backend, `full` included).
"""

from jhybrid.attention.base import AttentionBackend, LayerContext
from jhybrid.attention.full import FullAttention, masked_attention

__all__ = ["AttentionBackend", "LayerContext", "FullAttention", "masked_attention"]
