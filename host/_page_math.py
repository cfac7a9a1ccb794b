"""Inner loops of the CPU attention kernel (host.attention) over one chunk of a K/V page.

bf16 K and V are widened in registers (`bits << 16`, reinterpreted as float32) right where they are
used, so no float32 copy of the page is written and read back; float32 storage is used as is.
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
def _f32_from_bits(typingctx, x):
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
        return lambda x: _f32_from_bits(np.uint32(x) << np.uint32(16))
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
