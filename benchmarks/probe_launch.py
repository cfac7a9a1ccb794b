"""When does launching a compiled JAX program wait for the GPU? (issue 32, session q)

The serving engine's stacks (session p) showed a scout decode call's launch (`executable(*args)`)
taking ~16 ms of the call's ~21 ms: the launching thread could do little in the call's shadow. This
probe times launches in isolation, each case right after a long-running `busy` program was launched
(the stream then has ~`--busy-ms` of queued work) and, for reference, on an idle GPU:

  chain K, graphs      a program of K unfusable kernels (optimization barriers), XLA's CUDA graphs on
  chain K, no graphs   the same, each kernel launched on its own
  relaunch             the same program launched twice, the second time while the first is queued
  donate               a program that donates a buffer the busy program is still writing
  numpy arg            a small program with a numpy argument, while another thread uploads 256 MiB
                       host arrays (the host-to-device copies of scout's recalls)
  d2h then donate      a device-to-host copy of busy's output started (copy_to_host_async, as the
                       prefix cache's captures do), then that buffer donated

Launch = seconds until the call returns (the median of --repeats); total = until the result is
ready. Prints a table, writes JSON (--output) and its bar chart (--plot; --replot JSON redraws a
former run's).

    python3 benchmarks/probe_launch.py --output $OUT/probe-launch.json --plot $OUT/probe-launch.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np


def busy_program(n: int):
    @jax.jit
    def busy(x, w):
        for _ in range(n):
            x = (x @ w).astype(x.dtype)
        return x
    return busy


def queued_work(busy_ms: float, size: int, device, rng):
    """(busy, x, w, n): `busy(x, w)` queues ~busy_ms of work on `device` (n chained bf16 size² matmuls,
    calibrated here; compiled and run once)."""
    x = jax.device_put(rng.standard_normal((size,) * 2, np.float32).astype(jnp.bfloat16) * 0.01, device)
    w = jax.device_put(rng.standard_normal((size,) * 2, np.float32).astype(jnp.bfloat16) * 0.011, device)
    probe = busy_program(1)
    jax.block_until_ready(probe(x, w))
    one = min(timed_launch(probe, x, w)[1] for _ in range(5))
    n = max(1, int(busy_ms / 1e3 / one))
    busy = busy_program(n)
    jax.block_until_ready(busy(x, w))
    return busy, x, w, n


def add_output_args(parser) -> None:
    """--output (JSON), --plot (PNG), --replot (a former JSON to draw; run nothing)."""
    parser.add_argument("--output", default=None)
    parser.add_argument("--plot", default=None, help="PNG of the medians")
    parser.add_argument("--replot", default=None, help="draw --plot from this former JSON output; run nothing")


def replotted(args, draw) -> bool:
    """With --replot: draw(former result, PNG path) and True; else False."""
    if not args.replot:
        return False
    with open(args.replot) as f:
        draw(json.load(f), args.plot or args.replot.replace(".json", ".png"))
    return True


def write_outputs(result: dict, args, draw) -> None:
    """result as JSON to --output and drawn to --plot (each when given)."""
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        draw(result, args.plot)


def chain_program(k: int, options: dict | None):
    def chain(y):
        for i in range(k):
            y = y * 1.0001 + 1e-3
            y = jax.lax.optimization_barrier(y)  # keeps XLA from fusing the K steps into one kernel
        return y
    spec = jax.ShapeDtypeStruct((1024,), jnp.float32)
    lowered = jax.jit(chain).lower(spec)
    return lowered.compile(compiler_options=options) if options else lowered.compile()


def timed_launch(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    launched = time.perf_counter() - start
    jax.block_until_ready(out)
    return launched, time.perf_counter() - start, out


def median_ms(values):
    return round(1e3 * statistics.median(values), 3)


def plot(result: dict, path: str) -> None:
    """Bar chart of a run's launch medians: idle GPU against ~busy_ms of queued work in front."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "launch_behind_busy_ms" in r]
    names = [r["case"] for r in rows]
    y = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.5))
    ax.barh(y - 0.2, [r.get("launch_idle_ms") or 0 for r in rows], 0.4, label="GPU idle")
    ax.barh(y + 0.2, [r["launch_behind_busy_ms"] for r in rows], 0.4,
            label=f"behind {result['busy_ms']:.0f} ms of queued work")
    ax.set_yticks(y, names)
    ax.invert_yaxis()
    ax.set_xlabel("launch: ms until the call returns (median)")
    ax.set_title(f"When a launch waits: {result.get('device_kind', result['device'])}, jax {result['jax']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy-ms", type=float, default=60.0, help="queued work in front of each launch")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--size", type=int, default=8192, help="busy's square matrices (a CPU check: 256)")
    add_output_args(parser)
    args = parser.parse_args()
    if replotted(args, plot):
        return
    dev = jax.devices()[0]
    rng = np.random.default_rng(0)
    busy, x, w, n = queued_work(args.busy_ms, args.size, dev, rng)
    busy_launch, busy_total, _ = timed_launch(busy, x, w)
    print(f"device {dev.device_kind}; jax {jax.__version__}; busy = {n} matmuls, {1e3 * busy_total:.1f} ms "
          f"(its launch {1e3 * busy_launch:.2f} ms)", flush=True)

    y = jax.device_put(rng.standard_normal(1024).astype(np.float32), dev)
    rows = []

    def case(name: str, launch_fn, setup=None):
        idle, behind, totals = [], [], []
        for _ in range(args.repeats):
            a = setup() if setup else ()
            idle.append(timed_launch(launch_fn, *a)[0])
        for _ in range(args.repeats):
            a = setup() if setup else ()
            jax.block_until_ready(a)
            busy_out = busy(x, w)  # ~busy-ms of queued work
            launched, total, out = timed_launch(launch_fn, *a)
            behind.append(launched)
            totals.append(total)
            jax.block_until_ready(busy_out)
        row = {"case": name, "launch_idle_ms": median_ms(idle), "launch_behind_busy_ms": median_ms(behind),
               "total_behind_busy_ms": median_ms(totals)}
        rows.append(row)
        print(f"{name:34s} launch idle {row['launch_idle_ms']:8.2f} ms | behind busy {row['launch_behind_busy_ms']:8.2f} ms"
              f" (ready after {row['total_behind_busy_ms']:8.2f} ms)", flush=True)

    for k in (100, 1000, 3000):
        variants = [("graphs", None), ("no graphs", {"xla_gpu_enable_command_buffer": ""})]
        for label, options in variants[:1] if dev.platform == "cpu" else variants:
            exe = chain_program(k, options)
            jax.block_until_ready(exe(y))
            jax.block_until_ready(exe(y))
            case(f"chain {k}, {label}", exe, setup=lambda: (y,))

    exe = chain_program(1000, None)
    jax.block_until_ready(exe(y))

    def twice(v):
        exe(v)
        start = time.perf_counter()
        out = exe(v)
        twice.second.append(time.perf_counter() - start)
        return out
    twice.second = []
    case("relaunch (chain 1000, graphs), both", twice, setup=lambda: (y,))
    rows[-1]["second_launch_ms"] = median_ms(twice.second[-args.repeats:])
    print(f"{'  ... the second launch alone':34s} {rows[-1]['second_launch_ms']:8.2f} ms", flush=True)

    fresh = lambda: (jax.device_put(rng.standard_normal(1024).astype(np.float32), dev),)  # noqa: E731
    case("chain 1000, graphs, fresh input", exe, setup=fresh)

    donate = jax.jit(lambda a: a * 2, donate_argnums=0)
    small = jax.jit(lambda a, b: a + b)

    def donate_case(name: str, copy_first: bool) -> None:
        """Launch time of `donate` on busy's output (still being written), optionally after starting
        its device-to-host copy. A donation refused is a finding too: printed, not raised."""
        launches = []
        for _ in range(args.repeats):
            out = busy(x, w)
            if copy_first:
                out.copy_to_host_async()
            start = time.perf_counter()
            try:
                result = donate(out)
            except Exception as error:  # noqa: BLE001
                print(f"{name}: {type(error).__name__}: {str(error)[:200]}")
                return
            launches.append(time.perf_counter() - start)
            jax.block_until_ready(result)
        rows.append({"case": name, "launch_behind_busy_ms": median_ms(launches)})
        print(f"{name:34s} behind busy {rows[-1]['launch_behind_busy_ms']:8.2f} ms", flush=True)

    donate_case("donate busy's output", copy_first=False)
    donate_case("d2h started, then donate", copy_first=True)

    host_small = rng.standard_normal(1024).astype(np.float32)
    jax.block_until_ready(small(host_small, y))
    stop = threading.Event()
    big = rng.standard_normal((64 if dev.platform != "cpu" else 4, 1024, 1024)).astype(np.float32)  # 256 MiB, pageable

    def uploader():
        while not stop.is_set():
            jax.block_until_ready(jax.device_put(big, dev))
    calm = [timed_launch(small, host_small, y)[0] for _ in range(args.repeats)]
    thread = threading.Thread(target=uploader, daemon=True)
    thread.start()
    time.sleep(0.2)
    loaded = []
    for _ in range(args.repeats * 3):
        loaded.append(timed_launch(small, host_small, y)[0])
        time.sleep(0.003)
    on_device = []
    for _ in range(args.repeats * 3):
        on_device.append(timed_launch(small, y, y)[0])
        time.sleep(0.003)
    stop.set()
    thread.join(timeout=30)
    rows.append({"case": "numpy arg", "launch_idle_ms": median_ms(calm), "launch_during_uploads_ms": median_ms(loaded),
                 "launch_during_uploads_max_ms": round(1e3 * max(loaded), 3),
                 "device_args_during_uploads_ms": median_ms(on_device),
                 "device_args_during_uploads_max_ms": round(1e3 * max(on_device), 3)})
    print(f"{'numpy arg':34s} launch idle {rows[-1]['launch_idle_ms']:8.2f} ms | during 256 MiB uploads "
          f"{rows[-1]['launch_during_uploads_ms']:8.2f} (max {rows[-1]['launch_during_uploads_max_ms']:.2f}) | device "
          f"args {rows[-1]['device_args_during_uploads_ms']:.2f} (max {rows[-1]['device_args_during_uploads_max_ms']:.2f})",
          flush=True)

    result = {"device": dev.device_kind, "jax": jax.__version__, "busy_ms": round(1e3 * busy_total, 2),
              "busy_matmuls": n, "repeats": args.repeats, "rows": rows,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": "python3 benchmarks/probe_launch.py"}
    write_outputs(result, args, plot)


if __name__ == "__main__":
    main()
