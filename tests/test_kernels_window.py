"""Parity of the dense ring-window kernel (Pallas interpret mode) and its jnp reference vs float64.

Unwritten kernel outputs cannot hide: the Pallas interpreter initialises every float output to NaN
(checked in ``test_interpreter_poisons_unwritten_outputs``) and ``rel_err`` rejects NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from oracle import attention_f64, rel_err
from pallas_kernels.window_attention import window_attention, window_attention_reference

# Tolerances from the arithmetic: inputs are rounded to the tested dtype before the float64 oracle
# sees them, and the kernels compute in float32, so LSE and probabilities carry float32 rounding
# only (observed <= 3e-7); o in bf16 is rounded once on output and the probabilities meet V in bf16:
# two roundings of at most 2^-9 each -> 2^-8 relative (observed <= 2e-3).
TOL_O = {"float32": 1e-5, "bfloat16": 2.0**-8}
TOL_STATS = 1e-5  # LSE (relative to max(1, |lse|)) and probabilities (absolute), either dtype


def _case(rng, b, tq, hq, hkv, w, d, dtype, sinks):
    q = rng.standard_normal((b, tq, hq, d)).astype(np.float32)
    k = rng.standard_normal((b, hkv, w, d)).astype(np.float32)
    v = rng.standard_normal((b, hkv, w, d)).astype(np.float32)
    lengths = rng.integers(0, w + 1, b).astype(np.int32)
    lengths[0] = w  # one full ring, the rest ragged (0 allowed: empty window)
    ring_start = rng.integers(0, w, b).astype(np.int32)  # wrapped rings
    case = dict(q=q, k=k, v=v, lengths=lengths, ring_start=ring_start)
    if sinks:
        s = 4
        case["sink_k"] = rng.standard_normal((b, hkv, s, d)).astype(np.float32)
        case["sink_v"] = rng.standard_normal((b, hkv, s, d)).astype(np.float32)
        case["sink_lengths"] = rng.integers(0, s + 1, b).astype(np.int32)
    # Round through the tested dtype so the float64 oracle sees exactly the kernel's inputs.
    for key in ("q", "k", "v", "sink_k", "sink_v"):
        if key in case:
            case[key] = np.asarray(jnp.asarray(case[key], dtype).astype(jnp.float32))
    return case


def _oracle(case, scale, softcap=None):
    q, k, v = case["q"], case["k"], case["v"]
    b, tq, hq, d = q.shape
    _, hkv, w, _ = k.shape
    g = hq // hkv
    o = np.zeros(q.shape)
    lse = np.zeros(q.shape[:3])
    probs = np.zeros((b, hkv, w))
    for bi in range(b):
        length, start = case["lengths"][bi], case["ring_start"][bi]
        logical = (np.arange(w) - start) % w
        t = np.arange(tq)[:, None]
        visible = (logical[None, :] < length) & (logical[None, :] <= length - tq + t)  # [Tq, W]
        for h in range(hkv):
            keys, vals, vis = k[bi, h], v[bi, h], visible
            if "sink_k" in case:
                ns = case["sink_lengths"][bi]
                keys = np.concatenate([keys, case["sink_k"][bi, h, :ns]])
                vals = np.concatenate([vals, case["sink_v"][bi, h, :ns]])
                vis = np.concatenate([visible, np.ones((tq, ns), bool)], axis=1)
            for gi in range(g):
                hh = h * g + gi
                oo, ll, pp = attention_f64(q[bi, :, hh], keys, vals, vis, scale, softcap)
                o[bi, :, hh], lse[bi, :, hh] = oo, ll
                probs[bi, h] += pp[:, :w].sum(axis=0)
    return o, lse, probs


CASES = [
    # b, tq, hq, hkv, w,   d,   dtype,      sinks, probs
    (3, 1, 4, 4, 100, 64, "float32", False, True),  # GQA group 1, W not a block multiple
    (2, 1, 8, 2, 130, 128, "float32", True, True),  # group 4 + sinks
    (2, 1, 8, 1, 64, 256, "bfloat16", False, False),  # group 8, D = 256
    (2, 5, 8, 2, 77, 64, "float32", False, True),  # Tq > 1: causal inside the chunk
    (2, 16, 4, 1, 40, 128, "bfloat16", True, False),  # append chunk of 16 rows x group 4 = 64 rows
    (1, 3, 16, 2, 33, 64, "bfloat16", False, True),  # 24 rows -> one 32-row tile
]


@pytest.mark.parametrize("b,tq,hq,hkv,w,d,dtype,sinks,probs", CASES)
@pytest.mark.parametrize("backend", ["interpret", "reference"])
def test_window_attention_matches_float64(rng, backend, b, tq, hq, hkv, w, d, dtype, sinks, probs):
    case = _case(rng, b, tq, hq, hkv, w, d, dtype, sinks)
    args = {k: jnp.asarray(v, dtype) if k in ("q", "k", "v", "sink_k", "sink_v") else jnp.asarray(v)
            for k, v in case.items()}
    out = window_attention(args["q"], args["k"], args["v"], args["lengths"], args["ring_start"],
                           sink_k=args.get("sink_k"), sink_v=args.get("sink_v"),
                           sink_lengths=args.get("sink_lengths"), return_probs=probs, backend=backend,
                           block_k=32)
    o_ref, lse_ref, p_ref = _oracle(case, d**-0.5)
    assert out[0].dtype == jnp.dtype(dtype) and out[1].dtype == jnp.float32
    assert rel_err(out[0], o_ref) < TOL_O[dtype]
    lse = np.asarray(out[1])
    assert np.array_equal(np.isinf(lse), np.isinf(lse_ref)), "empty windows must give lse = -inf exactly"
    fin = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse[fin], lse_ref[fin], rtol=TOL_STATS, atol=TOL_STATS)
    if probs:
        assert out[2].shape == (b, hkv, w) and out[2].dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(out[2]), p_ref, atol=TOL_STATS, rtol=0)


def test_the_tolerances_catch_known_mistakes(rng):
    """Controls: probabilities off by 25 %, a softmax scale off by 10 %, and a bf16 output with one
    more rounding error than allowed all fail the checks above by a wide margin."""
    case = _case(rng, 2, 1, 8, 2, 130, 128, "float32", True)
    args = {k: jnp.asarray(v) for k, v in case.items()}
    o, lse, p = window_attention(args["q"], args["k"], args["v"], args["lengths"], args["ring_start"],
                                 sink_k=args["sink_k"], sink_v=args["sink_v"], sink_lengths=args["sink_lengths"],
                                 return_probs=True, backend="reference")
    o_ref, lse_ref, p_ref = _oracle(case, 128**-0.5)
    assert np.max(np.abs(np.asarray(p) * 1.25 - p_ref)) > 100 * TOL_STATS
    _, lse_bad, _ = window_attention(args["q"], args["k"], args["v"], args["lengths"], args["ring_start"],
                                     sink_k=args["sink_k"], sink_v=args["sink_v"], sink_lengths=args["sink_lengths"],
                                     scale=1.1 * 128**-0.5, return_probs=True, backend="reference")
    fin = np.isfinite(lse_ref)
    assert np.max(np.abs(np.asarray(lse_bad)[fin] - lse_ref[fin])) > 100 * TOL_STATS
    coarse = np.asarray(jnp.asarray(o_ref, jnp.float32).astype(jnp.float8_e4m3fn).astype(jnp.float32))
    assert rel_err(coarse, o_ref) > 4 * TOL_O["bfloat16"]  # an 8-bit output would not pass as bf16


def test_window_attention_empty_window_is_zero_and_minus_inf(rng):
    case = _case(rng, 2, 1, 4, 2, 48, 64, "float32", False)
    lengths = jnp.zeros((2,), jnp.int32)
    o, lse, p = window_attention(jnp.asarray(case["q"]), jnp.asarray(case["k"]), jnp.asarray(case["v"]),
                                 lengths, jnp.asarray(case["ring_start"]), return_probs=True, backend="interpret")
    assert not np.isnan(np.asarray(o)).any() and np.all(np.asarray(o) == 0)
    assert np.all(np.isneginf(np.asarray(lse)))
    assert np.all(np.asarray(p) == 0)


def test_window_attention_splits_agree(rng):
    """Forcing many KV splits (flash-decoding) gives the same result as one split."""
    case = _case(rng, 1, 1, 8, 2, 200, 64, "float32", False)
    args = [jnp.asarray(case[k]) for k in ("q", "k", "v", "lengths", "ring_start")]
    o1, l1 = window_attention(*args, backend="interpret", block_k=16, num_splits=1)
    o2, l2 = window_attention(*args, backend="interpret", block_k=16, num_splits=7)
    assert rel_err(o2, o1) < 1e-6
    np.testing.assert_allclose(np.asarray(l2), np.asarray(l1), rtol=1e-6)


def test_reference_matches_kernel_on_softcap(rng):
    case = _case(rng, 2, 2, 4, 2, 50, 64, "float32", True)
    args = [jnp.asarray(case[k]) for k in ("q", "k", "v", "lengths", "ring_start")]
    sk = dict(sink_k=jnp.asarray(case["sink_k"]), sink_v=jnp.asarray(case["sink_v"]),
              sink_lengths=jnp.asarray(case["sink_lengths"]))
    o1, l1 = window_attention(*args, **sk, softcap=5.0, backend="interpret", block_k=16)
    o_ref, lse_ref, _ = _oracle(case, 64**-0.5, softcap=5.0)
    assert rel_err(o1, o_ref) < 1e-5
    o2, l2 = window_attention_reference(*args, **sk, softcap=5.0)
    assert rel_err(o2, o_ref) < 1e-5


def test_interpreter_poisons_unwritten_outputs():
    """The guarantee the parity tests rely on: an output element no program writes comes back NaN."""

    def kernel(x_ref, o_ref):
        o_ref[pl.ds(0, 8)] = x_ref[pl.ds(0, 8)]  # leaves o[8:] unwritten

    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32), interpret=True)(
        jnp.ones((16,), jnp.float32))
    assert np.all(np.asarray(out[:8]) == 1) and np.all(np.isnan(np.asarray(out[8:])))


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(q_shape=(2, 1, 5, 64)), "multiple of KV heads"),
        (dict(q_shape=(2, 1, 4, 96), kv_d=96), "head_dim=96"),
        (dict(q_shape=(2, 65, 4, 64)), "Tq=65"),
        (dict(kv_dtype=jnp.int8), "k_ring.dtype"),
        (dict(lengths_shape=(3,)), "lengths.shape"),
        (dict(v_w=10), "v_ring.shape"),
    ],
)
def test_window_attention_bad_input_names_the_value(change, match):
    q_shape = change.get("q_shape", (2, 1, 4, 64))
    d = change.get("kv_d", q_shape[-1])
    q = jnp.zeros(q_shape, jnp.float32)
    k = jnp.zeros((2, 2, 16, d), change.get("kv_dtype", jnp.float32))
    v = jnp.zeros((2, 2, change.get("v_w", 16), d), change.get("kv_dtype", jnp.float32))
    lengths = jnp.zeros(change.get("lengths_shape", (2,)), jnp.int32)
    with pytest.raises(ValueError, match=match):
        window_attention(q, k, v, lengths, jnp.zeros((2,), jnp.int32), backend="interpret")
