"""Which 8-bit layout for the host KV? Attention error of candidate formats on a real model's KV.

Runs one full-attention prefill over real text, then for every layer quantizes K and V of the
first `tokens - queries` positions with each candidate layout, and attends the last `queries`
positions' real queries over (a) the exact float32 KV and (b) the dequantized KV:

    PYTHONPATH=. python -m jhybrid.bench.kv_quant_error --model smollm2 --tokens 2048

Candidates (block = the store's 64-token block; "row" = one token x one KV head):
  bf16          today's store, for reference
  int8-row      K and V: one float32 scale per row (symmetric, max|x| / 127)
  int8-kivi     K: one scale per block x head x channel; V: one per row (the KIVI layout)
  fp8-e4m3      K and V as e4m3 with no scale
  fp8-e4m3-row  K and V: e4m3 after dividing by a per-row scale (max|x| / 448)

Per candidate: mean and max over layers of the relative L2 error of the attention output
|o_q - o| / |o| (averaged over queries and heads), and of the max logit error |s_q - s| in units of
the logit standard deviation. This is how host_kv_dtype's layout was chosen (docs/design.md).
"""

from __future__ import annotations

import argparse
import sys

import jax.numpy as jnp
import ml_dtypes
import numpy as np

FP8_MAX = 448.0


def _int8_round(x, scale):
    return np.clip(np.rint(x / scale), -127, 127) * scale


def quantize_dequantize(x: np.ndarray, layout: str, kind: str, block: int = 64) -> np.ndarray:
    """x [T, Hkv, D] float64 -> its value after a round trip through `layout` (float64)."""
    t = x.shape[0]
    if layout == "int8-row" or (layout == "int8-kivi" and kind == "v"):
        scale = np.maximum(np.abs(x).max(-1, keepdims=True), 1e-30) / 127.0
        return _int8_round(x, scale)
    if layout == "int8-kivi":  # keys: one scale per (block, head, channel)
        out = np.empty_like(x)
        for b0 in range(0, t, block):
            xb = x[b0:b0 + block]
            scale = np.maximum(np.abs(xb).max(0, keepdims=True), 1e-30) / 127.0
            out[b0:b0 + block] = _int8_round(xb, scale)
        return out
    if layout == "bf16":
        return x.astype(ml_dtypes.bfloat16).astype(np.float64)
    if layout == "fp8-e4m3":
        return np.clip(x, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    if layout == "fp8-e4m3-row":
        scale = np.maximum(np.abs(x).max(-1, keepdims=True), 1e-30) / FP8_MAX
        return (x / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * scale
    raise ValueError(f"layout={layout!r}; expected one of {LAYOUTS}")


LAYOUTS = ("bf16", "int8-row", "int8-kivi", "fp8-e4m3", "fp8-e4m3-row")


def _attend(q, k, v):
    """q [Tq, Hq, D], k/v [T, Hkv, D] float64 -> (o [Tq, Hq, D], s [Tq, Hq, T])."""
    group = q.shape[1] // k.shape[1]
    kk = np.repeat(k, group, axis=1)
    vv = np.repeat(v, group, axis=1)
    s = np.einsum("qhd,thd->qht", q, kk) / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("qht,thd->qhd", p, vv), s


def layout_errors(model, tokens: np.ndarray, queries: int) -> list[dict]:
    """One row per (layer, layout): out_rel_err, logit_err_sd."""
    tokens = np.asarray(tokens, np.int32)
    t = len(tokens)
    ids, positions = jnp.asarray(tokens[None]), jnp.arange(t, dtype=jnp.int32)[None]
    cache = model.init_cache(1, t)
    _, cache, inputs = model.hidden_states(ids, positions, cache, return_hidden_states=True)
    n_kv = t - queries
    rows = []
    for i, layer in enumerate(model.layers):
        q = np.asarray(layer.attention.project_q(layer.attention_input(inputs[i]), positions)[0, n_kv:], np.float64)
        k = np.asarray(cache.layers[i]["k"][0, :n_kv], np.float64)
        v = np.asarray(cache.layers[i]["v"][0, :n_kv], np.float64)
        o_ref, s_ref = _attend(q, k, v)
        sd = s_ref.std()
        for name in LAYOUTS:
            o, s = _attend(q, quantize_dequantize(k, name, "k"), quantize_dequantize(v, name, "v"))
            rel = np.linalg.norm(o - o_ref, axis=-1) / np.maximum(np.linalg.norm(o_ref, axis=-1), 1e-30)
            rows.append({"layer": i, "layout": name, "out_rel_err": float(rel.mean()),
                         "logit_err_sd": float(np.abs(s - s_ref).max() / sd),
                         "k_absmax": float(np.abs(k).max()), "v_absmax": float(np.abs(v).max())})
    return rows


def summary(rows: list[dict]) -> dict:
    out = {}
    for name in LAYOUTS:
        r = [x for x in rows if x["layout"] == name]
        out[name] = {"out_rel_err_mean": round(float(np.mean([x["out_rel_err"] for x in r])), 5),
                     "out_rel_err_worst_layer": round(float(np.max([x["out_rel_err"] for x in r])), 5),
                     "logit_err_sd_max": round(float(np.max([x["logit_err_sd"] for x in r])), 4)}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--text", default="paul_graham")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--queries", type=int, default=64, help="last positions used as queries")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from jhybrid.bench.texts import text_tokens
    from jhybrid.loading.pretrained import load_pretrained

    pretrained = load_pretrained(args.model, dtype="float32")
    rows = layout_errors(pretrained.model, text_tokens(pretrained, args.text, args.tokens), args.queries)
    result = summary(rows)
    for name, s in result.items():
        print(f"{name:14s} " + " ".join(f"{k}={v}" for k, v in s.items()))
    if args.json:
        from jhybrid.bench.results import write_json
        write_json(args.json, "kv-quant-error", vars(args), rows,
                   "PYTHONPATH=. python -m jhybrid.bench.kv_quant_error " + " ".join(argv or sys.argv[1:]),
                   extra={"summary": result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
