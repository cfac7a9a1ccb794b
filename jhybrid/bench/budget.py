"""KV budget calculator (`jhybrid budget`): how much KV a model needs, and what to offload.

GQA-aware: the KV of one token is 2 (K and V) x layers x KV heads x head_dim x bytes per element;
query heads do not count. The GPU window for a target GPU share s of a context N is
sink + whole blocks of round-down(s x N - sink), the rest (N - window tokens per sequence and
layer) lives in the host store.
"""

from __future__ import annotations

import dataclasses
import math
import re

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1, "int8": 1}


def dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def kv_bytes_per_token(config, kv_dtype: str | None = None) -> int:
    """Bytes of K and V of one token over all layers (GQA: num_kv_heads, not num_heads)."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype_bytes(kv_dtype or config.dtype)


def parameter_count(config) -> int:
    """Approximate parameters of a decoder (embeddings, attention, gated MLP, norms)."""
    d, q, kv = config.d_model, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    mlp = (3 if config.mlp_type in ("swiglu", "geglu") else 2) * d * config.mlp_dim
    per_layer = d * q + 2 * d * kv + q * d + mlp + 2 * d
    embeddings = config.vocab_size * d * (1 if config.tie_embeddings else 2)
    return embeddings + config.num_layers * per_layer + d


def weight_bytes(config, dtype: str | None = None) -> int:
    return parameter_count(config) * dtype_bytes(dtype or config.dtype)


def parse_bytes(text: str) -> int:
    """'80' (GiB), '80GiB', '80GB', '512MiB' -> bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?B)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise ValueError(f"cannot read a memory size from {text!r} (e.g. 80, 80GiB, 80GB, 512MiB)")
    value, unit, suffix = float(match[1]), match[2].upper() or "G", (match[3] or "iB")
    base = 1024 if suffix.lower() == "ib" else 1000
    return int(value * base ** "BKMGT".index(unit if unit else "B"))


def window_for_share(context: int, share: float, sink: int = 16, block_size: int = 16) -> int:
    """GPU window tokens (sinks included) holding `share` of the context, in whole blocks."""
    ring = max(0, int(share * context) - sink)
    return min(context, sink + max(1, ring // block_size) * block_size)


@dataclasses.dataclass
class Budget:
    """All byte counts are totals over layers and KV heads; per-request = one sequence."""

    model: str
    context: int
    batch: int
    gpu_bytes: int
    kv_bytes_per_token: int
    kv_bytes_per_request: int
    weight_bytes: int
    free_gpu_bytes: int
    max_batch_full_on_gpu: int
    fits_fully_on_gpu: bool
    gpu_share: float
    window_tokens: int
    blocks_to_offload_per_layer: int
    blocks_to_offload_total: int
    host_bytes: int
    gpu_kv_bytes_with_window: int
    max_batch_with_window: int
    max_window_for_batch: int


def kv_budget(name: str, config, context: int, batch: int, gpu_bytes: int, gpu_share: float = 0.25,
              sink: int = 16, block_size: int = 16, kv_dtype: str | None = None,
              reserve_bytes: int = 0) -> Budget:
    """The numbers of `jhybrid budget`. reserve_bytes: device memory kept for activations etc."""
    if context <= 0 or batch <= 0 or gpu_bytes <= 0:
        raise ValueError("context, batch and gpu memory must be positive")
    if not 0.0 < gpu_share <= 1.0:
        raise ValueError(f"gpu_share={gpu_share}: expected a fraction in (0, 1]")
    per_token = kv_bytes_per_token(config, kv_dtype)
    per_request = per_token * context
    weights = weight_bytes(config)
    free = max(0, gpu_bytes - weights - reserve_bytes)
    window = window_for_share(context, gpu_share, sink, block_size)
    offloaded = context - window
    blocks = math.ceil(offloaded / block_size)
    return Budget(
        model=name, context=context, batch=batch, gpu_bytes=gpu_bytes,
        kv_bytes_per_token=per_token, kv_bytes_per_request=per_request, weight_bytes=weights,
        free_gpu_bytes=free, max_batch_full_on_gpu=free // per_request,
        fits_fully_on_gpu=batch * per_request <= free, gpu_share=gpu_share, window_tokens=window,
        blocks_to_offload_per_layer=blocks, blocks_to_offload_total=blocks * batch * config.num_layers,
        host_bytes=batch * offloaded * per_token, gpu_kv_bytes_with_window=batch * window * per_token,
        max_batch_with_window=free // (window * per_token),
        max_window_for_batch=min(context, free // (batch * per_token)))


def format_budget(b: Budget) -> list[tuple[str, str]]:
    """(label, value) lines for printing."""
    gib = lambda n: f"{n / 2**30:,.2f} GiB"  # noqa: E731
    return [
        ("model", b.model), ("context x batch", f"{b.context:,} x {b.batch}"),
        ("GPU memory", gib(b.gpu_bytes)), ("weights (approx.)", gib(b.weight_bytes)),
        ("free for KV", gib(b.free_gpu_bytes)),
        ("KV per token", f"{b.kv_bytes_per_token:,} B ({b.kv_bytes_per_token / 1024:.1f} KiB)"),
        ("KV per request", gib(b.kv_bytes_per_request)),
        ("max batch fully on GPU", f"{b.max_batch_full_on_gpu}"),
        ("this batch fits fully on GPU", "yes" if b.fits_fully_on_gpu else "no"),
        (f"window for GPU share {b.gpu_share:g}", f"{b.window_tokens:,} tokens (sinks included)"),
        ("GPU KV with that window", gib(b.gpu_kv_bytes_with_window)),
        ("blocks to offload", f"{b.blocks_to_offload_per_layer:,} per layer and sequence, "
                              f"{b.blocks_to_offload_total:,} in all"),
        ("host memory needed", gib(b.host_bytes)),
        ("max batch with that window", f"{b.max_batch_with_window}"),
        ("largest window for this batch", f"{b.max_window_for_batch:,} tokens"),
    ]
