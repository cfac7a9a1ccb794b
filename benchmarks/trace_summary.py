"""Where a profiled window's time went: totals per event name of a JAX profiler trace in Perfetto
JSON (`jax.profiler.start_trace(dir, create_perfetto_trace=True)` writes
dir/plugins/profile/<run>/perfetto_trace.json.gz), per thread of each process (the GPU's streams, the host's
threads), the longest first.

  python3 benchmarks/trace_summary.py TRACE_DIR_OR_FILE [--top 25] [--json OUT.json] [--detail REGEX]

--detail REGEX: for the device events whose name matches (e.g. "Memcpy"), the totals per argument set
(the XLA program `hlo_module`, the instruction `hlo_op`, the copy's size and kinds: what issued them),
and the GPU streams' time per program.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re


def load_events(path: str) -> tuple[list[dict], dict[int, str], dict[tuple[int, int], str]]:
    """(complete events, process names by pid, thread names by (pid, tid)) of a Perfetto JSON trace."""
    if os.path.isdir(path):
        found = sorted(glob.glob(os.path.join(path, "**", "perfetto_trace.json.gz"), recursive=True))
        if not found:
            raise SystemExit(f"no perfetto_trace.json.gz under {path}")
        path = found[-1]
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    processes, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid"))] = e["args"]["name"]
    return [e for e in events if e.get("ph") == "X" and "dur" in e], processes, threads


def summarize(events, processes, threads, top: int) -> dict:
    """{process: {"span_ms", "busy_ms" (sum of durations), "names": [(name, total ms, count)]}}."""
    by_process: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    spans: dict[str, list[float]] = {}
    for e in events:
        proc = processes.get(e["pid"], str(e["pid"]))
        thread = threads.get((e["pid"], e.get("tid")), "")
        key = f"{proc} / {thread}" if thread else proc
        name = e["name"][:120]
        by_process[key][name] += e["dur"] / 1e3
        counts[key][name] += 1
        lo, hi = spans.get(key, [e["ts"], e["ts"] + e["dur"]])
        spans[key] = [min(lo, e["ts"]), max(hi, e["ts"] + e["dur"])]
    out = {}
    for key, totals in sorted(by_process.items(), key=lambda kv: -sum(kv[1].values())):
        out[key] = {"span_ms": round((spans[key][1] - spans[key][0]) / 1e3, 1),
                    "busy_ms": round(sum(totals.values()), 1),
                    "names": [(n, round(ms, 2), counts[key][n]) for n, ms in totals.most_common(top)]}
    return out


IGNORED_ARGS = ("correlation", "group_id", "context_id", "stream", "device_id", "run_id", "ts", "scope_range")


def _arg_key(args: dict) -> str:
    """An event's arguments without the per-event ids: what the same kind of event shares."""
    kept = {k: v for k, v in sorted(args.items()) if not any(word in k for word in IGNORED_ARGS)}
    return "; ".join(f"{k}={str(v)[:160]}" for k, v in kept.items())


def detail(events, processes, threads, pattern: str, top: int) -> dict:
    """{"events": [(argument set, total ms, count)] of device events whose name matches `pattern`,
    "programs": {stream: [(hlo_module, total ms, count)]}} (the GPU streams' time per XLA program)."""
    regex = re.compile(pattern)
    by_args, counts = collections.Counter(), collections.Counter()
    programs: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    program_counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for e in events:
        proc = processes.get(e["pid"], str(e["pid"]))
        if not proc.startswith("/device:"):
            continue
        args = e.get("args", {})
        stream = f"{proc} / {threads.get((e['pid'], e.get('tid')), '')}"
        module = str(args.get("hlo_module", "(none)"))
        programs[stream][module] += e["dur"] / 1e3
        program_counts[stream][module] += 1
        if regex.search(e["name"]):
            key = f"{e['name']}: {_arg_key(args)}"
            by_args[key] += e["dur"] / 1e3
            counts[key] += 1
    return {"events": [(k, round(ms, 2), counts[k]) for k, ms in by_args.most_common(top)],
            "programs": {s: [(m, round(ms, 2), program_counts[s][m]) for m, ms in c.most_common(top)]
                         for s, c in programs.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--json")
    parser.add_argument("--detail", help="regex of device event names to break down by their arguments")
    args = parser.parse_args()
    loaded = load_events(args.trace)
    summary = summarize(*loaded, top=args.top)
    for key, s in summary.items():
        print(f"\n{key}: span {s['span_ms']} ms, events total {s['busy_ms']} ms")
        for name, ms, n in s["names"]:
            print(f"  {ms:10.2f} ms {n:7d}x  {name}")
    if args.detail:
        found = detail(*loaded, args.detail, args.top)
        print(f"\ndevice events matching {args.detail!r}, per argument set:")
        for key, ms, n in found["events"]:
            print(f"  {ms:10.2f} ms {n:7d}x  {key}")
        for stream, rows in found["programs"].items():
            print(f"\n{stream}: time per XLA program")
            for module, ms, n in rows:
                print(f"  {ms:10.2f} ms {n:7d}x  {module}")
        summary["detail"] = found
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
