"""Which GPU stream and copy kind jhybrid's bulk moves (`jhybrid.hybrid.transfer`) take, and at what rate.

    PYTHONPATH=. python3 benchmarks/device/transfer_probe.py [--tokens 16384] [--trace-dir /tmp/probe]

Times `to_device` (NumPy -> pinned_host -> device) and `to_host` (device -> pinned_host -> NumPy) of
one prefill-copy-sized array, [4, 8, tokens, 128] bfloat16 (a layer's K of 4 rows), median of 10 after
2 warm-ups, then traces 3 of each and prints the device events per stream and kind
(benchmarks/trace_summary.py): a copy on the compute stream delays the steps queued behind it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import jax
import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from jhybrid.hybrid.transfer import to_device, to_host  # noqa: E402


def median_seconds(fn, repeats: int = 10) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--trace-dir", default="/tmp/transfer-probe")
    args = parser.parse_args()
    device = jax.devices()[0]
    rng = np.random.default_rng(0)
    host = rng.standard_normal((4, 8, args.tokens, 128), np.float32).astype(ml_dtypes.bfloat16)
    on_device = jax.block_until_ready(to_device(host, device))
    nbytes = host.nbytes
    up = median_seconds(lambda: jax.block_until_ready(to_device(host, device)))
    down = median_seconds(lambda: to_host(on_device))
    plain = median_seconds(lambda: jax.block_until_ready(jax.device_put(host, device)))
    print(f"{nbytes / 2**20:.0f} MiB: to_device {up * 1e3:.2f} ms ({nbytes / up / 1e9:.1f} GB/s), "
          f"to_host {down * 1e3:.2f} ms ({nbytes / down / 1e9:.1f} GB/s), "
          f"plain device_put {plain * 1e3:.2f} ms ({nbytes / plain / 1e9:.1f} GB/s)", flush=True)
    jax.profiler.start_trace(args.trace_dir, create_perfetto_trace=True)
    for _ in range(3):
        jax.block_until_ready(to_device(host, device))
        to_host(on_device)
    jax.profiler.stop_trace()
    summary = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "trace_summary.py")
    subprocess.run([sys.executable, summary, args.trace_dir, "--top", "8", "--detail", "Memcpy"], check=False)


if __name__ == "__main__":
    main()
