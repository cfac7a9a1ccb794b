"""How good is scout's layer-ahead query? Cosine similarity between the predicted and the real query.

scout (ScoutAttention) chooses layer i+1's offloaded blocks before layer i+1 runs, from a predicted
query: layer i+1's attention norm, W_q and RoPE applied to layer i's *input* x_i instead of layer
i+1's own input x_{i+1} = x_i + attn_i + mlp_i. The paper reports cosine similarities of 0.93-0.97
between predicted and real queries on 7-12B models. This measures it on any model over any tokens:

    from jhybrid.bench.query_similarity import query_similarity
    rows = query_similarity(model, token_ids)   # one row per predicted layer (1 .. L-1)

    PYTHONPATH=. python -m jhybrid.bench.query_similarity --model smollm2 --tokens 1024

Per row: layer, cos_mean / cos_median / cos_p10 over (token, query head), cos_head_min (the worst
head's mean), and the same statistics of the residual update's relative size |x_{i+1} - x_i| / |x_i|
(rel_update_mean): a small update is what makes the prediction work. RoPE rotates the predicted
and real query by the same angles, so the cosine is the same with or without it (it is applied).
"""

from __future__ import annotations

import argparse
import json
import sys

import jax.numpy as jnp
import numpy as np

from jhybrid.hybrid.calibration import cosines, predicted_and_exact


def query_similarity(model, tokens, skip_first: int = 0) -> list[dict]:
    """Rows (one per layer 1..L-1) of predicted-vs-real query cosine statistics for `tokens` [T]
    run as one full-attention prefill. skip_first: leading positions left out of the statistics
    (e.g. the first token, whose hidden state is atypical)."""
    tokens = np.asarray(tokens, np.int32)
    t = len(tokens)
    ids, positions = jnp.asarray(tokens[None]), jnp.arange(t, dtype=jnp.int32)[None]
    cache = model.init_cache(1, t)
    _, _, inputs = model.hidden_states(ids, positions, cache, return_hidden_states=True)  # [L, 1, T, d]
    rows = []
    for i in range(model.config.num_layers - 1):
        predicted, real = predicted_and_exact(model, inputs, i, i + 1, positions)  # [1, T, Hq, D]
        cos = cosines(predicted[0, skip_first:], real[0, skip_first:])
        x0 = np.asarray(inputs[i, 0, skip_first:], np.float64)
        x1 = np.asarray(inputs[i + 1, 0, skip_first:], np.float64)
        rel = np.linalg.norm(x1 - x0, axis=-1) / np.maximum(np.linalg.norm(x0, axis=-1), 1e-30)
        rows.append({"layer": i + 1, "cos_mean": round(float(cos.mean()), 4),
                     "cos_median": round(float(np.median(cos)), 4),
                     "cos_p10": round(float(np.percentile(cos, 10)), 4),
                     "cos_head_min": round(float(cos.mean(axis=0).min()), 4),
                     "rel_update_mean": round(float(rel.mean()), 4), "tokens": int(cos.shape[0])})
    return rows


def summary(rows: list[dict]) -> dict:
    """Mean over layers of each statistic (+ the worst layer's mean cosine)."""
    cos = [r["cos_mean"] for r in rows]
    return {"layers": len(rows), "cos_mean_over_layers": round(float(np.mean(cos)), 4),
            "cos_worst_layer": min(rows, key=lambda r: r["cos_mean"])["layer"] if rows else None,
            "cos_worst_layer_mean": round(float(min(cos)), 4) if rows else None,
            "cos_best_layer_mean": round(float(max(cos)), 4) if rows else None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="'smollm2' (real weights) or a loadable model")
    parser.add_argument("--text", default="paul_graham", help="paul_graham | squad")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--skip-first", type=int, default=1, help="leading positions left out (default 1)")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    from jhybrid.bench.texts import text_tokens
    from jhybrid.loading.pretrained import load_pretrained

    pretrained = load_pretrained(args.model, dtype="float32")
    rows = query_similarity(pretrained.model, text_tokens(pretrained, args.text, args.tokens), args.skip_first)
    for row in rows:
        print(" ".join(f"{k}={v}" for k, v in row.items()))
    print(json.dumps(summary(rows)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "text": args.text, "tokens": args.tokens, "rows": rows,
                       "summary": summary(rows)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
