"""CPU attention over offloaded KV (Numba, parallel, nogil), returning partial states `(o, lse)`.

Contract (docs/design.md, "Partial states"): queries `[B, Tq, Hq, D]` float32; query head `hq` attends KV head
`hq // (Hq // Hkv)`. Returns `o [B, Tq, Hq, D]` float32 normalised over the attended tokens and
`lse [B, Tq, Hq]` float32 = natural log of sum_j exp(s_j), with s_j = scale * q . k_j
(scale = 1/sqrt(D) unless given). An empty token set gives o = 0, lse = -inf. No causal mask: all
offloaded tokens precede the queries.

Three entry points, one kernel (see `host.paged_view`):
  (a) `attend_context`  the packed sparse context cache (HGCA's CPU sparse attention)
  (b) `attend_all`      every stored token (re-evaluation; keep-all exactness), optional probabilities
  (c) `attend_blocks`   chosen block numbers per (sequence, KV head) (ScoutAttention's CPU part)

Inside the kernel the Hq/Hkv query heads of a group (x Tq queries) are processed together, so each
K/V row is read from memory once per group; bf16 is widened by `bits << 16` in registers where it is
used (host._page_math: explicit SIMD micro-kernels in LLVM vector IR where D is a multiple of 2
vectors: four query rows x four keys per pass over D with the 16 dot products reduced together,
value accumulators of four rows kept in registers over a whole chunk, vectorised max / exp; else
loop-vectorised Numba code), fp16 by an exact bit-level conversion into scratch; accumulation is float32 with an online
softmax per piece and an exact LSE merge of the pieces of a unit. A chunk of up to 128 tokens
spans several pages when they are small (16-token store blocks: one softmax step per chunk, not
per block), and the rows a few KiB ahead are prefetched in software in the piece's page order, so
across scattered pages (hardware prefetchers stop at 4 KiB boundaries).

Work split (for all core counts and batch*heads, 8 units on 16 threads included): the units' tokens
are cut into pieces of decreasing size (guided scheduling, `_plan_pieces`), one worker per thread
takes the next piece from an atomic counter, so a unit larger than its share is split over several
threads (its partial (o, lse) states merged exactly) and all threads finish within about one small
piece of each other. Each worker allocates its scratch once per call and writes a whole unit's
(o, lse) itself; the last worker to finish a piece of a split unit merges it. One Numba call per
attention (planning aside) and one parallel region; `attend_pages_into` (the native exchange's
worker) writes straight into its output slots.

Selected blocks (scout, issue 29 item 3): `benchmarks/bench_host_attention.py --pattern scout`
measures the production path (`host.exchange_worker.serve_blocks`) on blocks scattered over a 4 GiB
arena against the same kernel streaming contiguous pages: on the 16-core H100 host 0.78-0.93 of the
streaming rate (bf16 49-73 GB/s; before: 27-60 GB/s with 16-token blocks at 0.44 of streaming).
"""

from __future__ import annotations

import functools
import math

import numba
import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from host.store_format import FORMAT_CODE
from host.numba_threads import configure_threading_layer
from host._page_math import (PV_VEC, QK_VEC, accumulate1, accumulate4, atomic_fetch_add, atomic_load, bf16_lane_pos,
                              exp_row, f32_from_bits, prefetch, pv_rows, qk_rows, row_max, scores1, scores4)
from host.paged_view import PagedKV

THREADING_LAYER = configure_threading_layer()

# Fast-math without 'nnan'/'ninf': lse = -inf and max(-inf, x) must stay exact.
_FASTMATH = {"contract", "reassoc", "nsz", "arcp", "afn"}
_TWO_POW_112 = np.float32(2.0 ** 112)
# Work split (see _plan_pieces): smallest piece of a unit's tokens handed to a worker, and the
# multiple of tokens on which a unit is cut (the kernel's chunks of 16-32 tokens stay whole).
MIN_PIECE_TOKENS = 64
_PIECE_ALIGN = 16
# Bytes of K per chunk in the attention kernel (128 tokens at D=64 and D=128 bf16, the cap; a
# 64-token store block is one chunk): with the SIMD micro-kernels, measured on the 2-core EPYC
# (Zen 4), 128 tokens beat 64 by ~5% and 16 by ~20% (fixed per-chunk softmax cost).
_CHUNK_BYTES = 32768
# Software prefetch distance: the K and V rows up to this many bytes of K past the segment being
# computed are prefetched (in the piece's page order, so across page boundaries: pages lie
# scattered and hardware prefetchers do not cross 4 KiB). Pages larger than
# _OWN_PAGE_PREFETCH_BYTES are left to the hardware prefetcher inside (only the next pages' rows
# are prefetched); smaller ones (16-32-token store blocks) are prefetched whole, ahead. Measured on
# the 16-core H100 host (--pattern scout): 4, 8 and 16 KiB within noise of each other (8 KiB best
# median); before, only pages >= 64 rows got any prefetch (the window never reached 16-32-token
# blocks). _PREFETCH_NEXT_PIECE: a worker starting a piece also prefetches the first rows of the
# piece handed out next (scout's units are short lists: a piece often is a whole unit).
_PREFETCH_BYTES = 8192
_OWN_PAGE_PREFETCH_BYTES = 8192
_PREFETCH_NEXT_PIECE = True


@njit(inline="always", nogil=True)
def _row_scale(rows, j, d_size):
    """The float32 scale stored little-endian in rows[j, d_size:d_size + 4] (int8 rows)."""
    b = np.uint32(0)
    for i in range(4):
        b |= (np.uint32(rows[j, d_size + i]) & np.uint32(0xFF)) << np.uint32(8 * i)
    return f32_from_bits(b)


@njit(inline="always", nogil=True, fastmath=_FASTMATH)
def _widen_rows(src, n, fmt, dst, off):
    """dst[off:off + n] = float32 values of src[:n] ([page_tokens, W]); fmt 0 fp32, 1 bf16 bits,
    2 fp16 bits, 3 int8 rows of D values + their float32 scale in the last 4 bytes (W = D + 4;
    host.store_format)."""
    d_size = dst.shape[1]
    if fmt == 0:
        for j in range(n):
            for d in range(d_size):
                dst[off + j, d] = np.float32(src[j, d])
        return
    if fmt == 3:
        for j in range(n):
            row_scale = _row_scale(src, j, d_size)
            for d in range(d_size):
                dst[off + j, d] = np.float32(src[j, d]) * row_scale
        return
    bits = dst.view(np.uint32)
    if fmt == 1:
        for j in range(n):
            for d in range(d_size):
                bits[off + j, d] = np.uint32(src[j, d]) << 16
        return
    # fp16: exponent/mantissa shifted into float32 position, then scaled by 2^112 (exact for normal
    # and subnormal halves); inf/nan patched; sign or-ed in.
    for j in range(n):
        o = off + j
        for d in range(d_size):
            bits[o, d] = (np.uint32(src[j, d]) & np.uint32(0x7FFF)) << 13
        for d in range(d_size):
            dst[o, d] = dst[o, d] * _TWO_POW_112
        for d in range(d_size):
            h = np.uint32(src[j, d])
            b = bits[o, d]
            if (h & np.uint32(0x7C00)) == np.uint32(0x7C00):
                b = np.uint32(0x7F800000) | ((h & np.uint32(0x3FF)) << 13)
            bits[o, d] = b | ((h & np.uint32(0x8000)) << 16)


def _rows_in_place(pages, page, c0, n):
    """pages[page, c0:c0 + n], for the kernels that read rows in place (fp32, bf16)."""
    return pages[page, c0:c0 + n]


@overload(_rows_in_place, inline="always")
def _rows_in_place_typed(pages, page, c0, n):
    # Numba types both branches of `if fmt >= 2` for every page dtype; int8 rows (with their scale
    # at the end) are always widened first, so their in-place branch is typed on an empty float32
    # block and never runs.
    if pages.dtype == types.int8:
        return lambda pages, page, c0, n: np.empty((0, pages.shape[2] - 4), np.float32)
    return lambda pages, page, c0, n: pages[page, c0:c0 + n]


@njit(inline="always", nogil=True)
def _scores_simd(qs, k, n, s):
    """s[:, :n] = qs . k[:n]^T (plus 3 spare columns) with the SIMD micro-kernel (host._page_math)."""
    n_rows = qs.shape[0]
    n4 = n_rows - n_rows % 4
    for r in range(0, n4, 4):
        for j in range(0, n, 4):
            qk_rows(qs, r, k, j, n, s, 4)
    rem = n_rows - n4
    if rem == 3:
        for j in range(0, n, 4):
            qk_rows(qs, n4, k, j, n, s, 3)
    elif rem == 2:
        for j in range(0, n, 4):
            qk_rows(qs, n4, k, j, n, s, 2)
    elif rem == 1:
        for j in range(0, n, 4):
            qk_rows(qs, n4, k, j, n, s, 1)


@njit(inline="always", nogil=True)
def _values_simd(s, v, n, acc):
    """acc += s[:, :n] . v[:n] with the SIMD micro-kernel (host._page_math)."""
    n_rows = acc.shape[0]
    n4 = n_rows - n_rows % 4
    for r in range(0, n4, 4):
        pv_rows(s, r, v, n, acc, 4)
    rem = n_rows - n4
    if rem == 3:
        pv_rows(s, n4, v, n, acc, 3)
    elif rem == 2:
        pv_rows(s, n4, v, n, acc, 2)
    elif rem == 1:
        pv_rows(s, n4, v, n, acc, 1)


@njit(inline="always", nogil=True, fastmath=_FASTMATH)
def _softmax_update(s, n, acc, run_max, run_sum):
    """Online-softmax step for scores s[:, :n] of a chunk: s <- exp(s - new running max) in place,
    running sums and accumulators rescaled where the running max moved."""
    n_rows, d_size = acc.shape
    for r in range(n_rows):
        m_new = row_max(s, r, n, run_max[r])
        total = exp_row(s, r, n, m_new)
        if m_new > run_max[r]:  # rescale only when the running max moved
            corr = np.exp(run_max[r] - m_new)
            run_max[r] = m_new
            run_sum[r] *= corr
            for d in range(d_size):
                acc[r, d] *= corr
        run_sum[r] += total


@njit(inline="always", nogil=True)
def _segment(t, c_lo, c_hi, page_tokens, page_ids, base):
    """The run of a chunk [c_lo, c_hi) that starts at token t and stays inside one page: (page index
    in the unit, first row in the page, rows, the page, column in the chunk)."""
    pi = t // page_tokens
    r0 = t - pi * page_tokens
    return pi, r0, min(page_tokens - r0, c_hi - t), page_ids[base + pi], t - c_lo


@njit(inline="always", nogil=True)
def _prefetch_tokens(k_pages, v_pages, page_ids, base, page_tokens, row_bytes, t0, t1):
    """Prefetch hints for the K and V rows of tokens [t0, t1) of a unit whose pages are
    page_ids[base:] (every cache line of those rows)."""
    t = t0
    while t < t1:
        pi = t // page_tokens
        r1 = min(page_tokens, t1 - pi * page_tokens)
        page = page_ids[base + pi]
        b0 = (t - pi * page_tokens) * row_bytes
        b0 -= b0 % 64
        for off in range(b0, r1 * row_bytes, 64):
            prefetch(k_pages, page, off)
            prefetch(v_pages, page, off)
        t = pi * page_tokens + r1


@njit(inline="always", nogil=True, fastmath=_FASTMATH)
def _scores_at(qs, k, n, s, off, simd):
    """s[:, off:off + n] = qs . k[:n]^T (k bf16 bits or float32, read in place); the SIMD
    micro-kernel also writes up to 3 columns past (s needs them)."""
    if simd:
        _scores_simd(qs, k, n, s[:, off:])
        return
    n_rows = qs.shape[0]
    n4 = n_rows - n_rows % 4
    for r in range(0, n4, 4):
        scores4(qs[r], qs[r + 1], qs[r + 2], qs[r + 3], k, n, s[r, off:], s[r + 1, off:], s[r + 2, off:],
                s[r + 3, off:])
    for r in range(n4, n_rows):
        scores1(qs[r], k, n, s[r, off:])


@njit(inline="always", nogil=True, fastmath=_FASTMATH)
def _values_at(s, off, v, n, acc, simd):
    """acc += s[:, off:off + n] . v[:n] (v bf16 bits or float32, read in place)."""
    if simd:
        _values_simd(s[:, off:], v, n, acc)
        return
    n_rows = acc.shape[0]
    n4 = n_rows - n_rows % 4
    for r in range(0, n4, 4):
        accumulate4(s[r, off:], s[r + 1, off:], s[r + 2, off:], s[r + 3, off:], v, n, acc[r], acc[r + 1],
                    acc[r + 2], acc[r + 3])
    for r in range(n4, n_rows):
        accumulate1(s[r, off:], v, n, acc[r])


@njit(inline="always", nogil=True, fastmath=_FASTMATH)
def _attend_chunk(qs, k, v, n, acc, run_max, run_sum, s, simd):
    """Online-softmax update of (acc, run_max, run_sum) [R, ...] with n tokens k[:n], v[:n]
    (bf16 bits or float32): scores for four query rows per K read, one exp pass per row, then
    values for four rows per V read. `simd`: explicit SIMD micro-kernels (qs and acc in the lane
    order of k's dtype, s with 3 spare columns); else the loop-vectorised ones (natural order)."""
    n_rows, d_size = qs.shape
    n4 = n_rows - n_rows % 4
    if simd:
        _scores_simd(qs, k, n, s)
    else:
        for r in range(0, n4, 4):
            scores4(qs[r], qs[r + 1], qs[r + 2], qs[r + 3], k, n, s[r], s[r + 1], s[r + 2], s[r + 3])
        for r in range(n4, n_rows):
            scores1(qs[r], k, n, s[r])
    _softmax_update(s, n, acc, run_max, run_sum)
    if simd:
        _values_simd(s, v, n, acc)
        return
    for r in range(0, n4, 4):
        accumulate4(s[r], s[r + 1], s[r + 2], s[r + 3], v, n, acc[r], acc[r + 1], acc[r + 2], acc[r + 3])
    for r in range(n4, n_rows):
        accumulate1(s[r], v, n, acc[r])


@njit(nogil=True, cache=True)
def _plan_pieces(unit_tokens, n_threads, min_piece, align):
    """Cut the units' tokens into *pieces* (unit u, tokens [lo, hi)) for dynamic scheduling.

    The units' tokens are taken as one stream, in unit order, and cut into pieces of decreasing
    size (guided scheduling: each piece takes 1/(2 * n_threads) of the tokens still unassigned,
    at least `min_piece`), a piece ending early where its unit ends. So one large unit is split over
    all threads (its partial states merged exactly afterwards), many small units are processed
    whole, and workers that take the next piece from a shared counter all finish within about one
    small piece of each other. Cuts inside a unit fall on multiples of `align` tokens.

    unit_tokens int64 [U] -> piece_unit, piece_lo, piece_hi int64 [P] (pieces in unit order,
    every piece non-empty) and unit_piece_ptr int64 [U + 1] (pieces of unit u:
    unit_piece_ptr[u]:unit_piece_ptr[u + 1]; none for an empty unit).
    """
    n_units = unit_tokens.shape[0]
    total = 0
    for u in range(n_units):
        total += unit_tokens[u]
    divisor = 2 * max(1, n_threads)
    # number of pieces before unit boundaries: a dry run of the size sequence
    n_seg = 0
    rem = total
    while rem > 0:
        size = max(min_piece, -(-rem // divisor))
        size = -(-size // align) * align
        rem -= min(size, rem)
        n_seg += 1
    cap = n_seg + n_units  # each unit boundary adds at most one piece; aligning only enlarges pieces
    piece_unit = np.empty(cap, np.int64)
    piece_lo = np.empty(cap, np.int64)
    piece_hi = np.empty(cap, np.int64)
    unit_piece_ptr = np.zeros(n_units + 1, np.int64)
    n_p = 0
    u = 0
    off = 0
    rem = total
    while rem > 0:
        size = max(min_piece, -(-rem // divisor))
        need = -(-size // align) * align
        while need > 0 and rem > 0:
            while unit_tokens[u] - off == 0:  # skip empty / finished units
                u += 1
                off = 0
            n_u = unit_tokens[u]
            take = min(need, n_u - off)
            if off + take < n_u:  # cut inside the unit: on a multiple of `align`
                take = min(-(-(off + take) // align) * align, n_u) - off
            piece_unit[n_p] = u
            piece_lo[n_p] = off
            piece_hi[n_p] = off + take
            unit_piece_ptr[u + 1] += 1
            n_p += 1
            need -= take
            rem -= take
            off += take
    for u in range(n_units):
        unit_piece_ptr[u + 1] += unit_piece_ptr[u]
    return piece_unit[:n_p], piece_lo[:n_p], piece_hi[:n_p], unit_piece_ptr


@njit(nogil=True, cache=True)
def _attention_kernel(q, k_pages, v_pages, fmt, page_ptr, page_ids, n_kv_heads, scale,
                      piece_unit, piece_lo, piece_hi, unit_piece_ptr, n_workers):
    """(o [B, Tq, Hq, D], lse [B, Tq, Hq]) float32 over the pieces of `_plan_pieces`
    (`_attention_kernel_into` fresh arrays)."""
    n_batch, tq, hq, d_size = q.shape
    o = np.empty((n_batch, tq, hq, d_size), np.float32)
    lse = np.empty((n_batch, tq, hq), np.float32)
    _attention_kernel_into(q, k_pages, v_pages, fmt, page_ptr, page_ids, n_kv_heads, scale, piece_unit, piece_lo,
                           piece_hi, unit_piece_ptr, n_workers, o, lse)
    return o, lse


@njit(inline="always", nogil=True, fastmath=_FASTMATH)
def _merge_unit(u, n_kv_heads, group, n_rows, d_size, lo, hi, part_acc, part_max, part_sum, out, o, lse):
    """o, lse of unit u = exact LSE merge of its pieces lo:hi (none, or -inf scores everywhere:
    o = 0, lse = -inf)."""
    b = u // n_kv_heads
    h = u % n_kv_heads
    for r in range(n_rows):
        t = r // group
        head = h * group + r % group
        m = -np.inf
        for it in range(lo, hi):
            m = max(m, part_max[it, r])
        if m == -np.inf:
            for d in range(d_size):
                o[b, t, head, d] = 0.0
            lse[b, t, head] = -np.inf
            continue
        total = np.float32(0.0)
        for d in range(d_size):
            out[d] = 0.0
        for it in range(lo, hi):
            if part_max[it, r] == -np.inf:
                continue
            w = np.exp(part_max[it, r] - m)
            total += w * part_sum[it, r]
            for d in range(d_size):
                out[d] += w * part_acc[it, r, d]
        inv = np.float32(1.0) / total
        for d in range(d_size):
            o[b, t, head, d] = out[d] * inv
        lse[b, t, head] = m + np.log(total)


@njit(parallel=True, nogil=True, fastmath=_FASTMATH, cache=True)
def _attention_kernel_into(q, k_pages, v_pages, fmt, page_ptr, page_ids, n_kv_heads, scale,
                           piece_unit, piece_lo, piece_hi, unit_piece_ptr, n_workers, o, lse):
    """o [B, Tq, Hq, D], lse [B, Tq, Hq] float32 (written, C-contiguous) over the pieces of
    `_plan_pieces`.

    Phase 1: `n_workers` workers (one per thread) take pieces from a shared atomic counter, each
    keeping its scratch (scaled queries, accumulators, scores) for all its pieces, and write per
    piece the unnormalised accumulator [R, D], running max [R], sum of exp [R] (R = Tq * G rows:
    the G query heads of the KV head x Tq queries, so each K/V row is read once per group). A
    unit of one piece is written to o, lse directly by its worker; the worker that completes the
    last piece of a split unit (a per-unit atomic count) merges its pieces exactly (LSE merge).
    So one parallel region per call, and no piece state is written for most units. Units without
    pieces get o = 0, lse = -inf (serially, after the region).

    A piece is processed in chunks of about `_CHUNK_BYTES` of K (16-128 tokens) that run across
    page boundaries: pass 1 computes each segment's scores (a segment: the chunk's rows inside one
    page) into its columns of the chunk, one online-softmax step covers the whole chunk, pass 2
    adds each segment's values. Before each segment, the K and V rows up to `_PREFETCH_BYTES` of
    K ahead are prefetched (`_prefetch_tokens`). bf16, float32 and (with the SIMD micro-kernels)
    int8 pages are read in place (widened in registers; int8 key scales applied to the scores,
    value scales to the probabilities after the softmax sums); fp16 chunks, and int8 ones without
    SIMD, are first converted into float32 scratch (`_attend_chunk`).
    """
    n_batch, tq, hq, d_size = q.shape
    group = hq // n_kv_heads
    n_rows = tq * group
    page_tokens = k_pages.shape[1]
    row_bytes = k_pages.strides[1]
    chunk = min(128, max(16, _CHUNK_BYTES // max(1, row_bytes)))
    pf_rows = max(4, _PREFETCH_BYTES // max(1, row_bytes))
    own_page_hw = page_tokens * row_bytes > _OWN_PAGE_PREFETCH_BYTES
    # explicit SIMD micro-kernels where D is a multiple of 2 vectors and rows are unit-stride; for
    # bf16 pages read in place, queries and accumulators are kept in its permuted lane order
    simd = d_size % (2 * max(QK_VEC, PV_VEC)) == 0 and (fmt >= 2 or (k_pages.strides[2] == k_pages.itemsize
                                                     and v_pages.strides[2] == v_pages.itemsize))
    perm = simd and fmt == 1
    n_pieces = piece_unit.shape[0]
    part_acc = np.empty((n_pieces, n_rows, d_size), np.float32)
    part_max = np.empty((n_pieces, n_rows), np.float32)
    part_sum = np.empty((n_pieces, n_rows), np.float32)
    counter = np.zeros(16, np.int64)  # one cache line of its own
    n_units = unit_piece_ptr.shape[0] - 1
    left = np.empty(n_units, np.int64)  # pieces of each unit not yet done
    for u in range(n_units):
        left[u] = unit_piece_ptr[u + 1] - unit_piece_ptr[u]
    for _w in prange(n_workers):
        out = np.empty(d_size, np.float32)
        qs = np.empty((n_rows, d_size), np.float32)
        acc = np.empty((n_rows, d_size), np.float32)
        stats = np.empty((2, max(n_rows, 16)), np.float32)  # running max / sum, >= a cache line each
        run_max = stats[0]
        run_sum = stats[1]
        s = np.empty((n_rows, chunk + 4), np.float32)
        kf = np.empty((chunk if fmt == 2 or (fmt == 3 and not simd) else 0, d_size), np.float32)
        vf = np.empty((chunk if fmt == 2 or (fmt == 3 and not simd) else 0, d_size), np.float32)
        k_scale = np.empty(chunk if fmt == 3 else 0, np.float32)
        while True:
            p = atomic_fetch_add(counter, 0, 1)
            if p >= n_pieces:
                break
            u = piece_unit[p]
            b = u // n_kv_heads
            h = u % n_kv_heads
            for t in range(tq):
                for g in range(group):
                    for d in range(d_size):
                        col = bf16_lane_pos(d, QK_VEC) if perm else d
                        qs[t * group + g, col] = q[b, t, h * group + g, d] * scale
            for r in range(n_rows):
                run_max[r] = -np.inf
                run_sum[r] = 0.0
                for d in range(d_size):
                    acc[r, d] = 0.0
            lo = piece_lo[p]
            hi = piece_hi[p]
            base = page_ptr[u]
            if _PREFETCH_NEXT_PIECE:  # the first rows of the piece handed out next (to some worker)
                nxt = atomic_load(counter, 0)  # (a plain read would be hoisted out of the loop)
                if nxt < n_pieces:
                    n_lo = piece_lo[nxt]
                    _prefetch_tokens(k_pages, v_pages, page_ids, page_ptr[piece_unit[nxt]], page_tokens, row_bytes,
                                     n_lo, min(piece_hi[nxt], n_lo + pf_rows))
            pf_t = lo  # the piece's tokens [lo, pf_t) are prefetched
            c_lo = lo
            while c_lo < hi:  # chunks of up to `chunk` tokens, across page boundaries
                c_hi = min(hi, c_lo + chunk)
                # pass 1 over the chunk's segments (its rows inside one page each): prefetch ahead,
                # then scores (or the widened rows) of the segment at column `off` of the chunk
                t = c_lo
                while t < c_hi:
                    pi, r0, n, page, off = _segment(t, c_lo, c_hi, page_tokens, page_ids, base)
                    if own_page_hw:  # the hardware prefetcher covers the rest of a large page
                        pf_t = max(pf_t, (pi + 1) * page_tokens)
                    want = min(hi, t + n + pf_rows)
                    if want > pf_t:
                        _prefetch_tokens(k_pages, v_pages, page_ids, base, page_tokens, row_bytes, pf_t, want)
                        pf_t = want
                    if fmt == 3 and simd:
                        k = k_pages[page, r0:r0 + n]
                        for j in range(n):
                            k_scale[off + j] = _row_scale(k, j, d_size)
                        _scores_simd(qs, k, n, s[:, off:])
                    elif fmt >= 2:
                        _widen_rows(k_pages[page, r0:r0 + n], n, fmt, kf, off)
                        _widen_rows(v_pages[page, r0:r0 + n], n, fmt, vf, off)
                    else:
                        _scores_at(qs, _rows_in_place(k_pages, page, r0, n), n, s, off, simd)
                    t += n
                n_tok = c_hi - c_lo
                if fmt >= 2 and not (fmt == 3 and simd):
                    _attend_chunk(qs, kf, vf, n_tok, acc, run_max, run_sum, s, simd)
                else:
                    if fmt == 3:  # int8: raw dot products times each key row's scale
                        for r in range(n_rows):
                            for j in range(n_tok):
                                s[r, j] *= k_scale[j]
                    _softmax_update(s, n_tok, acc, run_max, run_sum)
                    # pass 2: values of each segment
                    t = c_lo
                    while t < c_hi:
                        pi, r0, n, page, off = _segment(t, c_lo, c_hi, page_tokens, page_ids, base)
                        if fmt == 3:  # int8: probabilities times each value row's scale (after the sums)
                            v = v_pages[page, r0:r0 + n]
                            for j in range(n):
                                v_scale = _row_scale(v, j, d_size)
                                for r in range(n_rows):
                                    s[r, off + j] *= v_scale
                            _values_simd(s[:, off:], v, n, acc)
                        else:
                            _values_at(s, off, _rows_in_place(v_pages, page, r0, n), n, acc, simd)
                        t += n
                c_lo = c_hi
            if unit_piece_ptr[u + 1] - unit_piece_ptr[u] == 1:  # the whole unit: its o, lse now
                for r in range(n_rows):
                    t = r // group
                    head = h * group + r % group
                    if run_max[r] == -np.inf:  # -inf scores everywhere
                        for d in range(d_size):
                            o[b, t, head, d] = 0.0
                        lse[b, t, head] = -np.inf
                        continue
                    inv = np.float32(1.0) / run_sum[r]
                    for d in range(d_size):
                        o[b, t, head, d] = acc[r, bf16_lane_pos(d, PV_VEC) if perm else d] * inv
                    lse[b, t, head] = run_max[r] + np.log(run_sum[r])
                continue
            for r in range(n_rows):
                part_max[p, r] = run_max[r]
                part_sum[p, r] = run_sum[r]
                for d in range(d_size):
                    part_acc[p, r, d] = acc[r, bf16_lane_pos(d, PV_VEC) if perm else d]
            # the last of a split unit's pieces to finish merges them (the atomic orders the other
            # pieces' stores before this worker's reads)
            if atomic_fetch_add(left, u, -1) == 1:
                _merge_unit(u, n_kv_heads, group, n_rows, d_size, unit_piece_ptr[u], unit_piece_ptr[u + 1], part_acc,
                            part_max, part_sum, out, o, lse)
    for u in range(n_units):  # units without pieces
        if unit_piece_ptr[u + 1] == unit_piece_ptr[u]:
            b = u // n_kv_heads
            h = u % n_kv_heads
            for r in range(n_rows):
                t = r // group
                head = h * group + r % group
                for d in range(d_size):
                    o[b, t, head, d] = 0.0
                lse[b, t, head] = -np.inf


@njit(parallel=True, nogil=True, fastmath=_FASTMATH, cache=True)
def _probabilities_kernel(q, k_pages, fmt, page_ptr, page_ids, n_kv_heads, scale, piece_unit, piece_lo, piece_hi,
                          unit_piece_ptr, scores, lse, probs):
    """Each token's attention probability from one pass over the keys (no values, no output):
    probs[u, j] = mean over the Tq queries of the sum over the group's query heads of exp(s - lse),
    and lse [B, Tq, Hq] of every query over its unit's tokens (host.sparsify's re-scoring).

    1. per piece (parallel): the scores of its tokens into scores[u] ([U, Tq * group, max tokens]
       float32 scratch) and their running max and sum per query row (the attention kernel's
       micro-kernels: bf16 / fp32 rows read in place, fp16 widened, int8 keys' scales applied);
    2. per unit: its pieces' (max, sum) merged into lse;
    3. per piece (parallel): the probabilities of its tokens from their scores and lse."""
    _, tq, hq, d_size = q.shape
    group = hq // n_kv_heads
    n_rows = tq * group
    page_tokens = k_pages.shape[1]
    chunk = 64
    simd = d_size % (2 * max(QK_VEC, PV_VEC)) == 0 and (fmt >= 2 or k_pages.strides[2] == k_pages.itemsize)
    perm = simd and fmt == 1
    n_pieces = piece_unit.shape[0]
    n_units = unit_piece_ptr.shape[0] - 1
    part_max = np.empty((n_pieces, n_rows), np.float32)
    part_sum = np.empty((n_pieces, n_rows), np.float32)
    for p in prange(n_pieces):
        u = piece_unit[p]
        b = u // n_kv_heads
        h = u % n_kv_heads
        qs = np.empty((n_rows, d_size), np.float32)
        for t in range(tq):
            for g in range(group):
                for d in range(d_size):
                    col = bf16_lane_pos(d, QK_VEC) if perm else d
                    qs[t * group + g, col] = q[b, t, h * group + g, d] * scale
        s = np.empty((n_rows, chunk + 4), np.float32)
        kf = np.empty((chunk + 4 if fmt == 2 or (fmt == 3 and not simd) else 0, d_size), np.float32)
        run_max = np.full(n_rows, -np.inf, np.float32)
        run_sum = np.zeros(n_rows, np.float32)
        base = page_ptr[u]
        lo = piece_lo[p]
        hi = piece_hi[p]
        t0 = lo
        while t0 < hi:  # segments: runs of up to `chunk` tokens inside one page
            pi, r0, n, page, _ = _segment(t0, t0, min(hi, t0 + chunk), page_tokens, page_ids, base)
            if fmt == 3 and simd:
                k = k_pages[page, r0:r0 + n]
                _scores_simd(qs, k, n, s)
                for j in range(n):
                    row_scale = _row_scale(k, j, d_size)
                    for r in range(n_rows):
                        s[r, j] *= row_scale
            elif fmt >= 2:
                _widen_rows(k_pages[page, r0:r0 + n], n, fmt, kf, 0)
                _scores_at(qs, kf, n, s, 0, simd)
            else:
                _scores_at(qs, _rows_in_place(k_pages, page, r0, n), n, s, 0, simd)
            for r in range(n_rows):
                for j in range(n):
                    scores[u, r, t0 + j] = s[r, j]
                m_new = row_max(s, r, n, run_max[r])
                total = exp_row(s, r, n, m_new)
                if m_new > run_max[r]:
                    run_sum[r] *= np.exp(run_max[r] - m_new)
                    run_max[r] = m_new
                run_sum[r] += total
            t0 += n
        for r in range(n_rows):
            part_max[p, r] = run_max[r]
            part_sum[p, r] = run_sum[r]
    unit_lse = np.full((n_units, n_rows), -np.inf, np.float32)
    for u in range(n_units):
        b = u // n_kv_heads
        h = u % n_kv_heads
        for r in range(n_rows):
            m = -np.inf
            for p in range(unit_piece_ptr[u], unit_piece_ptr[u + 1]):
                m = max(m, part_max[p, r])
            if m > -np.inf:
                total = np.float32(0.0)
                for p in range(unit_piece_ptr[u], unit_piece_ptr[u + 1]):
                    total += part_sum[p, r] * np.exp(part_max[p, r] - m)
                unit_lse[u, r] = m + np.log(total)
            lse[b, r // group, h * group + r % group] = unit_lse[u, r]
    inv_tq = np.float32(1.0) / tq
    for p in prange(n_pieces):
        u = piece_unit[p]
        lo = piece_lo[p]
        n = piece_hi[p] - lo
        rows = scores[u, :, lo:lo + n]
        for j in range(n):
            probs[u, lo + j] = 0.0
        for r in range(n_rows):
            if unit_lse[u, r] == -np.inf:
                continue
            exp_row(rows, r, n, unit_lse[u, r])
            for j in range(n):
                probs[u, lo + j] += rows[r, j]
        for j in range(n):
            probs[u, lo + j] *= inv_tq


def check_queries(queries, n_batch: int, n_kv_heads: int, head_dim: int) -> np.ndarray:
    """Validate queries [B, Tq, Hq, D] float32 against the batch and the store's head shape."""
    if not isinstance(queries, np.ndarray):
        raise ValueError(f"queries must be a NumPy array, got {type(queries).__name__}")
    if queries.dtype != np.float32:
        raise ValueError(f"queries dtype {queries.dtype}; expected float32")
    if queries.ndim != 4:
        raise ValueError(f"queries have shape {queries.shape}; expected [B, Tq, Hq, D]")
    b, tq, hq, d = queries.shape
    if b != n_batch:
        raise ValueError(f"queries batch {b}; expected {n_batch} (one row per seq_id)")
    if d != head_dim:
        raise ValueError(f"queries head dim {d}; expected D={head_dim}")
    if hq == 0 or hq % n_kv_heads:
        raise ValueError(f"queries have Hq={hq} heads; expected a positive multiple of Hkv={n_kv_heads}")
    if tq == 0:
        raise ValueError("queries have Tq=0 positions; expected at least one")
    return np.ascontiguousarray(queries)


def plan_pieces(view: PagedKV, n_threads: int | None = None, min_piece_tokens: int = MIN_PIECE_TOKENS):
    """The work split of `paged_attention` (see `_plan_pieces`): piece_unit, piece_lo, piece_hi
    int64 [P] (token ranges inside units) and unit_piece_ptr int64 [U + 1]."""
    n_threads = numba.get_num_threads() if n_threads is None else n_threads
    if not isinstance(n_threads, (int, np.integer)) or n_threads < 1:
        raise ValueError(f"n_threads={n_threads!r}; expected a positive int")
    if not isinstance(min_piece_tokens, (int, np.integer)) or min_piece_tokens < 1:
        raise ValueError(f"min_piece_tokens={min_piece_tokens!r}; expected a positive int")
    align = min(_PIECE_ALIGN, int(min_piece_tokens))
    return _plan_pieces(view.unit_tokens, int(n_threads), int(min_piece_tokens), align)


def paged_attention(queries: np.ndarray, view: PagedKV, scale: float | None = None,
                    return_probs: bool = False, n_threads: int | None = None,
                    min_piece_tokens: int = MIN_PIECE_TOKENS):
    """Attention of queries [B, Tq, Hq, D] float32 (C-contiguous) over a `PagedKV` with B * Hkv units.

    Returns (o, lse): o float32 [B, Tq, Hq, D], lse float32 [B, Tq, Hq]; plus probs float32
    [B, Hkv, max unit tokens] (0 beyond each unit's tokens) when `return_probs`. Runs on
    `numba.get_num_threads()` threads of the calling thread; `n_threads` / `min_piece_tokens` only
    change how the tokens are cut into pieces (see `_plan_pieces`; results equal to float rounding).
    """
    scale = _check_paged(queries, view, scale)
    n_workers = numba.get_num_threads()
    piece_unit, lo, hi, unit_piece_ptr = plan_pieces(view, n_workers if n_threads is None else n_threads,
                                                     min_piece_tokens)
    o, lse = _attention_kernel(queries, view.k_pages, view.v_pages, view.fmt, view.page_ptr, view.page_ids,
                               view.n_kv_heads, scale, piece_unit, lo, hi, unit_piece_ptr, n_workers)
    if not return_probs:
        return o, lse
    _, probs = _probabilities(queries, view, scale, piece_unit, lo, hi, unit_piece_ptr)
    return o, lse, probs


def paged_token_probabilities(queries: np.ndarray, view: PagedKV, scale: float | None = None,
                              n_threads: int | None = None, min_piece_tokens: int = MIN_PIECE_TOKENS):
    """Each token's attention probability under queries [B, Tq, Hq, D] float32 over a `PagedKV`,
    without the attention output: one pass over the keys, none over the values (hgca's re-scoring
    reads only these). Returns (lse float32 [B, Tq, Hq], probs float32 [B, Hkv, max unit tokens]):
    probs as `paged_attention(..., return_probs=True)` gives them (0 beyond each unit's tokens)."""
    scale = _check_paged(queries, view, scale)
    n_workers = numba.get_num_threads()
    piece_unit, lo, hi, unit_piece_ptr = plan_pieces(view, n_workers if n_threads is None else n_threads,
                                                     min_piece_tokens)
    return _probabilities(queries, view, scale, piece_unit, lo, hi, unit_piece_ptr)


def _check_paged(queries: np.ndarray, view: PagedKV, scale) -> np.float32:
    """Queries [B, Tq, Hq, D] against the view (its units, heads, format, token counts); the scale
    as float32 (default 1 / sqrt(D))."""
    b, tq, hq, d = queries.shape
    if view.n_units != b * view.n_kv_heads:
        raise ValueError(f"{view.n_units} (sequence, KV head) units for a batch of {b} x Hkv={view.n_kv_heads}")
    if hq % view.n_kv_heads:
        raise ValueError(f"queries have Hq={hq} heads; expected a multiple of Hkv={view.n_kv_heads}")
    view.check_format()
    if view.head_dim != d:
        raise ValueError(f"queries head dim {d}; the pages have D={view.head_dim}")
    if view.unit_tokens.shape[0] and (view.unit_tokens.min() < 0 or np.any(
            view.unit_tokens > np.diff(view.page_ptr) * view.page_tokens)):
        raise ValueError("unit_tokens exceed the units' pages (or are negative): "
                         f"{view.unit_tokens.tolist()[:16]} tokens, {np.diff(view.page_ptr).tolist()[:16]} pages "
                         f"of {view.page_tokens}")
    scale = np.float32(1.0 / math.sqrt(d) if scale is None else scale)
    if not np.isfinite(scale):
        raise ValueError(f"scale={scale}; expected a finite float")
    return scale


def _probabilities(queries, view: PagedKV, scale, piece_unit, lo, hi, unit_piece_ptr):
    """`_probabilities_kernel` over a checked view and its pieces -> (lse, probs [B, Hkv, T])."""
    b, tq, hq, _ = queries.shape
    max_tokens = int(view.unit_tokens.max()) if view.n_units else 0
    probs = np.zeros((view.n_units, max_tokens), np.float32)
    lse = np.full((b, tq, hq), -np.inf, np.float32)
    scores = np.empty((view.n_units, tq * (hq // view.n_kv_heads), max_tokens), np.float32)
    _probabilities_kernel(queries, view.k_pages, view.fmt, view.page_ptr, view.page_ids, view.n_kv_heads, scale,
                          piece_unit, lo, hi, unit_piece_ptr, scores, lse, probs)
    return lse, probs.reshape(b, view.n_kv_heads, max_tokens)


# ---- views of the store -------------------------------------------------------------------------

def _store_view_locked(store, layer: int, seq_ids, block_ids=None) -> PagedKV:
    """Pages of the KV store: every block (block_ids None) or the chosen block numbers
    block_ids int64 [B, Hkv, n] (-1 = no block) of each sequence and KV head. Vectorised over heads
    and blocks (one Python step per sequence): this runs on every attention call."""
    cfg = store.config
    hkv, bs = cfg.n_kv_heads, cfg.block_size
    arrays = store.layers[layer].arrays
    slot_lists = [store.block_slots(layer, s) for s in seq_ids]
    heads = np.arange(hkv, dtype=np.int64)
    if block_ids is None:
        counts = np.repeat(np.asarray([sl.shape[0] for sl in slot_lists], np.int64), hkv)
        page_ids = np.concatenate([(sl[None, :] * hkv + heads[:, None]).reshape(-1) for sl in slot_lists]) \
            if slot_lists else np.zeros(0, np.int64)
    else:
        n_b = len(seq_ids)
        valid = block_ids >= 0
        n_have = np.asarray([sl.shape[0] for sl in slot_lists], np.int64).reshape(n_b, 1, 1)
        over = valid & (block_ids >= n_have)
        if over.any():
            bi, h, _ = (int(x[0]) for x in np.nonzero(over))
            raise ValueError(f"block id {int(block_ids[bi, h].max())} for seq_id={seq_ids[bi]!r} head {h}; the "
                             f"sequence has {int(n_have[bi, 0, 0])} blocks in layer {layer}")
        srt = np.sort(block_ids, axis=-1)
        dup = (srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)
        if dup.any():
            bi, h, _ = (int(x[0]) for x in np.nonzero(dup))
            ids = block_ids[bi, h]
            raise ValueError(f"duplicate block ids {ids[ids >= 0].tolist()} for seq_id={seq_ids[bi]!r} head {h}: "
                             "a token must be attended at most once")
        width = max([sl.shape[0] for sl in slot_lists] + [1])
        table = np.zeros((n_b, width), np.int64)  # slots of each sequence's blocks, padded
        for bi, sl in enumerate(slot_lists):
            table[bi, :sl.shape[0]] = sl
        safe = np.where(valid, block_ids, 0)
        pages = table[np.arange(n_b)[:, None, None], safe] * hkv + heads[None, :, None]
        page_ids = pages[valid]  # C order: unit by unit, each unit's blocks in the given order
        counts = valid.sum(axis=-1).reshape(-1).astype(np.int64)
    page_ptr = np.zeros(counts.shape[0] + 1, np.int64)
    np.cumsum(counts, out=page_ptr[1:])
    d = cfg.row_width
    return PagedKV(arrays["k"].reshape(-1, bs, d), arrays["v"].reshape(-1, bs, d), FORMAT_CODE[cfg.kv_dtype],
                   page_ptr, page_ids.astype(np.int64, copy=False), counts * bs, hkv)


def _run(store, layer, seq_ids, queries, make_view, compute):
    """compute(queries, view) over the view make_view() takes under the store's lock, the queries
    checked against the store and its slots held (`begin_read`) while it runs."""
    seq_ids = list(seq_ids)
    cfg = store.config
    queries = check_queries(queries, len(seq_ids), cfg.n_kv_heads, cfg.head_dim)
    with store.lock:
        store.check_layer(layer)
        for s in seq_ids:
            store.check_sequence(s)
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids {seq_ids} contain duplicates")
        view = make_view()
        store.begin_read()
    try:
        return compute(queries, view)
    finally:
        store.end_read()


def attend_context(store, layer: int, seq_ids, queries: np.ndarray, scale: float | None = None):
    """(a) Attention over each (sequence, KV head)'s kept tokens in the sparse context cache.
    queries [B, Tq, Hq, D] float32 with B = len(seq_ids) -> (o, lse)."""
    seq_ids = list(seq_ids)
    return _run(store, layer, seq_ids, queries, lambda: store.context.snapshot_locked(layer, seq_ids),
                functools.partial(paged_attention, scale=scale))


def attend_all(store, layer: int, seq_ids, queries: np.ndarray, scale: float | None = None,
               return_probs: bool = False):
    """(b) Attention over every stored token of each sequence -> (o, lse) or (o, lse, probs) with
    probs float32 [B, Hkv, max tokens]: token j of sequence b (block j // block_size, row
    j % block_size, in block-number order) gets the sum over the group's query heads of its
    probability, averaged over the Tq queries."""
    seq_ids = list(seq_ids)
    return _run(store, layer, seq_ids, queries, lambda: _store_view_locked(store, layer, seq_ids),
                functools.partial(paged_attention, scale=scale, return_probs=return_probs))


def token_probabilities(store, layer: int, seq_ids, queries: np.ndarray, scale: float | None = None):
    """Every stored token's attention probability (as `attend_all(..., return_probs=True)` gives
    it) without the attention output -> (lse float32 [B, Tq, Hq], probs float32 [B, Hkv, max tokens])."""
    seq_ids = list(seq_ids)
    return _run(store, layer, seq_ids, queries, lambda: _store_view_locked(store, layer, seq_ids),
                functools.partial(paged_token_probabilities, scale=scale))


def attend_blocks(store, layer: int, seq_ids, queries: np.ndarray, block_ids: np.ndarray,
                  scale: float | None = None):
    """(c) Attention over chosen blocks: block_ids int [B, Hkv, n] of sequence-local block numbers
    (0 = first offloaded block), -1 for padding (ragged counts per head), no duplicates."""
    seq_ids = list(seq_ids)
    block_ids = np.asarray(block_ids)
    hkv = store.config.n_kv_heads
    if block_ids.ndim != 3 or block_ids.shape[:2] != (len(seq_ids), hkv):
        raise ValueError(f"block_ids shape {block_ids.shape}; expected [B={len(seq_ids)}, Hkv={hkv}, n]")
    if not np.issubdtype(block_ids.dtype, np.integer):
        raise ValueError(f"block_ids dtype {block_ids.dtype}; expected an integer dtype")
    return _run(store, layer, seq_ids, queries,
                lambda: _store_view_locked(store, layer, seq_ids, block_ids.astype(np.int64)),
                functools.partial(paged_attention, scale=scale))


@njit(nogil=True, cache=True)
def attend_pages_into(queries, k_pages, v_pages, fmt, page_ptr, page_ids, unit_tokens, n_kv_heads, scale, n_workers,
                      o, lse):
    """`attend_pages` writing o [B, Tq, Hq, D] and lse [B, Tq, Hq] (float32, C-contiguous) in place:
    the native exchange's worker passes its output slots (no per-call output arrays, no copy)."""
    n_workers = max(1, min(n_workers, unit_tokens.sum() // (4 * MIN_PIECE_TOKENS)))
    piece_unit, lo, hi, unit_piece_ptr = _plan_pieces(unit_tokens, n_workers, MIN_PIECE_TOKENS,
                                                      min(_PIECE_ALIGN, MIN_PIECE_TOKENS))
    _attention_kernel_into(queries, k_pages, v_pages, fmt, page_ptr, page_ids, n_kv_heads, scale,
                           piece_unit, lo, hi, unit_piece_ptr, n_workers, o, lse)


@njit(nogil=True, cache=True)
def attend_pages(queries, k_pages, v_pages, fmt, page_ptr, page_ids, unit_tokens, n_kv_heads, scale, n_workers):
    """`paged_attention` callable from nopython code (the native exchange's worker loop,
    host.exchange_worker): plans the pieces for `n_workers` (the calling thread's Numba thread
    count: numba.get_num_threads() inside nopython code would make it uncachable) and runs the
    kernel. Inputs are trusted (built by nopython code from validated tables). Small work runs on
    fewer threads (a piece per thread of at least MIN_PIECE_TOKENS * 4 tokens): waking all of them
    costs more than it saves. -> (o, lse) float32."""
    n_batch, tq, hq, d_size = queries.shape
    o = np.empty((n_batch, tq, hq, d_size), np.float32)
    lse = np.empty((n_batch, tq, hq), np.float32)
    attend_pages_into(queries, k_pages, v_pages, fmt, page_ptr, page_ids, unit_tokens, n_kv_heads, scale, n_workers,
                      o, lse)
    return o, lse
