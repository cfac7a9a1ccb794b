"""The open-time host-memory refusal (OffloadConfig.host_memory_cap_bytes) counts the host store in
its own format: an int8 store (1 byte per value + a float32 scale per row of head_dim values) needs
about a quarter of a float32 one, so a cap just below the float32 store's need refuses it and opens
the int8 one; one byte below the int8 store's need is refused, naming the cap and the need; and a
store opened with exactly its stated need holds a whole context (the need counts what the store
reserves, not only K and V)."""

from __future__ import annotations

import re

import pytest

from jhybrid.hybrid import make_backend
from tests.hybrid_support import TINY, WINDOW

BATCH, MAX_LEN = 2, 128


def needed_bytes(host_kv_dtype) -> int:
    """The bytes a store of this format needs, as the refusal of a 1-byte cap states them."""
    backend = make_backend("hgca", host_memory_cap_bytes=1, host_kv_dtype=host_kv_dtype, **WINDOW)
    with pytest.raises(ValueError, match="host memory cap of 1 bytes cannot hold") as info:
        backend.open(TINY, BATCH, MAX_LEN)
    return int(re.search(r"\((\d+) bytes needed\)", str(info.value)).group(1))


def test_int8_store_is_refused_only_below_its_own_size():
    int8, fp32 = needed_bytes("int8"), needed_bytes(None)  # TINY is float32: the model-format store
    assert int8 < 0.5 * fp32  # 1 byte + a 4-byte scale per d values against 4 bytes each (+ MAW, positions)

    too_small = make_backend("hgca", host_memory_cap_bytes=int8 - 1, host_kv_dtype="int8", **WINDOW)
    with pytest.raises(ValueError, match=f"host memory cap of {int8 - 1} bytes cannot hold .*{int8} bytes needed"):
        too_small.open(TINY, BATCH, MAX_LEN)

    cap = fp32 - 1  # too small for a float32 store, ample for the int8 one
    with pytest.raises(ValueError, match=f"host memory cap of {cap} bytes cannot hold .*{fp32} bytes needed"):
        make_backend("hgca", host_memory_cap_bytes=cap, **WINDOW).open(TINY, BATCH, MAX_LEN)
    int8_store = make_backend("hgca", host_memory_cap_bytes=cap, host_kv_dtype="int8", **WINDOW)
    int8_store.open(TINY, BATCH, MAX_LEN)
    try:
        assert int8_store.runtime is not None
    finally:
        int8_store.close()


@pytest.mark.parametrize("host_kv_dtype", [None, "int8"])
def test_a_cap_of_exactly_the_need_holds_a_whole_context(host_kv_dtype, rng):
    from jhybrid.models import create_model
    from tests.hybrid_support import run_forced

    need = needed_bytes(host_kv_dtype)
    backend = make_backend("topk", host_memory_cap_bytes=need, host_kv_dtype=host_kv_dtype, **WINDOW)
    prompt = rng.integers(0, TINY.vocab_size, (BATCH, 96)).astype("int32")
    continuation = rng.integers(0, TINY.vocab_size, (BATCH, MAX_LEN - 96)).astype("int32")
    _, backend, _, _ = run_forced(create_model(TINY, seed=0), backend, prompt, continuation, max_len=MAX_LEN)
    try:
        assert backend.runtime.store.n_blocks(0, 0) > 0
    finally:
        backend.close()
