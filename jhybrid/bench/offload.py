"""A sweep point's OffloadConfig + its context length -> an attention backend (or a reason to skip)."""

from __future__ import annotations

from jhybrid.hybrid import OffloadConfig, make_backend


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
    """(backend, window_tokens or None for full) for a point whose sequences hold `context` tokens.
    model, calibration_tokens: resolve scout's scout_exact_layers="auto" (`make_backend`).

    Raises PointSkipped when the point cannot run: the window holds the whole context (nothing
    would be offloaded), or the budget exceeds the offloaded tokens."""
    config = resolve(offload, context)
    if config.mode == "full":
        return make_backend("full"), None
    window = config.window_tokens
    if window >= context:
        raise PointSkipped(f"window {window} >= context {context}: nothing is offloaded")
    if config.budget is not None and config.mode in ("scout", "topk") and config.budget > context - window:
        raise PointSkipped(f"budget {config.budget} > offloaded tokens {context - window} "
                           f"(context {context} - window {window})")
    return make_backend(config, model=model, calibration_tokens=calibration_tokens), window


def exact_layers_of(offload: OffloadConfig):
    """The row value of offload.scout_exact_layers: a list of layer indices or an int N (JSON-friendly);
    None outside scout."""
    if offload.mode != "scout":
        return None
    exact = offload.scout_exact_layers
    return exact if isinstance(exact, (int, str)) else list(exact)
