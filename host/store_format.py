"""The host store's formats and shape: how K / V values are stored (`kv_dtype`) and `StoreConfig`.

bf16 / fp16 are stored as uint16 bit patterns (Numba has no 16-bit float arithmetic: the kernels
widen them in registers), fp32 as float32. FORMAT_CODE is what the kernels are told.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np


KV_DTYPES = ("bf16", "fp16", "fp32")
# Code passed to the Numba kernels so they know how to widen the stored bits to float32.
FORMAT_CODE = {"fp32": 0, "bf16": 1, "fp16": 2}
STORAGE_DTYPE = {"bf16": np.dtype(np.uint16), "fp16": np.dtype(np.uint16), "fp32": np.dtype(np.float32)}


def to_storage(x: np.ndarray, kv_dtype: str) -> np.ndarray:
    """Convert K or V values to the store's storage representation (no copy when already there).

    Accepts float32, float16, ml_dtypes.bfloat16, or uint16 bit patterns (taken to be already in
    `kv_dtype`'s 16-bit format; not accepted for an fp32 store). Rounding is NumPy/ml_dtypes'
    round-to-nearest-even.
    """
    x = np.asarray(x)
    dt = x.dtype
    if kv_dtype == "fp32":
        if dt == np.uint16:
            raise ValueError("uint16 K/V given to an fp32 store: pass float32, float16 or bfloat16 values")
        if dt in (np.float32, np.float16, ml_dtypes.bfloat16):
            return x.astype(np.float32, copy=False)
    elif kv_dtype == "bf16":
        if dt == np.uint16:
            return x
        if dt == ml_dtypes.bfloat16:
            return x.view(np.uint16)
        if dt in (np.float32, np.float16):
            return x.astype(ml_dtypes.bfloat16).view(np.uint16)
    elif kv_dtype == "fp16":
        if dt == np.uint16:
            return x
        if dt == np.float16:
            return x.view(np.uint16)
        if dt in (np.float32, ml_dtypes.bfloat16):
            return x.astype(np.float16).view(np.uint16)
    else:
        raise ValueError(f"kv_dtype={kv_dtype!r}; expected one of {KV_DTYPES}")
    raise ValueError(f"K/V dtype {dt}; expected float32, float16, bfloat16 or uint16 bit patterns")


def from_storage(x: np.ndarray, kv_dtype: str) -> np.ndarray:
    """Storage representation -> float32 values (exact: every bf16/fp16 value is a float32)."""
    if kv_dtype == "fp32":
        return np.asarray(x, np.float32)
    if kv_dtype == "bf16":
        return np.asarray(x).view(ml_dtypes.bfloat16).astype(np.float32)
    if kv_dtype == "fp16":
        return np.asarray(x).view(np.float16).astype(np.float32)
    raise ValueError(f"kv_dtype={kv_dtype!r}; expected one of {KV_DTYPES}")


@dataclass(frozen=True)
class StoreConfig:
    """Shape of what the store holds. `kv_dtype` in {"bf16", "fp16", "fp32"}."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    block_size: int
    kv_dtype: str = "bf16"
    host_memory_cap_bytes: int | None = None
    initial_blocks_per_layer: int = 16
    context_page_tokens: int = 256

    def __post_init__(self):
        for name in ("n_layers", "n_kv_heads", "head_dim", "block_size", "initial_blocks_per_layer",
                     "context_page_tokens"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"{name}={value!r}; expected a positive int")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype={self.kv_dtype!r}; expected one of {KV_DTYPES}")
