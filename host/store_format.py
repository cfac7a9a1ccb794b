"""The host store's formats and shape: how K / V values are stored (`kv_dtype`) and `StoreConfig`.

bf16 / fp16 are stored as uint16 bit patterns (Numba has no 16-bit float arithmetic: the kernels
widen them in registers), fp32 as float32. FORMAT_CODE is what the kernels are told.

int8 (8-bit host KV): each row (one token x one KV head, D values) is stored as D int8 values
followed by its float32 scale in 4 bytes (little-endian), so a row is `D + 4` int8 and moves with
its scale wherever rows are copied (context cache, recall uploads, prefill copies); values are
round(x / scale) clipped to [-127, 127] with scale = max|x| / 127 (symmetric, per row; an all-zero
row has scale 0). Layout chosen by measurement (`jhybrid.bench.kv_quant_error`, SmolLM2 on real
text, results/kv-quant-error-smollm2-cpu.json): per-row int8 gives 1.1 % mean relative attention-output
error, the KIVI layout (keys per block x channel) 1.1 %, fp8 e4m3 3-5 %; per-row scales also survive
the context cache's re-packing of single tokens, which per-block channel scales do not.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np


KV_DTYPES = ("bf16", "fp16", "fp32", "int8")
# Code passed to the Numba kernels so they know how to widen the stored bits to float32.
FORMAT_CODE = {"fp32": 0, "bf16": 1, "fp16": 2, "int8": 3}
STORAGE_DTYPE = {"bf16": np.dtype(np.uint16), "fp16": np.dtype(np.uint16), "fp32": np.dtype(np.float32),
                 "int8": np.dtype(np.int8)}
INT8_SCALE_BYTES = 4  # the float32 scale stored after each int8 row
HALF_DTYPES = {"bf16": np.dtype(ml_dtypes.bfloat16), "fp16": np.dtype(np.float16)}  # kept as uint16 bits


def row_width(kv_dtype: str, head_dim: int) -> int:
    """Stored elements per row of D values: D, or D + 4 for int8 (the inline float32 scale)."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype={kv_dtype!r}; expected one of {KV_DTYPES}")
    return head_dim + (INT8_SCALE_BYTES if kv_dtype == "int8" else 0)


def bytes_per_value(kv_dtype: str, head_dim: int) -> float:
    """Host bytes per K or V value, the int8 scale included (sizing: jhybrid budget)."""
    return row_width(kv_dtype, head_dim) * STORAGE_DTYPE[kv_dtype].itemsize / head_dim


def quantize_int8(x: np.ndarray) -> np.ndarray:
    """[..., D] float values -> [..., D + 4] int8 rows with their float32 scale (see module doc)."""
    x = np.asarray(x, np.float32)
    scale = np.abs(x).max(axis=-1, keepdims=True) / np.float32(127.0)
    if not np.isfinite(scale).all():
        raise ValueError("int8 host KV: a K/V row holds inf or nan (its scale would be undefined); "
                         "expected finite values")
    safe = np.where(scale > 0, scale, np.float32(1.0))
    out = np.empty(x.shape[:-1] + (x.shape[-1] + INT8_SCALE_BYTES,), np.int8)
    out[..., :-INT8_SCALE_BYTES] = np.clip(np.rint(x / safe), -127, 127)
    out[..., -INT8_SCALE_BYTES:] = scale.astype("<f4").view(np.int8)
    return out


def dequantize_int8(rows: np.ndarray) -> np.ndarray:
    """[..., D + 4] int8 rows -> [..., D] float32 values (value * scale, in float32)."""
    rows = np.asarray(rows)
    if rows.dtype != np.int8 or rows.shape[-1] <= INT8_SCALE_BYTES:
        raise ValueError(f"int8 rows of dtype {rows.dtype} and shape {rows.shape}; expected int8 [..., D + 4]")
    scale = np.ascontiguousarray(rows[..., -INT8_SCALE_BYTES:]).view("<f4")
    return rows[..., :-INT8_SCALE_BYTES].astype(np.float32) * scale.astype(np.float32)


def to_storage(x: np.ndarray, kv_dtype: str) -> np.ndarray:
    """Convert K or V values to the store's storage representation (no copy when already there).

    Accepts float32, float16, ml_dtypes.bfloat16, or uint16 bit patterns (taken to be already in
    `kv_dtype`'s 16-bit format; not accepted for an fp32 store), or for int8 already stored int8
    rows [..., D + 4]. Rounding is NumPy/ml_dtypes'
    round-to-nearest-even.
    """
    x = np.asarray(x)
    dt = x.dtype
    if kv_dtype == "int8":
        if dt == np.int8:  # already stored rows (values + scale), taken as they are
            return x
        if dt in (np.float32, np.float16, ml_dtypes.bfloat16):
            return quantize_int8(x)
        raise ValueError(f"K/V dtype {dt} given to an int8 store; expected float32, float16 or bfloat16 values "
                         "(or int8 rows of D + 4)")
    if kv_dtype == "fp32":
        if dt == np.uint16:
            raise ValueError("uint16 K/V given to an fp32 store: pass float32, float16 or bfloat16 values")
        if dt in (np.float32, np.float16, ml_dtypes.bfloat16):
            return x.astype(np.float32, copy=False)
    elif kv_dtype in HALF_DTYPES:  # bf16 / fp16 as uint16 bit patterns
        half = HALF_DTYPES[kv_dtype]
        if dt == np.uint16:
            return x
        if dt in (np.float32, np.float16, ml_dtypes.bfloat16):
            return x.astype(half, copy=False).view(np.uint16)
    else:
        raise ValueError(f"kv_dtype={kv_dtype!r}; expected one of {KV_DTYPES}")
    raise ValueError(f"K/V dtype {dt}; expected float32, float16, bfloat16 or uint16 bit patterns")


def from_storage(x: np.ndarray, kv_dtype: str) -> np.ndarray:
    """Storage representation -> float32 values (exact for bf16 / fp16: every such value is a
    float32; int8 rows [..., D + 4] -> their dequantized values [..., D])."""
    if kv_dtype == "int8":
        return dequantize_int8(x)
    if kv_dtype == "fp32":
        return np.asarray(x, np.float32)
    if kv_dtype == "bf16":
        return np.asarray(x).view(ml_dtypes.bfloat16).astype(np.float32)
    if kv_dtype == "fp16":
        return np.asarray(x).view(np.float16).astype(np.float32)
    raise ValueError(f"kv_dtype={kv_dtype!r}; expected one of {KV_DTYPES}")


@dataclass(frozen=True)
class StoreConfig:
    """Shape of what the store holds. `kv_dtype` in KV_DTYPES; stored rows are `row_width` wide."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    block_size: int
    kv_dtype: str = "bf16"
    host_memory_cap_bytes: int | None = None
    initial_blocks_per_layer: int = 16
    context_page_tokens: int = 256
    # Per-block float32 key min / max [Hkv, D] (Quest-style block digests) kept beside the KV.
    # Off by default: the decode modes score blocks on digests computed on the device before
    # eviction, and the host copy costs 8 KiB per block at Hkv 8, D 128 (a quarter of an int8 block).
    key_digests: bool = False

    def __post_init__(self):
        for name in ("n_layers", "n_kv_heads", "head_dim", "block_size", "initial_blocks_per_layer",
                     "context_page_tokens"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"{name}={value!r}; expected a positive int")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype={self.kv_dtype!r}; expected one of {KV_DTYPES}")

    @property
    def row_width(self) -> int:
        """Stored elements per (token, head) row: head_dim, + 4 for int8's inline scale."""
        return row_width(self.kv_dtype, self.head_dim)
