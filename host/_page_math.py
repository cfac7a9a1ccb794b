"""Inner loops of the CPU attention kernel (host.attention) over one chunk of a K/V page.

bf16 K and V are widened in registers (`bits << 16`, reinterpreted as float32) right where they are
used, so no float32 copy of the page is written and read back; int8 values are converted in
registers the same way (their per-row scales are applied to the scores and probabilities by the
caller); float32 storage is used as is.
Scores are computed for up to four query rows per K row read (q . k reduced per token), and the
value accumulation adds four tokens to four rows per pass over D (D innermost: vertical FMAs).

Also a software prefetch hint (`prefetch`) used to fetch the next page of a work item while the
current one is computed: hardware prefetchers stop at 4 KiB boundaries and pages lie scattered, so
without it the kernel waits on memory at every page start instead of overlapping.

Numba's on-disk cache (cache=True) of host.attention does not track this module: after editing it,
delete host/__pycache__/attention.*.nbi/.nbc (or touch host/attention.py) before measuring.
"""

from __future__ import annotations

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

# Fast-math without 'nnan'/'ninf': lse = -inf and max(-inf, x) must stay exact.
FASTMATH = {"contract", "reassoc", "nsz", "arcp", "afn"}


@intrinsic
def f32_from_bits(typingctx, x):
    """float32 whose bit pattern is the low 32 bits of integer x."""
    if not isinstance(x, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        v = args[0]
        if x.bitwidth > 32:
            v = builder.trunc(v, ir.IntType(32))
        elif x.bitwidth < 32:
            v = builder.zext(v, ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())

    return types.float32(x), codegen


def kv_value(x):
    """float32 value of one stored K/V element: bf16 bits (uint16) or a float."""


@overload(kv_value, inline="always")
def _kv_value(x):
    if isinstance(x, types.Integer):  # bf16 bits (fp16 pages are widened before, see attention)
        return lambda x: f32_from_bits(np.uint32(x) << np.uint32(16))
    return lambda x: np.float32(x)


# Opaque pointers from LLVM 17 on ("p0"); typed pointer mangling before ("p0i8").
_PREFETCH_NAME = "llvm.prefetch.p0" if llvm.llvm_version_info >= (17,) else "llvm.prefetch.p0i8"


@intrinsic
def prefetch(typingctx, arr, index, byte_offset):
    """Prefetch hint (into the outer caches, not L1) for the line holding byte `byte_offset` of arr[index]
    (arr C-contiguous, at least 2-D). No fault for any address; no effect on results."""
    if not isinstance(arr, types.Array) or arr.ndim < 2:
        return None

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        zero = context.get_constant(types.intp, 0)
        idx = [args[1]] + [zero] * (aryty.ndim - 1)
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, idx, wraparound=False, boundscheck=False)
        i8p = ir.IntType(8).as_pointer()
        addr = builder.gep(builder.bitcast(ptr, i8p), [args[2]])
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, _PREFETCH_NAME)
        builder.call(fn, [addr, i32(0), i32(1), i32(1)])  # read, low locality (outer caches), data
        return context.get_dummy_value()

    return types.void(arr, index, byte_offset), codegen


@njit(inline="always", nogil=True, fastmath=FASTMATH)
def _dots4x4(q0, q1, q2, q3, k0, k1, k2, k3):
    """The 16 dot products of four query rows with four K rows (one pass over D: 16 independent
    vector accumulators, so the loop is throughput- rather than latency-bound)."""
    a00 = a01 = a02 = a03 = np.float32(0.0)
    a10 = a11 = a12 = a13 = np.float32(0.0)
    a20 = a21 = a22 = a23 = np.float32(0.0)
    a30 = a31 = a32 = a33 = np.float32(0.0)
    for d in range(k0.shape[0]):
        x0 = kv_value(k0[d])
        x1 = kv_value(k1[d])
        x2 = kv_value(k2[d])
        x3 = kv_value(k3[d])
        y = q0[d]
        a00 += y * x0
        a01 += y * x1
        a02 += y * x2
        a03 += y * x3
        y = q1[d]
        a10 += y * x0
        a11 += y * x1
        a12 += y * x2
        a13 += y * x3
        y = q2[d]
        a20 += y * x0
        a21 += y * x1
        a22 += y * x2
        a23 += y * x3
        y = q3[d]
        a30 += y * x0
        a31 += y * x1
        a32 += y * x2
        a33 += y * x3
    return (a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33)


@njit(inline="always", nogil=True, fastmath=FASTMATH)
def scores4(q0, q1, q2, q3, k, n, s0, s1, s2, s3):
    """s_r[j] = q_r . k[j] for j < n and four query rows r; each K row is read once for all four."""
    d_size = k.shape[1]
    for jb in range(n // 4):
        j = 4 * jb
        (s0[j], s0[j + 1], s0[j + 2], s0[j + 3], s1[j], s1[j + 1], s1[j + 2], s1[j + 3],
         s2[j], s2[j + 1], s2[j + 2], s2[j + 3], s3[j], s3[j + 1], s3[j + 2], s3[j + 3]) = _dots4x4(
            q0, q1, q2, q3, k[j], k[j + 1], k[j + 2], k[j + 3])
    for j in range(n - n % 4, n):
        kj = k[j]
        a0 = np.float32(0.0)
        a1 = np.float32(0.0)
        a2 = np.float32(0.0)
        a3 = np.float32(0.0)
        for d in range(d_size):
            x = kv_value(kj[d])
            a0 += q0[d] * x
            a1 += q1[d] * x
            a2 += q2[d] * x
            a3 += q3[d] * x
        s0[j] = a0
        s1[j] = a1
        s2[j] = a2
        s3[j] = a3


@njit(inline="always", nogil=True, fastmath=FASTMATH)
def scores1(q0, k, n, s0):
    """s0[j] = q0 . k[j] for j < n, two keys per pass."""
    d_size = k.shape[1]
    for jb in range(n // 2):
        j = 2 * jb
        k0, k1 = k[j], k[j + 1]
        a0 = np.float32(0.0)
        a1 = np.float32(0.0)
        for d in range(d_size):
            x = q0[d]
            a0 += x * kv_value(k0[d])
            a1 += x * kv_value(k1[d])
        s0[j] = a0
        s0[j + 1] = a1
    if n % 2:
        kj = k[n - 1]
        a = np.float32(0.0)
        for d in range(d_size):
            a += q0[d] * kv_value(kj[d])
        s0[n - 1] = a


@njit(inline="always", nogil=True, fastmath=FASTMATH)
def accumulate4(p0, p1, p2, p3, v, n, c0, c1, c2, c3):
    """c_r[:] += sum_{j<n} p_r[j] * v[j] for four rows r; four V rows per pass over D, each V element
    widened once for all four rows."""
    d_size = v.shape[1]
    for jb in range(n // 4):
        j = 4 * jb
        v0, v1, v2, v3 = v[j], v[j + 1], v[j + 2], v[j + 3]
        a0, a1, a2, a3 = p0[j], p0[j + 1], p0[j + 2], p0[j + 3]
        b0, b1, b2, b3 = p1[j], p1[j + 1], p1[j + 2], p1[j + 3]
        e0, e1, e2, e3 = p2[j], p2[j + 1], p2[j + 2], p2[j + 3]
        f0, f1, f2, f3 = p3[j], p3[j + 1], p3[j + 2], p3[j + 3]
        for d in range(d_size):
            x0 = kv_value(v0[d])
            x1 = kv_value(v1[d])
            x2 = kv_value(v2[d])
            x3 = kv_value(v3[d])
            c0[d] += a0 * x0 + a1 * x1 + a2 * x2 + a3 * x3
            c1[d] += b0 * x0 + b1 * x1 + b2 * x2 + b3 * x3
            c2[d] += e0 * x0 + e1 * x1 + e2 * x2 + e3 * x3
            c3[d] += f0 * x0 + f1 * x1 + f2 * x2 + f3 * x3
    for j in range(n - n % 4, n):
        vj = v[j]
        a, b, e, f = p0[j], p1[j], p2[j], p3[j]
        for d in range(d_size):
            x = kv_value(vj[d])
            c0[d] += a * x
            c1[d] += b * x
            c2[d] += e * x
            c3[d] += f * x


@njit(inline="always", nogil=True, fastmath=FASTMATH)
def accumulate1(p0, v, n, c0):
    """c0[:] += sum_{j<n} p0[j] * v[j]; four V rows per pass over D."""
    d_size = v.shape[1]
    for jb in range(n // 4):
        j = 4 * jb
        v0, v1, v2, v3 = v[j], v[j + 1], v[j + 2], v[j + 3]
        a0, a1, a2, a3 = p0[j], p0[j + 1], p0[j + 2], p0[j + 3]
        for d in range(d_size):
            c0[d] += (a0 * kv_value(v0[d]) + a1 * kv_value(v1[d]) + a2 * kv_value(v2[d])
                      + a3 * kv_value(v3[d]))
    for j in range(n - n % 4, n):
        vj = v[j]
        a = p0[j]
        for d in range(d_size):
            c0[d] += a * kv_value(vj[d])


@intrinsic
def atomic_fetch_add(typingctx, arr, index, value):
    """Atomically `arr[index] += value` (arr a C-contiguous int64 array, 1-D); returns the value
    before the addition. Used as a shared work counter by parallel workers (dynamic scheduling)."""
    if not (isinstance(arr, types.Array) and arr.ndim == 1 and arr.dtype == types.int64
            and isinstance(index, types.Integer) and isinstance(value, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        aryty, idxty, valty = signature.args
        ary = context.make_array(aryty)(context, builder, args[0])
        idx = context.cast(builder, args[1], idxty, types.intp)
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [idx], wraparound=False, boundscheck=False)
        val = context.cast(builder, args[2], valty, types.int64)
        return builder.atomic_rmw("add", ptr, val, "seq_cst")

    return types.int64(arr, index, value), codegen


def _atomic_load(dtype, ordering: str):
    """An intrinsic `load(arr, index)`: arr[index] read atomically with `ordering` (a 1-D array of
    `dtype`): a call, so Numba's parfor pass never hoists it (or what depends on it) out of a loop,
    as it does a plain read of an array it sees unchanged there."""

    @intrinsic
    def load(typingctx, arr, index):
        if not (isinstance(arr, types.Array) and arr.ndim == 1 and arr.dtype == dtype
                and isinstance(index, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            aryty, idxty = signature.args
            ary = context.make_array(aryty)(context, builder, args[0])
            idx = context.cast(builder, args[1], idxty, types.intp)
            ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [idx], wraparound=False, boundscheck=False)
            return builder.load_atomic(ptr, ordering, dtype.bitwidth // 8)

        return dtype(arr, index), codegen

    return load


atomic_load = _atomic_load(types.int64, "monotonic")  # a shared work counter (int64, relaxed)
load_acquire = _atomic_load(types.uint32, "acquire")  # a flag another thread releases (uint32)


# ---- explicit SIMD micro-kernels (LLVM vector IR) ----------------------------------------------
#
# Vectors of VEC float32 lanes (16 with AVX-512, else 8), written as LLVM vector IR: the loop
# vectoriser reduced every dot-product accumulator on its own (about as many shuffles/adds as FMAs
# at D = 64), widened bf16 with a lane-crossing zero-extension, and reloaded/stored the output rows
# every four tokens.
#
# bf16 lane order: a block of 2 * VEC bf16 values is loaded as VEC uint32 words; `word << 16` gives
# the even elements and `word & 0xFFFF0000` the odd ones (no shuffle). So for bf16 pages the query
# rows and the value accumulators are kept permuted: natural element d of each 2 * VEC block lies
# at position `bf16_lane_pos(d)` (evens first, then odds). float32 pages use the natural order.

_HOST_FEATURES = llvm.get_host_cpu_features()
VEC = 16 if _HOST_FEATURES.get("avx512f", False) else 8
QK_VEC = 8  # lanes of the score micro-kernel's vectors: ymm reductions are cheaper than zmm on Zen 4 (+5% at D=64)
PV_VEC = VEC  # lanes of the value micro-kernel's vectors
_F32 = ir.FloatType()
_I32 = ir.IntType(32)


@njit(inline="always", nogil=True)
def bf16_lane_pos(d, w):
    """Position of natural element d in the permuted (bf16 SIMD, w lanes) order of a row."""
    blk = 2 * w
    i = d % blk
    return d - i + (i % 2) * w + i // 2


def _row_ptr(context, builder, aryty, ary, index, col=None):
    """Pointer to element [index, col] (col 0 unless given) of a 2-D array."""
    col = context.get_constant(types.intp, 0) if col is None else col
    return cgutils.get_item_pointer(context, builder, aryty, ary, [index, col], wraparound=False,
                                    boundscheck=False)


def _load_pair(builder, ptr, dtype, offset, width):
    """Two float32 <width x float> vectors from the 2 * width elements at ptr + offset: for bf16
    bits the even and the odd elements (see bf16 lane order), for float32 and int8 the two halves."""
    vt = ir.VectorType(_F32, width)
    if dtype == types.int8:  # int8 values (their row scale is applied by the caller)
        raw = builder.load(builder.bitcast(builder.gep(ptr, [offset]), ir.VectorType(ir.IntType(8), 2 * width)
                                           .as_pointer()), align=1)
        f = builder.sitofp(raw, ir.VectorType(_F32, 2 * width))
        lo = builder.shuffle_vector(f, f, ir.Constant(ir.VectorType(_I32, width), list(range(width))))
        hi = builder.shuffle_vector(f, f, ir.Constant(ir.VectorType(_I32, width), list(range(width, 2 * width))))
        return lo, hi
    if isinstance(dtype, types.Integer):  # bf16 bits
        it = ir.VectorType(_I32, width)
        words = builder.load(builder.bitcast(builder.gep(ptr, [offset]), it.as_pointer()), align=2)
        even = builder.shl(words, ir.Constant(it, [16] * width))
        odd = builder.and_(words, ir.Constant(it, [-65536] * width))
        return builder.bitcast(even, vt), builder.bitcast(odd, vt)
    lo = builder.load(builder.bitcast(builder.gep(ptr, [offset]), vt.as_pointer()), align=4)
    off2 = builder.add(offset, ir.Constant(offset.type, width))
    hi = builder.load(builder.bitcast(builder.gep(ptr, [off2]), vt.as_pointer()), align=4)
    return lo, hi


def _vfma(builder, a, b, c):
    """a * b + c on float vectors (llvm.fma: one FMA instruction per register)."""
    vt = a.type
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vt, [vt, vt, vt]),
                                        f"llvm.fma.v{vt.count}f32")
    return builder.call(fn, [a, b, c])


def _simd_args_ok(*tys):
    return all(isinstance(t, types.Array) and t.ndim == 2 for t in tys)


def _n_rows_literal(rows):
    if isinstance(rows, types.IntegerLiteral) and 1 <= rows.literal_value <= 4:
        return rows.literal_value
    return None


@intrinsic
def qk_rows(typingctx, qs, r, k, j, n, s, rows):
    """s[r + a, j + t] = qs[r + a] . k[min(j + t, n - 1)] for a < rows (a literal 1..4), t < 4:
    four columns of s are written (s needs 3 spare columns past n). qs float32 rows in the lane
    order of k's dtype (bf16: permuted); needs D % (2 * VEC) == 0 and unit stride along D (the
    caller checks). The 4 * rows vector accumulators are reduced together by a transposing add
    tree (pairs of vectors: 2 shuffles + 1 add), not one by one."""
    n_r = _n_rows_literal(rows)
    if n_r is None or not _simd_args_ok(qs, k, s) or qs.dtype != types.float32 \
            or s.dtype != types.float32 or k.dtype not in (types.float32, types.uint16, types.int8):
        return None

    def codegen(context, builder, signature, args):
        qty, rty, kty, jty, nty, sty, _ = signature.args
        qa = context.make_array(qty)(context, builder, args[0])
        ka = context.make_array(kty)(context, builder, args[2])
        sa = context.make_array(sty)(context, builder, args[5])
        r0 = context.cast(builder, args[1], rty, types.intp)
        j0 = context.cast(builder, args[3], jty, types.intp)
        last = builder.sub(context.cast(builder, args[4], nty, types.intp), ir.Constant(r0.type, 1))
        intp = r0.type
        w = QK_VEC
        vt = ir.VectorType(_F32, w)
        qp = [_row_ptr(context, builder, qty, qa, builder.add(r0, intp(a))) for a in range(n_r)]
        kp = []
        for t in range(4):
            jt = builder.add(j0, intp(t))
            jt = builder.select(builder.icmp_signed(">", jt, last), last, jt)
            kp.append(_row_ptr(context, builder, kty, ka, jt))
        d_size = cgutils.unpack_tuple(builder, qa.shape, 2)[1]
        accs = [cgutils.alloca_once_value(builder, ir.Constant(vt, None)) for _ in range(4 * n_r)]
        with cgutils.for_range(builder, builder.udiv(d_size, intp(2 * w))) as loop:
            off = builder.mul(loop.index, intp(2 * w))
            kv = [_load_pair(builder, kp[t], kty.dtype, off, w) for t in range(4)]
            for a in range(n_r):
                qv = _load_pair(builder, qp[a], types.float32, off, w)
                for t in range(4):
                    acc = accs[4 * a + t]
                    x = _vfma(builder, qv[0], kv[t][0], builder.load(acc))
                    builder.store(_vfma(builder, qv[1], kv[t][1], x), acc)
        vals = [builder.load(acc) for acc in accs]
        g = w  # partial sums per dot product in each vector
        while g > 1:
            h = g // 2
            lo, hi = [], []
            for src in (0, w):
                for grp in range(w // g):
                    lo += [src + grp * g + i for i in range(h)]
                    hi += [src + grp * g + h + i for i in range(h)]
            lo_m = ir.Constant(ir.VectorType(_I32, w), lo)
            hi_m = ir.Constant(ir.VectorType(_I32, w), hi)
            pairs = [(vals[i], vals[min(i + 1, len(vals) - 1)]) for i in range(0, len(vals), 2)]
            vals = [builder.fadd(builder.shuffle_vector(x, y, lo_m), builder.shuffle_vector(x, y, hi_m))
                    for x, y in pairs]
            g = h
        # dot (a, t) = index i = 4a + t: lane i % w of vals[i // w]
        v4 = ir.VectorType(_F32, 4)
        for a in range(n_r):
            src = vals[(4 * a) // w]
            base = (4 * a) % w
            part = builder.shuffle_vector(src, src, ir.Constant(ir.VectorType(_I32, 4),
                                                                [base + i for i in range(4)]))
            dst = _row_ptr(context, builder, sty, sa, builder.add(r0, intp(a)), j0)
            builder.store(part, builder.bitcast(dst, v4.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.void(qs, r, k, j, n, s, rows), codegen


@intrinsic
def pv_rows(typingctx, p, r, v, n, acc, rows):
    """acc[r + a, :] += sum_{j < n} p[r + a, j] * v[j, :] for a < rows (a literal 1..4); acc rows
    in the lane order of v's dtype (bf16: permuted). Needs D % (2 * VEC) == 0 and unit stride along
    D (the caller checks). D is cut into blocks of a few vectors whose rows x block accumulators
    stay in registers over all n tokens (each output element loaded and stored once per call)."""
    n_r = _n_rows_literal(rows)
    if n_r is None or not _simd_args_ok(p, v, acc) or p.dtype != types.float32 \
            or acc.dtype != types.float32 or v.dtype not in (types.float32, types.uint16, types.int8):
        return None

    def codegen(context, builder, signature, args):
        pty, rty, vty, nty, aty, _ = signature.args
        pa = context.make_array(pty)(context, builder, args[0])
        va = context.make_array(vty)(context, builder, args[2])
        aa = context.make_array(aty)(context, builder, args[4])
        r0 = context.cast(builder, args[1], rty, types.intp)
        n_tok = context.cast(builder, args[3], nty, types.intp)
        intp = r0.type
        w = PV_VEC
        vt = ir.VectorType(_F32, w)
        pairs_per_block = 2 if w == 16 else 1  # 2 * pairs vectors of D per row in registers
        d_size = cgutils.unpack_tuple(builder, aa.shape, 2)[1]
        pp = [_row_ptr(context, builder, pty, pa, builder.add(r0, intp(a))) for a in range(n_r)]
        ap = [_row_ptr(context, builder, aty, aa, builder.add(r0, intp(a))) for a in range(n_r)]
        v0 = _row_ptr(context, builder, vty, va, intp(0))
        itemsize = context.get_abi_sizeof(context.get_data_type(vty.dtype))
        v_stride = builder.udiv(cgutils.unpack_tuple(builder, va.strides, 2)[0], intp(itemsize))
        splat = ir.Constant(ir.VectorType(_I32, w), [0] * w)

        def emit_block(d0, npair):
            nv = 2 * npair
            slots = [[cgutils.alloca_once(builder, vt) for _ in range(nv)] for _ in range(n_r)]
            for a in range(n_r):
                for b in range(nv):
                    ptr = builder.bitcast(builder.gep(ap[a], [builder.add(d0, intp(b * w))]), vt.as_pointer())
                    builder.store(builder.load(ptr, align=4), slots[a][b])
            with cgutils.for_range(builder, n_tok) as loop:
                row = builder.mul(loop.index, v_stride)
                xs = []
                for b in range(npair):
                    off = builder.add(row, builder.add(d0, intp(2 * b * w)))
                    xs += list(_load_pair(builder, v0, vty.dtype, off, w))
                for a in range(n_r):
                    pj = builder.load(builder.gep(pp[a], [loop.index]))
                    pv = builder.shuffle_vector(builder.insert_element(ir.Constant(vt, None), pj, _I32(0)),
                                                ir.Constant(vt, None), splat)
                    for b in range(nv):
                        builder.store(_vfma(builder, pv, xs[b], builder.load(slots[a][b])), slots[a][b])
            for a in range(n_r):
                for b in range(nv):
                    ptr = builder.bitcast(builder.gep(ap[a], [builder.add(d0, intp(b * w))]), vt.as_pointer())
                    builder.store(builder.load(slots[a][b]), ptr, align=4)

        step = 2 * pairs_per_block * w
        n_full = builder.udiv(d_size, intp(step))
        with cgutils.for_range(builder, n_full) as loop:
            emit_block(builder.mul(loop.index, intp(step)), pairs_per_block)
        done = builder.mul(n_full, intp(step))
        n_rest = builder.udiv(builder.sub(d_size, done), intp(2 * w))
        with cgutils.for_range(builder, n_rest) as loop:
            emit_block(builder.add(done, builder.mul(loop.index, intp(2 * w))), 1)
        return context.get_dummy_value()

    return types.void(p, r, v, n, acc, rows), codegen


def _fmax(builder, a, b):
    """a > b ? a : b (vmaxps; a NaN in a is dropped)."""
    return builder.select(builder.fcmp_ordered(">", a, b), a, b)


@intrinsic
def row_max(typingctx, s, r, n, init):
    """max(init, s[r, 0], ..., s[r, n - 1]) (float32; unit stride along the row), vectorised
    (compare-and-select: exact for -inf; NaN elements are ignored)."""
    if not (isinstance(s, types.Array) and s.ndim == 2 and s.dtype == types.float32
            and isinstance(r, types.Integer) and isinstance(n, types.Integer) and init == types.float32):
        return None

    def codegen(context, builder, signature, args):
        sty, rty, nty, _ = signature.args
        sa = context.make_array(sty)(context, builder, args[0])
        r0 = context.cast(builder, args[1], rty, types.intp)
        n_el = context.cast(builder, args[2], nty, types.intp)
        intp = r0.type
        w = VEC
        vt = ir.VectorType(_F32, w)
        it = ir.VectorType(_I32, w)
        vptr = vt.as_pointer()
        base = _row_ptr(context, builder, sty, sa, r0)
        neg_inf = ir.Constant(vt, [float("-inf")] * w)
        accs = [cgutils.alloca_once_value(builder, neg_inf) for _ in range(2)]
        n_vec = builder.udiv(n_el, intp(2 * w))
        with cgutils.for_range(builder, n_vec) as loop:
            off = builder.mul(loop.index, intp(2 * w))
            for i in range(2):
                ptr = builder.bitcast(builder.gep(base, [builder.add(off, intp(i * w))]), vptr)
                builder.store(_fmax(builder, builder.load(ptr, align=4), builder.load(accs[i])), accs[i])
        # the last n % (2 * w) elements: masked loads (-inf in the lanes past n; no scalar loop)
        done = builder.mul(n_vec, intp(2 * w))
        rest = builder.trunc(builder.sub(n_el, done), _I32)
        bt = ir.VectorType(ir.IntType(1), w)
        mload = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vt, [vptr, _I32, bt, vt]),
                                               f"llvm.masked.load.v{w}f32.p0")
        splat = builder.shuffle_vector(builder.insert_element(ir.Constant(it, None), rest, _I32(0)),
                                       ir.Constant(it, None), ir.Constant(it, [0] * w))
        m = _fmax(builder, builder.load(accs[0]), builder.load(accs[1]))
        for i in range(2):
            mask = builder.icmp_signed("<", ir.Constant(it, [i * w + lane for lane in range(w)]), splat)
            ptr = builder.bitcast(builder.gep(base, [builder.add(done, intp(i * w))]), vptr)
            m = _fmax(builder, builder.call(mload, [ptr, _I32(4), mask, neg_inf]), m)
        width = w  # horizontal: halve the width with shuffles
        while width > 1:
            half = width // 2
            hi = builder.shuffle_vector(m, m, ir.Constant(it, [half + i if i < half else i for i in range(w)]))
            m = _fmax(builder, hi, m)
            width = half
        return _fmax(builder, builder.extract_element(m, _I32(0)), args[3])

    return types.float32(s, r, n, init), codegen


# exp(x) = 2^t, t = x * log2(e): 2^k * 2^f with k = round(t), |f| <= 1/2; Taylor coefficients of
# 2^f (relative error < 1e-8 at degree 7).
_LOG2E = 1.4426950408889634
_EXP2_COEFFS = (1.525273380405984e-05, 0.00015403530393381606, 0.0013333558146428443, 0.009618129107628477,
                0.05550410866482158, 0.2402265069591007, 0.6931471805599453, 1.0)


@intrinsic
def exp_row(typingctx, s, r, n, shift):
    """s[r, j] = exp(s[r, j] - shift) for j < n in place (unit stride along the row); returns
    their float32 sum. Vectorised (Numba has no SIMD exp without SVML; masked loads/stores for the
    last n % VEC). t is clamped at -125 (exp(x) ~ 1e-38 instead of 0 below x = -86.6; the row
    maximum always contributes 1)."""
    if not (isinstance(s, types.Array) and s.ndim == 2 and s.dtype == types.float32
            and isinstance(r, types.Integer) and isinstance(n, types.Integer) and shift == types.float32):
        return None

    def codegen(context, builder, signature, args):
        sty, rty, nty, _ = signature.args
        sa = context.make_array(sty)(context, builder, args[0])
        r0 = context.cast(builder, args[1], rty, types.intp)
        n_el = context.cast(builder, args[2], nty, types.intp)
        intp = r0.type
        w = VEC
        vt = ir.VectorType(_F32, w)
        it = ir.VectorType(_I32, w)
        bt = ir.VectorType(ir.IntType(1), w)
        vptr = vt.as_pointer()
        base = _row_ptr(context, builder, sty, sa, r0)

        def splat(x, ty):
            return builder.shuffle_vector(builder.insert_element(ir.Constant(ty, None), x, _I32(0)),
                                          ir.Constant(ty, None), ir.Constant(it, [0] * w))

        def const(x):
            return ir.Constant(vt, [x] * w)

        shift_v = splat(args[3], vt)
        floor = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vt, [vt]), f"llvm.floor.v{w}f32")

        def exp_vec(x):
            t = builder.fmul(builder.fsub(x, shift_v), const(_LOG2E))
            t = _fmax(builder, t, const(-125.0))
            k = builder.call(floor, [builder.fadd(t, const(0.5))])
            f = builder.fsub(t, k)
            p = const(_EXP2_COEFFS[0])
            for c in _EXP2_COEFFS[1:]:
                p = _vfma(builder, p, f, const(c))
            e = builder.shl(builder.fptosi(k, it), ir.Constant(it, [23] * w))
            return builder.bitcast(builder.add(builder.bitcast(p, it), e), vt)

        total = cgutils.alloca_once_value(builder, const(0.0))
        n_vec = builder.udiv(n_el, intp(w))
        with cgutils.for_range(builder, n_vec) as loop:
            ptr = builder.bitcast(builder.gep(base, [builder.mul(loop.index, intp(w))]), vptr)
            y = exp_vec(builder.load(ptr, align=4))
            builder.store(y, ptr, align=4)
            builder.store(builder.fadd(builder.load(total), y), total)
        done = builder.mul(n_vec, intp(w))
        rest = builder.trunc(builder.sub(n_el, done), _I32)
        mask = builder.icmp_signed("<", ir.Constant(it, list(range(w))), splat(rest, it))
        ptr = builder.bitcast(builder.gep(base, [done]), vptr)
        mload = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vt, [vptr, _I32, bt, vt]),
                                               f"llvm.masked.load.v{w}f32.p0")
        mstore = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [vt, vptr, _I32, bt]),
                                                f"llvm.masked.store.v{w}f32.p0")
        y = exp_vec(builder.call(mload, [ptr, _I32(4), mask, const(0.0)]))
        builder.call(mstore, [y, ptr, _I32(4), mask])
        m = builder.fadd(builder.load(total), builder.select(mask, y, const(0.0)))
        width = w
        while width > 1:
            half = width // 2
            hi = builder.shuffle_vector(m, m, ir.Constant(it, [half + i if i < half else i for i in range(w)]))
            m = builder.fadd(m, hi)
            width = half
        return builder.extract_element(m, _I32(0))

    return types.float32(s, r, n, shift), codegen
