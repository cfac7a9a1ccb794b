"""Probe: does a device-to-host spill on a worker thread stall the thread that dispatches steps?

  PYTHONPATH=. python3 benchmarks/probe_spill.py [--gib 4] [--out $OUT/probe-spill.json]

A pool of KV blocks on the device (block [32 layers, 2, 16, 8, 128] bf16 = 2 MiB, Llama-3-8B's),
a main thread running small jitted steps back to back (each block_until_ready'd) and timing them;
meanwhile --gib of blocks are gathered (on the main thread, as the prefix cache does) and copied to
the host on a worker thread, in one of these ways:
  asarray        np.asarray of the gathered array (the host copy only)
  asarray+split  the same, then each block's own np.array copy (what the prefix cache's worker does)
  pieces         np.asarray of 128 MiB slices, each its own copy
  pinned         jhybrid.hybrid.transfer.to_host of the whole array (device -> pinned_host -> NumPy)
  pinned-pieces  to_host of 64 MiB slices
  product        the prefix cache's own copy: jhybrid.serving.kv_blocks.PendingRead
Per variant: the seconds the main thread spent dispatching the gather (and, for the `+async`
variants, `copy_to_host_async` after it, on the main thread), the worker's seconds, the main thread's
longest step during the copy and its median step before it.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from jhybrid.hybrid.transfer import to_host
from jhybrid.serving.kv_blocks import PendingRead

BLOCK = (32, 2, 16, 8, 128)


def run(variant: str, pool, count: int) -> dict:
    step = jax.jit(lambda x: x * 1.0001 + 1)
    x = jnp.ones((1024, 1024), jnp.float32)
    step(x).block_until_ready()
    times, done = [], threading.Event()
    result = {}

    def worker(gathered):
        start = time.perf_counter()
        if variant == "product":
            PendingRead(gathered, count)()
        elif variant.startswith("pinned"):
            per = max(1, (64 << 20) // (np.prod(BLOCK) * 2)) if variant == "pinned-pieces" else count
            host = np.empty(gathered.shape, np.dtype(gathered.dtype))
            for first in range(0, count, per):
                host[first:first + per] = to_host(gathered[first:first + per])
        elif variant.startswith("pieces"):
            per = max(1, (128 << 20) // (np.prod(BLOCK) * 2))
            blocks = []
            for first in range(0, count, per):
                piece = np.asarray(gathered[first:first + per])
                blocks.extend(np.array(b) for b in piece)
        else:
            host = np.asarray(gathered)
            if "split" in variant:
                blocks = [np.array(b) for b in host]
        result["worker_s"] = time.perf_counter() - start
        done.set()

    for _ in range(200):  # before
        t = time.perf_counter(); step(x).block_until_ready(); times.append(time.perf_counter() - t)
    before = float(np.median(times))
    slots = jnp.arange(count, dtype=jnp.int32)
    t = time.perf_counter()
    gathered = jnp.take(pool, slots, axis=0)
    if variant.endswith("+async"):
        gathered.copy_to_host_async()
    dispatch = time.perf_counter() - t
    thread = threading.Thread(target=worker, args=(gathered,))
    thread.start()
    del gathered
    during = []
    while not done.is_set():
        t = time.perf_counter(); step(x).block_until_ready(); during.append(time.perf_counter() - t)
    thread.join(600)
    return {"variant": variant, "gib": round(count * np.prod(BLOCK) * 2 / 2**30, 2), "dispatch_s": round(dispatch, 4),
            "worker_s": round(result["worker_s"], 3), "step_median_before_ms": round(before * 1e3, 3),
            "step_longest_during_ms": round(max(during) * 1e3, 1), "steps_during": len(during)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    count = int(args.gib * 2**30 // (np.prod(BLOCK) * 2))
    pool = jax.random.normal(jax.random.key(0), (count * 2,) + BLOCK, jnp.bfloat16)
    variants = ("asarray", "asarray", "pieces", "pinned", "pinned", "pinned-pieces", "product", "product")
    rows = [run(v, pool, count) for v in variants]  # the first: compiles included
    for row in rows:
        print(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": str(jax.devices()[0]), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
