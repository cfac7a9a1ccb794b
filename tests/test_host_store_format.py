"""The host store's 8-bit format: per-row int8 round trip bounds, its inline scale, bad input."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from host import KVStore, StoreConfig, from_storage, to_storage
from host.store_format import INT8_SCALE_BYTES, bytes_per_value, row_width


def test_int8_round_trip_within_half_a_step_per_row(rng):
    """|x - deq(q(x))| <= scale / 2 (+ float32 rounding) per element, scale = max|x| / 127 per row,
    over rows whose magnitudes span 2^-20 .. 2^20; the row's largest value is exact up to rounding."""
    d = 64
    x = rng.standard_normal((50, 3, d)).astype(np.float32)
    x *= np.float32(2.0) ** rng.integers(-20, 21, size=(50, 3, 1)).astype(np.float32)
    stored = to_storage(x, "int8")
    assert stored.dtype == np.int8 and stored.shape == (50, 3, d + INT8_SCALE_BYTES)
    back = from_storage(stored, "int8")
    assert back.dtype == np.float32 and back.shape == x.shape
    scale = np.abs(x).max(-1, keepdims=True).astype(np.float64) / 127
    err = np.abs(back.astype(np.float64) - x)
    assert (err <= scale * (0.5 + 1e-5)).all(), float((err / scale).max())
    assert np.all(np.abs(stored[..., :d]) <= 127)
    # the scale bytes are the float32 scale, little-endian, right after the row's values
    np.testing.assert_allclose(stored[..., d:].copy().view("<f4"), scale.astype(np.float32), rtol=1e-6)
    # a float64 control: the bound above is not vacuous (the error is a sizeable share of a step)
    assert (err / scale).max() > 0.3


def test_int8_zero_rows_and_input_dtypes(rng):
    x = np.zeros((2, 5, 32), np.float32)
    x[1, 2] = rng.standard_normal(32)
    back = from_storage(to_storage(x, "int8"), "int8")
    assert np.array_equal(back[0], x[0]) and np.array_equal(back[1, :2], x[1, :2])
    for dt in (np.float16, ml_dtypes.bfloat16):
        y = x.astype(dt)
        np.testing.assert_array_equal(to_storage(y, "int8"), to_storage(y.astype(np.float32), "int8"))


@pytest.mark.parametrize("bad,match", [
    (np.full((2, 8), np.inf, np.float32), "inf or nan"),
    (np.zeros((2, 8), np.uint16), "uint16"),
])
def test_int8_bad_values_are_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        to_storage(bad, "int8")


def test_unknown_format_is_a_clear_error():
    with pytest.raises(ValueError, match="kv_dtype='fp8'"):
        StoreConfig(n_layers=1, n_kv_heads=1, head_dim=8, block_size=4, kv_dtype="fp8")
    with pytest.raises(ValueError, match="kv_dtype='q4'"):
        to_storage(np.zeros((1, 8), np.float32), "q4")
    with pytest.raises(ValueError, match="kv_dtype='q4'"):
        row_width("q4", 8)


def test_int8_store_keeps_rows_with_their_scale_and_digests_of_stored_values(rng):
    c = StoreConfig(n_layers=1, n_kv_heads=2, head_dim=16, block_size=4, kv_dtype="int8", initial_blocks_per_layer=1,
                    key_digests=True)
    assert c.row_width == 20 and bytes_per_value("int8", 128) == pytest.approx(132 / 128)
    store = KVStore(c)
    store.add_sequence(7)
    k = rng.standard_normal((3, 4, 2, 16)).astype(np.float32) * 3
    v = rng.standard_normal((3, 4, 2, 16)).astype(np.float32)
    store.append_blocks(0, 7, k, v, rng.random((3, 4, 2)), np.arange(12).reshape(3, 4))
    got = store.read_blocks(0, 7)
    assert got["k"].dtype == np.int8 and got["k"].shape == (3, 4, 2, 20)
    kf = from_storage(got["k"], "int8")
    np.testing.assert_array_equal(kf, from_storage(to_storage(k, "int8"), "int8"))
    np.testing.assert_array_equal(got["key_min"], kf.min(axis=1))   # digests of what the CPU attends
    np.testing.assert_array_equal(got["key_max"], kf.max(axis=1))
    assert store.bytes_used() >= 3 * 2 * 4 * 2 * 20
    # Without digests (the default) the store keeps none and says so when asked for them.
    bare = KVStore(StoreConfig(n_layers=1, n_kv_heads=2, head_dim=16, block_size=4, kv_dtype="int8"))
    bare.add_sequence(0)
    bare.append_blocks(0, 0, k, v, rng.random((3, 4, 2)), np.arange(12).reshape(3, 4))
    assert "key_min" not in bare.read_blocks(0, 0)
    assert bare.bytes_used() < store.bytes_used()
    with pytest.raises(ValueError, match="key_digests=True"):
        bare.key_digests(0, 0)
