"""Where a profiled window's time went: totals per event name of a JAX profiler trace in Perfetto
JSON (`jax.profiler.start_trace(dir, create_perfetto_trace=True)` writes
dir/plugins/profile/<run>/perfetto_trace.json.gz), per thread of each process (the GPU's streams, the host's
threads), the longest first.

  python3 benchmarks/trace_summary.py TRACE_DIR_OR_FILE [--top 25] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--json")
    args = parser.parse_args()
    summary = summarize(*load_events(args.trace), top=args.top)
    for key, s in summary.items():
        print(f"\n{key}: span {s['span_ms']} ms, events total {s['busy_ms']} ms")
        for name, ms, n in s["names"]:
            print(f"  {ms:10.2f} ms {n:7d}x  {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
