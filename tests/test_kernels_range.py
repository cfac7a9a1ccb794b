"""Parity of the prefill range-attention kernel (Pallas interpret mode) and its jnp reference vs a
float64 oracle whose visibility is built from positions, lengths and windows directly (not from the
product's `causal_ranges`). Unwritten outputs come back NaN from the interpreter (see
test_kernels_window.py) and `rel_err` rejects NaN."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oracle import attention_f64, rel_err
from pallas_kernels.range_attention import causal_ranges, range_attention, range_attention_reference

TOL_O = {"float32": 1e-5, "bfloat16": 2.0**-8}  # as test_kernels_window.py: float32 math, one bf16 rounding
TOL_LSE = 1e-5


def _rounded(rng, shape, dtype):
    return np.asarray(jnp.asarray(rng.standard_normal(shape).astype(np.float32), dtype).astype(jnp.float32))


def _oracle(q, k_bhld, v_bhld, visible, scale):
    """q [B, T, Hq, D], k/v [B, Hkv, L, D], visible [B, T, L] bool -> o, lse in float64."""
    b, t, hq, d = q.shape
    hkv = k_bhld.shape[1]
    g = hq // hkv
    o, lse = np.zeros(q.shape), np.zeros(q.shape[:3])
    for bi in range(b):
        for h in range(hq):
            o[bi, :, h], lse[bi, :, h], _ = attention_f64(q[bi, :, h], k_bhld[bi, h // g], v_bhld[bi, h // g],
                                                          visible[bi], scale)
    return o, lse


def _check(out, o_ref, lse_ref, dtype):
    o, lse = np.asarray(out[0]), np.asarray(out[1])
    assert out[1].dtype == jnp.float32
    assert rel_err(o, o_ref) < TOL_O[dtype]
    assert np.array_equal(np.isneginf(lse), np.isneginf(lse_ref)), "an empty range must give lse = -inf exactly"
    assert np.all(o[np.isneginf(lse_ref)] == 0)
    fin = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse[fin], lse_ref[fin], rtol=TOL_LSE, atol=TOL_LSE)


CAUSAL_CASES = [
    # b, t,  hq, hkv, L,   d,   dtype,      window
    (3, 37, 8, 2, 150, 64, "float32", None),  # GQA 4, T*G = 148 rows (3 tiles, the last partial)
    (2, 16, 4, 4, 96, 128, "bfloat16", None),  # group 1
    (2, 9, 8, 1, 70, 64, "float32", 24),  # group 8, sliding window shorter than the chunk's reach
    (1, 5, 2, 1, 33, 256, "bfloat16", None),  # D = 256, L not a block multiple
]


@pytest.mark.parametrize("b,t,hq,hkv,length,d,dtype,window", CAUSAL_CASES)
@pytest.mark.parametrize("backend", ["interpret", "reference"])
def test_causal_chunk_over_a_cache_matches_float64(rng, backend, b, t, hq, hkv, length, d, dtype, window):
    """A prefill chunk per sequence at ragged offsets (one sequence not prefilling: every position
    -1; one chunk ending in padding) over a [B, L, Hkv, D] cache holding garbage past each length."""
    q = _rounded(rng, (b, t, hq, d), dtype)
    k = _rounded(rng, (b, length, hkv, d), dtype)
    v = _rounded(rng, (b, length, hkv, d), dtype)
    start = rng.integers(0, length - t + 1, b)
    positions = start[:, None] + np.arange(t)[None, :]
    n_real = rng.integers(1, t + 1, b)
    positions = np.where(np.arange(t)[None, :] < n_real[:, None], positions, -1)
    if b > 1:
        positions[-1] = -1  # a row of the batch that is not prefilling
    lengths = np.where(positions.max(1) >= 0, positions.max(1) + 1, rng.integers(0, length + 1, b))
    key = np.arange(length)[None, None, :]
    p = positions[:, :, None]
    visible = (p >= 0) & (key <= p) & (key < lengths[:, None, None])
    if window is not None:
        visible &= p - key < window
    lo, hi = causal_ranges(jnp.asarray(positions, jnp.int32), jnp.asarray(lengths, jnp.int32), window)
    args = (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), lo, hi)
    out = range_attention(*args, backend=backend, block_k=16, row_tile=64 if backend == "interpret" else None)
    assert out[0].dtype == jnp.dtype(dtype) and out[0].shape == q.shape
    _check(out, *_oracle(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), visible, d**-0.5), dtype)


@pytest.mark.parametrize("backend", ["interpret", "reference"])
def test_offloaded_copies_layout_with_valid_prefixes(rng, backend):
    """[B, Hkv, P, D] copies, every valid query over the first n_valid[b] keys (one sequence with
    none: lse -inf, o 0), bf16 K/V with a float32 output, small row tiles (several tiles per program grid axis)."""
    b, t, hq, hkv, length, d = 3, 12, 6, 2, 80, 64
    q = _rounded(rng, (b, t, hq, d), "bfloat16")
    k = _rounded(rng, (b, hkv, length, d), "bfloat16")
    v = _rounded(rng, (b, hkv, length, d), "bfloat16")
    n_valid = np.array([length, 0, 41])
    positions = np.where(np.arange(t)[None, :] < np.array([[t], [t], [7]]), 1, -1)
    visible = (positions[:, :, None] >= 0) & (np.arange(length)[None, None, :] < n_valid[:, None, None])
    hi = jnp.asarray(np.where(positions >= 0, n_valid[:, None], 0), jnp.int32)
    out = range_attention(jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16),
                          jnp.zeros_like(hi), hi, kv_layout="heads_tokens", out_dtype=jnp.float32,
                          backend=backend, block_k=16, row_tile=16 if backend == "interpret" else None)
    assert out[0].dtype == jnp.float32
    o_ref, lse_ref = _oracle(q, k, v, visible, d**-0.5)
    _check(out, o_ref, lse_ref, "bfloat16")  # the probabilities meet V in bf16 (V's dtype)


def test_arbitrary_ranges_and_the_controls(rng):
    """Random [lo, hi) per query (empty ones included) in interpret mode; controls: the reference
    with hi one key short, or the scale 10 % off, fails the same checks by a wide margin."""
    b, t, hq, hkv, length, d = 2, 20, 4, 2, 64, 64
    q = _rounded(rng, (b, t, hq, d), "float32")
    k = _rounded(rng, (b, length, hkv, d), "float32")
    v = _rounded(rng, (b, length, hkv, d), "float32")
    lo = rng.integers(0, length, (b, t))
    hi = np.minimum(lo + rng.integers(-3, length, (b, t)), length)
    hi[:, ::7] = lo[:, ::7]  # some empty ranges in every draw
    keys = np.arange(length)[None, None, :]
    visible = (keys >= lo[:, :, None]) & (keys < hi[:, :, None])
    assert (~visible.any(-1)).any() and visible.any()
    args = [jnp.asarray(x) for x in (q, k, v, lo.astype(np.int32), hi.astype(np.int32))]
    o_ref, lse_ref = _oracle(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), visible, d**-0.5)
    _check(range_attention(*args, backend="interpret", block_k=16, row_tile=32), o_ref, lse_ref, "float32")
    short = range_attention_reference(*args[:4], jnp.asarray(np.maximum(hi - 1, lo), np.int32))
    assert rel_err(short[0], o_ref) > 100 * TOL_O["float32"]
    scaled = range_attention_reference(*args, scale=1.1 * d**-0.5)
    fin = np.isfinite(lse_ref)
    assert np.max(np.abs(np.asarray(scaled[1])[fin] - lse_ref[fin])) > 100 * TOL_LSE


@pytest.mark.parametrize("layout", ["tokens_heads", "heads_tokens"])
@pytest.mark.parametrize("backend", ["interpret", "reference"])
def test_batch_rows_read_their_rows_of_a_larger_buffer(rng, backend, layout):
    """batch_rows: 3 query rows over rows 4, 0, 2 of a 5-row buffer (the others hold different
    data: reading a wrong row fails), causal chunks at ragged offsets."""
    n, b, t, hq, hkv, length, d = 5, 3, 10, 4, 2, 48, 64
    shape = (n, length, hkv, d) if layout == "tokens_heads" else (n, hkv, length, d)
    q = _rounded(rng, (b, t, hq, d), "float32")
    k, v = _rounded(rng, shape, "float32"), _rounded(rng, shape, "float32")
    rows = np.array([4, 0, 2], np.int32)
    positions = np.array([5, 30, 38])[:, None] + np.arange(t)[None, :]
    lengths = positions.max(1) + 1
    visible = np.arange(length)[None, None, :] <= positions[:, :, None]
    lo, hi = causal_ranges(jnp.asarray(positions, jnp.int32), jnp.asarray(lengths, jnp.int32))
    out = range_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), lo, hi, kv_layout=layout,
                          batch_rows=jnp.asarray(rows), backend=backend, block_k=16)
    picked_k, picked_v = k[rows], v[rows]
    if layout == "tokens_heads":
        picked_k, picked_v = picked_k.transpose(0, 2, 1, 3), picked_v.transpose(0, 2, 1, 3)
    _check(out, *_oracle(q, picked_k, picked_v, visible, d**-0.5), "float32")


@pytest.mark.parametrize("backend", ["interpret", "reference"])
def test_blocks_layout_reads_quest_pages(rng, backend):
    """kv_layout="blocks" ([B*NB, Hkv, bs, D], quest's cache): causal chunks at ragged offsets, a
    row that is not prefilling, a sliding window; equals the oracle over each sequence's tokens."""
    b, nb, bs, t, hq, hkv, d = 3, 5, 16, 12, 4, 2, 64
    q = _rounded(rng, (b, t, hq, d), "float32")
    k = _rounded(rng, (b * nb, hkv, bs, d), "float32")
    v = _rounded(rng, (b * nb, hkv, bs, d), "float32")
    positions = np.array([3, 50, 0])[:, None] + np.arange(t)[None, :]
    positions[2] = -1
    lengths = np.where(positions.max(1) >= 0, positions.max(1) + 1, 0)
    key = np.arange(nb * bs)[None, None, :]
    visible = (positions[:, :, None] >= 0) & (key <= positions[:, :, None]) & (positions[:, :, None] - key < 20)
    lo, hi = causal_ranges(jnp.asarray(positions, jnp.int32), jnp.asarray(lengths, jnp.int32), 20)
    out = range_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), lo, hi, kv_layout="blocks", backend=backend)
    as_tokens = lambda x: x.reshape(b, nb, hkv, bs, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, nb * bs, d)  # noqa: E731
    _check(out, *_oracle(q, as_tokens(k), as_tokens(v), visible, d**-0.5), "float32")


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(kv_layout="bhld"), "kv_layout='bhld'"),
        (dict(q_shape=(2, 4, 5, 64)), "multiple of KV heads"),
        (dict(lo_shape=(2, 3)), r"key_lo.shape=\(2, 3\)"),
        (dict(k_dtype=jnp.int8), "k.dtype"),
        (dict(row_tile=48), "row_tile=48"),
    ],
)
def test_bad_input_names_the_value(change, match):
    q = jnp.zeros(change.get("q_shape", (2, 4, 4, 64)), jnp.float32)
    k = jnp.zeros((2, 16, 2, 64), change.get("k_dtype", jnp.float32))
    lo = jnp.zeros(change.get("lo_shape", (2, 4)), jnp.int32)
    with pytest.raises(ValueError, match=match):
        range_attention(q, k, k, lo, jnp.zeros((2, 4), jnp.int32), kv_layout=change.get("kv_layout", "tokens_heads"),
                        row_tile=change.get("row_tile"), backend="interpret")


def test_full_backend_prefill_through_the_kernel_equals_the_jnp_path():
    """`full` with its prefill chunks on the range kernel (interpreted; the GPU default) gives the
    logits of the jnp path: a prompt in chunks of 16 (the last one padded), then decode steps."""
    from jhybrid.attention.full import FullAttention
    from jhybrid.models import create_model
    from tests.hybrid_support import TINY, run_forced

    model = create_model(TINY, seed=3)
    rng = np.random.default_rng(5)
    prompt, cont = rng.integers(0, 97, (2, 40)).astype(np.int32), rng.integers(0, 97, (2, 6)).astype(np.int32)
    with jax.default_matmul_precision("highest"):
        expected = run_forced(model, FullAttention("jnp"), prompt, cont)[0]
        got = run_forced(model, FullAttention("interpret"), prompt, cont)[0]
    np.testing.assert_allclose(got, expected, atol=2e-4, rtol=2e-4)
    with pytest.raises(ValueError, match="prefill_backend='cuda'"):
        FullAttention("cuda")
