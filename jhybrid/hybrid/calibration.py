"""scout's exact-query layers, chosen from measurement: `scout_exact_layers="auto"`.

scout selects a layer's blocks one layer early, with a *predicted* query (that layer's norm, W_q and
RoPE applied to the previous offloaded layer's input). Where the prediction is poor (SmolLM2's
layers 1 and 2: mean cosine 0.23 / 0.67 against 0.96-0.99 elsewhere) the layer should select with
its exact query instead, at the cost of one more exchange per step. `calibrate` runs the model once
over a calibration text (full attention), measures the mean cosine similarity of predicted and exact
queries of every offloaded layer, and names the layers below `OffloadConfig.scout_min_cos`. The
cosines are cached per model (a fingerprint of its config and weights) and calibration text under
`$JHYBRID_CACHE` (default ~/.cache/jhybrid)/scout-calibration/, so a model is measured once.

    config = resolve_exact_layers(config, model, tokens)   # "auto" -> a tuple of offloaded layers

Layer numbers are offloaded-layer numbers (`jhybrid.hybrid.sliding.LayerPlan`: the global layers of
a model with sliding-window layers, else every layer). Offloaded layer 0 is always exact.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np

from jhybrid.hybrid.sliding import LayerPlan

log = logging.getLogger(__name__)


def cache_dir() -> str:
    return os.path.join(os.environ.get("JHYBRID_CACHE", os.path.expanduser("~/.cache/jhybrid")), "scout-calibration")


def predicted_and_exact(model, layer_inputs: jax.Array, source: int, target: int, positions: jax.Array):
    """Layer `target`'s query predicted from layer `source`'s input, and its exact query.
    layer_inputs [L, B, T, d_model] (`hidden_states(..., return_hidden_states=True)`);
    returns two [B, T, Hq, D] arrays."""
    layer = model.layers[target]
    predicted = layer.attention.project_q(layer.attention_input(layer_inputs[source]), positions)
    exact = layer.attention.project_q(layer.attention_input(layer_inputs[target]), positions)
    return predicted, exact


def cosines(predicted: jax.Array, exact: jax.Array) -> np.ndarray:
    """Cosine similarity per (token, head) of two [..., D] arrays, float64."""
    p, r = np.asarray(predicted, np.float64), np.asarray(exact, np.float64)
    return (p * r).sum(-1) / np.maximum(np.linalg.norm(p, axis=-1) * np.linalg.norm(r, axis=-1), 1e-30)


def layer_ahead_cosines(model, tokens, skip_first: int = 1) -> list[float]:
    """Mean cosine similarity [G] of scout's predicted and exact query for each offloaded layer
    g >= 1 (predicted from offloaded layer g - 1's input), over `tokens` [T] run as one full-attention
    prefill; entry 0 is 1.0 (layer 0 is always exact). skip_first: leading positions left out."""
    tokens = np.asarray(tokens, np.int32)
    if tokens.ndim != 1 or tokens.shape[0] <= skip_first + 1:
        raise ValueError(f"calibration tokens of shape {tokens.shape}; expected [T] with T > {skip_first + 1}")
    plan = LayerPlan.of(model.config)
    ids, positions = jnp.asarray(tokens[None]), jnp.arange(tokens.shape[0], dtype=jnp.int32)[None]
    _, _, inputs = model.hidden_states(ids, positions, model.init_cache(1, tokens.shape[0]), return_hidden_states=True)
    out = [1.0]
    for source, target in zip(plan.global_layers, plan.global_layers[1:]):
        predicted, exact = predicted_and_exact(model, inputs, source, target, positions)
        out.append(float(cosines(predicted[0, skip_first:], exact[0, skip_first:]).mean()))
    return out


def model_fingerprint(model) -> str:
    """A short hash of the model's config and parameters (what the cosines depend on)."""
    from flax import nnx

    digest = hashlib.sha256(model.config.to_json().encode())
    for leaf in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)):
        values = np.asarray(leaf).reshape(-1)
        digest.update(np.ascontiguousarray(values[:: max(1, values.size // 4096)]).tobytes())
    return digest.hexdigest()[:16]


def calibrate(model, tokens, use_cache: bool = True) -> list[float]:
    """`layer_ahead_cosines`, read from / written to the per-model cache."""
    tokens = np.asarray(tokens, np.int32)
    key = f"{model_fingerprint(model)}-{hashlib.sha256(tokens.tobytes()).hexdigest()[:12]}"
    path = os.path.join(cache_dir(), key + ".json")
    if use_cache and os.path.isfile(path):
        try:
            with open(path) as f:
                return [float(x) for x in json.load(f)["cosines"]]
        except (OSError, ValueError, KeyError, TypeError) as error:
            log.warning("scout calibration cache %s is unreadable (%s); measuring again", path, error)
    cos = layer_ahead_cosines(model, tokens)
    if use_cache:
        os.makedirs(cache_dir(), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"cosines": cos, "tokens": int(tokens.shape[0])}, f)
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the whole new one
    return cos


def resolve_exact_layers(config, model, tokens, use_cache: bool = True):
    """`config` with scout_exact_layers="auto" replaced by the offloaded layers whose predicted
    query's mean cosine is below config.scout_min_cos on `tokens` [T] (a calibration text); any
    other config is returned as it is."""
    if config.scout_exact_layers != "auto":
        return config
    if not config.predict_query:
        return dataclasses.replace(config, scout_exact_layers=())
    cos = calibrate(model, tokens, use_cache)
    exact = tuple(g for g, c in enumerate(cos) if g > 0 and c < config.scout_min_cos)
    log.info("scout: layer-ahead query cosines %s; exact-query layers %s (below %.2f)",
             [round(c, 3) for c in cos], list(exact), config.scout_min_cos)
    return dataclasses.replace(config, scout_exact_layers=exact)


__all__ = ["calibrate", "layer_ahead_cosines", "resolve_exact_layers", "model_fingerprint", "cosines",
           "predicted_and_exact", "cache_dir"]
