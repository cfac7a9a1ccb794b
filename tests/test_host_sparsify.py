"""Per-head sparsification on crafted weights, renormalisation, re-evaluation after an append."""

from __future__ import annotations

import math

import numpy as np
import pytest

from host import KVStore, StoreConfig, attend_context, reevaluate, salience_threshold, sparsify_evicted
from host.reference import context_tokens, norm_relative_error, reference_attention, stored_tokens

BS, HKV, D = 8, 2, 32


def new_store(rng, n_blocks=4, maw=None, seq=0):
    store = KVStore(StoreConfig(n_layers=1, n_kv_heads=HKV, head_dim=D, block_size=BS, kv_dtype="bf16",
                                initial_blocks_per_layer=2, context_page_tokens=8))
    store.add_sequence(seq)
    k = rng.standard_normal((n_blocks, BS, HKV, D)).astype(np.float32)
    v = rng.standard_normal((n_blocks, BS, HKV, D)).astype(np.float32)
    if maw is None:
        maw = rng.random((n_blocks, BS, HKV)).astype(np.float32) / (n_blocks * BS)
    pos = 100 + np.arange(n_blocks * BS).reshape(n_blocks, BS)
    numbers = store.append_blocks(0, seq, k, v, maw, pos)
    return store, numbers, k


def test_sharp_head_keeps_few_flat_head_keeps_many(rng):
    window = 64
    n_blocks = 4
    maw = np.empty((n_blocks, BS, HKV), np.float32)
    maw[..., 0] = 1e-5                       # sharp head: almost all weight elsewhere ...
    maw[:, 3, 0] = 0.2                       # ... except one token per block
    maw[..., 1] = 1.5 / window               # flat head: everything just over 1 / window
    store, numbers, _ = new_store(rng, n_blocks, maw)
    added = sparsify_evicted(store, 0, [0], [numbers[:2]], beta=1.0, window_tokens=window)
    np.testing.assert_array_equal(added, [[2, 2 * BS]])
    added = sparsify_evicted(store, 0, [0], [numbers[2:]], beta=1.0, window_tokens=window)
    np.testing.assert_array_equal(added, [[2, 2 * BS]])
    counts = store.context.kept_counts(0, 0)
    np.testing.assert_array_equal(counts, [n_blocks, n_blocks * BS])
    sharp, flat = store.context.kept(0, 0, 0), store.context.kept(0, 0, 1)
    np.testing.assert_array_equal(sharp["positions"], 100 + 3 + BS * np.arange(n_blocks))
    np.testing.assert_array_equal(flat["positions"], 100 + np.arange(n_blocks * BS))
    for kept in (sharp, flat):
        assert math.isclose(kept["weight_normalised"].sum(), 1.0, rel_tol=1e-12)
    np.testing.assert_allclose(sharp["weight_normalised"], 1 / n_blocks)
    # a higher beta drops the flat head entirely; nothing is dropped from the store
    store2, numbers2, _ = new_store(rng, n_blocks, maw)
    added = sparsify_evicted(store2, 0, [0], [numbers2], beta=2.0, window_tokens=window)
    np.testing.assert_array_equal(added, [[n_blocks, 0]])
    assert store2.n_tokens(0, 0) == n_blocks * BS
    # the context kernel attends exactly the kept tokens
    q = rng.standard_normal((1, 1, HKV * 4, D)).astype(np.float32)
    o, lse = attend_context(store, 0, [0], q)
    ks, vs = context_tokens(store, 0, 0)
    ro, rl = reference_attention(q, [ks], [vs], HKV)
    assert norm_relative_error(o, ro) < 2e-5 and norm_relative_error(lse, rl) < 2e-5


def test_threshold_is_strict_and_beta_validated():
    assert salience_threshold(1.0, 100) == 0.01
    for beta in (0, -1.0, math.inf, math.nan, "1", True):
        with pytest.raises(ValueError, match="beta="):
            salience_threshold(beta, 10)
    with pytest.raises(ValueError, match="A.size=0"):
        salience_threshold(1.0, 0)


def test_bad_sparsify_input(rng):
    store, numbers, _ = new_store(rng)
    with pytest.raises(ValueError, match="beta=0"):
        sparsify_evicted(store, 0, [0], [numbers], beta=0, window_tokens=16)
    with pytest.raises(ValueError, match="unknown seq_id=5"):
        sparsify_evicted(store, 0, [5], [numbers], beta=1, window_tokens=16)
    with pytest.raises(ValueError, match=r"block numbers \[7\]"):
        sparsify_evicted(store, 0, [0], [[7]], beta=1, window_tokens=16)
    with pytest.raises(ValueError, match="beta=inf"):
        reevaluate(store, 0, [0], np.zeros((1, 1, HKV, D), np.float32), beta=math.inf)
    assert store.context.kept_counts(0, 0).sum() == 0


def test_reevaluation_reinstates_a_token_that_became_important(rng):
    n_blocks = 4
    maw = np.full((n_blocks, BS, HKV), 1e-6, np.float32)
    maw[0, :, :] = 1.0                               # at eviction only block 0 looked important
    store, numbers, k = new_store(rng, n_blocks, maw)
    sparsify_evicted(store, 0, [0], [numbers], beta=1.0, window_tokens=32)
    target_block, target_row = 2, 5
    target_index = target_block * BS + target_row
    for h in range(HKV):
        assert target_index not in store.context.kept(0, 0, h)["token_index"]
    # the new user turn's queries point at the target token's key (both heads of each group)
    stored_k, _ = stored_tokens(store, 0, 0)
    group = 2
    q = np.zeros((1, 3, HKV * group, D), np.float32)
    for h in range(HKV):
        q[0, :, h * group:(h + 1) * group] = 4.0 * stored_k[h][target_index]
    counts = reevaluate(store, 0, [0], q, beta=1.0)
    ks, vs = stored_tokens(store, 0, 0)
    _, _, ref_probs = reference_attention(q, [ks], [vs], HKV, return_probs=True)
    n_tok = n_blocks * BS
    for h in range(HKV):
        kept = store.context.kept(0, 0, h)
        assert target_index in kept["token_index"]
        expected = np.flatnonzero(ref_probs[0][h] > 1.0 / n_tok)
        np.testing.assert_array_equal(kept["token_index"], expected)
        assert counts[0, h] == expected.size < n_tok
        assert math.isclose(kept["weight_normalised"].sum(), 1.0, rel_tol=1e-9)
        np.testing.assert_array_equal(kept["positions"], 100 + expected)
    assert store.n_tokens(0, 0) == n_tok  # nothing dropped from the store


def test_reevaluation_keeps_selection_of_blocks_evicted_later(rng):
    store, numbers, _ = new_store(rng, 2)
    q = rng.standard_normal((1, 1, HKV, D)).astype(np.float32)
    # score snapshot covers 2 blocks; then a new block arrives and is sparsified before the rebuild
    from host import sparsify as sp
    real_probabilities = sp.token_probabilities

    newer = {}  # per head: the new block's kept tokens before the rebuild (every field)

    def attend_then_append(*args, **kwargs):
        out = real_probabilities(*args, **kwargs)
        kk = rng.standard_normal((1, BS, HKV, D)).astype(np.float32)
        vv = rng.standard_normal((1, BS, HKV, D)).astype(np.float32)
        new = store.append_blocks(0, 0, kk, vv, np.ones((1, BS, HKV)), 7 + np.arange(BS)[None])
        sparsify_evicted(store, 0, [0], [new], beta=1.0, window_tokens=16)
        for h in range(HKV):
            kept = store.context.kept(0, 0, h)
            newer[h] = {name: x[kept["token_index"] >= 2 * BS] for name, x in kept.items()
                        if name != "weight_normalised"}
        return out

    sp.token_probabilities = attend_then_append
    try:
        reevaluate(store, 0, [0], q, beta=1.0)
    finally:
        sp.token_probabilities = real_probabilities
    for h in range(HKV):
        kept = store.context.kept(0, 0, h)
        after = kept["token_index"] >= 2 * BS
        assert np.sum(after) == BS   # the whole new block (MAW 1 > 1/16) survived the rebuild ...
        assert np.all(kept["token_index"][:-BS] < 2 * BS)  # ... after the rescored ones, in order
        for name, want in newer[h].items():  # ... every field as eviction-time sparsify kept it
            np.testing.assert_array_equal(kept[name][after], want, err_msg=name)
        np.testing.assert_array_equal(newer[h]["positions"], 7 + np.arange(BS))


def test_extend_spans_keeps_the_tokens_after_each_kept_one_across_blocks():
    from host.sparsify import extend_spans

    keep = np.zeros((2, 3, 4), bool)  # [Hkv, blocks, block_size]: tokens 0..11 per head
    keep[0, 0, 3] = True              # token 3: spans into block 1 (tokens 4, 5)
    keep[0, 2, 2] = True              # token 10: the span stops at the last token (11)
    keep[1, 1, 0] = True              # token 4 of head 1 only
    got = extend_spans(keep, 2).reshape(2, -1)
    assert np.flatnonzero(got[0]).tolist() == [3, 4, 5, 10, 11]
    assert np.flatnonzero(got[1]).tolist() == [4, 5, 6]
    assert extend_spans(keep, 0) is keep
    assert np.array_equal(extend_spans(keep, 50).reshape(2, -1)[1], np.arange(12) >= 4)
    with pytest.raises(ValueError, match="keep_after=-1"):
        extend_spans(keep, -1)


@pytest.mark.parametrize("where", ["evicted", "reevaluate"])
def test_keep_after_adds_the_continuation_of_each_kept_token(rng, where):
    """Same store and scores with keep_after 0 and 3: the second selection is the first plus the
    3 tokens after each of its tokens (within the stored tokens), per head."""
    n_blocks = 4
    maw = np.full((n_blocks, BS, HKV), 1e-6, np.float32)
    maw[1, 6, :] = 1.0   # salient at eviction: spans into block 2
    maw[3, 7, 0] = 1.0   # the last stored token of head 0: nothing after it
    seed = int(rng.integers(1 << 30))
    kept = {}
    for after in (0, 3):
        store, numbers, _ = new_store(np.random.default_rng(seed), n_blocks, maw)
        if where == "evicted":
            sparsify_evicted(store, 0, [0], [numbers], beta=1.0, window_tokens=32, keep_after=after)
        else:
            stored_k, _ = stored_tokens(store, 0, 0)
            q = np.zeros((1, 2, HKV * 2, D), np.float32)
            for h in range(HKV):
                q[0, :, h * 2:(h + 1) * 2] = 8.0 * stored_k[h][1 * BS + 6]
            reevaluate(store, 0, [0], q, beta=1.0, keep_after=after)
        kept[after] = [store.context.kept(0, 0, h)["token_index"].tolist() for h in range(HKV)]
    n_tok = n_blocks * BS
    for h in range(HKV):
        assert 1 * BS + 6 in kept[0][h] and len(kept[0][h]) < n_tok // 2
        want = sorted({j + s for j in kept[0][h] for s in range(4) if j + s < n_tok})
        assert kept[3][h] == want


def test_select_salient_cap_keeps_the_highest_scoring_of_those_over_the_threshold(rng):
    """max_keep_share: per head at most ceil(share x n / (1 + keep_after)) span starts, the
    highest-scoring among the tokens over the threshold (oracle: a sort per head); None and 1.0
    change nothing; a head under its cap keeps all it passes."""
    from host.sparsify import select_salient

    hkv, nb, bs = 3, 5, 8
    n = nb * bs
    scores = rng.random((hkv, nb, bs))
    scores[2] *= 0.05                      # head 2: few tokens over the threshold (under its cap)
    scores[2, 1, 3] = 0.9
    threshold = 0.3
    for share in (0.05, 0.1, 0.25):
        for keep_after in (0, 2):
            got = select_salient(scores, threshold, keep_after, share)
            seeds = select_salient(scores, threshold, 0, share if keep_after == 0 else None)
            limit = max(1, math.ceil(share * n / (1 + keep_after)))
            for h in range(hkv):
                flat = scores[h].reshape(-1)
                over = np.flatnonzero(flat > threshold)
                want = np.sort(over[np.argsort(-flat[over], kind="stable")[:limit]])
                want_spans = sorted({j + s for j in want for s in range(keep_after + 1) if j + s < n})
                assert np.flatnonzero(got[h].reshape(-1)).tolist() == want_spans, (share, keep_after, h)
            if keep_after == 0:
                assert np.array_equal(got, seeds)
    uncapped = scores > threshold
    assert np.array_equal(select_salient(scores, threshold), uncapped)
    assert np.array_equal(select_salient(scores, threshold, 0, 1.0), uncapped)
    for bad in (0.0, 1.5, -0.1, True, "0.1"):
        with pytest.raises(ValueError, match=r"max_keep_share=.*expected None or a fraction in \(0, 1\]"):
            select_salient(scores, threshold, 0, bad)


@pytest.mark.parametrize("where", ["evicted", "reevaluate"])
def test_max_keep_share_caps_the_context_cache(rng, where):
    """Through the store: the capped context cache holds, per head, the top ceil(share x n) of the
    uncapped one by score (n: the examined tokens), and attends exactly those tokens."""
    n_blocks, share = 4, 0.1
    n = n_blocks * BS
    seed = int(rng.integers(1 << 30))
    maw = np.random.default_rng(seed).random((n_blocks, BS, HKV)).astype(np.float32)  # all over 1 / 32
    kept = {}
    for cap in (None, share):
        store, numbers, _ = new_store(np.random.default_rng(seed), n_blocks, maw + 0.05)
        if where == "evicted":
            sparsify_evicted(store, 0, [0], [numbers], beta=1.0, window_tokens=32, max_keep_share=cap)
        else:
            q = np.random.default_rng(seed + 1).standard_normal((1, 2, HKV * 2, D)).astype(np.float32)
            reevaluate(store, 0, [0], q, beta=1e-6, max_keep_share=cap)
        kept[cap] = [store.context.kept(0, 0, h) for h in range(HKV)]
        if cap is not None:
            q = rng.standard_normal((1, 1, HKV * 2, D)).astype(np.float32)
            o, lse = attend_context(store, 0, [0], q)
            ks, vs = context_tokens(store, 0, 0)
            ro, rl = reference_attention(q, [ks], [vs], HKV)
            assert norm_relative_error(o, ro) < 2e-5 and norm_relative_error(lse, rl) < 2e-5
    for h in range(HKV):
        full, capped = kept[None][h], kept[share][h]
        assert len(full["token_index"]) > math.ceil(share * n)
        top = full["token_index"][np.argsort(-full["weight"], kind="stable")[:math.ceil(share * n)]]
        assert sorted(capped["token_index"].tolist()) == sorted(top.tolist())
