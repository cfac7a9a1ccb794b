"""Shared helper of the benchmark tests: one throughput point of the tiny model (imported by the
test modules; not a test module)."""

from __future__ import annotations

from jhybrid.config import expand_sweep
from jhybrid.config.loading import config_from_dict

OFFLOAD = {"gpu_ratio": 0.25, "sink": 16, "block_size": 16, "budget": 32, "recall_blocks": 2,
           "host_threads": 1}


def point(mode="hgca", batch=1, context=256, offload=None, **bench):
    """The throughput point of the tiny model in `mode` (synthetic fill, 3 decode steps after 1
    warm-up); `offload` and `bench` override the offload and benchmark settings."""
    from jhybrid.hybrid import OffloadConfig

    read = {k: v for k, v in OFFLOAD.items()  # only what the mode reads (the rest is an error)
            if k not in OffloadConfig(mode=mode, **OFFLOAD).ignored_settings()}
    run = config_from_dict({"name": "t", "model": {"name": "tiny"},
                            "offload": {**read, "mode": mode, **(offload or {})},
                            "benchmark": {"task": "throughput", "fill": "synthetic", "batch": batch,
                                          "context": context, "decode_tokens": 3, "warmup_steps": 1,
                                          **bench}})
    return expand_sweep(run)[0]
