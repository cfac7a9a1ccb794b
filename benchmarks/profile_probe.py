"""How stable is the balanced split's machine profile? Measures the host attention probe
(jhybrid.hybrid.split._measure_host_attention_gbps) several times in one process, first call
included, at the split's 256 MiB and at 2 GiB, and the HBM probe, then writes JSON.

    PYTHONPATH=. python3 benchmarks/profile_probe.py --output $OUT/profile-probe.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def probe(total_bytes: int, repeats: int, n_threads: int | None) -> dict:
    """Host attention KV GB/s over a bf16 paged view of `total_bytes` (K + V), per call."""
    import numba

    from host.attention import paged_attention
    from host.paged_view import PagedKV

    n_threads = n_threads or max(1, numba.config.NUMBA_NUM_THREADS - 1)
    numba.set_num_threads(n_threads)
    b, hkv, hq, d, page = 4, 8, 32, 128, 16
    pages_per_unit = total_bytes // (b * hkv * 2 * page * d * 2)
    n = b * hkv * pages_per_unit
    start = time.perf_counter()
    k = np.empty((n, page, d), np.uint16)
    k[:] = (np.arange(page * d, dtype=np.uint32).reshape(page, d) % 251 + 0x3C00).astype(np.uint16)
    v = k.copy()
    fill_s = time.perf_counter() - start
    view = PagedKV(k, v, 1, np.arange(b * hkv + 1, dtype=np.int64) * pages_per_unit, np.arange(n, dtype=np.int64),
                   np.full(b * hkv, pages_per_unit * page, np.int64), hkv)
    q = np.random.default_rng(0).standard_normal((b, 1, hq, d)).astype(np.float32)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        paged_attention(q, view, 0.1)
        rates.append(view.attended_bytes() / (time.perf_counter() - start) / 1e9)
    return {"bytes": int(view.attended_bytes()), "threads": n_threads, "fill_s": round(fill_s, 2),
            "gbps_per_call": [round(r, 1) for r in rates]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", required=True)
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    import jax

    from jhybrid.hybrid.split import _measure_hbm_gbps

    out = {"device": str(jax.devices()[0].device_kind), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "command": "PYTHONPATH=. python3 benchmarks/profile_probe.py --output $OUT/profile-probe.json",
           "rows": []}
    for label, size in (("256 MiB (the split's probe), first in the process", 2**28), ("2 GiB", 2**31),
                        ("256 MiB again", 2**28)):
        row = {"probe": label, **probe(size, args.repeats, None)}
        out["rows"].append(row)
        print(row, flush=True)
    out["hbm_gbps"] = [round(_measure_hbm_gbps(), 1) for _ in range(3)]
    print("HBM GB/s", out["hbm_gbps"])
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
