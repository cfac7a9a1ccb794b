"""Soak: 10,000 short requests through a 2-slot ServingEngine on the tiny random model (full and
hgca): no request lost or mixed up, every slot free and empty at the end, and the process's RSS
flat after warm-up. Slow: runs only with JHYBRID_RUN_SLOW=1; JHYBRID_SOAK_REQUESTS sets the count.

RSS bound: a leak of one request's worth of state (its prompt, tokens, timings and handle, ~1-2 KiB
in Python objects; a cache row is preallocated and reused, so a leaked row would not show here but
in `slot_lengths`) over the 9,500 requests after warm-up would add >= 10 MiB; the allocator's own
jitter (malloc arenas, Python's pools, XLA's host buffers) measured a few MiB on this machine. The
bound, 12 MiB from the end of warm-up to the end, catches a per-request leak of >~1.3 KiB."""

from __future__ import annotations

import os

import numpy as np
import pytest

from jhybrid.bench.shapes import load_model
from jhybrid.bench.throughput import host_rss_bytes
from jhybrid.config.schema import ModelSpec
from jhybrid.serving import FinishReason, Request

REQUESTS = int(os.environ.get("JHYBRID_SOAK_REQUESTS", "10000"))
WARMUP = 500  # requests before the RSS baseline
IN_FLIGHT = 8  # requests submitted before waiting for them (2 slots busy, a queue behind them)
MAX_TOKENS = 3
RSS_BOUND = 12 * 2**20


def _backend(mode: str):
    if mode == "full":
        return None
    from jhybrid.hybrid import make_backend

    return make_backend("hgca", window_tokens=40, block_size=16, sink=8, host_threads=1, beta=1.0)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("mode", ["full", "hgca"])
def test_soak_no_loss_no_leak(mode):
    from jhybrid.serving import ServingEngine

    model, _ = load_model(ModelSpec(name="tiny"))
    rng = np.random.default_rng(0)
    engine = ServingEngine(model, _backend(mode), slots=2, max_len=128, prefill_chunk=16)
    engine.start()
    completed, rss, prompts = 0, {}, {}
    try:
        for begin in range(0, REQUESTS, IN_FLIGHT):
            handles = []
            for i in range(begin, min(begin + IN_FLIGHT, REQUESTS)):
                length = int(rng.integers(4, 48))
                prompt = rng.integers(0, model.config.vocab_size, length).tolist()
                handles.append((engine.submit(Request(prompt=prompt, max_tokens=MAX_TOKENS, request_id=f"s-{i}")),
                                f"s-{i}", length))
            for handle, rid, length in handles:
                out = handle.result(120)
                assert out.request_id == rid and out.prompt_tokens == length, (out.request_id, rid)
                assert out.finish_reason is FinishReason.LENGTH and len(out.tokens) == MAX_TOKENS, out
                completed += 1
            done = begin + len(handles)
            if done >= WARMUP and "warm" not in rss:
                rss["warm"] = host_rss_bytes()
            if done >= REQUESTS // 2 and "mid" not in rss:
                rss["mid"] = host_rss_bytes()
        rss["end"] = host_rss_bytes()
        stats = engine.stats()
        lengths = engine.slot_lengths()
    finally:
        engine.close()
    growth = rss["end"] - rss["warm"]
    print(f"soak {mode}: {completed} requests, RSS warm {rss['warm'] / 2**20:.1f} MiB, mid "
          f"{rss['mid'] / 2**20:.1f} MiB, end {rss['end'] / 2**20:.1f} MiB, growth {growth / 2**20:+.2f} MiB; "
          f"steps {stats.steps}, compiles {stats.compiles}")
    assert completed == REQUESTS
    assert stats.finished == REQUESTS and stats.errors == 0 and stats.cancelled == 0
    assert stats.running == 0 and stats.waiting == 0
    assert (lengths == 0).all(), lengths  # every row reset: no slot leaked
    assert growth <= RSS_BOUND, f"RSS grew {growth / 2**20:.1f} MiB after warm-up (bound {RSS_BOUND / 2**20:.0f})"
