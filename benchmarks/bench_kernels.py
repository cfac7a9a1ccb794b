"""GPU benchmark of the Pallas kernels (issue 2): one run builds, checks and times every variant.

  PYTHONPATH=. python3 benchmarks/bench_kernels.py --out $OUT/kernels-h100.json

Dense window kernel: bytes of KV read per second at B in {1, 8, 32} x context in {4K, 32K}
(Hq/Hkv = 32/8, D = 128, bf16), beside jax.nn.dot_product_attention (cudnn, xla) and a
device-to-device copy (the bandwidth ceiling). Block-sparse kernel at 10/25/50 % selected blocks.
Digest scoring + top-k at 128K tokens. Every timed kernel is first checked against its reference
on the same random data. Timing: device time per call from the difference of two jitted programs
running ``--calls`` and 2 x ``--calls`` kernels back to back over rotating input sets (so a small KV
cannot sit in L2); each program time is the median of ``--repeats`` samples after warm-up.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, time_fn, write_results  # noqa: E402

from pallas_kernels.block_digest import block_scores, block_scores_reference, select_blocks  # noqa: E402
from pallas_kernels.block_sparse_attention import block_sparse_attention, block_sparse_attention_reference  # noqa: E402
from pallas_kernels.window_attention import window_attention, window_attention_reference  # noqa: E402

L2_BYTES = 50 * 2**20


def rel_err(x, ref):
    x = np.asarray(x, np.float64)
    ref = np.asarray(ref, np.float64)
    if np.isnan(x).any():
        return float("inf")
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def timed_per_call(fn, arg_sets, calls, repeats, perturb=0):
    """Device time per call of ``fn`` in µs, by differencing two back-to-back batches of calls.

    One jitted program runs ``n`` calls back to back (call i uses ``arg_sets[i % len(arg_sets)]``,
    with argument ``perturb`` scaled by (1 + 1e-3 i) outside the program, so no two calls are
    identical and XLA cannot merge them). A jit dispatch with hundreds of arguments costs far more
    than a small kernel, so we time n = ``calls`` and n = 2 * ``calls`` (medians of ``repeats``) and
    return (T(2n) - T(n)) / n: the fixed dispatch cost cancels, the kernels' own time stays.
    """
    n_sets = len(arg_sets)

    def program(n):
        call_args = []
        for i in range(n):
            a = list(arg_sets[i % n_sets])
            if perturb is not None:
                a[perturb] = jax.block_until_ready((a[perturb] * (1 + 1e-3 * i)).astype(a[perturb].dtype))
            call_args.append(tuple(a))

        @jax.jit
        def many(all_args):
            return [fn(*a) for a in all_args]

        return lambda: jax.block_until_ready(many(call_args))

    t1 = time_fn(program(calls), warmup=3, repeats=repeats)
    t2 = time_fn(program(2 * calls), warmup=3, repeats=repeats)
    return (t2 - t1) / calls


def n_sets_for(bytes_per_set, calls):
    return int(min(calls, max(1, math.ceil(4 * L2_BYTES / bytes_per_set))))


COPY_MAX_BYTES = 512 * 2**20


def copy_gbps(nbytes, calls, repeats):
    """Device-to-device copy bandwidth (bytes read + written): y = x + c over min(nbytes, 512 MiB).

    Capped so that 2 x ``calls`` outputs fit in memory; past L2 size the rate no longer depends on it.
    """
    nbytes = min(nbytes, COPY_MAX_BYTES)
    n = nbytes // 2
    xs = [jax.random.normal(jax.random.key(i), (n,), jnp.bfloat16) for i in range(n_sets_for(nbytes, calls))]
    # c = 1 + 2^-k differs per call (exact in bf16 for k <= 7) so no two calls are identical.
    sets = [(xs[i % len(xs)], jnp.asarray(1 + 2.0 ** -(i % 8), jnp.bfloat16)) for i in range(len(xs) * 8)]
    us = timed_per_call(lambda x, c: x + c, sets, calls, repeats, perturb=None)
    return 2 * nbytes / us / 1e3


def bench_dense(args, rows):
    hq, hkv, d = 32, 8, 128
    tuning = dict(block_k=args.block_k, num_splits=None, num_warps=args.num_warps, num_stages=args.num_stages)
    for batch in args.batches:
        for ctx in args.contexts:
            key = jax.random.key(batch * 1000 + ctx)
            kv_bytes = 2 * batch * hkv * ctx * d * 2
            n_sets = n_sets_for(kv_bytes, args.calls)
            sets = []
            for i in range(n_sets):
                kq, kk, kvv, ks = jax.random.split(jax.random.fold_in(key, i), 4)
                q = jax.random.normal(kq, (batch, 1, hq, d), jnp.bfloat16)
                k = jax.random.normal(kk, (batch, hkv, ctx, d), jnp.bfloat16)
                v = jax.random.normal(kvv, (batch, hkv, ctx, d), jnp.bfloat16)
                lengths = jnp.full((batch,), ctx, jnp.int32)
                start = jax.random.randint(ks, (batch,), 0, ctx, jnp.int32)
                sets.append((q, k, v, lengths, start))
            row = dict(kernel="dense_window", batch=batch, context=ctx, hq=hq, hkv=hkv, d=d, dtype="bf16",
                       kv_bytes=kv_bytes)
            try:
                q, k, v, lengths, start = sets[0]
                o, lse = jax.jit(lambda *a: window_attention(*a, backend="triton", **tuning))(q, k, v, lengths, start)
                o_ref, lse_ref = jax.jit(lambda *a: window_attention_reference(*a))(q, k, v, lengths, start)
                row["rel_err_o"] = rel_err(o, o_ref)
                row["max_err_lse"] = float(jnp.max(jnp.abs(lse - lse_ref)))
                us = timed_per_call(lambda *a: window_attention(*a, backend="triton", **tuning), sets,
                                    args.calls, args.repeats)
                row["median_us"] = us
                row["achieved_GBps"] = kv_bytes / us / 1e3
            except Exception as e:  # noqa: BLE001 - record and continue the sweep
                row["error"] = f"{type(e).__name__}: {e}"[:400]
                traceback.print_exc()
            # JAX's own Pallas-Triton decode op (jax.experimental.pallas.ops.gpu.decode_attention.gqa).
            try:
                from jax.experimental.pallas.ops.gpu import decode_attention as jax_decode

                lay = [(q[:, 0], jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)) for (q, k, v, _, _) in sets]
                row["jax_gqa_us"] = timed_per_call(lambda q, k, v: jax_decode.gqa(q, k, v), lay, args.calls, args.repeats)
                row["jax_gqa_GBps"] = kv_bytes / row["jax_gqa_us"] / 1e3
                del lay
            except Exception as e:  # noqa: BLE001
                row["jax_gqa_error"] = f"{type(e).__name__}: {e}"[:300]
            # cuDNN / XLA on the same bytes in their own layout [B, T, H, D].
            for impl in ("cudnn", "xla"):
                try:
                    lay = [(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)) for (q, k, v, _, _) in sets]
                    f = lambda q, k, v, impl=impl: jax.nn.dot_product_attention(q, k, v, implementation=impl)  # noqa: E731
                    row[f"{impl}_us"] = timed_per_call(f, lay, args.calls, args.repeats)
                    row[f"{impl}_GBps"] = kv_bytes / row[f"{impl}_us"] / 1e3
                    del lay
                except Exception as e:  # noqa: BLE001
                    row[f"{impl}_error"] = f"{type(e).__name__}: {e}"[:300]
            try:
                row["copy_GBps"] = copy_gbps(kv_bytes, args.calls, args.repeats)
            except Exception as e:  # noqa: BLE001
                row["copy_error"] = f"{type(e).__name__}: {e}"[:300]
            del sets
            rows.append(row)
            print(row, flush=True)


def sweep_dense(args, rows):
    """Tuning sweep of the dense kernel's launch parameters at a few shapes (rows kernel=dense_sweep)."""
    hq, hkv, d = 32, 8, 128
    for batch, ctx in ((1, 32768), (8, 32768), (32, 32768)):
        key = jax.random.key(batch)
        kq, kk, kvv = jax.random.split(key, 3)
        q = jax.random.normal(kq, (batch, 1, hq, d), jnp.bfloat16)
        k = jax.random.normal(kk, (batch, hkv, ctx, d), jnp.bfloat16)
        v = jax.random.normal(kvv, (batch, hkv, ctx, d), jnp.bfloat16)
        lengths = jnp.full((batch,), ctx, jnp.int32)
        start = jnp.full((batch,), ctx // 3, jnp.int32)
        kv_bytes = 2 * batch * hkv * ctx * d * 2
        sets = [(q, k, v, lengths, start)]
        base_programs = batch * hkv
        for block_k in (64, 128):
            for num_warps in (4, 8):
                for num_stages in (2, 3, 4):
                    for programs in (264, 528, 1056):
                        splits = max(1, min(programs // base_programs, ctx // block_k))
                        tune = dict(block_k=block_k, num_warps=num_warps, num_stages=num_stages, num_splits=splits)
                        row = dict(kernel="dense_sweep", batch=batch, context=ctx, **tune)
                        try:
                            us = timed_per_call(lambda *a, t=tune: window_attention(*a, backend="triton", **t),
                                                sets, args.calls, args.repeats)
                            row.update(median_us=us, achieved_GBps=kv_bytes / us / 1e3)
                        except Exception as e:  # noqa: BLE001
                            row["error"] = f"{type(e).__name__}: {e}"[:200]
                        rows.append(row)
        best = min((r for r in rows if r["kernel"] == "dense_sweep" and r["batch"] == batch and "median_us" in r),
                   key=lambda r: r["median_us"], default=None)
        print("best", best, flush=True)


def diag_dense(args, rows):
    """Where small-shape time goes: whole op vs the split-KV kernel alone, over split counts."""
    from pallas_kernels.window_attention import _ring_partials

    hq, hkv, d = 32, 8, 128
    for batch, ctx in ((1, 4096), (1, 32768), (8, 4096)):
        key = jax.random.key(100 + batch)
        kq, kk, kvv = jax.random.split(key, 3)
        kv_bytes = 2 * batch * hkv * ctx * d * 2
        n_sets = n_sets_for(kv_bytes, args.calls)
        sets = [(jax.random.normal(jax.random.fold_in(kq, i), (batch, 1, hq, d), jnp.bfloat16),
                 jax.random.normal(jax.random.fold_in(kk, i), (batch, hkv, ctx, d), jnp.bfloat16),
                 jax.random.normal(jax.random.fold_in(kvv, i), (batch, hkv, ctx, d), jnp.bfloat16),
                 jnp.full((batch,), ctx, jnp.int32), jnp.full((batch,), 7, jnp.int32)) for i in range(n_sets)]
        for splits in (None, 1, 4, 16, 66):
            row = dict(kernel="dense_diag", batch=batch, context=ctx, num_splits=splits or "default")
            try:
                f = lambda *a, s=splits: window_attention(*a, backend="triton", num_splits=s)  # noqa: E731
                row["median_us"] = timed_per_call(f, sets, args.calls, args.repeats)
                g = lambda q, k, v, L, S, s=splits: _ring_partials(  # noqa: E731
                    q, k, v, L, S, causal=False, scale=d**-0.5, softcap=None, want_scores=False, interpret=False,
                    merge_later=False, block_k=None, num_splits=s, num_warps=None, num_stages=None)[:2]
                row["kernel_only_us"] = timed_per_call(g, sets, args.calls, args.repeats)
                row["achieved_GBps"] = kv_bytes / row["median_us"] / 1e3
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"[:200]
            rows.append(row)
            print(row, flush=True)


def bench_block_sparse(args, rows):
    hq, hkv, d, bs = 32, 8, 128, args.sparse_block
    batch, ctx = args.sparse_batch, args.sparse_context
    nb = ctx // bs
    pool_blocks = batch * nb
    key = jax.random.key(7)
    kk, kv_, kq = jax.random.split(key, 3)
    k_pool = jax.random.normal(kk, (pool_blocks, hkv, bs, d), jnp.bfloat16)
    v_pool = jax.random.normal(kv_, (pool_blocks, hkv, bs, d), jnp.bfloat16)
    q = jax.random.normal(kq, (batch, 1, hq, d), jnp.bfloat16)
    block_lens = jnp.full((pool_blocks,), bs, jnp.int32)
    rng = np.random.default_rng(0)
    for frac in args.fractions:
        n_sel = max(1, int(round(frac * nb)))
        ids = np.stack([np.stack([rng.choice(nb, n_sel, replace=False) + b * nb for _ in range(hkv)])
                        for b in range(batch)]).astype(np.int32)  # [B, Hkv, n_sel]
        counts = np.full((batch, hkv), n_sel, np.int32)
        sel_bytes = 2 * batch * hkv * n_sel * bs * d * 2
        row = dict(kernel="block_sparse", batch=batch, context=ctx, block_size=bs, selected_frac=frac,
                   kv_bytes=sel_bytes)
        try:
            args_ = (q, k_pool, v_pool, jnp.asarray(ids), jnp.asarray(counts), block_lens)
            o, lse = jax.jit(lambda *a: block_sparse_attention(*a, backend="triton"))(*args_)
            o_ref, lse_ref = jax.jit(lambda *a: block_sparse_attention_reference(*a))(*args_)
            row["rel_err_o"] = rel_err(o, o_ref)
            row["max_err_lse"] = float(jnp.max(jnp.abs(lse - lse_ref)))
            us = timed_per_call(lambda *a: block_sparse_attention(*a, backend="triton"), [args_], args.calls,
                                args.repeats)
            row["median_us"] = us
            row["achieved_GBps"] = sel_bytes / us / 1e3
            row["copy_GBps"] = copy_gbps(sel_bytes, args.calls, args.repeats)
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"[:400]
            traceback.print_exc()
        rows.append(row)
        print(row, flush=True)


def bench_digest(args, rows):
    hq, hkv, d, bs = 32, 8, 128, 16
    ctx, batch = 128 * 1024, args.digest_batch
    nb = ctx // bs
    key = jax.random.key(11)
    k1, k2, k3 = jax.random.split(key, 3)
    a = jax.random.normal(k1, (batch, hkv, nb, d), jnp.bfloat16)
    b = jax.random.normal(k2, (batch, hkv, nb, d), jnp.bfloat16)
    kmin, kmax = jnp.minimum(a, b), jnp.maximum(a, b)
    q = jax.random.normal(k3, (batch, hq, d), jnp.bfloat16)
    num_blocks = jnp.full((batch,), nb, jnp.int32)
    budget_blocks = 2048 // bs
    row = dict(kernel="digest_topk", batch=batch, context=ctx, block_size=bs, budget_tokens=2048,
               kv_bytes=2 * batch * hkv * nb * d * 2)
    try:
        s = jax.jit(lambda *a: block_scores(*a, backend="triton"))(q, kmin, kmax, num_blocks)
        s_ref = jax.jit(block_scores_reference)(q, kmin, kmax, num_blocks)
        row["rel_err_scores"] = rel_err(jnp.where(jnp.isfinite(s_ref), s, 0), jnp.where(jnp.isfinite(s_ref), s_ref, 0))
        f = lambda q, mn, mx, n: select_blocks(block_scores(q, mn, mx, n, backend="triton"), n, budget_blocks)  # noqa: E731
        row["median_us"] = timed_per_call(f, [(q, kmin, kmax, num_blocks)],
                                          args.calls, args.repeats)
        g = lambda q, mn, mx, n: block_scores(q, mn, mx, n, backend="triton")  # noqa: E731
        row["score_only_us"] = timed_per_call(g, [(q, kmin, kmax, num_blocks)],
                                              args.calls, args.repeats)
        h = lambda q, mn, mx, n: select_blocks(block_scores_reference(q, mn, mx, n), n, budget_blocks)  # noqa: E731
        row["jnp_reference_us"] = timed_per_call(h, [(q, kmin, kmax, num_blocks)],
                                                 args.calls, args.repeats)
        row["achieved_GBps"] = row["kv_bytes"] / row["score_only_us"] / 1e3
    except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {e}"[:400]
        traceback.print_exc()
    rows.append(row)
    print(row, flush=True)


def warm_up_gpu(seconds: float = 2.0):
    """Run matmuls for a couple of seconds so clocks have ramped before the first timed shape."""
    import time

    x = jax.random.normal(jax.random.key(0), (8192, 8192), jnp.bfloat16)
    f = jax.jit(lambda a: a @ a)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        jax.block_until_ready(f(x))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results/kernels-h100.json")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--calls", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--block-k", type=int, default=None)
    p.add_argument("--num-warps", type=int, default=None)
    p.add_argument("--num-stages", type=int, default=None)
    p.add_argument("--sparse-batch", type=int, default=8)
    p.add_argument("--sparse-context", type=int, default=32768)
    p.add_argument("--sparse-block", type=int, default=64)
    p.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.25, 0.5])
    p.add_argument("--digest-batch", type=int, default=8)
    p.add_argument("--only", choices=["dense", "sweep", "diag", "sparse", "digest"], nargs="+",
                   default=["dense", "sparse", "digest"])
    args = p.parse_args()
    print("devices:", jax.devices(), flush=True)
    warm_up_gpu()
    rows: list[dict] = []
    if "dense" in args.only:
        bench_dense(args, rows)
    if "sweep" in args.only:
        sweep_dense(args, rows)
    if "diag" in args.only:
        diag_dense(args, rows)
    if "sparse" in args.only:
        bench_block_sparse(args, rows)
    if "digest" in args.only:
        bench_digest(args, rows)
    write_results(args.out, "kernels", vars(args), rows)
    print()
    print_table([r for r in rows if r["kernel"] not in ("dense_sweep", "dense_diag")], ["kernel", "batch", "context", "selected_frac", "median_us", "achieved_GBps", "copy_GBps",
                      "cudnn_us", "cudnn_GBps", "xla_us", "jax_gqa_us", "rel_err_o", "error"])
    diag = [r for r in rows if r["kernel"] == "dense_diag"]
    if diag:
        print()
        print_table(diag, ["batch", "context", "num_splits", "median_us", "kernel_only_us", "achieved_GBps", "error"])


if __name__ == "__main__":
    main()
