"""Compile the host kernels (host/*.py, `@njit(cache=True)`) into Numba's on-disk cache ahead of use.

scripts/setup.sh runs this after building the native exchange; by hand:

    .venv/bin/python scripts/warm_host_kernels.py [--layers 1,2] [--jobs N] [--keep]

Without it a fresh checkout compiles the kernels on first use: minutes on a 2-core machine, inside
the first test or the first hybrid decode step that reaches them. Numba compiles one
specialization per combination of argument types (array dtype, rank, layout, writability, and the
length of a tuple); each group below calls the kernels once, on tiny inputs, through the entry
points the project calls them by, with the type combinations the project passes:

  attention  per KV storage format (fp32: float32; bf16 / fp16: uint16 bit patterns, one compiled
             form for both; int8: int8 rows + scale): paged_attention over every stored token with
             token probabilities (hgca's re-evaluation), the context cache (hgca, clipped to the
             published blocks), chosen blocks (scout / topk), and attend_pages(_into) (the native
             exchange's kernel); plus fp32 with read-only queries (hgca's re-scoring of a restored
             session, jhybrid.hybrid.modes.hgca.HgcaHost.restored, passes np.asarray of a device
             array: the tests' float32 models)
  gather     scout's recall gather of (block, head) rows out of the store's arena, per format
  exchange   the native exchange's worker serving one hgca step (serve_context) and one scout /
             topk step (serve_blocks) per format and per number of offloaded layers in --layers
             (default 1,2: the test models): the layers' mailboxes and pages are tuples, and a
             tuple's length is part of the type (another count compiles on first use, ~25 s:
             the attention kernels inside come from the cache). Skipped when the native library
             is not built (decode steps then use jax.pure_callback and never call the worker).

Numba's cache lives in host/__pycache__ and is keyed by each source file's path and mtime (not by
the modules a kernel inlines, such as host/_page_math.py), so unless --keep is given its host
entries are deleted first: everything is compiled from the current sources. The groups run in
--jobs processes (default: min(2, CPUs); a lock serialises their cache writes). Prints one line per
group. Exit status 0 when every group compiled, 1 otherwise (setup reports it as a warning: the
kernels then compile on first use).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import glob
import os
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
CACHE_DIR = os.path.join(ROOT, "host", "__pycache__")
LOCK_PATH = os.path.join(CACHE_DIR, "warm.lock")

import numpy as np  # noqa: E402

KV_DTYPES = ("fp32", "bf16", "int8")
DEFAULT_LAYERS = "1,2"
HKV, GROUP, D, BS = 2, 2, 64, 16
HQ = HKV * GROUP


# ---- the groups ---------------------------------------------------------------------------------

def _threads() -> int:
    import numba

    return min(2, numba.config.NUMBA_NUM_THREADS)


def _store(kv_dtype: str, n_layers: int = 1, batch: int = 2, n_blocks: int = 3):
    """A tiny KVStore: n_blocks blocks per sequence and layer, hgca's context cache filled."""
    from host import KVStore, StoreConfig, sparsify_evicted

    rng = np.random.default_rng(0)
    store = KVStore(StoreConfig(n_layers=n_layers, n_kv_heads=HKV, head_dim=D, block_size=BS, kv_dtype=kv_dtype,
                                initial_blocks_per_layer=4))
    for b in range(batch):
        store.add_sequence(b)
    for layer in range(n_layers):
        numbers = []
        for b in range(batch):
            k = rng.standard_normal((n_blocks, BS, HKV, D)).astype(np.float32)
            v = rng.standard_normal((n_blocks, BS, HKV, D)).astype(np.float32)
            maw = rng.random((n_blocks, BS, HKV)).astype(np.float32)
            pos = np.arange(n_blocks * BS, dtype=np.int64).reshape(n_blocks, BS)
            numbers.append(store.append_blocks(layer, b, k, v, maw, pos))
        sparsify_evicted(store, layer, list(range(batch)), numbers, beta=0.5, window_tokens=BS)
    return store


def _queries(batch: int, tq: int = 1, writeable: bool = True) -> np.ndarray:
    q = np.random.default_rng(1).standard_normal((batch, tq, HQ, D)).astype(np.float32)
    q.flags.writeable = writeable
    return q


def warm_attention(kv_dtype: str, read_only_queries: bool = False) -> None:
    from host import attend_all, attend_blocks, attend_context, reevaluate
    from host.attention import _store_view_locked, attend_pages, attend_pages_into
    from host.targets import KEPT_TOKENS

    store = _store(kv_dtype)
    seqs = [0, 1]
    q = _queries(2, writeable=not read_only_queries)
    if read_only_queries:  # paged_attention with and without probabilities
        attend_all(store, 0, seqs, q, return_probs=True)
        reevaluate(store, 0, seqs, _queries(2, tq=2, writeable=False), beta=0.5)
        return
    attend_all(store, 0, seqs, q)
    attend_all(store, 0, seqs, q, return_probs=True)
    reevaluate(store, 0, seqs, _queries(2, tq=2), beta=0.5)
    attend_context(store, 0, seqs, q)
    KEPT_TOKENS.attend(store, 0, seqs, q, None, published_tokens=np.array([BS, 2 * BS], np.int64))
    attend_blocks(store, 0, seqs, q, np.array([[[0, 2], [1, -1]], [[2, -1], [0, 1]]], np.int64))
    with store.lock:
        view = _store_view_locked(store, 0, seqs)
    o, lse = attend_pages(q, view.k_pages, view.v_pages, view.fmt, view.page_ptr, view.page_ids, view.unit_tokens,
                          view.n_kv_heads, np.float32(0.125), _threads())
    attend_pages_into(q, view.k_pages, view.v_pages, view.fmt, view.page_ptr, view.page_ids, view.unit_tokens,
                      view.n_kv_heads, np.float32(0.125), _threads(), o, lse)


def warm_gather(kv_dtype: str) -> None:
    from host.gather import gather_rows

    arrays = _store(kv_dtype, batch=1, n_blocks=2).layers[0].arrays
    out_k = np.empty((2,) + arrays["k"].shape[2:], arrays["k"].dtype)
    out_v = np.empty_like(out_k)
    gather_rows(arrays["k"], arrays["v"], np.array([0, 1], np.int64), np.array([1, 0], np.int64), out_k, out_v)


def warm_exchange(kv_dtype: str, n_layers: int) -> str | None:
    """One hgca step (ContextPages) and one scout / topk step (BlockPages) through a real
    ExchangeWorker on CPU mailboxes; a note when skipped (no native library)."""
    from host.exchange_worker import BlockPages, ContextPages, ExchangeWorker, NativeExchange, StepPlan

    try:
        native = NativeExchange()
    except OSError as exc:
        return f"skipped: {exc}"
    batch, k = 2, 2
    store = _store(kv_dtype, n_layers=n_layers, batch=batch)
    published = np.full(batch, store.n_blocks(0, 0), np.int64)
    slot_tables = np.stack([np.stack([store.block_slots(layer, b) for b in range(batch)])
                            for layer in range(n_layers)]).astype(np.int64)
    steps = (lambda: ContextPages.of(store, n_layers, batch, published * BS),
             lambda: BlockPages.of(store, k, slot_tables, published))
    boxes = native.open(n_layers, batch, HQ, HKV, D, k, gpu=False, timeout_s=900.0)
    worker = ExchangeWorker(native, boxes, _threads(), float(1 / np.sqrt(D)), timeout_s=900.0)
    try:
        for seq, pages in enumerate(steps, start=1):
            for layer in range(n_layers):
                boxes.q[layer][:] = 0.5
                boxes.ids[layer][:] = np.resize(np.array([0, 2, 1, -1], np.int32), boxes.ids[layer].shape)
            worker.arm(StepPlan(np.arange(n_layers, dtype=np.int32), lambda pages=pages: (pages(), None)))
            boxes.ready[:] = seq  # each layer's seq-th submit has arrived
            if not worker.wait_idle(1200):
                raise TimeoutError("the exchange worker did not finish the step")
            worker.raise_pending()
            if not np.all(boxes.done == seq):
                raise RuntimeError(f"the exchange worker answered {boxes.done.tolist()}; expected {seq}")
    finally:
        if worker.close(60):
            native.close()
    return None


def groups(layer_counts) -> list[tuple[str, object]]:
    """(name, thunk) in a good order for --jobs workers taking every jobs-th group: the long ones
    (each format's first attention compile, about a minute and a half on a 2-core machine) first."""
    out = []
    for fmt in KV_DTYPES:
        out.append((f"attention {fmt}: all tokens (+ probabilities), context cache, chosen blocks, attend_pages",
                    lambda fmt=fmt: warm_attention(fmt)))
    out.append(("attention fp32, read-only queries (+ probabilities)", lambda: warm_attention("fp32", True)))
    for fmt in KV_DTYPES:
        for n in layer_counts:
            out.append((f"exchange worker {fmt}, {n} layer(s): serve_context (hgca), serve_blocks (scout, topk)",
                        lambda fmt=fmt, n=n: warm_exchange(fmt, n)))
    for fmt in KV_DTYPES:
        out.append((f"gather {fmt} (scout's recall)", lambda fmt=fmt: warm_gather(fmt)))
    return out


# ---- running ------------------------------------------------------------------------------------

def _serialise_cache_writes() -> None:
    """Numba's cache index is read-modify-written without a lock: with several processes adding
    entries to one function's index, hold an exclusive file lock around each load and save."""
    from numba.core import caching

    if not all(callable(getattr(caching.IndexDataCacheFile, m, None)) for m in ("save", "load")):
        raise RuntimeError("numba.core.caching.IndexDataCacheFile has no save / load to serialise: run with --jobs 1")

    def locked(method):
        def run(self, *args):
            with open(LOCK_PATH, "a") as f:
                fcntl.flock(f, fcntl.LOCK_EX)
                try:
                    return method(self, *args)
                finally:
                    fcntl.flock(f, fcntl.LOCK_UN)
        return run

    caching.IndexDataCacheFile.save = locked(caching.IndexDataCacheFile.save)
    caching.IndexDataCacheFile.load = locked(caching.IndexDataCacheFile.load)


def run_worker(layer_counts, index: int, jobs: int) -> int:
    import numba

    if jobs > 1:
        _serialise_cache_writes()
    numba.set_num_threads(_threads())
    failed = 0
    for name, fn in groups(layer_counts)[index::jobs]:
        start = time.perf_counter()
        try:
            note = fn()
        except Exception:  # noqa: BLE001 - reported; these kernels then compile on first use
            failed += 1
            print(f"[warm] FAILED: {name}\n{traceback.format_exc()}", flush=True)
            continue
        print(f"[warm] {time.perf_counter() - start:6.1f} s  {name}" + (f" ({note})" if note else ""), flush=True)
    return failed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", default=os.environ.get("JHYBRID_WARM_LAYERS", DEFAULT_LAYERS),
                   help="offloaded-layer counts to compile the exchange worker for, comma-separated "
                        f"(default {DEFAULT_LAYERS}, or $JHYBRID_WARM_LAYERS; e.g. add 30 for SmolLM2)")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="processes (default min(2, CPUs))")
    p.add_argument("--keep", action="store_true", help="keep the existing host/__pycache__ Numba entries")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # "index/jobs": run that share here
    args = p.parse_args()
    layer_counts = sorted({int(x) for x in args.layers.split(",") if x.strip()})
    if args.worker:
        index, jobs = (int(x) for x in args.worker.split("/"))
        return 1 if run_worker(layer_counts, index, jobs) else 0

    os.makedirs(CACHE_DIR, exist_ok=True)
    if not args.keep:
        for path in glob.glob(os.path.join(CACHE_DIR, "*.nbi")) + glob.glob(os.path.join(CACHE_DIR, "*.nbc")):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
    jobs = max(1, min(args.jobs, len(groups(layer_counts))))
    print(f"[warm] compiling the host kernels into Numba's cache (host/__pycache__) in {jobs} process(es), "
          f"exchange worker for {','.join(map(str, layer_counts))} layer(s): a few minutes", flush=True)
    start = time.perf_counter()
    cmd = [sys.executable, os.path.abspath(__file__), "--layers", ",".join(map(str, layer_counts))]
    procs = [subprocess.Popen(cmd + ["--worker", f"{i}/{jobs}"]) for i in range(jobs)]
    codes = [proc.wait() for proc in procs]
    with contextlib.suppress(FileNotFoundError):
        os.remove(LOCK_PATH)
    failed = sum(code != 0 for code in codes)
    print(f"[warm] done in {time.perf_counter() - start:.0f} s"
          + (f"; {failed} process(es) reported failures (those kernels compile on first use)" if failed else ""),
          flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
