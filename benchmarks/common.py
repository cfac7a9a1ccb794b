"""Small helpers shared by the benchmark scripts: device description, versions, timing, JSON output."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import statistics
import sys
import time


def device_description() -> str:
    import jax

    dev = jax.devices()[0]
    cores = os.cpu_count()
    if dev.platform == "gpu":
        return f"{dev.device_kind}, {cores}-core host"
    return f"cpu: {cores} cores"


def versions() -> dict:
    import jax
    import jaxlib

    out = {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "python": platform.python_version()}
    for mod in ("numba", "numpy", "flax", "torch"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - optional packages are simply not reported
            pass
    return out


def time_fn(fn, *, warmup: int = 3, repeats: int = 20) -> float:
    """Median wall time in microseconds of ``fn()``; ``fn`` must block until its work is done."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def write_results(path: str, name: str, config: dict, rows: list[dict]) -> dict:
    doc = {
        "name": name,
        "device": device_description(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"),
        "versions": versions(),
        "command": " ".join(shlex.quote(a) for a in [os.path.basename(sys.executable)] + sys.argv),
        "config": config,
        "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    return doc


def print_table(rows: list[dict], keys: list[str]) -> None:
    widths = {k: max(len(k), *(len(_fmt(r.get(k))) for r in rows)) for k in keys}
    print("  ".join(k.rjust(widths[k]) for k in keys))
    for r in rows:
        print("  ".join(_fmt(r.get(k)).rjust(widths[k]) for k in keys))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)
