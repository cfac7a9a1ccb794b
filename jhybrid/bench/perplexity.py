"""Perplexity task: teacher-forced decoding of a real text through the point's attention mode.

Row: mode, text, tokens, gpu_ratio, beta, budget, ppl (+ window, scored, mean_nll, seconds; hgca:
kept_share, the share of offloaded tokens its CPU attends at the end of the text, over layers and
KV heads: what the beta threshold kept).
"""

from __future__ import annotations

import time

import numpy as np

from jhybrid.bench.forced import forced_nll
from jhybrid.bench.offload import PointSkipped, backend_for, exact_layers_of
from jhybrid.bench.texts import calibration_tokens, text_tokens


def run_perplexity(model, pretrained, point, on_step=None, deadline=None) -> list[dict]:
    bench, offload = point.benchmark, point.offload
    if pretrained is None:  # random-weight model: random tokens (a smoke test of the path)
        tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, bench.tokens).astype(np.int32)
        text = "random"
    else:
        tokens, text = text_tokens(pretrained, bench.text, bench.tokens), bench.text
    if bench.scored_tokens >= bench.tokens - 1:
        raise PointSkipped(f"scored_tokens {bench.scored_tokens} >= tokens {bench.tokens} - 1")
    backend, window = backend_for(offload, bench.tokens, model,
                                  calibration_tokens(pretrained) if pretrained is not None else None)
    context = bench.tokens - 1 - bench.scored_tokens
    start = time.perf_counter()
    nll = forced_nll(model, backend, tokens, context, chunk=bench.prefill_chunk, on_step=on_step)
    row_kept = {"kept_share": hgca_kept_share(backend)} if offload.mode == "hgca" else {}
    return [{"task": "perplexity", "mode": offload.mode, "text": text, "tokens": bench.tokens,
             "gpu_ratio": offload.gpu_ratio if window else None, "window": window,
             "beta": offload.beta if offload.mode == "hgca" else None,
             **({"keep_after": offload.keep_after} if offload.mode == "hgca" and offload.keep_after else {}),
             **({"max_keep_share": offload.max_keep_share}
                if offload.mode == "hgca" and offload.max_keep_share is not None else {}),
             "budget": offload.budget if offload.mode in ("scout", "topk") else None,
             **({"host_kv_dtype": offload.host_kv_dtype} if offload.host_kv_dtype is not None else {}),
             "predict_query": offload.predict_query if offload.mode == "scout" else None,
             "scout_exact_layers": exact_layers_of(offload),
             **({"exact_layers_used": exact_layers_of(backend.config)} if offload.mode == "scout" else {}),
             "scored": len(nll), "mean_nll": round(float(nll.mean()), 6),
             "ppl": round(float(np.exp(nll.mean())), 4),
             **row_kept, "seconds": round(time.perf_counter() - start, 2)}]


def hgca_kept_share(backend) -> float | None:
    """Kept (CPU-attended) tokens / offloaded tokens of an hgca backend's host store, summed over
    its layers, sequences and KV heads (None before anything was offloaded)."""
    runtime = backend.runtime
    runtime.evictor.publish_all()  # the background copies, their sparsification ...
    runtime.evictor.wait_background()  # ... and the queued re-evaluations are done
    store, hkv = runtime.store, runtime.hkv
    kept = offloaded = 0
    for layer in range(runtime.n_layers):
        for seq in range(runtime.batch):
            kept += int(store.context.kept_counts(layer, seq).sum())
            offloaded += store.n_tokens(layer, seq) * hkv
    return round(kept / offloaded, 4) if offloaded else None
