"""Per-head sparsification (HGCA §3.2.2): which offloaded tokens the CPU attends.

Rule, per (layer, sequence, KV head): keep token j iff  A_j > beta / A.size, strictly.

- At eviction (`sparsify_evicted`), A_j is the token's MAW as stored with its block, and
  **A.size = `window_tokens`, the GPU window size in tokens** (`OffloadConfig.window_tokens` = sink +
  blk_num * block_size): the number of GPU-side entries the MAW was spread over. Only the newly
  evicted blocks are examined; their kept tokens are appended to the head's context cache.
- At re-evaluation (`reevaluate`, after an append / new user turn), A_j is the new queries'
  attention probability computed over *all* host-stored tokens of the sequence (kernel (b)), and
  **A.size = the number of tokens stored on the host for that (layer, sequence)**. The head's
  context cache is rebuilt: tokens that now pass are reinstated, tokens that fail are dropped from
  attention (never from the store).

Grouped-query attention: A per KV head is the **sum over the group's query heads** of their
probabilities (so a token that any head of the group relies on stays), and at re-evaluation the
mean over the Tq new queries. The bridge must hand `KVStore.append_blocks` MAW combined the same
way (sum over the group's query heads of each head's moving-average weight).

Spans (`keep_after`, not in HGCA; default 0 = the paper's rule): a kept token also keeps the
`keep_after` tokens that follow it (same head, token order). Copying a salient span — a number, a
name, an id — needs its continuation, which the queries that found the span's start rarely score
above the threshold (SnapKV pools its selection over neighbours for the same reason). At eviction the
span stays within the blocks evicted together.

Cap (`max_keep_share`, not in HGCA; default None = the paper's rule): of the tokens that pass the
threshold, at most ceil(max_keep_share x n) per head are kept, the highest-scoring (n = the tokens
examined: the newly evicted blocks' at eviction, all stored tokens at re-evaluation). It bounds the
CPU's work per step where the threshold would keep more than the host can attend in the GPU's time
(the balanced split, `jhybrid.hybrid.split`, sets it). With spans, the cap applies to the tokens that
start spans (ceil(max_keep_share x n / (1 + keep_after)) of them), so spans stay whole.

Renormalisation: the kept tokens' scores are stored raw; `ContextCache.kept(...)["weight_normalised"]`
gives them renormalised to sum to 1 per head, as HGCA's context cache holds them.

Both functions are meant to run in an executor worker (`HostExecutor.submit_task`), off the
decode critical path; they take the store lock only to read the new blocks and to publish.
"""

from __future__ import annotations

import math

import numpy as np

from host.attention import token_probabilities


def salience_threshold(beta: float, a_size: int) -> float:
    """beta / A.size after validating both."""
    if isinstance(beta, bool) or not isinstance(beta, (int, float, np.floating, np.integer)) \
            or not (0.0 < float(beta) < math.inf):
        raise ValueError(f"beta={beta!r}; expected a float in (0, inf)")
    if not isinstance(a_size, (int, np.integer)) or a_size <= 0:
        raise ValueError(f"A.size={a_size!r}; expected a positive int (window tokens or stored tokens)")
    return float(beta) / float(a_size)


def extend_spans(keep: np.ndarray, keep_after: int) -> np.ndarray:
    """keep [Hkv, n_blocks, block_size] bool -> the same with the `keep_after` tokens that follow each
    kept token (in token order across the blocks) kept too."""
    if isinstance(keep_after, bool) or not isinstance(keep_after, (int, np.integer)) or keep_after < 0:
        raise ValueError(f"keep_after={keep_after!r}; expected an int >= 0")
    if keep_after == 0 or keep.size == 0:
        return keep
    flat = keep.reshape(keep.shape[0], -1)
    out = flat.copy()
    for shift in range(1, min(int(keep_after), flat.shape[1] - 1) + 1):
        out[:, shift:] |= flat[:, :-shift]
    return out.reshape(keep.shape)


def check_max_keep_share(max_keep_share) -> None:
    if max_keep_share is None:
        return
    if isinstance(max_keep_share, bool) or not isinstance(max_keep_share, (int, float, np.floating, np.integer)) \
            or not (0.0 < float(max_keep_share) <= 1.0):
        raise ValueError(f"max_keep_share={max_keep_share!r}; expected None or a fraction in (0, 1]")


def select_salient(scores: np.ndarray, threshold: float, keep_after: int = 0,
                   max_keep_share: float | None = None) -> np.ndarray:
    """scores [Hkv, n_blocks, block_size] float -> keep, the same shape, bool: the tokens scoring above
    `threshold`, at most ceil(max_keep_share x n / (1 + keep_after)) of them per head (the highest;
    None: no cap), each followed by its `keep_after` continuation (`extend_spans`)."""
    check_max_keep_share(max_keep_share)
    keep = scores > threshold
    if max_keep_share is not None and max_keep_share < 1.0 and keep.size:
        hkv = keep.shape[0]
        flat_keep = keep.reshape(hkv, -1)
        n = flat_keep.shape[1]
        limit = max(1, math.ceil(float(max_keep_share) * n / (1 + keep_after)))
        over = flat_keep.sum(axis=1) > limit
        if over.any():
            masked = np.where(flat_keep[over], scores.reshape(hkv, -1)[over].astype(np.float64), -np.inf)
            top = np.argpartition(-masked, limit - 1, axis=1)[:, :limit]  # exactly `limit`, ties broken
            capped = np.zeros_like(masked, dtype=bool)
            np.put_along_axis(capped, top, True, axis=1)
            flat_keep = flat_keep.copy()
            flat_keep[over] = capped & flat_keep[over]
            keep = flat_keep.reshape(keep.shape)
    return extend_spans(keep, keep_after)


def _append_kept_locked(store, layer: int, seq_id, block_numbers: np.ndarray, keep: np.ndarray,
                        scores: np.ndarray) -> None:
    """The kept tokens of the blocks `block_numbers` appended to the sequence's context cache,
    head-major then in token order, their K/V copied straight from the store's arena.
    keep, scores [Hkv, n_blocks, block_size]."""
    arrays = store.layers[layer].arrays
    slots = store.block_slots(layer, seq_id)[block_numbers]
    heads, bi, rows = np.nonzero(keep)
    token_index = block_numbers[bi] * store.config.block_size + rows
    store.context.append_from_store_locked(layer, seq_id, arrays, heads.astype(np.int64), slots[bi], rows.astype(np.int64),
                                           scores[heads, bi, rows].astype(np.float32),
                                           arrays["positions"][slots[bi], rows], token_index)


def sparsify_evicted(store, layer: int, seq_ids, block_numbers, beta: float, window_tokens: int,
                     keep_after: int = 0, max_keep_share: float | None = None) -> np.ndarray:
    """Select the salient tokens of newly evicted blocks into the context cache.

    seq_ids: sequence ids; block_numbers: for each sequence, an int array of its block numbers to
    examine (as returned by `KVStore.append_blocks`). Returns kept-token counts int64 [B, Hkv]
    added by this call. max_keep_share: the cap (module docstring), None = HGCA's rule alone.
    """
    threshold = salience_threshold(beta, window_tokens)
    check_max_keep_share(max_keep_share)
    seq_ids = list(seq_ids)
    if len(block_numbers) != len(seq_ids):
        raise ValueError(f"{len(block_numbers)} block-number lists for {len(seq_ids)} seq_ids; expected one each")
    added = np.zeros((len(seq_ids), store.config.n_kv_heads), np.int64)
    with store.lock:
        store.check_layer(layer)
        for s in seq_ids:
            store.check_sequence(s)
        for i, (s, blocks) in enumerate(zip(seq_ids, block_numbers)):
            blocks = np.asarray(blocks, np.int64).reshape(-1)
            n_have = store.n_blocks(layer, s)
            if blocks.size and (blocks.min() < 0 or blocks.max() >= n_have):
                raise ValueError(f"block numbers {blocks.tolist()} for seq_id={s!r}; expected [0, {n_have})")
            slots = store.block_slots(layer, s)[blocks]
            maw = store.layers[layer].arrays["maw"][slots].transpose(1, 0, 2)  # [Hkv, n, bs]
            keep = select_salient(maw, threshold, keep_after, max_keep_share)
            _append_kept_locked(store, layer, s, blocks, keep, maw)
            added[i] = keep.sum(axis=(1, 2))
    return added


def reevaluate(store, layer: int, seq_ids, queries: np.ndarray, beta: float, scale: float | None = None,
               keep_after: int = 0, max_keep_share: float | None = None) -> np.ndarray:
    """Rescore every stored token with the new queries [B, Tq, Hq, D] float32 and rebuild each
    head's context cache. Blocks appended after the scoring snapshot keep their current selection.
    Returns kept-token counts int64 [B, Hkv] after the rebuild.

    Cost is Tq x (all stored tokens) dot products per query head on the CPU: pass a handful of the new
    turn's query positions (e.g. its last 16-64), not a whole long prompt."""
    if isinstance(beta, bool) or not isinstance(beta, (int, float, np.floating, np.integer)) \
            or not (0.0 < float(beta) < math.inf):
        raise ValueError(f"beta={beta!r}; expected a float in (0, inf)")
    check_max_keep_share(max_keep_share)
    seq_ids = list(seq_ids)
    with store.lock:
        n_blocks = [store.n_blocks(layer, s) for s in seq_ids]
    _, probs = token_probabilities(store, layer, seq_ids, queries, scale)
    cfg = store.config
    bs, hkv = cfg.block_size, cfg.n_kv_heads
    kept = np.zeros((len(seq_ids), hkv), np.int64)
    with store.lock:
        for i, s in enumerate(seq_ids):
            store.check_sequence(s)  # it may have been freed meanwhile
            nb = n_blocks[i]
            if nb == 0:
                kept[i] = store.context.kept_counts(layer, s)
                continue
            n_tok = nb * bs
            scores = probs[i, :, :n_tok].reshape(hkv, nb, bs)
            keep = select_salient(scores, salience_threshold(beta, n_tok), keep_after, max_keep_share)
            # Tokens of blocks evicted after the snapshot: keep what eviction-time sparsify chose.
            newer_rows = []
            for h in range(hkv):
                rows = store.context.kept_since_locked(layer, s, h, n_tok)
                newer_rows.append((np.full(rows[-1].size, h, np.int64), *rows))
            for h in range(hkv):
                store.context.clear_head_locked(layer, s, h)
            _append_kept_locked(store, layer, s, np.arange(nb, dtype=np.int64), keep, scores)
            for rows in newer_rows:
                store.context.append_locked(layer, s, *rows)
            kept[i] = store.context.kept_counts(layer, s)
    return kept
