"""Benchmark of the host CPU attention kernels (issue 3): GB/s of attended KV bytes.

For each point (D, B*Hkv units, selected tokens per unit), each host KV format of `--kv-formats`
(bf16, and int8 rows with their scale: host.store_format), G query heads per KV head:
  kernel a  context cache: pages of `--page-tokens` kept tokens, page order shuffled (as allocated)
  kernel c  chosen blocks: a store of `--block-size`-token blocks, head-major inside a block, a random
            subset (in random order) of 4/5 of each sequence's blocks attended
side by side with the raw multi-threaded read of the same bytes (Numba parallel integer sum over
the same pages: the ceiling), a NumPy einsum version (bf16 widened in NumPy, then einsum/softmax)
and torch's CPU scaled_dot_product_attention (bf16, dense [B, Hkv, N, D], enable_gqa) on the same
values (those two only up to `--baseline-max-mib`). Each point is checked against the float64
reference on a few units and against the baselines. Also times the sparsification of one evicted
block per sequence for a batch of 32 and the append of that block to the store: steady state (slots
touched ahead) separately from first-touch appends and from one arena growth (see bench_sparsify).

    PYTHONPATH=. python3 benchmarks/bench_host_attention.py --out benchmarks/results/host-attention-TAG.json
    PYTHONPATH=. python3 benchmarks/bench_host_attention.py --quick     # small grid (2-core machine)

Scout pattern (issue 29 item 3, `--pattern scout`): the CPU part of ScoutAttention on its production
path, `host.exchange_worker.serve_blocks` (block ids -> page lists -> `attend_pages`), over blocks
selected at random from a store arena much larger than the LLC (`--arena-gib`), against the same
kernel streaming contiguous pages of the same bytes, same process; bf16 and int8, block sizes
16/32/64, CPU shares of a 2048-token budget per (sequence, KV head):

    PYTHONPATH=. python3 benchmarks/bench_host_attention.py --pattern scout --json $OUT/scout.json
    PYTHONPATH=. python3 benchmarks/bench_host_attention.py --pattern scout --small --json /tmp/s.json  # 2 cores

Defaults: batch 32, Hkv 8, G 4, D 128, a 4 GiB K + V arena, 16 layers per serve_blocks call, CPU
shares 10 % and 100 %; measuring takes ~20 s on the 16-core H100 host, plus Numba's compilation
on a first run (~2.5 min there; bf16 and int8 can be compiled in two processes at once by a
small run of each: `--batch 8 --arena-gib 0.25 --layers 16 --repeats 1 --min-seconds 0
--kv-formats bf16` and `... int8`). Numba's cache of serve_blocks does not notice edits of
host/attention.py: delete host/__pycache__/exchange_worker.*.nb[ic] after such an edit.

Rows carry `kv_format` and `bf16_equiv_GBps` (tokens attended per second x the bytes they take in
bf16: what 8-bit storage buys in attention throughput); the baselines run on bf16 points only.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import socket
import statistics
import sys
import time

import ml_dtypes
import numpy as np

from host.attention import THREADING_LAYER, attend_pages, paged_attention

try:
    from host.attention import attend_pages_into
except ImportError:  # older kernels (A/B runs of --pattern scout against them): outputs copied
    attend_pages_into = None
from host.paged_view import PagedKV
from host.reference import norm_relative_error, reference_attention

import numba
from numba import njit, prange

BF16 = 1  # FORMAT_CODE["bf16"]
INT8 = 3  # FORMAT_CODE["int8"]: rows of D int8 + a float32 scale (host.store_format)


# ---- data --------------------------------------------------------------------------------------

@njit(parallel=True, cache=True)

def _header(name: str, n_threads: int) -> dict:
    """name, device, date, versions and command of a results file."""
    return {"name": name, "device": device_name(n_threads),
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "versions": versions(), "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}


def _verdict(failures: list[str], ok: str) -> int:
    """Print the correctness verdict -> the exit code (1 when any check failed)."""
    if failures:
        print("CORRECTNESS FAILURES:\n  " + "\n  ".join(failures))
        return 1
    print(f"correctness: {ok}")
    return 0


def _write_json(result: dict, path: str, note: str = "") -> None:
    """Write a results file (creating its folder) and say where."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {path}{note}")

def _fill_random_bf16(buf, seed):
    """Random bf16 bit patterns of magnitude in [0.25, 1) with random sign (a hash of the index:
    fast, parallel, and it touches every page before timing)."""
    flat = buf.reshape(-1)
    for i in prange(flat.shape[0]):
        x = np.uint64(i) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed)
        x ^= x >> np.uint64(31)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(29)
        flat[i] = np.uint16(0x3E80 + (x & np.uint64(0xFF))) | np.uint16(((x >> np.uint64(8)) & np.uint64(1)) << np.uint64(15))


@njit(parallel=True, cache=True)
def _fill_random_int8(rows, seed):
    """rows [n, D + 4] int8: random values in [-127, 127] (a hash of the index) and the scale
    1/127 in the last 4 bytes (little-endian float32 0x3C010204); touches every page."""
    d = rows.shape[1] - 4
    for i in prange(rows.shape[0]):
        for j in range(d):
            x = np.uint64(i * rows.shape[1] + j) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed)
            x ^= x >> np.uint64(31)
            x *= np.uint64(0xBF58476D1CE4E5B9)
            x ^= x >> np.uint64(29)
            rows[i, j] = np.int8(np.int64(x % np.uint64(255)) - 127)
        rows[i, d] = 0x04
        rows[i, d + 1] = 0x02
        rows[i, d + 2] = 0x01
        rows[i, d + 3] = 0x3C


@njit(parallel=True, nogil=True, cache=True)
def _read_ceiling(k_pages, v_pages, page_ids, page_rows, out):
    """Raw read of the same bytes: integer sum over the attended rows of each K and V page."""
    for i in prange(page_ids.shape[0]):
        k = k_pages[page_ids[i]]
        v = v_pages[page_ids[i]]
        total = np.uint32(0)
        for j in range(page_rows[i]):
            for d in range(k.shape[1]):
                total += np.uint32(np.uint8(k[j, d])) + np.uint32(np.uint8(v[j, d]))
        out[i] = total


def widen(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def unit_tokens_of(view: PagedKV, u: int, dense=True):
    """float32 K, V [n, D] of unit u (its pages in order)."""
    from host.store_format import from_storage

    pages = view.page_ids[view.page_ptr[u]:view.page_ptr[u + 1]]
    n = int(view.unit_tokens[u])
    w = view.k_pages.shape[2]
    fmt = "int8" if view.fmt == INT8 else "bf16"
    k = from_storage(view.k_pages[pages].reshape(-1, w)[:n], fmt)
    v = from_storage(view.v_pages[pages].reshape(-1, w)[:n], fmt)
    return k, v


def make_view(kind: str, arena_k, arena_v, units: int, tokens: int, d: int, hkv: int, page_tokens: int,
              block_size: int, rng, fmt: int = BF16) -> PagedKV:
    """arena_k / arena_v: flat storage (uint16 bf16 bits, or int8 rows of d + 4)."""
    d = d + 4 if fmt == INT8 else d  # the stored row width
    if kind == "a":  # context cache: units * tokens/page pages, shuffled
        per_unit = tokens // page_tokens
        n_pages = units * per_unit
        k = arena_k[: n_pages * page_tokens * d].reshape(n_pages, page_tokens, d)
        v = arena_v[: n_pages * page_tokens * d].reshape(n_pages, page_tokens, d)
        page_ids = rng.permutation(n_pages).astype(np.int64)
    else:  # store blocks [slots, Hkv, bs, D] -> pages slot*Hkv + h; attend 4/5 of each sequence's blocks
        per_unit = tokens // block_size
        stored = per_unit * 5 // 4
        n_seq = units // hkv
        n_slots = n_seq * stored
        k = arena_k[: n_slots * hkv * block_size * d].reshape(n_slots * hkv, block_size, d)
        v = arena_v[: n_slots * hkv * block_size * d].reshape(n_slots * hkv, block_size, d)
        slot_of = rng.permutation(n_slots).reshape(n_seq, stored)  # sequences' slots interleaved
        lists = []
        for b in range(n_seq):
            for h in range(hkv):
                chosen = rng.choice(stored, size=per_unit, replace=False)
                lists.append(slot_of[b, chosen] * hkv + h)
        page_ids = np.concatenate(lists).astype(np.int64)
    page_ptr = np.arange(units + 1, dtype=np.int64) * per_unit
    return PagedKV(k, v, fmt, page_ptr, page_ids, np.full(units, tokens, np.int64), hkv)


# ---- timing ------------------------------------------------------------------------------------

def timeit(fn, min_seconds: float, min_repeats: int, max_repeats: int = 200, warmup: int = 2):
    """Median seconds per call (after warm-up); repeats until both minima are met."""
    for _ in range(warmup):
        fn()
    times = []
    start = time.perf_counter()
    while len(times) < max_repeats and (len(times) < min_repeats or time.perf_counter() - start < min_seconds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times), len(times)


def timeit_alternating(fns, min_seconds: float, min_repeats: int, max_repeats: int = 200, warmup: int = 2):
    """[(median, min) seconds per call of each fn], repeats: the functions timed in turn (one call
    of each per round, after warm-up), so that load from elsewhere on the machine falls on all alike."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    start = time.perf_counter()
    while len(times[0]) < max_repeats and (len(times[0]) < min_repeats or time.perf_counter() - start < min_seconds):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [(statistics.median(ts), min(ts)) for ts in times], len(times[0])


def numpy_attention(q, k_bits, v_bits, scale):
    """NumPy version: q [B, Hkv, G, D] float32, k/v bits [B, Hkv, N, D] uint16."""
    k, v = widen(k_bits), widen(v_bits)
    s = np.einsum("bhgd,bhnd->bhgn", q, k, optimize=True) * scale
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    total = e.sum(-1, keepdims=True)
    o = np.einsum("bhgn,bhnd->bhgd", e, v, optimize=True) / total
    return o, (m + np.log(total))[..., 0]


# ---- main --------------------------------------------------------------------------------------

def versions() -> dict:
    out = {"python": platform.python_version(), "numpy": np.__version__, "numba": numba.__version__}
    for name in ("jax", "jaxlib", "torch"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # not installed: recorded as such
            out[name] = None
    return out


def device_name(n_threads: int) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"cpu: {os.cpu_count()} cores ({cpu}), {n_threads} Numba threads"


def bench_sparsify(rows, args, rng):
    """Append + sparsify of one evicted block per sequence, batch 32 (the per-step host work of hgca).

    Three append figures, because first touch of fresh memory costs seconds per GiB on these VMs:
      append_blocks_batch32               steady state: the slots were touched ahead by
                                          `KVStore.reserve_blocks` (as a server does at setup)
      append_blocks_batch32_first_touch   a fresh store: every append writes never-touched pages
      arena_grow_2x                       one capacity doubling of the layer's arena (a view of
                                          the address-space reservation: no copy; note says so)
    """
    from host.kv_store import KVStore, StoreConfig
    from host.sparsify import sparsify_evicted

    batch, hkv, d, bs = 32, 8, 128, args.block_size
    rounds = 64  # appends per store, at most (timing loops are capped below this)
    cfg = StoreConfig(n_layers=1, n_kv_heads=hkv, head_dim=d, block_size=bs, kv_dtype="bf16",
                      initial_blocks_per_layer=batch * rounds, context_page_tokens=args.page_tokens)
    # bf16 bits, as the bridge receives evicted KV from the GPU
    k = rng.standard_normal((batch, 1, bs, hkv, d)).astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    window = 4096
    # MAW like a decode window: most tokens tiny, ~10% above beta / window
    maw = np.where(rng.random((batch, 1, bs, hkv)) < 0.1, 3.0, 0.2).astype(np.float32) / window
    pos = np.arange(bs).reshape(1, bs)

    def make_store(reserve):
        store = KVStore(cfg)
        if reserve:
            store.reserve_blocks(0, batch * rounds)
        for s in range(batch):
            store.add_sequence(s)
        return store

    def appender(store, numbers):
        def append():
            for s in range(batch):
                numbers[s] = store.append_blocks(0, s, k[s], k[s], maw[s], pos)
        return append

    numbers = [None] * batch
    store = make_store(True)
    t_app, t_app_min, n_app = timeit(appender(store, numbers), 0.5, 20, max_repeats=rounds - 4)
    t_sp, t_sp_min, n_sp = timeit(lambda: sparsify_evicted(store, 0, list(range(batch)), numbers, 1.0, window),
                                  0.5, 20, max_repeats=60)
    kept = store.context.kept_counts(0, 0).sum() / (hkv * (n_sp + 2) * bs)
    fresh = make_store(False)
    t_ft, t_ft_min, n_ft = timeit(appender(fresh, [None] * batch), 0.3, 10, max_repeats=rounds - 4, warmup=0)
    arena = fresh.layers[0]
    cap = arena.capacity
    t0 = time.perf_counter()
    arena.ensure_capacity(cap - arena.pool.high_water + 1)  # one slot past capacity: a doubling
    t_grow = time.perf_counter() - t0
    grow_note = (f"capacity {cap} -> {arena.capacity} slots ({arrays_gib(arena)} GiB after); "
                 f"{'copied the arena' if arena.slots.copies else 'no copy (view of the address-space reservation)'}")
    block_note = f"one evicted block of {bs} tokens per sequence, batch {batch}, Hkv {hkv}, D {d}"
    for name, t, tmin, n, note in (
            ("append_blocks_batch32", t_app, t_app_min, n_app,
             f"{block_note}; steady state: slots touched ahead by reserve_blocks"),
            ("append_blocks_batch32_first_touch", t_ft, t_ft_min, n_ft,
             f"{block_note}; fresh store, every append writes never-touched pages (no reserve_blocks)"),
            ("sparsify_evicted_block_batch32", t_sp, t_sp_min, n_sp, f"{block_note}; kept fraction {kept:.3f}"),
            ("arena_grow_2x", t_grow, t_grow, 1, grow_note)):
        rows.append({"kernel": name, "batch_heads": batch * hkv, "tokens": bs, "D": d, "dtype": "bf16",
                     "median_us": t * 1e6, "min_us": tmin * 1e6, "repeats": n, "achieved_GBps": None,
                     "read_ceiling_GBps": None, "fraction_of_ceiling": None, "numpy_us": None, "torch_us": None,
                     "note": note})
        print(f"{name}: median {t * 1e6:.0f} us (min {tmin * 1e6:.0f} us, {n} repeats): {note}", flush=True)


def arrays_gib(arena) -> str:
    return f"{sum(a.nbytes for a in arena.arrays.values()) / 2**30:.2f}"


# ---- scout pattern: selected blocks on the production path vs streaming (issue 29 item 3) -------

@njit(nogil=True, cache=True)
def _stream_layers(q, k_pages, v_pages, fmt, page_ptr, page_ids, unit_tokens, hkv, scale, n_threads, o_out, lse_out):
    """The streaming reference: the kernel over each layer's contiguous pages (page_ids [L, P];
    q [L, B, 1, Hq, D]), written into preallocated outputs o_out [L, B*Hq*D], lse_out [L, B*Hq]
    as serve_blocks writes its slots (`attend_pages_into`)."""
    n_b, tq, hq, d = q.shape[1:]
    for layer in range(page_ids.shape[0]):
        attend_pages_into(q[layer], k_pages, v_pages, fmt, page_ptr, page_ids[layer], unit_tokens, hkv, scale,
                          n_threads, o_out[layer].reshape(n_b, tq, hq, d), lse_out[layer].reshape(n_b, tq, hq))


@njit(nogil=True, cache=True)
def _stream_layers_copy(q, k_pages, v_pages, fmt, page_ptr, page_ids, unit_tokens, hkv, scale, n_threads, o_out,
                        lse_out):
    """`_stream_layers` for kernels without `attend_pages_into`: outputs copied out, as such a
    kernel's serve_blocks does."""
    for layer in range(page_ids.shape[0]):
        o, lse = attend_pages(q[layer], k_pages, v_pages, fmt, page_ptr, page_ids[layer], unit_tokens, hkv, scale,
                              n_threads)
        o_out[layer, :o.size] = o.reshape(o.size)
        lse_out[layer, :lse.size] = lse.reshape(lse.size)


def _scout_arena(nbytes: int):
    """uint8 [nbytes] like the store's arenas (an address-space reservation with transparent huge
    pages requested: host.memory), else np.empty."""
    from host.memory import _reserve_address_space

    buf = _reserve_address_space(nbytes)
    return buf[:nbytes] if buf is not None else np.empty(nbytes, np.uint8)


def _scout_select(rng, n_layers, batch, hkv, n_blocks, n_sel, n_pad):
    """ids int32 [L, B, Hkv, n_sel + n_pad]: n_sel distinct random block numbers < n_blocks per
    (layer, sequence, head), in random order, with n_pad -1 entries at random positions."""
    keys = rng.random((n_layers, batch, hkv, n_blocks), dtype=np.float32)
    chosen = np.argpartition(keys, n_sel - 1, axis=-1)[..., :n_sel] if n_sel < n_blocks else \
        np.argsort(keys, axis=-1)
    width = n_sel + n_pad
    ids = np.full((n_layers, batch, hkv, width), -1, np.int32)
    pos = np.argsort(rng.random((n_layers, batch, hkv, width), dtype=np.float32), axis=-1)[..., :n_sel]
    np.put_along_axis(ids, pos, chosen.astype(np.int32), axis=-1)
    return ids


def bench_scout(args) -> int:
    """`--pattern scout`: see the module docstring. Per (kv format, block size, CPU share):
      stream    the kernel (`attend_pages_into`, writing preallocated outputs as serve_blocks writes
                its slots) over contiguous pages (`--stream-page-tokens` rows each, every unit's
                pages adjacent, units adjacent) of the same tokens per unit, one region per layer of
                the call (regions cycle through the arena, so nothing is served from the LLC);
      selected  `serve_blocks` (the native exchange's worker body: ids -> page lists -> attend_pages
                -> answer) over `--layers` layers per call, each layer's blocks chosen at random
                (distinct, random order, some -1 padding) among its sequence's blocks, whose slots
                are a random permutation of the whole arena (sequences interleaved, as appends make
                them).
    GB/s = K + V bytes of the attended rows (int8 scales included) per second; ratio = selected /
    stream. Median of repeats after warm-up."""
    from host.exchange_worker import serve_blocks
    from host.store_format import from_storage

    n_threads = numba.get_num_threads()
    stream_fn = _stream_layers if attend_pages_into is not None else _stream_layers_copy
    batch, hkv, group, d, budget = args.batch, args.hkv, args.group, args.head_dim, args.budget
    hq = hkv * group
    n_layers = args.layers
    rng = np.random.default_rng(args.seed)
    arena_bytes = int(args.arena_gib * 2**30) // 2  # K and V arenas, each half of --arena-gib
    reuse = min(arena_bytes, 2**31)  # bytes read between two reads of the same block (see below)
    print(f"device: {device_name(n_threads)}; threading layer {THREADING_LAYER}", flush=True)
    t_start = time.perf_counter()
    k_raw, v_raw = _scout_arena(arena_bytes), _scout_arena(arena_bytes)
    scale = np.float32(1.0 / math.sqrt(d))
    rows, failures = [], []
    for fmt_name in args.kv_formats:
        fmt = INT8 if fmt_name == "int8" else BF16
        width = d + 4 if fmt == INT8 else d
        itemsize = 1 if fmt == INT8 else 2
        row_bytes = width * itemsize
        t0 = time.perf_counter()
        if fmt == INT8:
            n_rows_all = arena_bytes // row_bytes
            for raw, seed in ((k_raw, 1), (v_raw, 2)):
                _fill_random_int8(raw[:n_rows_all * row_bytes].view(np.int8).reshape(n_rows_all, width), seed)
        else:
            for raw, seed in ((k_raw, 1), (v_raw, 2)):
                _fill_random_bf16(raw[:arena_bytes // 2 * 2].view(np.uint16), seed)
        print(f"{fmt_name}: filled 2 x {arena_bytes / 2**30:.2f} GiB in {time.perf_counter() - t0:.1f} s", flush=True)
        storage = np.int8 if fmt == INT8 else np.uint16
        for bs in args.block_sizes:
            slot_bytes = hkv * bs * row_bytes
            n_slots = arena_bytes // slot_bytes
            nb = n_slots // batch  # blocks stored per sequence
            k_pages = k_raw[:n_slots * slot_bytes].view(storage).reshape(n_slots * hkv, bs, width)
            v_pages = v_raw[:n_slots * slot_bytes].view(storage).reshape(n_slots * hkv, bs, width)
            slot_table = rng.permutation(n_slots)[:batch * nb].reshape(batch, nb).astype(np.int64)
            for share in args.shares:
                n_sel = max(1, min(nb, round(share * budget / bs)))
                n_pad = max(1, n_sel // 8)
                k_ids = n_sel + n_pad
                tokens = n_sel * bs
                units = batch * hkv
                layer_bytes = units * tokens * 2 * row_bytes
                ids = _scout_select(rng, n_layers, batch, hkv, nb, n_sel, n_pad)
                q = rng.standard_normal((n_layers, batch, 1, hq, d)).astype(np.float32)
                # (b) selected blocks: serve_blocks over n_layers "layers" (all views of the one arena)
                layers = np.arange(n_layers, dtype=np.int32)
                served = np.zeros(n_layers, np.uint32)
                ready = np.ones(n_layers, np.uint32)
                done = np.zeros(n_layers, np.uint32)
                abort = np.zeros(1, np.uint32)
                slots_q = tuple(q[i].reshape(-1).copy() for i in range(n_layers))
                slots_ids = tuple(ids[i].reshape(-1).copy() for i in range(n_layers))
                slots_o = tuple(np.full(batch * hq * d, np.nan, np.float32) for _ in range(n_layers))
                slots_lse = tuple(np.full(batch * hq, np.nan, np.float32) for _ in range(n_layers))
                # calls cycle through n_var variants of the slot tables (every block moved by a random
                # number of slots) and of the stream regions, so that what one call reads was last
                # read >= `reuse` bytes earlier (no LLC hits between calls)
                call_bytes = n_layers * layer_bytes
                n_var = int(min(64, max(1, -(-reuse // call_bytes))))
                shifts = rng.integers(0, n_slots, n_var)
                shifts[0] = 0
                table_vars = [np.broadcast_to((slot_table + s) % n_slots, (n_layers, batch, nb)).copy()
                              for s in shifts]
                calls = [0, 0]
                n_blocks = np.full((n_layers, batch), nb, np.int64)
                last_ids = np.full((n_layers, batch * hkv * k_ids), -1, np.int32)
                stats = np.zeros(2, np.int64)
                kt, vt = (k_pages,) * n_layers, (v_pages,) * n_layers

                def selected():
                    served[:] = 0
                    ready[:] = 1
                    tables = table_vars[calls[0] % n_var]
                    calls[0] += 1
                    n, bad = serve_blocks(layers, served, ready, done, abort, slots_q, slots_ids, slots_o,
                                          slots_lse, batch, hq, d, hkv, k_ids, scale, n_threads, fmt, bs, kt, vt,
                                          tables, n_blocks, last_ids, stats)
                    if n != n_layers or bad != -1:
                        raise RuntimeError(f"serve_blocks served {n} of {n_layers} layers (bad {bad})")

                selected()  # variant 0: the slot table checked below
                if stats[0] != n_layers * units * tokens:
                    failures.append(f"{fmt_name} bs {bs} share {share}: {stats[0]} tokens attended, expected "
                                    f"{n_layers * units * tokens}")
                # correctness: layer 0 and the last layer, two units each, against the float64 reference
                for layer in (0, n_layers - 1):
                    o = slots_o[layer].reshape(batch, 1, hq, d)
                    lse = slots_lse[layer].reshape(batch, 1, hq)
                    for u in (0, units - 1):
                        bi, h = divmod(u, hkv)
                        sel = ids[layer, bi, h][ids[layer, bi, h] >= 0]
                        pages = slot_table[bi, sel] * hkv + h
                        kf = from_storage(k_pages[pages].reshape(-1, width), fmt_name)
                        vf = from_storage(v_pages[pages].reshape(-1, width), fmt_name)
                        heads = slice(h * group, (h + 1) * group)
                        ro, rl = reference_attention(q[layer, bi:bi + 1, :, heads], [[kf]], [[vf]], 1)
                        err = max(norm_relative_error(o[bi:bi + 1, :, heads], ro),
                                  norm_relative_error(lse[bi:bi + 1, :, heads], rl))
                        if err > 1e-4:
                            failures.append(f"selected {fmt_name} bs {bs} share {share} layer {layer} unit {u}: "
                                            f"rel err {err:.2e}")
                # (a) streaming: contiguous pages of the same tokens per unit, one region per layer
                pt = min(args.stream_page_tokens, tokens)
                per_unit = -(-tokens // pt)
                s_pages = units * per_unit
                n_pages_all = arena_bytes // (pt * row_bytes)
                n_regions = n_pages_all // s_pages
                if n_regions < 1:
                    raise ValueError(f"--arena-gib {args.arena_gib} too small for one layer's {layer_bytes} bytes")
                sk = k_raw[:n_pages_all * pt * row_bytes].view(storage).reshape(n_pages_all, pt, width)
                sv = v_raw[:n_pages_all * pt * row_bytes].view(storage).reshape(n_pages_all, pt, width)
                s_ptr = np.arange(units + 1, dtype=np.int64) * per_unit
                s_ids_vars = [np.stack([((c * n_layers + i) % n_regions) * s_pages + np.arange(s_pages, dtype=np.int64)
                                        for i in range(n_layers)]) for c in range(n_var)]
                s_tokens = np.full(units, tokens, np.int64)
                s_o = np.full((n_layers, batch * hq * d), np.nan, np.float32)
                s_lse = np.full((n_layers, batch * hq), np.nan, np.float32)

                def stream():
                    s_ids = s_ids_vars[calls[1] % n_var]
                    calls[1] += 1
                    stream_fn(q, sk, sv, fmt, s_ptr, s_ids, s_tokens, hkv, scale, n_threads, s_o, s_lse)

                stream()
                if not (np.isfinite(s_o).all() and np.isfinite(s_lse).all()):
                    failures.append(f"stream {fmt_name} bs {bs} share {share}: non-finite output")
                ((t_sel, t_sel_min), (t_str, t_str_min)), reps = timeit_alternating(
                    (selected, stream), 2 * args.min_seconds, args.repeats)
                sel_gbps = n_layers * layer_bytes / t_sel / 1e9
                str_gbps = n_layers * layer_bytes / t_str / 1e9
                row = {"pattern": "scout", "kv_format": fmt_name, "block_size": bs, "cpu_share": share,
                       "blocks_per_unit": n_sel, "ids_per_unit": k_ids, "tokens_per_unit": tokens, "batch": batch,
                       "hkv": hkv, "G": group, "D": d, "layers_per_call": n_layers, "bytes_per_layer": layer_bytes,
                       "stream_page_tokens": pt, "stream_regions": n_regions, "call_variants": n_var,
                       "stream_us_per_layer": t_str / n_layers * 1e6, "selected_us_per_layer": t_sel / n_layers * 1e6,
                       "stream_min_us_per_layer": t_str_min / n_layers * 1e6,
                       "selected_min_us_per_layer": t_sel_min / n_layers * 1e6,
                       "repeats": reps, "stream_GBps": str_gbps, "selected_GBps": sel_gbps,
                       "ratio": sel_gbps / str_gbps}
                rows.append(row)
                print(f"{fmt_name:>5} bs {bs:3d} share {share:5.2f} ({n_sel:4d} blocks, {layer_bytes / 2**20:7.1f} MiB"
                      f"/layer): stream {str_gbps:6.1f} GB/s, selected {sel_gbps:6.1f} GB/s, ratio "
                      f"{row['ratio']:.2f}", flush=True)
                del slots_q, slots_ids, slots_o, slots_lse, table_vars, last_ids, s_o, s_lse, s_ids_vars
    wall = time.perf_counter() - t_start
    result = {
        **_header("host-attention-scout", n_threads),
        "config": {"batch": batch, "hkv": hkv, "G": group, "D": d, "budget_tokens": budget, "shares": args.shares,
                   "block_sizes": args.block_sizes, "kv_formats": args.kv_formats, "layers_per_call": n_layers,
                   "arena_gib": args.arena_gib, "stream_page_tokens": args.stream_page_tokens, "threads": n_threads,
                   "threading_layer": numba.threading_layer(), "Tq": 1, "small": args.small,
                   "timing": f"median of >= {args.repeats} calls and >= {args.min_seconds} s after 2 warm-up calls; "
                             "a call serves layers_per_call layers",
                   "bytes": "K+V bytes of the attended rows (int8: D + 4 bytes per row)",
                   "selected": "host.exchange_worker.serve_blocks over random blocks of the arena",
                   "stream": "host.attention.attend_pages_into over contiguous pages of the same tokens per unit "
                             "(attend_pages + an output copy for kernels without it)",
                   "wall_seconds": round(wall, 1), "correctness_failures": failures},
        "rows": rows,
    }
    out_path = args.json or args.out or f"benchmarks/results/host-attention-scout-{socket.gethostname()}.json"
    _write_json(result, out_path, f" ({wall:.0f} s)")
    print(f"{'format':>6} {'bs':>3} {'share':>5} {'blocks':>6} {'MiB/layer':>9} {'stream GB/s':>11} "
          f"{'selected GB/s':>13} {'ratio':>5}")
    for r in rows:
        print(f"{r['kv_format']:>6} {r['block_size']:>3} {r['cpu_share']:>5.2f} {r['blocks_per_unit']:>6} "
              f"{r['bytes_per_layer'] / 2**20:>9.1f} {r['stream_GBps']:>11.1f} {r['selected_GBps']:>13.1f} "
              f"{r['ratio']:>5.2f}")
    ratios = [r["ratio"] for r in rows]
    if ratios:
        print(f"ratio selected / stream: min {min(ratios):.2f}, median {statistics.median(ratios):.2f}")
    return _verdict(failures, "checked units match the float64 reference")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/host-attention-<host>.json)")
    p.add_argument("--quick", action="store_true", help="small grid for the 2-core machine")
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--batch-heads", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    p.add_argument("--group", type=int, default=4, help="query heads per KV head (G)")
    p.add_argument("--hkv", type=int, default=8, help="KV heads per sequence (B = batch_heads / hkv)")
    p.add_argument("--kernels", nargs="+", default=["a", "c"], choices=["a", "c"])
    p.add_argument("--kv-formats", nargs="+", default=["bf16", "int8"], choices=["bf16", "int8"])
    p.add_argument("--threads", type=int, default=None, help="Numba threads (default: all)")
    p.add_argument("--page-tokens", type=int, default=256)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--max-gib", type=float, default=2.0, help="skip points whose K+V bytes exceed this")
    p.add_argument("--baseline-max-mib", type=float, default=256.0, help="NumPy/torch only up to this size")
    p.add_argument("--time-budget", type=float, default=170.0,
                   help="seconds; past it the remaining NumPy/torch baselines are skipped (left null)")
    p.add_argument("--min-seconds", type=float, default=None,
                   help="per measured function and point (default 0.4; scout 0.3, --small 0.2)")
    p.add_argument("--json", default=None, help="JSON path (same as --out)")
    p.add_argument("--pattern", default="grid", choices=["grid", "scout"],
                   help="grid: the kernels over the point grid; scout: selected blocks vs streaming (issue 29)")
    g = p.add_argument_group("--pattern scout")
    g.add_argument("--small", action="store_true", help="scout sizes for the 2-core machine (batch 8, 1 GiB arena)")
    g.add_argument("--batch", type=int, default=32)
    g.add_argument("--head-dim", type=int, default=128)
    g.add_argument("--budget", type=int, default=2048, help="tokens per (sequence, KV head) selected in all")
    g.add_argument("--shares", type=float, nargs="+", default=[0.1, 1.0], help="CPU shares of the budget")
    g.add_argument("--block-sizes", type=int, nargs="+", default=[16, 32, 64])
    g.add_argument("--layers", type=int, default=16, help="layers served per serve_blocks call")
    g.add_argument("--arena-gib", type=float, default=4.0, help="K + V store arena the blocks are scattered over")
    g.add_argument("--stream-page-tokens", type=int, default=256, help="page size of the streaming reference")
    g.add_argument("--repeats", type=int, default=7, help="at least this many timed calls per point")
    g.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    if args.pattern == "scout":
        if args.small:
            args.batch = min(args.batch, 8)
            args.arena_gib = min(args.arena_gib, 1.0)
            args.layers = min(args.layers, 8)
            args.repeats = max(args.repeats, 9)
        if args.min_seconds is None:
            args.min_seconds = 0.2 if args.small else 0.3
        if args.threads:
            numba.set_num_threads(args.threads)
        return bench_scout(args)
    if args.min_seconds is None:
        args.min_seconds = 0.4
    args.out = args.out or args.json
    if args.quick:
        args.batch_heads = [8, 32]
        args.tokens = [1024, 4096, 16384]
        args.max_gib = min(args.max_gib, 0.25)
        args.min_seconds = min(args.min_seconds, 0.3)
    if args.threads:
        numba.set_num_threads(args.threads)
    n_threads = numba.get_num_threads()
    rng = np.random.default_rng(1234)
    out_path = args.out or f"benchmarks/results/host-attention-{socket.gethostname()}.json"
    print(f"device: {device_name(n_threads)}; threading layer {THREADING_LAYER}", flush=True)

    points = [(d, u, n) for d in args.dims for u in args.batch_heads for n in args.tokens
              if u * n * d * 2 * 2 <= args.max_gib * 2**30 and u % args.hkv == 0]
    max_elems = max(u * n * d * 5 // 4 for d, u, n in points) + 1
    t0 = t_start = time.perf_counter()
    arena_k = np.empty(max_elems, np.uint16)
    arena_v = np.empty(max_elems, np.uint16)
    _fill_random_bf16(arena_k, 1)  # also the first touch of every page, before any timing
    _fill_random_bf16(arena_v, 2)
    print(f"filled {2 * max_elems * 2 / 2**30:.2f} GiB of random bf16 in {time.perf_counter() - t0:.1f} s; "
          f"active Numba threading layer: {numba.threading_layer()}", flush=True)

    rows, failures, measured = [], [], []
    int8_arena = None
    if "int8" in args.kv_formats:  # rows of D int8 + scale; sized for the widest D
        max_rows = max(u * n * 5 // 4 for d, u, n in points) + 1
        n8 = max_rows * (max(args.dims) + 4)
        int8_arena = (np.empty(n8, np.int8), np.empty(n8, np.int8))
        t0 = time.perf_counter()
    # Pass 1: our kernel and the read ceiling for every point. Baselines run in pass 2, so that
    # torch's / BLAS's spinning OpenMP threads never compete with Numba's during our timings.
    filled_int8_d = None
    for fmt_name in args.kv_formats:
        fmt = INT8 if fmt_name == "int8" else BF16
        for d, units, tokens in points:
            if fmt == INT8:
                arena_k_f, arena_v_f = int8_arena
                if filled_int8_d != d:  # every page written (first touch) before timing
                    rows_n = arena_k_f.shape[0] // (d + 4)
                    _fill_random_int8(arena_k_f[:rows_n * (d + 4)].reshape(rows_n, d + 4), 1)
                    _fill_random_int8(arena_v_f[:rows_n * (d + 4)].reshape(rows_n, d + 4), 2)
                    filled_int8_d = d
            else:
                arena_k_f, arena_v_f = arena_k, arena_v
            for kind in args.kernels:
                view = make_view(kind, arena_k_f, arena_v_f, units, tokens, d, args.hkv, args.page_tokens,
                                 args.block_size, rng, fmt)
                b = units // args.hkv
                q = rng.standard_normal((b, 1, args.hkv * args.group, d)).astype(np.float32)
                nbytes = view.attended_bytes()
                o, lse = paged_attention(q, view)
                # correctness: float64 reference on two units (over the dequantized values for int8)
                for u in (0, units - 1):
                    k, v = unit_tokens_of(view, u)
                    bi, h = divmod(u, args.hkv)
                    heads = slice(h * args.group, (h + 1) * args.group)
                    ro, rl = reference_attention(q[bi:bi + 1, :, heads], [[k]], [[v]], 1)
                    err = max(norm_relative_error(o[bi:bi + 1, :, heads], ro),
                              norm_relative_error(lse[bi:bi + 1, :, heads], rl))
                    if err > 1e-4:
                        failures.append(f"kernel {kind} {fmt_name} D={d} units={units} tokens={tokens} unit {u}: "
                                        f"rel err {err:.2e}")
                t_ours, t_ours_min, reps = timeit(lambda: paged_attention(q, view), args.min_seconds, 10)
                page_rows = np.full(view.page_ids.shape[0], view.page_tokens, np.int64)  # all pages full here
                sums = np.empty(view.page_ids.shape[0], np.uint32)
                t_read, _, _ = timeit(lambda: _read_ceiling(view.k_pages, view.v_pages, view.page_ids, page_rows,
                                                            sums), args.min_seconds, 10)
                bf16_bytes = units * tokens * 2 * d * 2
                row = {"kernel": {"a": "context_cache", "c": "chosen_blocks"}[kind], "batch_heads": units,
                       "tokens": tokens, "D": d, "G": args.group, "dtype": fmt_name, "kv_format": fmt_name,
                       "median_us": t_ours * 1e6, "min_us": t_ours_min * 1e6, "repeats": reps,
                       "achieved_GBps": nbytes / t_ours / 1e9, "read_ceiling_GBps": nbytes / t_read / 1e9,
                       "bf16_equiv_GBps": bf16_bytes / t_ours / 1e9,
                       "numpy_us": None, "torch_us": None, "bytes": nbytes}
                row["fraction_of_ceiling"] = row["achieved_GBps"] / row["read_ceiling_GBps"]
                rows.append(row)
                if fmt == BF16:
                    measured.append((row, view, q, o))
                print(f"{row['kernel']:>14} D={d:3d} batch_heads={units:3d} tokens={tokens:6d} {fmt_name}: "
                      f"{t_ours * 1e6:9.0f} us {row['achieved_GBps']:6.1f} GB/s, bf16-equivalent "
                      f"{row['bf16_equiv_GBps']:6.1f} GB/s (read ceiling {row['read_ceiling_GBps']:6.1f} GB/s, "
                      f"fraction {row['fraction_of_ceiling']:.2f})", flush=True)
    del int8_arena
    if len(args.kv_formats) > 1:  # the int8 / bf16 ratio of bf16-equivalent throughput, point by point
        by_point = {(r["kernel"], r["D"], r["batch_heads"], r["tokens"], r["kv_format"]): r for r in rows}
        for (kernel, d, units, tokens, fmt_name), r in list(by_point.items()):
            base = by_point.get((kernel, d, units, tokens, "bf16"))
            if fmt_name == "int8" and base is not None:
                r["speedup_vs_bf16"] = r["bf16_equiv_GBps"] / base["bf16_equiv_GBps"]
                print(f"{kernel:>14} D={d:3d} batch_heads={units:3d} tokens={tokens:6d}: int8 / bf16 = "
                      f"{r['speedup_vs_bf16']:.2f}x ({base['bytes'] / 2**20:.0f} MiB of bf16 KV)", flush=True)

    # Pass 2: NumPy and torch on dense [B, Hkv, N, D] copies of the same values.
    try:
        import torch
        torch.set_num_threads(n_threads)
    except Exception as exc:
        print(f"torch unavailable ({exc}); torch_us left null", flush=True)
        torch = None
    for row, view, q, o in measured:
        if row["bytes"] > args.baseline_max_mib * 2**20:
            continue
        if time.perf_counter() - t_start > args.time_budget:
            print(f"time budget of {args.time_budget} s spent: remaining baselines skipped", flush=True)
            break
        d, units, tokens, kind = row["D"], row["batch_heads"], row["tokens"], row["kernel"]
        b = units // args.hkv
        dense = lambda pages: np.stack([pages[view.page_ids[view.page_ptr[u]:view.page_ptr[u + 1]]].reshape(-1, d)
                                        for u in range(units)]).reshape(b, args.hkv, tokens, d)
        kd, vd = dense(view.k_pages), dense(view.v_pages)
        qn = q[:, 0].reshape(b, args.hkv, args.group, d)
        scale = 1.0 / math.sqrt(d)
        no, _ = numpy_attention(qn, kd, vd, scale)
        err = norm_relative_error(o[:, 0].reshape(no.shape), no)
        if err > 1e-4:
            failures.append(f"numpy vs {kind} D={d} units={units} tokens={tokens}: {err:.2e}")
        row["numpy_us"] = timeit(lambda: numpy_attention(qn, kd, vd, scale), args.min_seconds / 2, 3, 20, 1)[0] * 1e6
        if torch is not None:
            tq_ = torch.from_numpy(q[:, 0].copy()).to(torch.bfloat16).reshape(b, args.hkv * args.group, 1, d)
            tk = torch.from_numpy(kd.view(np.int16)).view(torch.bfloat16)
            tv = torch.from_numpy(vd.view(np.int16)).view(torch.bfloat16)
            sdpa = torch.nn.functional.scaled_dot_product_attention
            with torch.inference_mode():
                to = sdpa(tq_, tk, tv, enable_gqa=True).float().numpy()
                err = norm_relative_error(to[:, :, 0], o[:, 0])
                if err > 2e-2:  # torch rounds q and o to bf16
                    failures.append(f"torch vs {kind} D={d} units={units} tokens={tokens}: {err:.2e}")
                row["torch_us"] = timeit(lambda: sdpa(tq_, tk, tv, enable_gqa=True), args.min_seconds / 2, 3, 50, 1)[0] * 1e6
        print(f"{kind:>14} D={d:3d} BH={units:3d} N={tokens:6d}: numpy {row['numpy_us']:9.0f} us, "
              f"torch {row['torch_us'] or float('nan'):9.0f} us", flush=True)
        del kd, vd
    bench_sparsify(rows, args, rng)

    result = {
        **_header("host-attention", n_threads),
        "config": {"group": args.group, "hkv": args.hkv, "page_tokens": args.page_tokens,
                   "block_size": args.block_size, "threads": n_threads, "threading_layer": numba.threading_layer(),
                   "kv_formats": args.kv_formats, "Tq": 1, "quick": args.quick, "max_gib": args.max_gib,
                   "timing": f"median of >= 10 calls and >= {args.min_seconds} s after 2 warm-up calls",
                   "bytes": "K+V bytes of the attended tokens", "numpy": "bf16 widened in NumPy + einsum",
                   "torch": "F.scaled_dot_product_attention bf16 dense [B, Hq, 1, D] x [B, Hkv, N, D], enable_gqa",
                   "baseline_max_mib": args.baseline_max_mib,
                   "wall_seconds": round(time.perf_counter() - t_start, 1),
                   "correctness_failures": failures},
        "rows": rows,
    }
    _write_json(result, out_path)
    print(f"{'kernel':>14} {'D':>4} {'batch_heads':>11} {'tokens':>6} {'dtype':>5} {'median_us':>9} {'min_us':>9} "
          f"{'achieved_GBps':>13} {'read_ceiling_GBps':>17} {'fraction_of_ceiling':>19} {'numpy_us':>9} {'torch_us':>9}")
    for r in rows:
        if r["achieved_GBps"] is None:
            continue
        print(f"{r['kernel']:>14} {r['D']:>4} {r['batch_heads']:>11} {r['tokens']:>6} {r['dtype']:>5} {r['median_us']:>9.0f} "
              f"{r['min_us']:>9.0f} {r['achieved_GBps']:>13.1f} {r['read_ceiling_GBps']:>17.1f} "
              f"{r['fraction_of_ceiling']:>19.2f} {r['numpy_us'] or float('nan'):>9.0f} {r['torch_us'] or float('nan'):>9.0f}")
    for r in rows:
        if r["achieved_GBps"] is None:
            print(f"{r['kernel']}: median {r['median_us']:.0f} us ({r['note']})")
    return _verdict(failures, "all points match the float64 reference (and the NumPy/torch baselines)")


if __name__ == "__main__":
    sys.exit(main())
