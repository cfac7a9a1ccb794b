"""Soak: 10,000 decode steps of a tiny model in hgca and scout with evictions all along; the process's
resident memory must stay flat once the host store's own growth (rows holding live blocks and
context pages: its arenas are reserved ahead and become resident as they fill) is subtracted (a leak per step of a
few KiB would show as tens of MiB). Slow: JHYBRID_RUN_SLOW=1 (JHYBRID_SOAK_STEPS to change the
length). The figures are printed (pytest -s) for BENCHMARKS.md."""

from __future__ import annotations

import dataclasses
import gc
import os

import numpy as np
import pytest

from jhybrid.bench.throughput import host_rss_bytes
from jhybrid.generation import Generator, SamplingParams
from jhybrid.hybrid import OffloadConfig, make_backend
from jhybrid.models import create_model
from tests.hybrid_support import TINY

STEPS = int(os.environ.get("JHYBRID_SOAK_STEPS", "10000"))
WARM = 1000  # steps before the first reading: compilation, first arena growth, caches
LEAK_LIMIT = 32 * 2**20


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("options", [dict(mode="hgca", beta=1.0),
                                     dict(mode="scout", budget=64, recall_blocks=2)], ids=["hgca", "scout"])
def test_resident_memory_is_flat_over_a_long_decode(options):
    if host_rss_bytes() is None:
        pytest.skip("needs /proc (Linux) to read the resident set size")
    config = dataclasses.replace(TINY, max_position_embeddings=STEPS + 256)
    model = create_model(config, seed=0)
    backend = make_backend(OffloadConfig(window_tokens=72, block_size=16, sink=8, host_threads=1, **options))
    generator = Generator(model, backend, prefill_chunk=16)
    readings = {}

    def on_tokens(tokens, emitted):
        made = len(seen) + 1
        seen.append(int(tokens[0]))
        if made in (WARM, STEPS // 2, STEPS):
            gc.collect()
            store = backend.runtime.store
            readings[made] = (host_rss_bytes(), store.bytes_used(), store.n_blocks(0, 0))

    seen: list[int] = []
    prompt = np.random.default_rng(0).integers(0, TINY.vocab_size, 40).tolist()
    result = generator.generate([prompt], max_new_tokens=STEPS, sampling=SamplingParams(temperature=1.0, seed=1),
                                on_tokens=on_tokens)
    assert len(result.tokens[0]) == STEPS and set(readings) == {WARM, STEPS // 2, STEPS}
    (rss0, store0, blocks0), (rss1, store1, blocks1) = readings[WARM], readings[STEPS]
    rss_mid, store_mid, _ = readings[STEPS // 2]
    second_half = (rss1 - rss_mid) - (store1 - store_mid)  # bounded buffers (step history) are full by then
    assert blocks1 - blocks0 >= (STEPS - WARM) // 16 - 1  # evictions all along
    growth = (rss1 - rss0) - (store1 - store0)
    print(f"\nsoak {options['mode']}: {STEPS} steps, {result.decode_tokens_per_second:.0f} tok/s; RSS "
          f"{rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB, store rows in use {store0 / 2**20:.1f} -> "
          f"{store1 / 2**20:.1f} MiB, blocks {blocks0} -> {blocks1}; growth beyond the store "
          f"{growth / 2**20:.2f} MiB ({second_half / 2**20:.2f} MiB in the second half)")
    # Measured on the 2-core CPU machine (BENCHMARKS.md, "Soak"): 12 / 9.5 MiB in all, 8.3 / 5.2 MiB
    # in the second half (hgca / scout): ~1-1.7 KiB per step of native memory, not yet explained.
    assert growth < LEAK_LIMIT and second_half < LEAK_LIMIT / 2
    backend.close()
