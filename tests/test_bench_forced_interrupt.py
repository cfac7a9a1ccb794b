"""A bench point's interrupt check reaches the prefill of a teacher-forced run (jhybrid.bench.forced):
Ctrl-C during a long prompt's prefill stops at the next chunk, not after the whole prefill."""

from __future__ import annotations

import numpy as np
import pytest

from jhybrid.attention.full import FullAttention
from jhybrid.bench.forced import forced_nll
from jhybrid.models import create_model
from tests.hybrid_support import TINY


def test_prefill_chunks_call_on_step_so_an_interrupt_stops_there():
    model = create_model(TINY)
    tokens = np.random.default_rng(0).integers(0, TINY.vocab_size, 70).astype(np.int32)
    calls = []

    def stop_at_second_chunk(done, total):
        calls.append((done, total))
        if len(calls) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        forced_nll(model, FullAttention(), tokens, context=60, chunk=16, on_step=stop_at_second_chunk)
    assert calls == [(0, 9), (0, 9)]  # two prefill chunks of 16 (of 4), no decode step yet
