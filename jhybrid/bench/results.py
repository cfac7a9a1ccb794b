"""Results files (shared/DESIGN.md format): JSON {name, device, date, versions, command, config,
rows} + a CSV of the rows, and a printed summary table. Written after every point, atomically, so
an interrupted sweep keeps what it measured and a rerun can resume from the JSON."""

from __future__ import annotations

import csv
import datetime
import json
import logging
import os
import platform
import shlex
import sys

log = logging.getLogger(__name__)


def device_description() -> str:
    import jax

    device = jax.devices()[0]
    if device.platform == "gpu":
        return f"{device.device_kind}, {os.cpu_count()}-core host"
    return f"cpu: {os.cpu_count()} cores"


def versions() -> dict:
    import jax
    import jaxlib

    out = {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "python": platform.python_version()}
    for module in ("numba", "numpy", "flax"):
        try:
            out[module] = __import__(module).__version__
        except ImportError:
            log.info("%s is not installed: not reported in versions", module)
    return out


def command_line(argv: list[str] | None = None) -> str:
    argv = sys.argv[1:] if argv is None else argv
    return " ".join(shlex.quote(a) for a in ["jhybrid", *argv])


def read_rows(path: str) -> list[dict]:
    """Rows of an existing results JSON ([] when there is none)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return json.load(f).get("rows", [])


def write_json(path: str, name: str, config: dict, rows: list[dict], command: str) -> None:
    doc = {"name": name, "device": device_description(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "versions": versions(), "command": command, "config": config, "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def columns(rows: list[dict]) -> list[str]:
    """Union of the rows' keys, in first-seen order."""
    seen: dict[str, None] = {}
    for row in rows:
        seen.update(dict.fromkeys(row))
    return list(seen)


def write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns(rows))
        writer.writeheader()
        writer.writerows(rows)


SUMMARY_KEYS = {
    "perplexity": ["mode", "text", "tokens", "window", "gpu_ratio", "beta", "budget", "ppl"],
    "niah": ["mode", "length", "depth", "window", "retrieved", "answer"],
    "throughput": ["mode", "batch", "context", "window", "decode_tok_s", "tbt_p50_ms", "tbt_p99_ms", "ttft_s"],
}


def print_summary(rows: list[dict], console=None) -> None:
    """One rich table per task (+ the skipped points with their reasons)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    for task, keys in SUMMARY_KEYS.items():
        selected = [r for r in rows if r.get("task") == task and not r.get("skipped")]
        if not selected:
            continue
        table = Table(title=task)
        for key in keys:
            table.add_column(key, justify="right")
        for row in selected:
            table.add_row(*(_fmt(row.get(k)) for k in keys))
        console.print(table)
    skipped = [r for r in rows if r.get("skipped")]
    if skipped:
        table = Table(title="skipped points")
        table.add_column("point")
        table.add_column("reason")
        for row in skipped:
            table.add_row(row["point"], row["skipped"])
        console.print(table)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value).replace("\n", "\\n")
