"""Print the markdown tables of BENCHMARKS.md from the JSON files in benchmarks/results/.

  python benchmarks/render_tables.py kernels|diag|host|hybrid|hcache|throughput [results/file.json]
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def _f(v, nd=1):
    if v is None or (isinstance(v, float) and v != v):
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def kernels(path):
    d = json.load(open(path))
    dense = [r for r in d["rows"] if r["kernel"] == "dense_window"]
    print(f"Device: {d['device']}; {d['date']}; jax {d['versions']['jax']}\n")
    print(table(
        ["B", "context", "ours µs", "ours TB/s", "cuDNN µs", "cuDNN TB/s", "XLA µs", "JAX gqa µs", "copy TB/s",
         "ours / cuDNN time", "rel err vs jnp"],
        [[str(r["batch"]), str(r["context"]), _f(r.get("median_us")), _f(r.get("achieved_GBps", 0) / 1e3, 2),
          _f(r.get("cudnn_us")), _f(r.get("cudnn_GBps", 0) / 1e3, 2), _f(r.get("xla_us")), _f(r.get("jax_gqa_us")),
          _f(r.get("copy_GBps", 0) / 1e3, 2), _f(r["median_us"] / r["cudnn_us"], 2) if "cudnn_us" in r else "-",
          f"{r.get('rel_err_o', float('nan')):.1e}"] for r in dense]))
    sparse = [r for r in d["rows"] if r["kernel"] == "block_sparse"]
    print()
    print(table(
        ["B", "context", "block", "selected", "µs", "TB/s on selected bytes", "copy TB/s", "% of copy"],
        [[str(r["batch"]), str(r["context"]), str(r["block_size"]), f"{r['selected_frac']:.0%}", _f(r["median_us"]),
          _f(r["achieved_GBps"] / 1e3, 2), _f(r["copy_GBps"] / 1e3, 2), f"{r['achieved_GBps'] / r['copy_GBps']:.0%}"]
         for r in sparse if "median_us" in r]))
    for r in d["rows"]:
        if r["kernel"] == "digest_topk" and "median_us" in r:
            print(f"\nDigest scoring + top-k, B={r['batch']}, {r['context']} tokens, block {r['block_size']}, "
                  f"budget {r['budget_tokens']}: {r['median_us']:.1f} µs (Pallas scores alone {r['score_only_us']:.1f} µs "
                  f"= {r['achieved_GBps'] / 1e3:.2f} TB/s of digests; jnp scores + top-k {r['jnp_reference_us']:.1f} µs)")


def host(path):
    d = json.load(open(path))
    print(f"Device: {d['device']}; {d['date']}\n")
    rows = [r for r in d["rows"] if r["kernel"] in ("context_cache", "chosen_blocks")]
    print(table(
        ["kernel", "D", "B·Hkv", "tokens/head", "µs", "GB/s", "read ceiling GB/s", "% of ceiling", "NumPy µs", "torch µs"],
        [[r["kernel"], str(r["D"]), str(r["batch_heads"]), str(r["tokens"]), _f(r["median_us"]),
          _f(r["achieved_GBps"]), _f(r["read_ceiling_GBps"]), _f(100 * r["achieved_GBps"] / r["read_ceiling_GBps"], 0),
          _f(r.get("numpy_us"), 0), _f(r.get("torch_us"), 0)] for r in rows]))
    for r in d["rows"]:
        if r["kernel"] not in ("context_cache", "chosen_blocks"):
            print(f"\n{r['kernel']}: {r['median_us']:.0f} µs ({r.get('note', '')})")


def dense_diag(path):
    d = json.load(open(path))
    rows = [r for r in d["rows"] if r["kernel"] == "dense_diag"]
    print(table(["B", "context", "splits", "whole op µs", "kernel alone µs"],
                [[str(r["batch"]), str(r["context"]), str(r["num_splits"]), _f(r.get("median_us")),
                  _f(r.get("kernel_only_us"))] for r in rows]))


def hybrid(path):
    d = json.load(open(path))
    print(f"Device: {d['device']}; {d['date']}; {d['config'].get('note', '')}\n")
    rows = [r for r in d["rows"] if "error" not in r]
    print(table(
        ["mode", "B", "GPU window", "tok/s (mean step)", "step ms mean", "step ms median", "GPU attn ms",
         "CPU attn ms", "callback ms", "callbacks/step", "GPU idle (all steps)", "GPU idle (median step)",
         "CPU share", "drift", "recall ms (critical path)", "GPU KV GB", "host KV GB"],
        [[r["mode"], str(r["batch"]), str(r["gpu_window"]), _f(r["tokens_per_s"]), _f(r["step_ms"], 2),
          _f(r.get("step_ms_median"), 2), _f(r["gpu_attn_ms"], 2), _f(r["cpu_attn_ms"], 2),
          _f(r["callback_ms"], 2), _f(r.get("callbacks_per_step"), 0), _f(r["gpu_idle_frac"], 2),
          _f(r.get("gpu_idle_frac_median"), 2), _f(r.get("cpu_share"), 2), _f(r.get("drift"), 2),
          _f(r.get("recall_ms"), 2), _f(r["gpu_kv_bytes"] / 1e9, 2), _f(r["host_kv_bytes"] / 1e9, 2)]
         for r in rows]))
    skipped = [r for r in d["rows"] if "error" in r]
    if skipped:
        print(f"\nNot run ({len(skipped)} rows): " + "; ".join(
            sorted({f"{r['error'][:60]}" for r in skipped})))


def throughput(path):
    d = json.load(open(path))
    print(f"Device: {d['device']}; {d['date']}\n")
    ran = [r for r in d["rows"] if not r.get("skipped") and r.get("decode_tok_s") is not None]
    ran.sort(key=lambda r: (r["model"], r.get("fill") != "synthetic", r["context"], r["batch"],
                            ["full", "recall", "hgca", "scout"].index(r["mode"]) if r["mode"] in
                            ("full", "recall", "hgca", "scout") else 9))
    print(table(
        ["model (layers)", "fill", "context", "B", "mode", "decode tok/s", "TBT p50 ms", "TBT p99 ms", "TTFT s",
         "CPU attn ms", "callback ms", "device in use GiB", "host KV GiB"],
        [[f"{r['model']} ({r['layers']})", str(r.get("fill", "-")), str(r["context"]), str(r["batch"]), r["mode"],
          _f(r["decode_tok_s"]), _f(r["tbt_p50_ms"], 2), _f(r["tbt_p99_ms"], 2), _f(r.get("ttft_s"), 2),
          _f(r.get("cpu_attn_ms"), 2), _f(r.get("callback_ms"), 2),
          _f((r.get("device_in_use_bytes") or float("nan")) / 2**30, 1),
          _f((r.get("host_kv_bytes") or float("nan")) / 2**30, 1)] for r in ran]))
    print()
    print(table(["model (layers)", "mode", "context", "largest batch run", "predicted max", "limited by",
                 "first batch over"],
                [[f"{c['model']} ({c['layers']})", c["mode"], str(c["context"]), _f(c.get("max_batch_run")),
                  _f(c.get("pred_max_batch")), str(c.get("limited_by") or "-"), _f(c.get("first_batch_over"))]
                 for c in d["capacity"] if c.get("layers") is not None]))
    skipped = [r for r in d["rows"] if r.get("skipped")]
    print(f"\nSkipped points ({len(skipped)}), by reason: " + "; ".join(
        f"{n} x {reason}" for reason, n in sorted(_count(r["skipped"].split(":")[0] for r in skipped).items())))


def _count(items):
    out = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out


def hcache(path):
    d = json.load(open(path))
    print(f"Device: {d['device']}; {d['date']}\n")
    rows = d["rows"]
    keys = sorted({(r["model"], r["storage"], r["history_tokens"]) for r in rows},
                  key=lambda k: (k[0], k[1] != "dram", k[2]))
    out = []
    for model, storage, n in keys:
        by = {r["method"]: r for r in rows if (r["model"], r["storage"], r["history_tokens"]) == (model, storage, n)}
        ms = {m: by[m]["restore_ms"] for m in by}
        best_single = min(ms[m] for m in ("hidden", "kv", "recompute") if m in ms)
        out.append([model, storage, str(n)] + [_f(ms.get(m)) for m in ("hidden", "kv", "recompute", "planner")]
                   + [by.get("planner", {}).get("plan", "-"),
                      _f(ms["kv"] / ms["hidden"], 2) if "kv" in ms and "hidden" in ms else "-",
                      _f(ms["recompute"] / ms["hidden"], 1) if "recompute" in ms and "hidden" in ms else "-",
                      _f(ms["planner"] / best_single, 2) if "planner" in ms else "-"])
    print(table(["model", "storage", "history", "hidden ms", "kv ms", "recompute ms", "planner ms", "plan",
                 "kv / hidden", "recompute / hidden", "planner / best single"], out))
    bpt = {(r["model"], r["method"]): r["bytes_per_token"] for r in rows if r["method"] in ("hidden", "kv")}
    print("\nStorage bytes per token: " + "; ".join(f"{m} {meth} {v}" for (m, meth), v in sorted(bpt.items())))


if __name__ == "__main__":
    what = sys.argv[1]
    default = {"kernels": "kernels-h100.json", "host": "host-attention-h100.json", "diag": "kernels-h100-run2.json",
               "hybrid": "hybrid-h100.json", "hcache": "hcache-h100.json",
               "throughput": "throughput-h100.json"}[what]
    path = sys.argv[2] if len(sys.argv) > 2 else os.path.join(HERE, "results", default)
    {"kernels": kernels, "host": host, "diag": dense_diag, "hybrid": hybrid, "hcache": hcache,
     "throughput": throughput}[what](path)
