"""Bulk moves between the device and host memory, and the one log-once helper of the hybrid core.

On a GPU bulk copies go through JAX's `pinned_host` memory kind (~50 GB/s measured on the H100,
against ~2 GB/s for `np.asarray` of a device array and ~11 GB/s for a pageable upload). Elsewhere
(the CPU backend: host and device memory are one) a plain copy is all there is; that path, and any
failure of the pinned one, is logged once, never silent.
"""

from __future__ import annotations

import logging

import jax
import ml_dtypes
import numpy as np

from host.store_format import from_storage

log = logging.getLogger("jhybrid.hybrid")
_logged: set[str] = set()


def log_once(key: str, level: int, message: str, *args) -> None:
    """Log `message % args` at `level` the first time `key` is seen in this process."""
    if key not in _logged:
        _logged.add(key)
        log.log(level, message, *args)


def device_of(x: jax.Array):
    return next(iter(x.devices()))


def device_ordinal(device) -> int:
    """The device ordinal XLA hands a custom call running on `device`: on a GPU the CUDA device
    number (`local_hardware_id`), on the CPU the device id (which, across processes, is global)."""
    local = getattr(device, "local_hardware_id", None)
    return int(device.id if local is None or device.platform == "cpu" else local)


def to_host(x: jax.Array) -> np.ndarray:
    """Device array -> NumPy: through `pinned_host` memory on a GPU, a plain copy elsewhere."""
    return np.asarray(start_to_host(x))


def start_to_host(x: jax.Array) -> jax.Array:
    """Starts x's device -> host copy without waiting: on a GPU its `pinned_host` copy (np.asarray of
    it later waits for that copy alone), elsewhere x itself (np.asarray copies it). `to_host` is this
    and np.asarray."""
    if device_of(x).platform == "gpu":
        try:
            return jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))
        except Exception as exc:  # noqa: BLE001 - logged, and the slower path is named
            log_once("to-host-failed", logging.WARNING, "device -> pinned_host copy failed (%s: %s); using "
                     "np.asarray (~2 GB/s)", type(exc).__name__, exc)
            return x
    log_once("to-host-plain", logging.INFO, "device is %r, not a GPU: device -> host copies are plain "
             "copies (no pinned_host memory kind)", device_of(x).platform)
    return x


def to_device(x: np.ndarray, device) -> jax.Array:
    """NumPy -> device: through `pinned_host` memory on a GPU, a plain device_put elsewhere."""
    if device.platform == "gpu":
        try:
            pinned = jax.device_put(x, jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host"))
            return jax.device_put(pinned, jax.sharding.SingleDeviceSharding(device, memory_kind="device"))
        except Exception as exc:  # noqa: BLE001 - logged, and the slower path is named
            log_once("to-device-failed", logging.WARNING, "host -> pinned_host -> device upload failed "
                     "(%s: %s); using a plain device_put (pageable, ~11 GB/s)", type(exc).__name__, exc)
            return jax.device_put(x, device)
    log_once("to-device-plain", logging.INFO, "device is %r, not a GPU: uploads are plain device_puts "
             "(no pinned_host memory kind)", device.platform)
    return jax.device_put(x, device)


def stored_as(x: np.ndarray, kv_dtype: str, dtype) -> np.ndarray:
    """Host-store rows (storage format `kv_dtype`) in the model dtype: a view when the bits agree,
    else an exact widening or a cast."""
    dtype = np.dtype(dtype)
    if kv_dtype == "bf16" and dtype == np.dtype(ml_dtypes.bfloat16):
        return x.view(ml_dtypes.bfloat16)
    if kv_dtype == "fp16" and dtype == np.dtype(np.float16):
        return x.view(np.float16)
    if kv_dtype == "fp32" and dtype == np.dtype(np.float32):
        return x
    return from_storage(x, kv_dtype).astype(dtype)


__all__ = ["log_once", "to_host", "start_to_host", "to_device", "device_of", "device_ordinal", "stored_as"]
