"""The statistics that decide the CPU's work in the selection and salience modes, on real text.

With random weights, scout's top-k drifts between steps and hgca's salience threshold keeps an
arbitrary share, so throughput measured on random contexts says little about real ones. This runs a
real model over a real text (teacher-forced, jhybrid.bench.forced) and measures, per layer:

  topk_overlap     scout: |S_t & S_t-1| / |S_t|, the share of a step's top-k blocks (per sequence and
                   KV head) that the previous step also selected (stable selections can be recalled)
  resident_share   scout: the share of the selected blocks that sit in the GPU recall pool when
                   selected (the CPU attends the rest)
  hgca_kept_share  hgca: the share of the offloaded tokens its salience threshold keeps for the CPU

    PYTHONPATH=. python -m jhybrid.bench.selection_stats --model smollm2 --tokens 2048 \\
        --json benchmarks/results/selection-stats-smollm2-cpu.json

`jhybrid.bench.synthetic` reproduces these figures at other shapes (`fill: calibrated`).

scout in its default regime (short window, budget 2048 over the whole context, pool of twice the
budget, recall at a CPU share of 12 %) is measured by `jhybrid.bench.scout_stats` (issue 29): the
CPU's share read from the blocks the CPU actually attended, recalls and their intervals from the
scout host's recall_log, and the drift of the selection over the scored steps.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from jhybrid.bench.forced import forced_nll
from jhybrid.hybrid import OffloadConfig, make_backend


def scout_stats(model, tokens: np.ndarray, offload: OffloadConfig, scored: int) -> list[dict]:
    """Per-layer topk_overlap and resident_share of a scout (or topk) run over the last `scored`
    decode steps of `tokens` [N]."""
    context = len(tokens) - 1 - scored
    backend = make_backend(offload, context=len(tokens))
    selections: list[list[np.ndarray]] = []  # per step: per layer selected ids [B, Hkv, k]
    resident: list[list[float]] = []

    def observe(cache):
        ids = [np.asarray(state.selected) for state in cache.layers]
        selections.append(ids)
        shares = []
        for state, sel in zip(cache.layers, ids):
            valid = sel >= 0
            if state.pool is None or not valid.any():
                shares.append(0.0)
                continue
            table = np.asarray(state.pool.blocks)  # [B, Hkv, R] (after this step's recalls are applied
            hit = (sel[..., None] == table[:, :, None, :]).any(-1) & valid  # next step: a lower bound)
            shares.append(float(hit.sum() / valid.sum()))
        resident.append(shares)

    forced_nll(model, backend, tokens, context, observe=observe)
    backend.close()
    rows = []
    for layer in range(model.config.num_layers):
        overlaps = []
        for prev, cur in zip(selections, selections[1:]):
            a, b = prev[layer], cur[layer]
            valid = b >= 0
            if not valid.any():
                continue
            same = (b[..., None] == a[:, :, None, :]).any(-1) & valid
            overlaps.append(same.sum() / valid.sum())
        rows.append({"layer": layer, "topk_overlap": round(float(np.mean(overlaps)), 4) if overlaps else None,
                     "resident_share": round(float(np.mean([r[layer] for r in resident[1:]])), 4)})
    return rows


def hgca_stats(model, tokens: np.ndarray, offload: OffloadConfig, scored: int) -> float | None:
    """hgca's kept share of the offloaded tokens after the run."""
    backend = make_backend(offload, context=len(tokens))
    forced_nll(model, backend, tokens, len(tokens) - 1 - scored)
    share = backend.row_fields().get("kept_share")
    backend.close()
    return share


def summary(rows: list[dict]) -> dict:
    def mean(key):
        values = [r[key] for r in rows if r[key] is not None]
        return round(float(np.mean(values)), 4) if values else None
    return {"topk_overlap": mean("topk_overlap"), "resident_share": mean("resident_share")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--text", default="paul_graham")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--scored", type=int, default=128, help="decode steps measured")
    parser.add_argument("--gpu-ratio", type=float, default=0.25)
    parser.add_argument("--budget", type=int, default=256, help="scout budget (tokens)")
    parser.add_argument("--recall-blocks", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from jhybrid.bench.texts import text_tokens
    from jhybrid.loading.pretrained import load_pretrained

    pretrained = load_pretrained(args.model, dtype="float32")
    tokens = text_tokens(pretrained, args.text, args.tokens)
    out = {"model": args.model, "text": args.text, "tokens": args.tokens, "scored": args.scored,
           "gpu_ratio": args.gpu_ratio, "budget": args.budget, "scout": {}}
    for r in args.recall_blocks:
        offload = OffloadConfig(mode="scout", gpu_ratio=args.gpu_ratio, budget=args.budget, recall_blocks=r)
        rows = scout_stats(pretrained.model, tokens, offload, args.scored)
        out["scout"][str(r)] = {"recall_blocks": r, "rows": rows, "summary": summary(rows)}
        print(f"scout recall_blocks={r}: {summary(rows)}", flush=True)
    out["hgca_kept_share"] = hgca_stats(pretrained.model, tokens, OffloadConfig(mode="hgca", gpu_ratio=args.gpu_ratio),
                                        args.scored)
    print(f"hgca kept share (beta 1.0): {out['hgca_kept_share']}")
    if args.json:
        import datetime
        import platform

        import jax
        doc = {"name": "selection-stats", "device": f"cpu: {__import__('os').cpu_count()} cores",
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "versions": {"jax": jax.__version__, "python": platform.python_version()},
               "command": "python -m jhybrid.bench.selection_stats " + " ".join(argv or sys.argv[1:]),
               "config": vars(args), "rows": [{"recall_blocks": int(r), **row} for r, d in out["scout"].items()
                                              for row in d["rows"]], "result": out}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
