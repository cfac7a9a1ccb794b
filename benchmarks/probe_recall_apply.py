"""What does applying scout's recalls cost the launching thread and the GPU? (issue 32, session r)

Session r grouped the recalls a step start triggers (`jhybrid.hybrid.modes.scout.RecallGroup`): one
`apply_recalls` launch scatters up to 8 layers' rows, where there was one launch per layer. In the
serving benchmark's saturation on the H200 the engine thread then spent ~6.7 ms per group launch,
against ~3.5 ms per layer launch before. This probe times the three ways to apply 8 layers' recalls
on the benchmark's pool shape (32 layers, 4 sequences, 8 KV heads, 64 slots of 64 tokens, D 128,
bf16), each on an idle GPU and right after a `busy` program queued ~--busy-ms of work:

  per layer x 8    eight launches, each one layer's rows (`apply_recalls` over that layer alone)
  group, 32 pools  one launch over every layer's pool, the 8 layers' rows masked per layer (today's)
  group, 8 pools   one launch over the 8 layers' pools only (a program per set of layers)

Launch = seconds until the last call returns; total = until the pools are ready (medians of
--repeats). Prints a table, writes JSON (--output) and its bar chart (--plot; --replot JSON redraws a
former run's).

    python3 benchmarks/probe_recall_apply.py --output $OUT/probe-recall-apply.json --plot $OUT/probe-recall-apply.png
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jhybrid.hybrid.modes.scout import apply_recalls
from jhybrid.hybrid.state import Pool
from probe_launch import add_output_args, median_ms, queued_work, replotted, write_outputs  # (benchmarks/, the script's folder)


def staged_rows(rng, layers: list[int], per_layer: int, batch: int, hkv: int, slots: int, bs: int, d: int,
                dtype, ids: list[int] | None = None):
    """A staged group as `stage_recall` uploads it: per_layer rows for each of `layers` (written to
    layer ids[i], default the layers themselves), padded to a power of two."""
    ids = layers if ids is None else ids
    n = per_layer * len(layers)
    size = 1 << max(3, (n - 1).bit_length())
    b = np.full(size, batch, np.int32)
    h, r, block, layer = (np.zeros(size, np.int32) for _ in range(4))
    layer[:] = -1
    for i, target in enumerate(ids):
        part = slice(i * per_layer, (i + 1) * per_layer)
        b[part] = rng.integers(0, batch, per_layer)
        h[part] = rng.integers(0, hkv, per_layer)
        r[part] = rng.integers(0, slots, per_layer)
        block[part] = rng.integers(0, 255, per_layer)
        layer[part] = target
    k = jnp.asarray(rng.standard_normal((size, bs, d)), dtype)
    v = jnp.asarray(rng.standard_normal((size, bs, d)), dtype)
    return tuple(jnp.asarray(x) for x in (b, h, r, block, layer)) + (k, v)


def plot(result: dict, path: str) -> None:
    """Bar chart of a run's medians: launch and total on an idle GPU, launch behind queued work."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    y = np.arange(len(rows))
    bars = (("launch_idle_ms", "launch, GPU idle"), ("total_idle_ms", "until ready, GPU idle"),
            ("launch_behind_busy_ms", f"launch, behind {result['busy_ms']:.0f} ms of queued work"))
    fig, ax = plt.subplots(figsize=(9, 0.8 * len(rows) + 1.6))
    for i, (key, label) in enumerate(bars):
        ax.barh(y + (i - 1) * 0.27, [r[key] for r in rows], 0.27, label=label)
    ax.set_yticks(y, [r["case"] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms (median)")
    shape = result["shape"]
    ax.set_title(f"Applying {shape['group']} layers' recalls ({shape['rows_per_layer']} rows each) of "
                 f"{shape['layers']} layers: {result['device']}, jax {result['versions']['jax']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--group", type=int, default=8, help="layers in a group")
    parser.add_argument("--rows", type=int, default=246, help="(block, head) rows per layer (the load's mean)")
    parser.add_argument("--small", action="store_true", help="a CPU check: tiny shapes")
    parser.add_argument("--busy-ms", type=float, default=60.0)
    parser.add_argument("--repeats", type=int, default=9)
    add_output_args(parser)
    args = parser.parse_args()
    if replotted(args, plot):
        return
    batch, hkv, slots, bs, d = (2, 2, 4, 4, 8) if args.small else (4, 8, 64, 64, 128)
    rows = min(args.rows, batch * hkv * slots) if args.small else args.rows
    dtype = jnp.bfloat16
    rng = np.random.default_rng(0)
    device = jax.devices()[0]

    def pool():
        return Pool(k=jnp.asarray(rng.standard_normal((batch * slots, hkv, bs, d)), dtype),
                    v=jnp.asarray(rng.standard_normal((batch * slots, hkv, bs, d)), dtype),
                    blocks=jnp.full((batch, hkv, slots), -1, jnp.int32),
                    used=jnp.full((batch, hkv, slots), -1, jnp.int32))

    pools = [pool() for _ in range(args.layers)]
    nexts = [jnp.full((batch, hkv, slots), -1, jnp.int32) for _ in range(args.layers - 1)] + [None]
    now = jax.device_put(np.arange(batch, dtype=np.int32), device)
    layers = list(range(1, args.layers, args.layers // args.group))[:args.group]  # spread, as triggers are
    one_layer = [staged_rows(rng, [n], rows, batch, hkv, slots, bs, d, dtype, ids=[1]) for n in layers]
    group_all = staged_rows(rng, layers, rows, batch, hkv, slots, bs, d, dtype)
    group_own = staged_rows(rng, layers, rows, batch, hkv, slots, bs, d, dtype, ids=list(range(len(layers))))

    busy, x, w, _ = queued_work(args.busy_ms, 256 if args.small else 8192, device, rng)

    def per_layer():
        for i, n in enumerate(layers):  # as before session r: one layer's pool and the layer before's copy
            (_, pools[n]), (nexts[n - 1], _) = apply_recalls((None, pools[n]), (nexts[n - 1], None), *one_layer[i], now)
        return pools[layers[-1]].k

    def group_over_all():
        out_pools, out_next = apply_recalls(tuple(pools), tuple(nexts), *group_all, now)
        pools[:], nexts[:] = list(out_pools), list(out_next)
        return pools[layers[-1]].k

    def group_over_own():
        own = tuple(pools[n] for n in layers)
        out_pools, _ = apply_recalls(own, (None,) * len(layers), *group_own, now)  # (the copies: 8 more inputs)
        for i, n in enumerate(layers):
            pools[n] = out_pools[i]
        return pools[layers[-1]].k

    cases = {"per layer x %d" % len(layers): per_layer, "group, %d pools" % args.layers: group_over_all,
             "group, %d pools" % len(layers): group_over_own}
    out_rows = []
    for name, fn in cases.items():
        jax.block_until_ready(fn())  # compile and first run
        row = {"case": name}
        for where in ("idle", "behind_busy"):
            launches, totals = [], []
            for _ in range(args.repeats):
                if where == "behind_busy":
                    queued = busy(x, w)
                start = time.perf_counter()
                out = fn()
                launches.append(time.perf_counter() - start)
                jax.block_until_ready(out)
                totals.append(time.perf_counter() - start)
                if where == "behind_busy":
                    jax.block_until_ready(queued)
            row[f"launch_{where}_ms"] = median_ms(launches)
            row[f"total_{where}_ms"] = median_ms(totals)
        out_rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"{'case':<22} {'launch idle':>12} {'total idle':>11} {'launch busy':>12} {'total busy':>11}  (ms)")
    for r in out_rows:
        print(f"{r['case']:<22} {r['launch_idle_ms']:>12} {r['total_idle_ms']:>11} {r['launch_behind_busy_ms']:>12} "
              f"{r['total_behind_busy_ms']:>11}")
    result = {"device": str(device.device_kind), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "versions": {"jax": jax.__version__}, "busy_ms": args.busy_ms,
              "command": "python3 " + " ".join(sys.argv),
              "shape": {"layers": args.layers, "group": len(layers), "rows_per_layer": rows,
                        "batch": batch, "hkv": hkv, "slots": slots, "block": bs, "head_dim": d},
              "rows": out_rows}
    write_outputs(result, args, plot)


if __name__ == "__main__":
    main()
