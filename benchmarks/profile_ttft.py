"""Where a hybrid prefill's time goes: per-phase wall time of `Generator.generate` prefills.

Wraps the host runtime's per-step work (eviction to the host store, attaching the device copies of the
offloaded prompt) and the jitted steps (synchronised) with timers, then runs three 8K-token prefills
per mode (the first one compiles; the last two are the warm figures):

  XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 PYTHONPATH=. python3 benchmarks/profile_ttft.py hgca scout

Shape: Llama-3-8B (4 of 32 layers, random bf16 weights), window = context / 4, 1024-token chunks;
CTX, CHUNK and SHAPE (a jhybrid.bench.shapes name) environment variables override them.
"""

from __future__ import annotations

import collections
import os
import sys
import time

import jax
import numpy as np

from jhybrid.bench.shapes import model_config_for
from jhybrid.generation import Generator
from jhybrid.hybrid import OffloadConfig, make_backend
from jhybrid.hybrid.prefill import PrefillCopies
from jhybrid.hybrid.runtime import HostRuntime
from jhybrid.models import create_model

SECONDS: dict[str, float] = collections.defaultdict(float)
CALLS: collections.Counter = collections.Counter()


def timed(owner, name: str, label: str, sync: bool = False) -> None:
    """Replace owner.name by a wrapper adding its wall time (after block_until_ready if sync)."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        if sync:
            jax.block_until_ready(out)
        SECONDS[label] += time.perf_counter() - start
        CALLS[label] += 1
        return out

    setattr(owner, name, wrapper)


def main(modes: list[str]) -> None:
    context, chunk = int(os.environ.get("CTX", 8192)), int(os.environ.get("CHUNK", 1024))
    timed(HostRuntime, "before_step", "runtime before_step (all)")
    timed(HostRuntime, "_evict", "  eviction to the host store")
    timed(PrefillCopies, "attach", "  attach offloaded-prompt copies")
    timed(Generator, "_run", "jitted steps (synchronised)", sync=True)
    config = model_config_for(os.environ.get("SHAPE", "llama3-8b")).replace(num_layers=4)
    model = create_model(config, seed=0)
    rng = np.random.default_rng(0)
    for mode in modes:
        hybrid = OffloadConfig(mode=mode, window_tokens=context // 4, block_size=16, sink=16,
                               beta=1.0 if mode == "hgca" else OffloadConfig.beta,
                               budget=2048 if mode in ("scout", "topk") else None)
        generator = Generator(model, make_backend(hybrid), prefill_chunk=chunk, max_len=context + 64)
        for run in range(3):
            SECONDS.clear()
            CALLS.clear()
            prompt = rng.integers(0, config.vocab_size, (1, context)).tolist()
            result = generator.generate(prompt, max_new_tokens=1)
            print(f"{mode} run {run}{' (compiles)' if run == 0 else ''}: "
                  f"time to first token {result.prefill_seconds:.3f} s")
            for label, seconds in SECONDS.items():
                print(f"    {label:34s} {seconds:8.3f} s  ({CALLS[label]} calls)")


if __name__ == "__main__":
    main(sys.argv[1:] or ["hgca", "scout"])
