"""Perplexity task: teacher-forced decoding of a real text through the point's attention mode.

Row: mode, text, tokens, gpu_ratio, window, the mode's columns (`backend.row_fields()`: e.g. hgca's
beta and kept_share, the share of offloaded tokens its CPU attends at the end of the text; scout's
budget and exact layers), ppl, scored, mean_nll, seconds.
"""

from __future__ import annotations

import time

import numpy as np

from jhybrid.bench.forced import forced_nll
from jhybrid.bench.offload import PointSkipped, backend_for
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
    try:
        nll = forced_nll(model, backend, tokens, context, chunk=bench.prefill_chunk, on_step=on_step)
        fields = backend.row_fields()
    finally:
        backend.close()
    return [{"task": "perplexity", "mode": offload.mode, "text": text, "tokens": bench.tokens,
             "gpu_ratio": offload.gpu_ratio if window else None, "window": window, **fields,
             "scored": len(nll), "mean_nll": round(float(nll.mean()), 6),
             "ppl": round(float(np.exp(nll.mean())), 4), "seconds": round(time.perf_counter() - start, 2)}]
