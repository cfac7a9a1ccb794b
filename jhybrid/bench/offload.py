"""A sweep point's OffloadConfig + its context length -> an attention backend (or a reason to skip)."""

from __future__ import annotations

from jhybrid.hybrid import OffloadConfig, make_backend
from jhybrid.hybrid.registry import mode_class


class PointSkipped(Exception):
    """A sweep point that cannot run (does not fit, degenerate, no time left); the message is the
    recorded reason, `fields` extra row keys (e.g. the batch and the memory prediction)."""

    def __init__(self, reason: str, **fields):
        super().__init__(reason)
        self.fields = fields


def resolve(offload: OffloadConfig, context: int) -> OffloadConfig:
    """The point's config with its GPU window resolved for `context` tokens (PointSkipped if invalid)."""
    try:
        return offload.resolved(context)
    except ValueError as error:
        raise PointSkipped(str(error)) from None


def backend_for(offload: OffloadConfig, context: int, model=None, calibration_tokens=None):
    """(backend, window_tokens or None for a mode without a window) for a point whose sequences hold
    `context` tokens. model, calibration_tokens: resolve the mode's per-model settings (`make_backend`).

    Raises PointSkipped when the point cannot run: the window holds the whole context (nothing
    would be offloaded), or the budget exceeds the offloaded tokens."""
    config = resolve(offload, context)
    mode = mode_class(config.mode)
    if not mode.offloads:
        return make_backend(config, model=model, calibration_tokens=calibration_tokens), None
    window = config.window_tokens
    if window >= context:
        raise PointSkipped(f"window {window} >= context {context}: nothing is offloaded")
    if "budget" in mode.settings and isinstance(config.budget, int) and config.budget > context - window:
        raise PointSkipped(f"budget {config.budget} > offloaded tokens {context - window} "
                           f"(context {context} - window {window})")
    return make_backend(config, model=model, calibration_tokens=calibration_tokens), window
