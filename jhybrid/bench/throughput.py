"""Throughput task: `batch` random prompts of `context` tokens, `decode_tokens` greedy steps.

Row: mode, model, batch, context, window, decode_tok_s, tbt_p50_ms, tbt_p99_ms, ttft_s,
peak_device_bytes, peak_host_bytes. Times exclude compilation (the Generator reports it apart).
A point whose KV cannot fit the device (estimated before the run, or an out-of-memory error during
it) is skipped with the reason.
"""

from __future__ import annotations

import logging
import os
import resource
import time

import jax
import numpy as np

from jhybrid.bench.budget import kv_bytes_per_token, weight_bytes
from jhybrid.bench.offload import PointSkipped, backend_for
from jhybrid.generation import Generator

log = logging.getLogger(__name__)


def device_memory() -> tuple[int | None, int | None]:
    """(bytes limit, peak bytes in use) of the first device, None where the platform does not say."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit"), stats.get("peak_bytes_in_use")


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits(config, batch: int, context: int, window: int | None) -> None:
    """PointSkipped if the offloaded KV exceeds the host's memory, or the device KV (the whole
    context for full/recall, the window otherwise) plus the weights exceed the device's memory
    (checked only where the device reports its limit)."""
    if window is not None:
        host_need = batch * (context - window) * kv_bytes_per_token(config)
        if host_need > host_memory_bytes():
            raise PointSkipped(f"host store needs ~{host_need / 2**30:.1f} GiB, the host has "
                               f"{host_memory_bytes() / 2**30:.1f} GiB")
    limit, _ = device_memory()
    if limit is None:
        return
    resident = context if window is None else window
    need = weight_bytes(config) + batch * resident * kv_bytes_per_token(config)
    if need > limit:
        raise PointSkipped(f"needs ~{need / 2**30:.1f} GiB on the device (weights + {batch} x "
                           f"{resident} KV tokens), the device has {limit / 2**30:.1f} GiB")


def run_throughput(model, pretrained, point, on_step=None) -> list[dict]:
    bench, offload = point.benchmark, point.offload
    total = bench.context + bench.decode_tokens
    backend, window = backend_for(offload, total)
    check_fits(model.config, bench.batch, total, window if offload.mode != "recall" else None)
    prompts = np.random.default_rng(0).integers(0, model.config.vocab_size, (bench.batch, bench.context))
    stamps: list[float] = []

    def on_tokens(tokens, emitted):
        stamps.append(time.perf_counter())
        if on_step:
            on_step(len(stamps), bench.decode_tokens)

    generator = Generator(model, backend, prefill_chunk=bench.prefill_chunk, max_len=total)
    try:
        generator.generate(prompts[:, :8].tolist(), max_new_tokens=2)  # compile the decode step
        stamps.clear()
        result = generator.generate(prompts.tolist(), max_new_tokens=bench.decode_tokens,
                                    on_tokens=on_tokens)
    except Exception as error:  # noqa: BLE001 - an out-of-memory point is recorded, others re-raised
        if "RESOURCE_EXHAUSTED" in str(error) or "out of memory" in str(error).lower():
            raise PointSkipped(f"out of device memory: {str(error).splitlines()[0][:200]}") from None
        raise
    gaps = np.diff(stamps) * 1e3 if len(stamps) > 1 else np.zeros(1)
    _, peak = device_memory()
    return [{"task": "throughput", "mode": offload.mode, "batch": bench.batch, "context": bench.context,
             "window": window, "decode_tok_s": round(result.decode_tokens_per_second, 2),
             "tbt_p50_ms": round(float(np.percentile(gaps, 50)), 3),
             "tbt_p99_ms": round(float(np.percentile(gaps, 99)), 3),
             "ttft_s": round(result.prefill_seconds, 4), "compile_s": round(result.compile_seconds, 2),
             "peak_device_bytes": peak,
             "peak_host_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}]
