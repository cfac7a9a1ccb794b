"""Results files (docs/design.md, "Benchmark results"): JSON {name, device, date, versions, command, config,
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


def read_results(path: str) -> dict:
    """An existing results JSON ({} when there is none); ValueError naming the file when it is not
    one `jhybrid bench` wrote (not JSON, truncated, not an object, rows not a list of objects)."""
    if not os.path.exists(path):
        return {}
    from jhybrid.config.files import read_json

    expected = "expected a results file of jhybrid bench (move it away to start a new one)"
    doc = read_json(path, expected)
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: holds a JSON {type(doc).__name__}, not an object with 'rows'; {expected}")
    rows = doc.get("rows", [])
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise ValueError(f"{path}: 'rows' is not a list of objects; {expected}")
    return doc


def read_rows(path: str) -> list[dict]:
    """Rows of an existing results JSON ([] when there is none; ValueError as read_results)."""
    return read_results(path).get("rows", [])


def write_json(path: str, name: str, config: dict, rows: list[dict], command: str,
               extra: dict | None = None) -> None:
    doc = {"name": name, "device": device_description(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "versions": versions(), "command": command, "config": config, **(extra or {}), "rows": rows}
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


SUMMARY_TEXT = 28  # characters of a text field (a NIAH answer) in the printed summary

# The printed summary: (row key, column label) per task, chosen to fit 100 columns; columns empty in
# every row are left out. Every other field is in the CSV / JSON.
SUMMARY_KEYS = {
    "perplexity": [("mode", "mode"), ("text", "text"), ("tokens", "tokens"), ("window", "window"),
                   ("gpu_ratio", "gpu"), ("beta", "beta"), ("keep_after", "keep_after"),
                   ("max_keep_share", "cap"), ("budget", "budget"), ("host_kv_dtype", "host kv"),
                   ("kept_share", "kept"), ("ppl", "ppl")],
    "niah": [("mode", "mode"), ("style", "style"), ("length", "length"), ("depth", "depth"), ("window", "window"),
             ("max_keep_share", "cap"), ("host_kv_dtype", "host kv"), ("retrieved", "retrieved"), ("answer", "answer")],
    "throughput": [("model", "model"), ("layers", "L"), ("mode", "mode"), ("host_kv_dtype", "host kv"),
                   ("fill", "fill"), ("context", "ctx"), ("batch", "batch"), ("window", "window"),
                   ("decode_tok_s", "tok/s"), ("tbt_p50_ms", "p50 ms"), ("tbt_p99_ms", "p99 ms"),
                   ("ttft_s", "ttft s"), ("gpu_idle_frac", "GPU idle")],
    "serving": [("model", "model"), ("layers", "L"), ("mode", "mode"), ("slots", "slots"), ("requests", "reqs"),
                ("completed", "done"), ("rate", "rate"), ("ttft_p50_s", "ttft p50 s"), ("ttft_p99_s", "ttft p99 s"),
                ("tbt_p50_ms", "tbt p50 ms"), ("tbt_p99_ms", "tbt p99 ms"), ("request_throughput", "req/s"),
                ("decode_tok_s", "tok/s"), ("goodput", "goodput"), ("prefix_hits", "hits"),
                ("prefix_misses", "misses"), ("ttft_hit_over_miss", "hit/miss"),
                ("tbt_p99_over_p50", "prefill p99/p50"), ("served_over_fixed", "vs fixed")],
}


def _capacity_reason(row: dict) -> bool:
    reason = str(row.get("skipped", ""))
    return "over device capacity" in reason or "over host capacity" in reason or "out of memory" in reason \
        or "not even one" in reason


def capacity_table(rows: list[dict]) -> list[dict]:
    """Per (model, layers, mode, context) of the throughput rows: the largest batch measured, the
    predicted largest batch and what bounds it, the smallest batch that did not fit (and why), and
    the batches not run for lack of time."""
    groups: dict = {}
    for r in rows:
        if r.get("task") != "throughput" or r.get("context") is None:
            continue
        key = (r.get("model"), r.get("layers"), r.get("mode"), r.get("host_kv_dtype"), r.get("context"))
        groups.setdefault(key, []).append(r)
    out = []
    for (model, layers, mode, host_kv_dtype, context), group in groups.items():
        ran = [r["batch"] for r in group if not r.get("skipped") and r.get("batch") is not None]
        failed = sorted((r for r in group if r.get("skipped") and _capacity_reason(r) and r.get("batch")),
                        key=lambda r: r["batch"])
        predicted_only = all(str(r.get("skipped", "")).startswith("prediction only") for r in group)
        timed_out = sorted({r.get("batch") or r.get("batch_spec") for r in group
                            if str(r.get("skipped", "")).startswith("time budget")}, key=str)
        pred = next((r for r in group if r.get("pred_max_batch") is not None), {})
        out.append({"model": model, "layers": layers or pred.get("layers"), "mode": mode,
                    "host_kv_dtype": host_kv_dtype, "context": context,
                    "max_batch_run": max(ran) if ran else None,
                    "pred_max_batch": pred.get("pred_max_batch"), "limited_by": pred.get("limited_by"),
                    "first_batch_over": failed[0]["batch"] if failed else None,
                    "over_reason": failed[0]["skipped"] if failed else None,
                    "not_run_time_budget": [str(b) for b in timed_out],
                    "measured": not predicted_only})
    return out


def print_summary(rows: list[dict], console=None) -> None:
    """One rich table per task (+ the skipped points with their reasons)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    for task, labelled in SUMMARY_KEYS.items():
        selected = [r for r in rows if r.get("task") == task and not r.get("skipped")]
        if not selected:
            continue
        labelled = [(k, label) for k, label in labelled if any(r.get(k) is not None for r in selected)]
        table = Table(title=f"{task} (every field: the CSV / JSON)")
        for _, label in labelled:
            table.add_column(label, justify="right")
        for row in selected:
            table.add_row(*(_fmt(row.get(k), k) for k, _ in labelled))
        console.print(table)
    capacity = capacity_table(rows)
    if capacity:
        labelled = [("model", "model"), ("layers", "L"), ("mode", "mode"), ("host_kv_dtype", "host kv"),
                    ("context", "ctx"),
                    ("measured", "measured"), ("max_batch_run", "max run"), ("pred_max_batch", "pred. max"),
                    ("limited_by", "limited by"), ("first_batch_over", "first over")]
        table = Table(title="largest batch per mode and context (measured / predicted)")
        for _, label in labelled:
            table.add_column(label, justify="right")
        for row in capacity:
            table.add_row(*(_fmt(row.get(k), k) for k, _ in labelled))
        console.print(table)
    failed = [r for r in rows if r.get("error")]
    if failed:
        table = Table(title="failed points (a rerun tries them again)")
        table.add_column("point", overflow="fold")
        table.add_column("error")
        for row in failed:
            table.add_row(row.get("point", "?"), row["error"])
        console.print(table)
    skipped = [r for r in rows if r.get("skipped") and not str(r["skipped"]).startswith("prediction only")]
    if skipped:
        table = Table(title="skipped points")
        table.add_column("point", overflow="fold")
        table.add_column("reason")
        for row in skipped:
            table.add_row(row["point"], row["skipped"])
        console.print(table)


def _fmt(value, key: str = "") -> str:
    if key.endswith("_bytes") and isinstance(value, int):
        from jhybrid.bench.budget import human_bytes

        return human_bytes(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    if value is None:
        return "-"
    text = str(value).replace("\n", "\\n")
    return text if len(text) <= SUMMARY_TEXT else text[:SUMMARY_TEXT - 1] + "…"  # whole text: CSV / JSON
