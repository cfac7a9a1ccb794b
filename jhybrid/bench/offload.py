"""OffloadSpec + a point's context length -> an attention backend (or a reason to skip the point)."""

from __future__ import annotations

import math

from jhybrid.attention.hybrid import make_backend
from jhybrid.hybrid.config import HybridConfig


class PointSkipped(Exception):
    """A sweep point that cannot run (does not fit, degenerate, no time left); the message is the
    recorded reason, `fields` extra row keys (e.g. the batch and the memory prediction)."""

    def __init__(self, reason: str, **fields):
        super().__init__(reason)
        self.fields = fields


def window_for(offload, context: int) -> int | None:
    """GPU window tokens (sinks included) for a context: window_tokens, or gpu_ratio x context
    rounded down to sink + whole blocks (at least 2 ring blocks). None for mode full."""
    if offload.mode == "full":
        return None
    if offload.window_tokens is not None:
        return offload.window_tokens
    if offload.gpu_ratio is None:
        raise PointSkipped(f"mode {offload.mode} needs offload.window_tokens or offload.gpu_ratio")
    ring = int(offload.gpu_ratio * context) - offload.sink
    return offload.sink + max(2, ring // offload.block_size) * offload.block_size


def topk_blocks_for(offload) -> int | None:
    """scout/topk budget in blocks (None: every block)."""
    if offload.budget is None or offload.mode not in ("scout", "topk"):
        return None
    return math.ceil(offload.budget / offload.block_size)


def backend_for(offload, context: int):
    """(backend, window_tokens) for a point whose sequences hold `context` tokens.

    Raises PointSkipped when the point cannot run: the window holds the whole context (nothing
    would be offloaded), or the budget exceeds the context."""
    window = window_for(offload, context)
    if offload.mode == "full":
        return make_backend("full"), None
    if window >= context:
        raise PointSkipped(f"window {window} >= context {context}: nothing is offloaded")
    if offload.budget is not None and offload.mode in ("scout", "topk") and offload.budget > context - window:
        raise PointSkipped(f"budget {offload.budget} > offloaded tokens {context - window} "
                           f"(context {context} - window {window})")
    try:
        config = HybridConfig(mode=offload.mode, window_tokens=window, block_size=offload.block_size,
                              sink=offload.sink, alpha=offload.alpha, beta=offload.beta,
                              topk_blocks=topk_blocks_for(offload), recall_blocks=offload.recall_blocks,
                              recall_threshold=offload.recall_threshold,
                              predict_query=offload.predict_query, exchange=offload.exchange,
                              scout_exact_layers=offload.scout_exact_layers if offload.mode == "scout" else (),
                              prefill_offloaded=offload.prefill_offloaded, keep_after=offload.keep_after,
                              n_threads=offload.host_threads)
    except ValueError as error:
        raise PointSkipped(str(error)) from None
    return make_backend(config), window


def exact_layers_of(offload):
    """The row value of offload.scout_exact_layers: a list of layer indices or an int N (JSON-friendly);
    None outside scout."""
    if offload.mode != "scout":
        return None
    exact = offload.scout_exact_layers
    return exact if isinstance(exact, int) else list(exact)
