"""scout's selection statistics in its default regime, on a real model and real text (issue 29, item 5).

A real model runs teacher-forced over a real text through scout (jhybrid.bench.forced): a prefill of
N tokens, then `warmup` + S decode steps, one token each. After every decode step the statistics are
read from what the backend exposes (`backend.selections(cache)`: each offloaded layer's top-k; the
cache's pool tables; `backend.runtime.last_block_ids(layer)`: the blocks the CPU attended; the scout
host's `recall_log`), and over the S scored steps (after the warm-up steps, which cover the pool's
warm start) each offloaded layer gets:

  topk_overlap        |S_t & S_t-1| / |S_t|: the share of a step's top-k blocks (per sequence and KV
                      head) that the previous step also selected
  cpu_share           the share of the selected blocks NOT resident in the GPU pool when selected,
                      i.e. what the CPU attends (read from the CPU's own block ids; `cpu_share_pool`
                      recomputes it from the cache's pool table as a cross-check)
  cpu_share_p90/max   over the scored steps
  recalls             recalls applied whose trigger fell in the scored steps (warm start excluded;
                      the host's recall_log), `recall_triggers` counts every trigger of the run
  recall_interval     mean interval between two recalls of the layer (decode steps)
  recall_rows         mean (block, head) rows moved per recall
  drift               distinct blocks a (sequence, KV head) selects over the S steps / k (1.0: the
                      same k blocks every step; large: the non-stable part wanders over the context)
  cpu_share_steady    cpu_share over the second half of the scored steps
  drift_by_window     drift over windows of 8 / 32 / 128 steps (mean over the windows)
  core_share          blocks selected at every scored step / k (the stable part)
  static_pool_cpu_share  the CPU share an oracle pool would leave that holds, for the whole run, the
                      `recall_blocks` blocks most often selected in the scored steps (a lower bound
                      for any pool of that size that never changes)

`summary` averages the layers (and splits exact / predicted-query layers); `steps` keeps the
per-step cpu share (mean over layers) and each recall. With recall_lag_steps 1 (the default here) a
recall is applied exactly one decode step after its trigger, so a run is replayable.

    PYTHONPATH=. python -m jhybrid.bench.scout_stats --model gemma3 --tokens 32768 --scored 64 \\
        --json benchmarks/results/selection-stats-scout-gemma3-32k-cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import shlex
import sys
import time

import numpy as np

from jhybrid.bench.forced import forced_nll

log = logging.getLogger(__name__)


DRIFT_WINDOWS = (8, 32, 128)  # drift_by_window: distinct blocks / k over windows of this many steps


def _offloaded_states(cache):
    from jhybrid.hybrid.state import LayerState

    return [s for s in cache.layers if isinstance(s, LayerState) and s.selected is not None]


def run(model, tokens: np.ndarray, offload, scored: int, warmup: int = 4, chunk: int = 512,
        calibration=None, progress=None) -> dict:
    """Teacher-forced scout run over `tokens` [N] with `warmup` + `scored` decode steps at the end;
    returns the raw per-step record (see `statistics`)."""
    from jhybrid.hybrid import make_backend

    steps = warmup + scored
    context = len(tokens) - 1 - steps
    backend = make_backend(offload, context=len(tokens), model=model, calibration_tokens=calibration)
    cfg = backend.config
    record = {"sel": [], "cpu": [], "pool": [], "offloaded": [], "t": []}

    def observe(cache):
        states = _offloaded_states(cache)
        runtime = backend.runtime
        record["sel"].append([np.asarray(s.selected) for s in states])
        record["pool"].append([None if s.pool is None else np.asarray(s.pool.blocks) for s in states])
        record["cpu"].append([runtime.last_block_ids(g) for g in range(len(states))])
        record["offloaded"].append(np.asarray(cache.meta.offloaded_blocks).copy())
        record["t"].append(time.perf_counter())

    start = time.perf_counter()
    try:
        nll = forced_nll(model, backend, tokens, context, chunk=min(chunk, cfg.max_prefill_chunk),
                         observe=observe, on_step=progress)
        host = backend.runtime.mode_host
        record["recall_log"] = [dict(e) for e in host.recall_log]
        record["counters"] = backend.counters()
        record["row_fields"] = backend.row_fields()
        record["exact"] = [bool(backend.mode.selects_exactly(g)) for g in range(len(record["sel"][0]))]
        record["global_layers"] = list(backend._plan.global_layers)
    finally:
        backend.close()
    record.update(nll=nll, seconds=time.perf_counter() - start, context=context, warmup=warmup, scored=scored,
                  config=cfg)
    return record


def _share(num: int, den: int) -> float | None:
    return None if den == 0 else num / den


def statistics(record: dict) -> tuple[list[dict], dict, dict]:
    """(rows per offloaded layer, summary, per-step series) of a `run` record over its scored steps."""
    cfg, warmup, scored = record["config"], record["warmup"], record["scored"]
    window = range(warmup, warmup + scored)  # decode-step indices scored (0 = the first decode step)
    n_layers = len(record["sel"][0])
    r_blocks = cfg.recall_blocks or 0
    rows, step_cpu = [], np.zeros((scored, n_layers))
    log_entries = [e for e in record["recall_log"] if not e["warm"]]
    for g in range(n_layers):
        overlaps, cpu_steps, pool_steps = [], [], []
        for i, t in enumerate(window):
            cur, prev = record["sel"][t][g], record["sel"][t - 1][g]
            valid = cur >= 0
            n_sel = int(valid.sum())
            same = (cur[..., None] == prev[:, :, None, :]).any(-1) & valid
            overlaps.append(_share(int(same.sum()), n_sel))
            cpu = record["cpu"][t][g]
            cpu_steps.append(_share(int((cpu >= 0).sum()), n_sel) if cpu is not None else None)
            step_cpu[i, g] = cpu_steps[-1] if cpu_steps[-1] is not None else np.nan
            table = record["pool"][t][g]
            if table is not None:
                hit = (cur[..., None] == table[:, :, None, :]).any(-1) & valid
                pool_steps.append(_share(n_sel - int(hit.sum()), n_sel))
        sel = np.stack([record["sel"][t][g] for t in window])  # [S, B, Hkv, k]
        k = sel.shape[-1]
        drifts, cores, oracle = [], [], []
        windows = {w: [] for w in DRIFT_WINDOWS if w <= sel.shape[0]}
        for b in range(sel.shape[1]):
            for h in range(sel.shape[2]):
                ids = sel[:, b, h]
                ids_valid = ids[ids >= 0]
                if ids_valid.size == 0:
                    continue
                blocks, counts = np.unique(ids_valid, return_counts=True)
                drifts.append(len(blocks) / k)
                for w, out in windows.items():
                    for begin in range(0, sel.shape[0] - w + 1, w):
                        part = ids[begin:begin + w]
                        out.append(len(np.unique(part[part >= 0])) / k)
                cores.append(int((counts == len(window)).sum()) / k)
                if r_blocks:
                    keep = set(blocks[np.argsort(-counts, kind="stable")[:r_blocks]].tolist())
                    missed = sum(int(x not in keep) for x in ids_valid.tolist())
                    oracle.append(missed / ids_valid.size)
        triggers = sorted(e["trigger_step"] for e in log_entries if e["layer"] == g and e["trigger_step"] in window)
        rows_moved = [e["rows"] for e in log_entries if e["layer"] == g and e["trigger_step"] in window]
        cpu_values = [c for c in cpu_steps if c is not None]
        rows.append({
            "layer": g, "model_layer": record["global_layers"][g], "exact_query": record["exact"][g],
            "topk_overlap": _round(np.mean([o for o in overlaps if o is not None])) if overlaps else None,
            "cpu_share": _round(np.mean(cpu_values)) if cpu_values else None,
            "cpu_share_p90": _round(np.percentile(cpu_values, 90)) if cpu_values else None,
            "cpu_share_max": _round(max(cpu_values)) if cpu_values else None,
            "cpu_share_steady": _round(np.mean(cpu_values[len(cpu_values) // 2:])) if cpu_values else None,
            "cpu_share_pool": _round(np.mean(pool_steps)) if pool_steps else None,
            "recalls": len(triggers),
            "recall_interval": _round(np.mean(np.diff(triggers)), 2) if len(triggers) >= 2 else None,
            "recall_rows": _round(np.mean(rows_moved), 1) if rows_moved else None,
            "drift": _round(np.mean(drifts)) if drifts else None,
            "drift_by_window": {str(w): _round(np.mean(v)) for w, v in windows.items() if v},
            "core_share": _round(np.mean(cores)) if cores else None,
            "static_pool_cpu_share": _round(np.mean(oracle)) if oracle else None,
        })
    summary = {key: _mean(rows, key) for key in ("topk_overlap", "cpu_share", "cpu_share_steady", "cpu_share_p90",
                                                  "cpu_share_pool",
                                                  "recall_interval", "drift", "core_share", "static_pool_cpu_share")}
    summary["drift_by_window"] = {w: _round(np.mean([r["drift_by_window"][w] for r in rows if w in r["drift_by_window"]]))
                                  for w in rows[0]["drift_by_window"]}
    summary["cpu_share_max"] = max((r["cpu_share_max"] for r in rows if r["cpu_share_max"] is not None), default=None)
    summary["recalls"] = sum(r["recalls"] for r in rows)
    summary["recalls_per_layer_per_100_steps"] = _round(100 * summary["recalls"] / (n_layers * scored), 2)
    for name, want in (("exact_layers", True), ("predicted_layers", False)):
        part = [r for r in rows if r["exact_query"] == want]
        if part:
            summary[name] = {"layers": [r["layer"] for r in part],
                             **{key: _mean(part, key) for key in ("topk_overlap", "cpu_share", "cpu_share_steady",
                                                                 "drift")}}
    nll = record["nll"][warmup:]
    summary["ppl_scored"] = _round(float(np.exp(nll.mean())), 4)
    k = record["sel"][0][0].shape[-1]
    summary.update(k_blocks=int(k), offloaded_blocks_first=int(record["offloaded"][warmup].max()),
                   offloaded_blocks_last=int(record["offloaded"][-1].max()),
                   budget_share_of_offloaded=_round(k / max(1, int(record["offloaded"][warmup].max()))))
    dt = np.diff(record["t"][warmup - 1:]) if warmup >= 1 else np.diff(record["t"])
    summary["decode_step_s"] = _round(float(np.median(dt)), 3) if len(dt) else None
    series = {"cpu_share_by_step": [_round(np.nanmean(step_cpu[i])) for i in range(scored)],
              "first_steps_cpu_share": [_step_cpu(record, t) for t in range(warmup)],
              "recall_log": record["recall_log"]}
    return rows, summary, series


def _step_cpu(record, t: int):
    """The CPU share of decode step t over every offloaded layer (None: not known)."""
    cpu = sum(int((c >= 0).sum()) for c in record["cpu"][t] if c is not None)
    sel = sum(int((s >= 0).sum()) for s, c in zip(record["sel"][t], record["cpu"][t]) if c is not None)
    return _round(_share(cpu, sel)) if sel else None


def _round(x, digits: int = 4):
    return None if x is None or not np.isfinite(x) else round(float(x), digits)


def _mean(rows, key):
    values = [r[key] for r in rows if r.get(key) is not None]
    return _round(np.mean(values)) if values else None


def print_table(name: str, rows: list[dict], summary: dict) -> None:
    head = f"{'layer':>5} {'model':>5} {'exact':>5} {'overlap':>8} {'cpu':>7} {'steady':>7} {'cpu p90':>8} {'cpu pool':>8} " \
           f"{'recalls':>7} {'interval':>8} {'drift':>7} {'core':>6} {'oracle':>7}"
    print(name)
    print(head)
    fmt = lambda v, w, d=3: f"{v:>{w}.{d}f}" if isinstance(v, float) else f"{str(v):>{w}}"  # noqa: E731
    for r in rows:
        print(f"{r['layer']:>5} {r['model_layer']:>5} {str(r['exact_query'])[0]:>5} {fmt(r['topk_overlap'], 8)} "
              f"{fmt(r['cpu_share'], 7)} {fmt(r['cpu_share_steady'], 7)} {fmt(r['cpu_share_p90'], 8)} {fmt(r['cpu_share_pool'], 8)} "
              f"{r['recalls']:>7} {fmt(r['recall_interval'], 8, 1)} {fmt(r['drift'], 7, 2)} "
              f"{fmt(r['core_share'], 6)} {fmt(r['static_pool_cpu_share'], 7)}")
    s = summary
    print(f"{'all':>5} {'':>5} {'':>5} {fmt(s['topk_overlap'], 8)} {fmt(s['cpu_share'], 7)} "
          f"{fmt(s['cpu_share_steady'], 7)} "
          f"{fmt(s['cpu_share_p90'], 8)} {fmt(s['cpu_share_pool'], 8)} {s['recalls']:>7} "
          f"{fmt(s['recall_interval'], 8, 1)} {fmt(s['drift'], 7, 2)} {fmt(s['core_share'], 6)} "
          f"{fmt(s['static_pool_cpu_share'], 7)}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3")
    parser.add_argument("--text", default="paul_graham")
    parser.add_argument("--tokens", type=int, default=16384, help="text tokens (prefill + decode steps + 1)")
    parser.add_argument("--scored", type=int, default=64, help="decode steps measured (after --warmup)")
    parser.add_argument("--warmup", type=int, default=4, help="decode steps before the scored ones (warm start)")
    parser.add_argument("--budget", type=int, default=None, help="scout budget in tokens (default: scout's, 2048)")
    parser.add_argument("--recall-blocks", type=int, default=None, help="pool blocks (default: 2x the budget's)")
    parser.add_argument("--window-tokens", type=int, default=None, help="GPU window (default: scout's, 272)")
    parser.add_argument("--recall-lag-steps", type=int, default=1, help="0 = asynchronous (None)")
    parser.add_argument("--exact-layers", default="auto", help='"auto" or a comma list of offloaded layers')
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--host-threads", type=int, default=1)
    parser.add_argument("--name", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    from jhybrid.bench.results import versions
    from jhybrid.bench.texts import calibration_tokens, text_tokens
    from jhybrid.hybrid import OffloadConfig
    from jhybrid.loading.pretrained import load_pretrained

    fields = {"mode": "scout", "recall_lag_steps": args.recall_lag_steps or None, "host_threads": args.host_threads}
    if args.budget is not None:
        fields["budget"] = args.budget
    if args.recall_blocks is not None:
        fields["recall_blocks"] = args.recall_blocks
    if args.window_tokens is not None:
        fields["window_tokens"] = args.window_tokens
    if args.exact_layers != "auto":
        fields["scout_exact_layers"] = tuple(int(x) for x in args.exact_layers.split(",") if x != "")
    offload = OffloadConfig(**fields)
    t0 = time.perf_counter()
    pretrained = load_pretrained(args.model)
    tokens = text_tokens(pretrained, args.text, args.tokens)
    total = args.warmup + args.scored

    def progress(done, _total):
        if done == 1 or done % 8 == 0 or done == total:
            print(f"[{time.perf_counter() - t0:7.0f} s] decode step {done}/{total}", flush=True)

    print(f"[{time.perf_counter() - t0:7.0f} s] {args.model}: {args.tokens} tokens of {args.text}, prefill "
          f"{args.tokens - 1 - total}, {total} decode steps", flush=True)
    record = run(pretrained.model, tokens, offload, args.scored, args.warmup, args.prefill_chunk,
                 calibration_tokens(pretrained), progress)
    rows, summary, series = statistics(record)
    cfg = record["config"]
    resolved = {key: getattr(cfg, key) for key in ("window_tokens", "sink", "block_size", "budget", "recall_blocks",
                                                   "recall_threshold", "recall_min_interval", "recall_lag_steps",
                                                   "predict_query", "scout_exact_layers", "host_kv_dtype")}
    resolved["scout_exact_layers"] = list(resolved["scout_exact_layers"]) if isinstance(
        resolved["scout_exact_layers"], tuple) else resolved["scout_exact_layers"]
    name = args.name or f"selection-stats-scout-{args.model}-{args.tokens // 1024}k-cpu"
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    print_table(f"{name}: {record['context']} prefill tokens, {args.scored} scored decode steps", rows, summary)
    print(json.dumps(summary), flush=True)
    if args.json:
        doc = {"name": name, "device": f"cpu: {os.cpu_count()} cores",
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "versions": versions(),
               "command": "PYTHONPATH=. python -m jhybrid.bench.scout_stats "
                          + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)),
               "config": {**vars(args), "context": record["context"], "offload": resolved,
                          "counters": {k: v for k, v in record["counters"].items() if "recall" in k},
                          "row_fields": record["row_fields"]},
               "rows": rows, "summary": summary, "steps": series}
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
