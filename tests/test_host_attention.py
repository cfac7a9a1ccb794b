"""CPU attention kernels (a) context cache, (b) all stored tokens, (c) chosen blocks vs the float64
reference: random index sets, ragged heads, empty sets, GQA groups, Tq > 1, storage dtypes."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from host import KVStore, StoreConfig, attend_all, attend_blocks, attend_context, from_storage, to_storage
from host.paged_view import PagedKV
from host.attention import paged_attention, paged_token_probabilities, plan_pieces
from host.reference import context_tokens, norm_relative_error, reference_attention, stored_tokens

TOL = 2e-5  # norm-relative, float32 accumulation vs float64 on the same (rounded) inputs


def make_store(rng, *, n_seq=3, hkv=2, d=32, bs=8, kv_dtype="bf16", blocks=None, layers=2):
    store = KVStore(StoreConfig(n_layers=layers, n_kv_heads=hkv, head_dim=d, block_size=bs, kv_dtype=kv_dtype,
                                initial_blocks_per_layer=2, context_page_tokens=16))
    blocks = blocks if blocks is not None else [int(rng.integers(1, 6)) for _ in range(n_seq)]
    for s, nb in enumerate(blocks):
        store.add_sequence(100 + s)
        for layer in range(layers):
            # several appends per sequence, interleaved with others, so slots are not contiguous
            for part in np.array_split(np.arange(nb), 2):
                n = part.size
                if n == 0:
                    continue
                k = rng.standard_normal((n, bs, hkv, d)).astype(np.float32) * 2
                v = rng.standard_normal((n, bs, hkv, d)).astype(np.float32)
                store.append_blocks(layer, 100 + s, k, v, rng.random((n, bs, hkv)),
                                    (part[:, None] * bs + np.arange(bs)).astype(np.int64))
    return store, [100 + s for s in range(len(blocks))]


def queries(rng, b, tq, hq, d):
    return (rng.standard_normal((b, tq, hq, d)) * 1.5).astype(np.float32)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp16", "fp32", "int8"])
@pytest.mark.parametrize("group,tq", [(1, 1), (4, 3), (8, 1)])
def test_all_tokens_matches_reference(rng, kv_dtype, group, tq):
    hkv, d = 2, 32
    store, seqs = make_store(rng, hkv=hkv, d=d, kv_dtype=kv_dtype)
    q = queries(rng, len(seqs), tq, hkv * group, d)
    o, lse, probs = attend_all(store, 1, seqs, q, return_probs=True)
    ks, vs = zip(*[stored_tokens(store, 1, s) for s in seqs])
    ro, rl, rp = reference_attention(q, ks, vs, hkv, return_probs=True)
    assert o.dtype == np.float32 and lse.dtype == np.float32
    assert norm_relative_error(o, ro) < TOL
    assert norm_relative_error(lse, rl) < TOL
    for b, s in enumerate(seqs):
        n = store.n_tokens(1, s)
        for h in range(hkv):
            np.testing.assert_allclose(probs[b, h, :n], rp[b][h], rtol=1e-4, atol=1e-6)
            assert np.all(probs[b, h, n:] == 0)
        # each query head's probabilities sum to 1: the group sum sums to G
        np.testing.assert_allclose(probs[b, :, :n].sum(-1), group, rtol=1e-4)


def test_given_scale_is_used(rng):
    store, seqs = make_store(rng)
    q = queries(rng, len(seqs), 1, 4, 32)
    o, lse = attend_all(store, 0, seqs, q, scale=0.3)
    ks, vs = zip(*[stored_tokens(store, 0, s) for s in seqs])
    ro, rl = reference_attention(q, ks, vs, 2, scale=0.3)
    assert norm_relative_error(o, ro) < TOL and norm_relative_error(lse, rl) < TOL


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
@pytest.mark.parametrize("group", [1, 4])
def test_chosen_blocks_random_ragged_sets(rng, group, kv_dtype):
    hkv, d, bs = 4, 64, 8
    store, seqs = make_store(rng, n_seq=3, hkv=hkv, d=d, bs=bs, blocks=[7, 1, 5], kv_dtype=kv_dtype)
    width = 5
    block_ids = np.full((len(seqs), hkv, width), -1, np.int64)
    for b, s in enumerate(seqs):
        nb = store.n_blocks(0, s)
        for h in range(hkv):
            k = int(rng.integers(0, min(nb, width) + 1))  # ragged, sometimes empty
            chosen = rng.choice(nb, size=k, replace=False)
            block_ids[b, h, rng.choice(width, size=k, replace=False)] = chosen  # padding anywhere
    block_ids[1, 0] = -1  # at least one empty head
    q = queries(rng, len(seqs), 2, hkv * group, d)
    o, lse = attend_blocks(store, 0, seqs, q, block_ids)
    keys, values = [], []
    for b, s in enumerate(seqs):
        kh, vh = [], []
        for h in range(hkv):
            ids = block_ids[b, h][block_ids[b, h] >= 0]
            k_all, v_all = stored_tokens(store, 0, s)
            kh.append(k_all[h].reshape(-1, bs, d)[ids].reshape(-1, d))
            vh.append(v_all[h].reshape(-1, bs, d)[ids].reshape(-1, d))
        keys.append(kh)
        values.append(vh)
    ro, rl = reference_attention(q, keys, values, hkv)
    assert norm_relative_error(o, ro) < TOL
    assert norm_relative_error(lse, rl) < TOL
    assert np.all(lse[1, :, :group] == -np.inf) and np.all(o[1, :, :group] == 0)


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
def test_context_cache_random_index_sets(rng, kv_dtype):
    hkv, d, bs = 2, 32, 8
    store, seqs = make_store(rng, hkv=hkv, d=d, bs=bs, blocks=[6, 3, 4], kv_dtype=kv_dtype)
    layer = 1
    for s in seqs:
        nb = store.n_blocks(layer, s)
        keep = rng.random((hkv, nb, bs)) < rng.random((hkv, 1, 1))  # per-head density: ragged sizes
        keep[0] = False if s == seqs[1] else keep[0]                  # one empty head
        from host.sparsify import _append_kept_locked
        with store.lock:
            _append_kept_locked(store, layer, s, np.arange(nb), keep, np.ones(keep.shape, np.float32))
        counts = store.context.kept_counts(layer, s)
        np.testing.assert_array_equal(counts, keep.sum(axis=(1, 2)))
    q = queries(rng, len(seqs), 1, hkv * 4, d)
    o, lse = attend_context(store, layer, seqs, q)
    ks, vs = zip(*[context_tokens(store, layer, s) for s in seqs])
    ro, rl = reference_attention(q, ks, vs, hkv)
    assert norm_relative_error(o, ro) < TOL and norm_relative_error(lse, rl) < TOL
    assert np.all(lse[1, 0, :4] == -np.inf) and np.all(o[1, 0, :4] == 0)
    assert not np.isnan(o).any()


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp32", "int8"])
def test_context_rows_copied_from_the_store_equal_numpy_gathered_rows(rng, kv_dtype):
    """`append_from_store_locked` (the K/V rows copied straight from the store's arena in parallel,
    host.gather.copy_token_rows) against `append_locked` of the same rows gathered by NumPy fancy
    indexing, on two sequences of one store: random index sets over scattered slots, interleaved
    heads (reordered head-major), an empty head, pages past the table's first capacity. Every field
    of every head's kept tokens must be equal; bad indices are errors, not writes."""
    from host.gather import copy_token_rows

    hkv, d, bs = 3, 16, 4
    store, seqs = make_store(rng, hkv=hkv, d=d, bs=bs, blocks=[40, 40], kv_dtype=kv_dtype)
    layer, arrays = 1, store.layers[1].arrays
    slots_of = store.block_slots(layer, seqs[0])
    keep = rng.random((hkv, 40, bs)) < 0.7
    keep[1] = False
    heads, bi, rows = np.nonzero(keep)
    token_major = np.lexsort((heads, bi * bs + rows))  # the heads interleaved, each head's rows in order
    heads, bi, rows = heads[token_major], bi[token_major], rows[token_major]
    slots = slots_of[bi]
    weights = rng.random(heads.size).astype(np.float32)
    positions, token_index = arrays["positions"][slots, rows], bi * bs + rows
    with store.lock:
        store.context.append_from_store_locked(layer, seqs[0], arrays, heads.astype(np.int64), slots,
                                               rows.astype(np.int64), weights, positions, token_index)
        store.context.append_locked(layer, seqs[1], heads.astype(np.int64), arrays["k"][slots, heads, rows],
                                    arrays["v"][slots, heads, rows], weights, positions, token_index)
    for h in range(hkv):
        got, want = (store.context.kept(layer, s, h) for s in seqs)
        assert got["token_index"].size == keep[h].sum()
        for name in ("k", "v", "weight", "positions", "token_index"):
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"head {h}: {name}")
    out = store.context.layers[layer].arrays
    one = np.zeros(1, np.int64)
    with pytest.raises(IndexError, match="a value of rows outside"):
        copy_token_rows(arrays["k"], arrays["v"], one, one, one + bs, out["k"], out["v"], one, one)
    with pytest.raises(IndexError, match="a value of pages outside"):
        copy_token_rows(arrays["k"], arrays["v"], one, one, one, out["k"], out["v"], one - 1, one)


def test_context_snapshot_page_lists_match_each_heads_kept_tokens(rng):
    """snapshot_locked (the page lists gathered in nopython code) against `kept()`: every unit's
    pages, in order, hold exactly its kept tokens; tables grown past their first capacity, empty
    heads, a sequence order that is not the store's, an unknown sequence and a bad layer."""
    hkv, d, bs = 3, 16, 4
    store, seqs = make_store(rng, hkv=hkv, d=d, bs=bs, blocks=[40, 1, 25])  # 16-token pages: > 8 per head
    from host.sparsify import _append_kept_locked
    layer = 0
    for s in seqs:
        nb = store.n_blocks(layer, s)
        keep = rng.random((hkv, nb, bs)) < rng.uniform(0.3, 1.0, (hkv, 1, 1))
        keep[1] = False  # an empty head in every sequence
        keep[0] |= s == seqs[0]  # 160 tokens: 10 pages, past the table's first capacity of 8
        with store.lock:
            _append_kept_locked(store, layer, s, np.arange(nb), keep, np.ones(keep.shape, np.float32))
    order = [seqs[2], seqs[0], seqs[1]]
    with store.lock:
        view = store.context.snapshot_locked(layer, order)
    page_tokens = view.k_pages.shape[1]
    for i, s in enumerate(order):
        for h in range(hkv):
            u = i * hkv + h
            want = store.context.kept(layer, s, h)["k"]
            pages = view.page_ids[view.page_ptr[u]:view.page_ptr[u + 1]]
            assert view.unit_tokens[u] == want.shape[0] and pages.size == -(-want.shape[0] // page_tokens)
            got = view.k_pages[pages].reshape(-1, view.k_pages.shape[-1])[: want.shape[0]]
            np.testing.assert_array_equal(got, want)
    assert view.page_ptr[-1] == view.page_ids.size and view.page_ptr.size == len(order) * hkv + 1
    with store.lock, pytest.raises(ValueError, match="unknown seq_id=999"):
        store.context.snapshot_locked(layer, [seqs[0], 999])
    with store.lock, pytest.raises(ValueError, match="layer=5"):
        store.context.snapshot_locked(5, seqs)


def test_empty_store_and_sequence(rng):
    store, _ = make_store(rng, blocks=[])
    store.add_sequence(7)
    q = queries(rng, 1, 2, 4, 32)
    for o, lse in (attend_all(store, 0, [7], q), attend_context(store, 0, [7], q),
                   attend_blocks(store, 0, [7], q, np.zeros((1, 2, 0), np.int64))):
        assert np.all(o == 0) and np.all(lse == -np.inf)


def test_work_split_does_not_change_result(rng):
    """One unit split over many work items (cores > batch*heads) equals one item per unit."""
    store, seqs = make_store(rng, n_seq=1, hkv=1, d=32, blocks=[9])
    with store.lock:
        from host.attention import _store_view_locked
        view = _store_view_locked(store, 0, seqs)
    q = queries(rng, 1, 1, 2, 32)
    one = paged_attention(q, view, n_threads=1, min_piece_tokens=10**9)  # one piece
    many = paged_attention(q, view, n_threads=64, min_piece_tokens=1)    # 72 tokens in ~40 pieces
    assert plan_pieces(view, 1, 10**9)[0].shape[0] == 1 and plan_pieces(view, 64, 1)[0].shape[0] > 20
    assert norm_relative_error(many[0], one[0]) < 1e-6 and norm_relative_error(many[1], one[1]) < 1e-6


def test_bf16_and_fp16_round_trip_exact(rng):
    x = rng.standard_normal((5, 4, 3, 16)).astype(np.float32) * 100
    for kv_dtype, np_type in (("bf16", ml_dtypes.bfloat16), ("fp16", np.float16)):
        rounded = x.astype(np_type)
        back = from_storage(to_storage(rounded, kv_dtype), kv_dtype)
        np.testing.assert_array_equal(back, rounded.astype(np.float32))
        np.testing.assert_array_equal(from_storage(to_storage(x, kv_dtype), kv_dtype), rounded.astype(np.float32))
    # the kernel widens exactly: attention over one token returns that token's V bit for bit
    specials = np.array([1.0, -2.5, 3.0e-5, 6.0e-8, 65504.0, -0.0, 1e-3, 7.0], np.float32)  # incl. fp16 subnormals
    for kv_dtype in ("bf16", "fp16"):
        store = KVStore(StoreConfig(n_layers=1, n_kv_heads=1, head_dim=8, block_size=1, kv_dtype=kv_dtype))
        store.add_sequence(0)
        v = specials.reshape(1, 1, 1, 8)
        store.append_blocks(0, 0, np.zeros_like(v), v, np.ones((1, 1, 1)), np.zeros((1, 1), np.int64))
        o, lse = attend_all(store, 0, [0], np.ones((1, 1, 1, 8), np.float32))
        expected = from_storage(to_storage(v, kv_dtype), kv_dtype).reshape(8)
        np.testing.assert_array_equal(o.reshape(8), expected)
        assert lse[0, 0, 0] == 0.0


def test_uint16_bits_accepted_as_is(rng):
    x = rng.standard_normal((1, 8, 2, 32)).astype(ml_dtypes.bfloat16)
    store, _ = make_store(rng, blocks=[])
    store.add_sequence(1)
    store.append_blocks(0, 1, x.view(np.uint16), x, np.ones((1, 8, 2)), np.zeros((1, 8), np.int64))
    d = store.read_blocks(0, 1)
    np.testing.assert_array_equal(d["k"], d["v"])
    np.testing.assert_array_equal(d["k"], x.view(np.uint16))


@pytest.mark.parametrize("bad,match", [
    (lambda q: q.astype(np.float64), "float32"),
    (lambda q: q[..., :16], "head dim"),
    (lambda q: q[:, :, :3], "multiple of Hkv"),
    (lambda q: q[:1], "batch"),
    (lambda q: q[0], "shape"),
])
def test_bad_queries_name_the_problem(rng, bad, match):
    store, seqs = make_store(rng)
    q = queries(rng, len(seqs), 1, 4, 32)
    with pytest.raises(ValueError, match=match):
        attend_all(store, 0, seqs, bad(q))


def test_bad_ids_name_the_problem(rng):
    store, seqs = make_store(rng, blocks=[2, 2])
    q = queries(rng, 2, 1, 4, 32)
    with pytest.raises(ValueError, match="unknown seq_id=12345"):
        attend_context(store, 0, [seqs[0], 12345], q)
    with pytest.raises(ValueError, match="layer=5"):
        attend_all(store, 5, seqs, q)
    with pytest.raises(ValueError, match="block id 2"):
        attend_blocks(store, 0, seqs, q, np.array([[[0, 2], [0, 1]], [[0, 1], [1, -1]]]))
    with pytest.raises(ValueError, match="duplicate"):
        attend_blocks(store, 0, seqs, q, np.array([[[1, 1], [0, 1]], [[0, 1], [1, -1]]]))
    with pytest.raises(ValueError, match="block_ids shape"):
        attend_blocks(store, 0, seqs, q, np.zeros((2, 3, 1), np.int64))


def test_long_context_parity(rng):
    """64K tokens per head, D=128, G=8, Tq=2: float32 accumulation stays within tolerance."""
    hkv, d, bs = 2, 128, 64
    store, seqs = make_store(rng, hkv=hkv, d=d, bs=bs, blocks=[1024], layers=1)
    q = queries(rng, 1, 2, hkv * 8, d)
    o, lse = attend_all(store, 0, seqs, q)
    ks, vs = stored_tokens(store, 0, seqs[0])
    ro, rl = reference_attention(q, [ks], [vs], hkv)
    assert norm_relative_error(o, ro) < 1e-4 and norm_relative_error(lse, rl) < 1e-5


def _random_paged_view(rng, kv_dtype, d, page_tokens, unit_tokens, n_kv_heads, spare_pages=3):
    """A PagedKV over shuffled pages of random values; returns (view, keys[b][h], values[b][h])."""
    from host.store_format import FORMAT_CODE

    pages_per_unit = [-(-n // page_tokens) for n in unit_tokens]
    n_pages = sum(pages_per_unit) + spare_pages
    k = (rng.standard_normal((n_pages, page_tokens, d)) * 2).astype(np.float32)
    v = rng.standard_normal((n_pages, page_tokens, d)).astype(np.float32)
    ks, vs = to_storage(k, kv_dtype), to_storage(v, kv_dtype)
    kf, vf = from_storage(ks, kv_dtype), from_storage(vs, kv_dtype)
    order = rng.permutation(n_pages)
    page_ptr = np.zeros(len(unit_tokens) + 1, np.int64)
    np.cumsum(pages_per_unit, out=page_ptr[1:])
    page_ids = order[:page_ptr[-1]].astype(np.int64)
    if kv_dtype == "int8":  # the kernel must read each row's own scale: make them differ widely
        row_scale = np.float32(2.0) ** rng.integers(-6, 7, size=(n_pages, page_tokens, 1)).astype(np.float32)
        ks, vs = to_storage(k * row_scale, kv_dtype), to_storage(v * row_scale[::-1], kv_dtype)
        kf, vf = from_storage(ks, kv_dtype), from_storage(vs, kv_dtype)
    keys, values = [], []
    for u, n in enumerate(unit_tokens):
        if u % n_kv_heads == 0:
            keys.append([])
            values.append([])
        pages = page_ids[page_ptr[u]:page_ptr[u + 1]]
        keys[-1].append(kf[pages].reshape(-1, d)[:n])  # kf: dequantized values, [.., D] for every format
        values[-1].append(vf[pages].reshape(-1, d)[:n])
    view = PagedKV(ks, vs, FORMAT_CODE[kv_dtype], page_ptr, page_ids, np.asarray(unit_tokens, np.int64), n_kv_heads)
    return view, keys, values


@pytest.mark.parametrize("kv_dtype,d", [("bf16", 128), ("bf16", 64), ("fp16", 64), ("fp32", 128), ("int8", 128),
                                        ("int8", 32), ("int8", 16)])  # int8 D=16: the widening (non-SIMD) path
@pytest.mark.parametrize("group,tq", [(4, 1), (2, 3), (3, 1), (1, 2)])
def test_large_pages_ragged_units_row_blocks(rng, kv_dtype, d, group, tq):
    """Pages of 256 tokens (several kernel chunks and prefetch windows per page), ragged unit sizes
    (partial last pages, token counts not multiples of 4, an empty unit) and query-row counts that
    are / are not multiples of the kernel's 4-row blocks, over several work-item splits."""
    hkv = 2
    unit_tokens = [700, 0, 1, 37, 513, 256]  # B = 3 sequences x Hkv = 2
    view, keys, values = _random_paged_view(rng, kv_dtype, d, 256, unit_tokens, hkv)
    q = queries(rng, 3, tq, hkv * group, d)
    ro, rl = reference_attention(q, keys, values, hkv)
    for split in ({}, {"n_threads": 1, "min_piece_tokens": 10**6}, {"n_threads": 7, "min_piece_tokens": 16}):
        o, lse = paged_attention(q, view, **split)
        assert norm_relative_error(o, ro) < TOL and norm_relative_error(lse, rl) < TOL
        assert np.all(lse[0, :, group:] == -np.inf) and np.all(o[0, :, group:] == 0)  # unit 1 = (b 0, h 1)


# ---- work split over tokens (pieces) ---------------------------------------------------------------

def _check_plan(unit_tokens, n_threads, min_piece):
    view = PagedKV(np.zeros((1, 1, 1), np.uint16), np.zeros((1, 1, 1), np.uint16), 1,
                   np.zeros(len(unit_tokens) + 1, np.int64), np.zeros(0, np.int64),
                   np.asarray(unit_tokens, np.int64), 1)
    unit, lo, hi, ptr = plan_pieces(view, n_threads, min_piece)
    assert np.all(hi > lo), "empty piece"
    assert np.all(np.diff(unit) >= 0), "pieces not in unit order"
    np.testing.assert_array_equal(np.diff(ptr), np.bincount(unit, minlength=len(unit_tokens)))
    for u, n in enumerate(unit_tokens):  # each unit's tokens covered exactly once, in order
        sl = slice(ptr[u], ptr[u + 1])
        assert np.all(unit[sl] == u)
        if n == 0:
            assert ptr[u + 1] == ptr[u]
            continue
        assert lo[sl][0] == 0 and hi[sl][-1] == n and np.array_equal(lo[sl][1:], hi[sl][:-1])
        align = min(16, min_piece)
        assert np.all(hi[sl][:-1] % align == 0), "cut inside a unit off the alignment"
    return unit, lo, hi, ptr


def test_plan_pieces_cover_ragged_units_exactly_once(rng):
    for _ in range(50):
        n_units = int(rng.integers(0, 40))
        tokens = [int(x) if rng.random() > 0.2 else 0 for x in rng.integers(0, 3000, n_units)]
        _check_plan(tokens, int(rng.integers(1, 33)), int(rng.choice([1, 5, 16, 64, 300])))
    unit, _, _, _ = _check_plan([], 16, 64)
    assert unit.shape[0] == 0
    unit, _, _, _ = _check_plan([0, 0, 0], 16, 64)
    assert unit.shape[0] == 0


@pytest.mark.parametrize("tokens", [1024, 4096, 65536])
def test_plan_pieces_split_few_units_over_all_threads(tokens):
    """B*Hkv = 8 units on 16 threads: each unit is cut into several pieces, at least 2x as many
    pieces as threads, and the last pieces handed out are small (all threads finish together)."""
    unit, lo, hi, ptr = _check_plan([tokens] * 8, 16, 64)
    assert unit.shape[0] >= 32
    assert np.all(np.diff(ptr) >= 4)
    sizes = hi - lo
    assert sizes[-16:].max() <= max(64, tokens * 8 // 64)  # tail pieces: a small share each
    assert sizes.max() <= -(-tokens * 8 // 32) + 16       # no piece above 1/(2*threads) of the work


@pytest.mark.parametrize("kv_dtype,d", [("bf16", 128), ("fp16", 64), ("fp32", 32), ("int8", 64)])
@pytest.mark.parametrize("group,tq", [(4, 1), (3, 2), (1, 1)])
def test_split_path_matches_reference(rng, kv_dtype, d, group, tq):
    """8 units (B=2, Hkv=4) with ragged sizes (empty, 1 token, off the 16-token alignment, several
    64-token pages) split over many pieces: float64 parity, and equal to the unsplit result."""
    hkv = 4
    unit_tokens = [1000, 0, 1, 129, 640, 77, 0, 1523]
    view, keys, values = _random_paged_view(rng, kv_dtype, d, 64, unit_tokens, hkv)
    q = queries(rng, 2, tq, hkv * group, d)
    ro, rl = reference_attention(q, keys, values, hkv)
    whole = paged_attention(q, view, n_threads=1, min_piece_tokens=10**6)
    assert plan_pieces(view, 1, 10**6)[0].shape[0] == 6  # one piece per non-empty unit
    for n_threads, min_piece in ((16, 64), (16, 16), (5, 1)):
        assert plan_pieces(view, n_threads, min_piece)[0].shape[0] > 2 * n_threads
        o, lse = paged_attention(q, view, n_threads=n_threads, min_piece_tokens=min_piece)
        assert norm_relative_error(o, ro) < TOL and norm_relative_error(lse, rl) < TOL
        assert norm_relative_error(o, whole[0]) < 1e-6 and norm_relative_error(lse, whole[1]) < 1e-6
        for u in (1, 6):  # empty units
            b, h = divmod(u, hkv)
            heads = slice(h * group, (h + 1) * group)
            assert np.all(lse[b, :, heads] == -np.inf) and np.all(o[b, :, heads] == 0)
    o, lse, probs = paged_attention(q, view, return_probs=True, n_threads=16, min_piece_tokens=16)
    _, _, rp = reference_attention(q, keys, values, hkv, return_probs=True)
    for u, n in enumerate(unit_tokens):
        b, h = divmod(u, hkv)
        # A probability moves by at most p(1-p) times its score's error, and float32 scores are off by
        # a few ulps of their magnitude: int8 rows scaled by up to 64 give scores in the thousands.
        heads = slice(h * group, (h + 1) * group)
        score_bound = (np.linalg.norm(q[b, :, heads], axis=-1).max() / np.sqrt(d)
                       * (np.linalg.norm(keys[b][h], axis=-1).max() if n else 0.0))
        atol = 1e-6 + 4 * np.finfo(np.float32).eps * score_bound
        np.testing.assert_allclose(probs[b, h, :n], rp[b][h], rtol=1e-4, atol=atol)
        assert np.all(probs[b, h, n:] == 0)
    # the probabilities without the attention output (hgca's re-scoring): one pass over the keys,
    # the same probabilities, and its own lse over the split pieces
    for n_threads, min_piece in ((1, 10**6), (16, 16), (5, 1)):
        lse_only, probs_only = paged_token_probabilities(q, view, n_threads=n_threads, min_piece_tokens=min_piece)
        assert norm_relative_error(lse_only, rl) < TOL
        np.testing.assert_allclose(probs_only, probs, rtol=1e-5, atol=1e-7)


def test_result_independent_of_numba_thread_count(rng):
    """Workers = numba threads of the caller; fewer threads than planned pieces still do them all."""
    import numba

    view, keys, values = _random_paged_view(rng, "bf16", 64, 64, [900, 300, 0, 2000], 2)
    q = queries(rng, 2, 1, 8, 64)
    ro, rl = reference_attention(q, keys, values, 2)
    old = numba.get_num_threads()
    try:
        for threads in sorted({1, old}):
            numba.set_num_threads(threads)
            o, lse = paged_attention(q, view, n_threads=16, min_piece_tokens=16)
            assert norm_relative_error(o, ro) < TOL and norm_relative_error(lse, rl) < TOL
    finally:
        numba.set_num_threads(old)


def test_all_units_empty_and_bad_views(rng):
    view, _, _ = _random_paged_view(rng, "bf16", 32, 16, [0, 0, 0, 0], 2)
    o, lse = paged_attention(queries(rng, 2, 2, 4, 32), view)
    assert o.shape == (2, 2, 4, 32) and np.all(o == 0) and np.all(lse == -np.inf)
    view, _, _ = _random_paged_view(rng, "bf16", 32, 16, [20, 5], 2)
    bad = PagedKV(view.k_pages, view.v_pages, view.fmt, view.page_ptr, view.page_ids,
                  np.asarray([33, 5], np.int64), 2)
    with pytest.raises(ValueError, match="exceed the units' pages"):
        paged_attention(queries(rng, 1, 1, 2, 32), bad)
    with pytest.raises(ValueError, match="min_piece_tokens=0"):
        paged_attention(queries(rng, 1, 1, 2, 32), view, min_piece_tokens=0)
    with pytest.raises(ValueError, match="head dim 16"):
        paged_attention(queries(rng, 1, 1, 2, 16), view)


# ---- selected blocks on the production path (issue 29 item 3) ---------------------------------------

@pytest.mark.parametrize("kv_dtype,d", [("bf16", 16), ("bf16", 64), ("fp16", 64), ("fp32", 48), ("int8", 64),
                                        ("int8", 16)])
@pytest.mark.parametrize("page_tokens", [16, 5])
def test_small_pages_chunks_across_pages_poisoned_outputs(rng, kv_dtype, d, page_tokens):
    """Chunks that span many small pages (segments at column offsets, odd segment lengths, partial
    last pages), SIMD and loop-vectorised paths, several work splits: every output row written
    (outputs poisoned with NaN first) and equal to the float64 reference."""
    from host.attention import _attention_kernel_into

    hkv, group = 2, 4
    unit_tokens = [700, 0, 13, 37, 512, 1]  # B = 3 x Hkv = 2
    view, keys, values = _random_paged_view(rng, kv_dtype, d, page_tokens, unit_tokens, hkv)
    q = queries(rng, 3, 1, hkv * group, d)
    ro, rl = reference_attention(q, keys, values, hkv)
    for n_threads, min_piece in ((1, 10**6), (16, 16), (7, 1)):
        o = np.full(q.shape, np.nan, np.float32)
        lse = np.full(q.shape[:3], np.nan, np.float32)
        unit, lo, hi, ptr = plan_pieces(view, n_threads, min_piece)
        _attention_kernel_into(q, view.k_pages, view.v_pages, view.fmt, view.page_ptr, view.page_ids, hkv,
                               np.float32(1 / np.sqrt(d)), unit, lo, hi, ptr, n_threads, o, lse)
        assert norm_relative_error(o, ro) < TOL and norm_relative_error(lse, rl) < TOL
        assert np.all(lse[0, :, group:] == -np.inf) and np.all(o[0, :, group:] == 0)


def _scattered_block_store(rng, kv_dtype, n_slots, hkv, bs, d):
    """k, v pages [n_slots * Hkv, bs, W] of random values (int8: row scales spread over 2^-6..2^6)
    and their float32 values [n_slots * Hkv, bs, D]."""
    k = (rng.standard_normal((n_slots * hkv, bs, d)) * 2).astype(np.float32)
    v = rng.standard_normal((n_slots * hkv, bs, d)).astype(np.float32)
    if kv_dtype == "int8":
        k = k * np.float32(2.0) ** rng.integers(-6, 7, size=(n_slots * hkv, bs, 1)).astype(np.float32)
        v = v * np.float32(2.0) ** rng.integers(-6, 7, size=(n_slots * hkv, bs, 1)).astype(np.float32)
    ks, vs = to_storage(k, kv_dtype), to_storage(v, kv_dtype)
    return ks, vs, from_storage(ks, kv_dtype), from_storage(vs, kv_dtype)


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
@pytest.mark.parametrize("bs", [16, 32, 64])
@pytest.mark.parametrize("group", [4, 1])
def test_serve_blocks_matches_reference_on_scattered_blocks(rng, kv_dtype, bs, group):
    """The native exchange's block path (`serve_blocks`: int32 ids -> page lists -> kernel -> the
    output slots, as scout's CPU part runs) on fresh random inputs: blocks scattered over the arena
    (sequences' slots interleaved), ragged counts, -1 padding anywhere, empty lists, long lists
    split over pieces, two layers per call, GQA. Output slots are poisoned (NaN) first, so a row
    the kernel does not write fails; float64 reference on the dequantized rows."""
    from host.exchange_worker import serve_blocks
    from host.store_format import FORMAT_CODE

    hkv, d, batch, n_layers, k_max = 2, 64, 3, 2, 45
    hq = hkv * group
    n_slots = 160
    ks, vs, kf, vf = _scattered_block_store(rng, kv_dtype, n_slots, hkv, bs, d)
    n_have = np.array([60, 7, 45])  # blocks each sequence has in the store
    perm = rng.permutation(n_slots)
    slot_table = np.zeros((batch, n_have.max()), np.int64)
    start = 0
    for b, nb in enumerate(n_have):
        slot_table[b, :nb] = perm[start:start + nb]
        start += nb
    ids = np.full((n_layers, batch, hkv, k_max), -1, np.int32)
    for layer in range(n_layers):
        for b in range(batch):
            for h in range(hkv):
                count = int(rng.integers(0, min(n_have[b], k_max) + 1))
                if (layer, b, h) == (0, 1, 0):
                    count = 0  # an empty list
                if (layer, b, h) == (1, 0, 1):
                    count = k_max  # a long list: split over several pieces
                chosen = rng.choice(n_have[b], size=count, replace=False)
                ids[layer, b, h, rng.choice(k_max, size=count, replace=False)] = chosen
    q = queries(rng, n_layers * batch, 1, hq, d).reshape(n_layers, batch, 1, hq, d)
    slots_q = tuple(q[i].reshape(-1).copy() for i in range(n_layers))
    slots_ids = tuple(ids[i].reshape(-1).copy() for i in range(n_layers))
    slots_o = tuple(np.full(batch * hq * d, np.nan, np.float32) for _ in range(n_layers))
    slots_lse = tuple(np.full(batch * hq, np.nan, np.float32) for _ in range(n_layers))
    layers = np.arange(n_layers, dtype=np.int32)
    served = np.zeros(n_layers, np.uint32)
    ready = np.ones(n_layers, np.uint32)
    done = np.zeros(n_layers, np.uint32)
    last_ids = np.full((n_layers, batch * hkv * k_max), -7, np.int32)
    stats = np.zeros(2, np.int64)
    n, bad = serve_blocks(layers, served, ready, done, np.zeros(1, np.uint32), slots_q, slots_ids, slots_o,
                          slots_lse, batch, hq, d, hkv, k_max, np.float32(1 / np.sqrt(d)), 16, FORMAT_CODE[kv_dtype],
                          bs, (ks,) * n_layers, (vs,) * n_layers,
                          np.broadcast_to(slot_table, (n_layers,) + slot_table.shape).copy(),
                          # C order, as the exchange builds it (.astype of a broadcast is F order: a
                          # second compilation of serve_blocks that nothing else uses)
                          np.broadcast_to(n_have, (n_layers, batch)).astype(np.int64, order="C"), last_ids, stats)
    assert (n, bad) == (n_layers, -1)
    assert np.all(done == 1) and np.all(served == 1)
    np.testing.assert_array_equal(last_ids, ids.reshape(n_layers, -1))
    assert stats[0] == (ids >= 0).sum() * bs
    for layer in range(n_layers):
        keys = [[kf[slot_table[b, ids[layer, b, h][ids[layer, b, h] >= 0]] * hkv + h].reshape(-1, d)
                 for h in range(hkv)] for b in range(batch)]
        values = [[vf[slot_table[b, ids[layer, b, h][ids[layer, b, h] >= 0]] * hkv + h].reshape(-1, d)
                   for h in range(hkv)] for b in range(batch)]
        ro, rl = reference_attention(q[layer], keys, values, hkv)
        o = slots_o[layer].reshape(batch, 1, hq, d)
        lse = slots_lse[layer].reshape(batch, 1, hq)
        assert norm_relative_error(o, ro) < TOL and norm_relative_error(lse, rl) < TOL
    assert np.all(slots_lse[0].reshape(batch, hq)[1, :group] == -np.inf)
    assert np.all(slots_o[0].reshape(batch, hq, d)[1, :group] == 0)
