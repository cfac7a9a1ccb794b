"""Soak: 10,000 decode steps of a tiny model in hgca and scout with evictions all along; the process's
resident memory must stay flat once the host store's own resident memory is subtracted (a leak of
a few hundred bytes per step would show as MiBs). Slow: JHYBRID_RUN_SLOW=1 (JHYBRID_SOAK_STEPS to
change the length). The figures are printed (pytest -s) for BENCHMARKS.md.

The store's share is accounted from its arenas, not fitted: `KVStore.bytes_resident()` counts their
resident pages (mincore), and must lie within `bytes_resident_bound()`, the rows the store has
written rounded up to whole pages. That rounding is not small: past the first 4 MiB of an arena
array the kernel backs it with 2 MiB transparent huge pages (host.memory asks for them), so each
array's resident memory runs up to 2 MiB ahead of its rows in use, in steps (the "0.9 KiB per step"
that the soak used to report beyond `bytes_used()` was this: 8-9 MiB over steps 1,000-10,000 from the
8 K/V arrays of hgca's store and context cache, ~4 MiB from scout's 4).

Each reading is taken after gc.collect() and glibc's malloc_trim(0): what the process holds, not the
free memory its allocators keep for reuse (glibc's per-thread arenas keep up to ~1 MiB of freed
chunks here, varying from run to run; that is not a leak, and it is not what the soak measures).
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import os

import numpy as np
import pytest

from host import KVStore, StoreConfig
from host.memory import _HUGE_FROM, _huge_page_bytes
from jhybrid.bench.throughput import host_rss_bytes
from jhybrid.generation import Generator, SamplingParams
from jhybrid.hybrid import OffloadConfig, make_backend
from jhybrid.models import create_model
from tests.hybrid_support import TINY

STEPS = int(os.environ.get("JHYBRID_SOAK_STEPS", "10000"))
WARM = 1000  # steps before the first reading: compilation, the bounded buffers (per-step history) filling
FLAT_LIMIT = 2**20  # growth beyond the store's resident memory, steps WARM -> STEPS


def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_TRIM = _malloc_trim()


def settled_rss() -> int:
    """The resident set size once garbage is collected and glibc has returned its free pages."""
    gc.collect()
    if _TRIM is not None:
        _TRIM(0)
    return host_rss_bytes()


def test_store_resident_memory_is_its_rows_rounded_up_to_pages():
    """Fast: the store's resident pages (mincore) stay within `bytes_resident_bound()` (written rows
    rounded up to 4 KiB pages, or to 2 MiB huge pages past the first 4 MiB of an array), which
    exceeds the rows by at most one page per array, as an array crosses into the huge-page region."""
    c = StoreConfig(n_layers=1, n_kv_heads=2, head_dim=64, block_size=16, kv_dtype="fp32",
                    initial_blocks_per_layer=1024)
    store = KVStore(c)
    store.add_sequence(0)
    if store.bytes_resident() is None:
        pytest.skip("mincore is not available")
    arrays = len(store.layers[0].arrays) + len(store.context.layers[0].arrays)
    k_block = store.layers[0].arrays["k"][0].nbytes  # 8 KiB: k crosses 4 MiB after 512 blocks
    rng = np.random.default_rng(0)
    for _ in range(12):
        n = 50
        k = rng.standard_normal((n, 16, 2, 64)).astype(np.float32)
        store.append_blocks(0, 0, k, k, np.ones((n, 16, 2), np.float32), np.zeros((n, 16), np.int64))
        used, resident, bound = store.bytes_used(), store.bytes_resident(), store.bytes_resident_bound()
        assert used <= bound <= used + arrays * max(4096, _huge_page_bytes())
        assert resident <= bound
        if store.n_blocks(0, 0) * k_block <= _HUGE_FROM:  # 4 KiB pages only: nothing to round but a page
            assert bound <= used + arrays * 4096
    store.free_sequence(0)
    assert store.bytes_used() == 0 and store.bytes_resident_bound() == bound  # rows recycled, still resident


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
    made = [0]

    def on_tokens(tokens, emitted):
        made[0] += 1
        if made[0] in (WARM, STEPS // 2, STEPS):
            store = backend.runtime.store
            rss = settled_rss()
            readings[made[0]] = (rss, store.bytes_resident(), store.bytes_resident_bound(), store.bytes_used(),
                                 store.n_blocks(0, 0))

    prompt = np.random.default_rng(0).integers(0, TINY.vocab_size, 40).tolist()
    result = generator.generate([prompt], max_new_tokens=STEPS, sampling=SamplingParams(temperature=1.0, seed=1),
                                on_tokens=on_tokens)
    backend.close()
    assert len(result.tokens[0]) == STEPS and set(readings) == {WARM, STEPS // 2, STEPS}
    if readings[WARM][1] is None:
        pytest.skip("mincore is not available: the store's resident pages cannot be counted")
    for step, (rss, resident, bound, used, _) in readings.items():
        # the store's resident memory is what its rows explain: written rows, rounded up to pages
        assert resident <= bound, (step, resident, bound)
    (rss0, res0, bound0, used0, blocks0), (rss1, res1, bound1, used1, blocks1) = readings[WARM], readings[STEPS]
    rss_mid, res_mid, _, _, _ = readings[STEPS // 2]
    assert blocks1 - blocks0 >= (STEPS - WARM) // 16 - 1  # evictions all along
    growth = (rss1 - rss0) - (res1 - res0)
    second_half = (rss1 - rss_mid) - (res1 - res_mid)
    mib = lambda x: f"{x / 2**20:.2f}"
    print(f"\nsoak {options['mode']}: {STEPS} steps, {result.decode_tokens_per_second:.0f} tok/s; RSS "
          f"{mib(rss0)} -> {mib(rss1)} MiB; store resident {mib(res0)} -> {mib(res1)} MiB (bound {mib(bound0)} -> "
          f"{mib(bound1)}, rows in use {mib(used0)} -> {mib(used1)}), blocks {blocks0} -> {blocks1}; growth beyond "
          f"the store {growth / 2**10:.0f} KiB ({second_half / 2**10:.0f} KiB in the second half; beyond its rows "
          f"in use {((rss1 - rss0) - (used1 - used0)) / 2**10:.0f} KiB)")
    assert growth <= FLAT_LIMIT and second_half <= FLAT_LIMIT
