"""`full` with a packed step (`PackedRows`: some rows' prefill chunks and every row's decode token in
one token row) against a float64 oracle built from the positions directly: the cache it leaves (each
valid token's K, V at its position, nothing else touched) and every query's output over the keys of
its own row up to its position. Fresh random inputs; GQA; a padding chunk row that is also a decoding
row; ragged chunks; rows in neither group; a sliding window."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jhybrid.attention.base import LayerContext
from jhybrid.attention.full import FullAttention, PackedRows, pack_rows
from oracle import attention_f64, rel_err

B, L, HQ, HKV, D, C = 4, 48, 8, 2, 64, 8
SCALE = D ** -0.5


def _case(rng):
    """Row 0 prefills 8 tokens from 5, row 2 its last 3 from 20 (the rest of its chunk padding), row 1
    decodes at 30 and is the padding chunk row (R = 4 rounded: rows 0, 2, 1, 3), row 3 decodes at 11."""
    lengths = np.array([5, 30, 20, 11], np.int32)
    rows = np.array([0, 2, 1, 3], np.int32)
    chunk_positions = np.full((4, C), -1, np.int32)
    chunk_positions[0] = np.arange(5, 5 + C)
    chunk_positions[1, :3] = np.arange(20, 23)
    decode_positions = np.array([-1, 30, -1, 11], np.int32)
    return lengths, rows, chunk_positions, decode_positions


def _expected(rng_cache, lengths, rows, chunk_positions, decode_positions, q, k, v, window):
    """(k cache, v cache, o [1, N, Hq, D]) in float64 from the positions alone."""
    k_cache, v_cache = (np.asarray(x, np.float64).copy() for x in rng_cache)
    token_row = np.concatenate([np.repeat(rows, C), np.arange(B)])
    token_pos = np.concatenate([chunk_positions.reshape(-1), decode_positions])
    new_len = lengths.copy()
    for i, (row, pos) in enumerate(zip(token_row, token_pos)):
        if pos >= 0:
            k_cache[row, pos], v_cache[row, pos] = k[0, i], v[0, i]
            new_len[row] = max(new_len[row], pos + 1)
    o = np.zeros(q.shape)
    keys = np.arange(L)
    for i, (row, pos) in enumerate(zip(token_row, token_pos)):
        if pos < 0:
            continue
        visible = (keys <= pos) & (keys < new_len[row])
        if window is not None:
            visible &= pos - keys < window
        for h in range(HQ):
            o[0, i, h] = attention_f64(q[0, i, h][None], k_cache[row, :, h // (HQ // HKV)],
                                       v_cache[row, :, h // (HQ // HKV)], visible[None], SCALE)[0][0]
    return k_cache, v_cache, o, token_pos


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("prefill_backend", ["jnp", "interpret", pytest.param("triton", marks=pytest.mark.gpu)])
def test_packed_step_stores_and_attends_each_group_in_its_own_row(rng, prefill_backend, window):
    lengths, rows, chunk_positions, decode_positions = _case(rng)
    n = len(rows) * C + B
    q = rng.standard_normal((1, n, HQ, D)).astype(np.float32)
    k = rng.standard_normal((1, n, HKV, D)).astype(np.float32)
    v = rng.standard_normal((1, n, HKV, D)).astype(np.float32)
    cache = [rng.standard_normal((B, L, HKV, D)).astype(np.float32) for _ in range(2)]
    positions = np.asarray(pack_rows(jnp.asarray(chunk_positions), jnp.asarray(decode_positions)))
    prefill_lengths = np.maximum(lengths[rows], chunk_positions.max(axis=1) + 1)
    decode_lengths = np.maximum(lengths, decode_positions + 1)
    meta = PackedRows(rows=jnp.asarray(rows), prefill_lengths=jnp.asarray(prefill_lengths),
                      decode_lengths=jnp.asarray(decode_lengths))
    context = LayerContext(scale=SCALE, num_layers=1, sliding_window=window, meta=meta)
    with jax.default_matmul_precision("highest"):  # float32 dots on the GPU are TF32 otherwise
        out, layer, _ = FullAttention(prefill_backend).attend(
            0, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(positions), jnp.zeros(1, jnp.int32),
            {"k": jnp.asarray(cache[0]), "v": jnp.asarray(cache[1])}, context)

    k_ref, v_ref, o_ref, token_pos = _expected(cache, lengths, rows, chunk_positions, decode_positions, q, k, v,
                                               window)
    np.testing.assert_array_equal(np.asarray(layer["k"]), k_ref.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(layer["v"]), v_ref.astype(np.float32))
    out = np.asarray(out)
    valid = token_pos >= 0
    assert rel_err(out[0, valid], o_ref[0, valid]) < 1e-5
    assert np.all(out[0, ~valid] == 0), "padding tokens must come back zero"


def test_split_inverts_pack():
    chunks, decode = jnp.arange(24).reshape(3, 8), jnp.arange(100, 104)
    meta = PackedRows(rows=jnp.arange(3), prefill_lengths=jnp.zeros(3), decode_lengths=jnp.zeros(4))
    back_chunks, back_decode = meta.split(pack_rows(chunks, decode))
    np.testing.assert_array_equal(back_chunks, chunks)
    np.testing.assert_array_equal(back_decode[:, 0], decode)
