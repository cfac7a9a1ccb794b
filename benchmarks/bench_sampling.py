"""Timing of the serving engine's per-row sampling (`jhybrid.serving.sampling.sample_rows`) on
Llama-3's vocabulary, against a plain argmax: the cost each engine step pays to sample its rows.

  PYTHONPATH=. python3 benchmarks/bench_sampling.py --out $OUT/sampling-h100.json [--compare MODULE]

Batches of B rows over V = 128256 logits (random, float32): all greedy, all temperature 0.8,
all temperature 0.8 with top-k 50 and top-p 0.9. --compare MODULE also times MODULE.sample_rows
(e.g. an earlier version saved as a file) on the same inputs, after checking it gives the same tokens.
Timing: median of --repeats block_until_ready'd calls after warm-up.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, time_fn, write_results  # noqa: E402

from jhybrid.generation import SamplingParams  # noqa: E402
from jhybrid.serving.sampling import RowSampling, sample_rows  # noqa: E402

VOCAB = 128256
KINDS = {"greedy": SamplingParams(), "temperature": SamplingParams(temperature=0.8, seed=1),
         "top-k + top-p": SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 32])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--compare", default=None, help="a module with an earlier sample_rows")
    args = parser.parse_args()
    variants = {"sample_rows": sample_rows}
    if args.compare:
        sys.path.insert(0, os.getcwd())
        variants[f"{args.compare}.sample_rows"] = importlib.import_module(args.compare).sample_rows
    argmax = jax.jit(lambda logits: jnp.argmax(logits, axis=-1))
    rows = []
    for batch in args.batches:
        logits = jax.random.normal(jax.random.key(batch), (batch, VOCAB), jnp.float32) * 3
        base = time_fn(lambda: argmax(logits).block_until_ready(), repeats=args.repeats)
        rows.append({"batch": batch, "kind": "argmax", "variant": "jnp.argmax", "us": round(base, 1)})
        for kind, params in KINDS.items():
            sampling = RowSampling.empty(batch)
            for row in range(batch):
                sampling.set_row(row, params)
            tokens = None
            for name, fn in variants.items():
                jitted = jax.jit(fn)
                got = np.asarray(jitted(logits, sampling))
                if tokens is not None and not (got == tokens).all():
                    raise SystemExit(f"{name} draws other tokens than sample_rows ({kind}, batch {batch})")
                tokens = got if tokens is None else tokens
                us = time_fn(lambda: jitted(logits, sampling).block_until_ready(), repeats=args.repeats)
                rows.append({"batch": batch, "kind": kind, "variant": name, "us": round(us, 1)})
    print_table(rows, ["batch", "kind", "variant", "us"])
    write_results(args.out, "sampling", {"vocab": VOCAB, "batches": args.batches, "repeats": args.repeats}, rows)


if __name__ == "__main__":
    main()
