"""Real-weight check: perplexity of a model over the first N tokens of a public English text.

Teacher forcing: the tokens go through the model in prefill chunks (the cache carries context
across chunks), and the perplexity is exp(mean negative log-likelihood of tokens 1..N-1).

    .venv/bin/python benchmarks/eval_perplexity.py                   # SmolLM2, Paul Graham, 512
    .venv/bin/python benchmarks/eval_perplexity.py --chunks 512 128  # one-shot and chunked rows

Writes benchmarks/results/ppl-<model>-<platform>.json (name, device, date, versions, command,
config, rows).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jhybrid.bench.texts import TEXT_FILES, load_text
from jhybrid.generation import make_step
from jhybrid.loading.pretrained import load_pretrained

def perplexity(model, tokens: np.ndarray, chunk: int) -> tuple[float, float]:
    """(mean NLL in nats, seconds) of tokens [N] with prefill chunks of `chunk` tokens."""
    step, params = make_step(model)
    n = len(tokens)
    cache = model.init_cache(1, n)
    nll_parts = []
    start = time.perf_counter()
    for begin in range(0, n, chunk):
        part = tokens[begin:begin + chunk]
        positions = jnp.arange(begin, begin + len(part), dtype=jnp.int32)[None]
        logits, cache = step(params, jnp.asarray(part[None], jnp.int32), positions, cache)
        log_probs = jax.nn.log_softmax(logits[0], axis=-1)  # [T, V] predicts the next token
        targets = tokens[begin + 1:begin + len(part) + 1]
        picked = jnp.take_along_axis(log_probs[:len(targets)], jnp.asarray(targets)[:, None], axis=1)
        nll_parts.append(-np.asarray(picked[:, 0]))
    seconds = time.perf_counter() - start
    return float(np.concatenate(nll_parts).mean()), seconds


def versions() -> dict:
    import flax
    import jaxlib

    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__,
            "python": platform.python_version()}


def device_name() -> str:
    device = jax.devices()[0]
    if device.platform == "cpu":
        return f"cpu: {os.cpu_count()} cores"
    return f"{device.device_kind}, {os.cpu_count()}-core host"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--text", default="paul_graham", choices=sorted(TEXT_FILES))
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--chunks", type=int, nargs="+", default=[512, 128],
                        help="prefill chunk sizes to evaluate (results must agree)")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)

    pretrained = load_pretrained(args.model)
    text = load_text(args.text)
    tokens = np.asarray(pretrained.tokenizer.encode(text[: args.tokens * 20]).ids[: args.tokens],
                        np.int32)
    if len(tokens) < args.tokens:
        raise ValueError(f"text {args.text} has only {len(tokens)} tokens")
    rows = []
    for chunk in args.chunks:
        nll, seconds = perplexity(pretrained.model, tokens, chunk)
        rows.append({"model": args.model, "text": args.text, "tokens": int(len(tokens)),
                     "prefill_chunk": chunk, "mean_nll": round(nll, 6),
                     "perplexity": round(float(np.exp(nll)), 4), "seconds": round(seconds, 3)})
        print(json.dumps(rows[-1]))
    platform_name = jax.devices()[0].platform
    output = args.output or os.path.join(os.path.dirname(__file__), "results",
                                         f"ppl-{args.model}-{platform_name}.json")
    result = {
        "name": "perplexity",
        "device": device_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        "command": " ".join(shlex.quote(a) for a in [".venv/bin/python", "benchmarks/eval_perplexity.py",
                                                     *(sys.argv[1:] if argv is None else argv)]),
        "config": {"model": args.model, "source": pretrained.source, "text": args.text,
                   "tokens": args.tokens, "dtype": pretrained.model.config.dtype,
                   "text_head": text[:80]},
        "rows": rows,
    }
    with open(output, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
