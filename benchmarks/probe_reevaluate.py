"""hgca's re-scoring on the CPU (`host.sparsify.reevaluate`) for one row of the Llama-3-8B shape.

One layer's re-scoring of a row with `--tokens` offloaded tokens (bf16 store, Hkv 8, D 128, 64-token
blocks) under `--queries` queries of 32 heads: its token probabilities (`paged_token_probabilities`,
one pass over the keys) and the whole call (the context cache rebuilt). `--baseline-rev REV` also
times, in the same process, what `reevaluate` ran at git revision REV: that revision's
`paged_attention(..., return_probs=True)` (the attention pass, whose output it discarded, then the
probabilities), alone and inside today's `reevaluate`, its kernels compiled from `git show
REV:host/attention.py` (uncached), and checks that both give the same probabilities. Warm-up, then the median of `--repeats`.

    PYTHONPATH=. python3 benchmarks/probe_reevaluate.py --baseline-rev 04c5539 --out probe.json
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numba
import numpy as np

from host import KVStore, StoreConfig, paged_token_probabilities, reevaluate
from host.attention import _store_view_locked, paged_attention

BLOCK, HKV, HQ, D = 64, 8, 32, 128


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up (and the compile)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def baseline_module(rev: str):
    """host/attention.py at `rev`, imported as a module of its own (its kernels not cached)."""
    source = subprocess.run(["git", "show", f"{rev}:host/attention.py"], check=True, capture_output=True,
                            text=True).stdout.replace("cache=True", "cache=False")
    path = Path(tempfile.mkdtemp()) / "baseline_attention.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=12288)
    parser.add_argument("--queries", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--baseline-rev", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    n_blocks = args.tokens // BLOCK
    store = KVStore(StoreConfig(n_layers=1, n_kv_heads=HKV, head_dim=D, block_size=BLOCK, kv_dtype="bf16"))
    store.add_sequence(0)
    k = rng.standard_normal((n_blocks, BLOCK, HKV, D)).astype(np.float32)
    v = rng.standard_normal((n_blocks, BLOCK, HKV, D)).astype(np.float32)
    maw = (rng.random((n_blocks, BLOCK, HKV)) / args.tokens).astype(np.float32)
    store.append_blocks(0, 0, k, v, maw, np.arange(n_blocks * BLOCK).reshape(n_blocks, BLOCK))
    q = (rng.standard_normal((1, args.queries, HQ, D)) * 1.5).astype(np.float32)
    with store.lock:
        view = _store_view_locked(store, 0, [0])
    rows = {"attention (output and lse)": median_ms(lambda: paged_attention(q, view), args.repeats),
            "token probabilities (one pass over the keys)": median_ms(lambda: paged_token_probabilities(q, view),
                                                                       args.repeats),
            "reevaluate (probabilities + context rebuild)": median_ms(
                lambda: reevaluate(store, 0, [0], q, beta=1.0), args.repeats)}
    if args.baseline_rev:
        old = baseline_module(args.baseline_rev)
        _, _, old_probs = old.paged_attention(q, view, return_probs=True)
        _, new_probs = paged_token_probabilities(q, view)
        np.testing.assert_allclose(new_probs, old_probs, rtol=1e-4, atol=1e-7)
        rows[f"{args.baseline_rev}: attention + probabilities (what reevaluate ran)"] = median_ms(
            lambda: old.paged_attention(q, view, return_probs=True), args.repeats)
        from host import sparsify  # reevaluate as it was: its probabilities from that attention call

        current = sparsify.token_probabilities
        sparsify.token_probabilities = lambda store_, layer, seq_ids, queries, scale=None: old.attend_all(
            store_, layer, seq_ids, queries, scale, return_probs=True)[1:]
        try:
            rows[f"{args.baseline_rev}: reevaluate"] = median_ms(lambda: reevaluate(store, 0, [0], q, beta=1.0),
                                                                 args.repeats)
        finally:
            sparsify.token_probabilities = current
    for name, ms in rows.items():
        print(f"{ms:9.1f} ms  {name}")
    if args.out:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), platform.processor())
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        Path(args.out).write_text(json.dumps({
            "command": " ".join(["PYTHONPATH=. python3 benchmarks/probe_reevaluate.py"] + sys.argv[1:]),
            "device": f"CPU: {cpu}", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit, "versions": {"numba": numba.__version__, "numpy": np.__version__,
                                           "python": platform.python_version()},
            "threads": numba.get_num_threads(), "tokens": args.tokens, "queries": args.queries,
            "shape": {"block": BLOCK, "hkv": HKV, "hq": HQ, "d": D, "kv_dtype": "bf16"},
            "rows_ms": rows}, indent=1))


if __name__ == "__main__":
    main()
