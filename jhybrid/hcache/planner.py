"""The bubble-free restore planner (paper §4.1.2, layer-wise partition).

Profile once on this machine, for a history of n tokens, four per-layer costs (seconds):
  io_hidden  read one layer's hidden states [n, d_model] from storage to the device,
  project    K/V projection (+ norm, RoPE) of one layer on the device,
  io_kv      read one layer's K, V [n, 2*Hkv*D] to the device,
  recompute  one layer of token recomputation (prefill) over n tokens.
Then choose per layer "recompute" (a leading run), "hidden" or "kv" (a trailing run) so that the
I/O stream and the compute stream finish together. The paper solves this in closed form for
(hidden + kv) or (recompute + hidden); we simulate the two-stream pipeline for every split
(r recomputed, h hidden, k KV layers; O(L^2) plans, microseconds) and take the fastest. The
single-method plans are among the candidates, so the chosen plan is never estimated slower than
the best single method; `confirm_plan` then measures it against every single-method plan on the
machine, where the two-stream model can be wrong, and keeps the fastest. Bytes decide by themselves: for grouped-query models KV rows
(2*Hkv*D values) can be smaller than hidden rows (d_model; SmolLM2: 384 vs 576) and then io_kv <
io_hidden with no projection to pay, and the search picks KV.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time

import numpy as np

from jhybrid.hcache.restorer import CollectingSink, LayerKernels, recompute_kv

log = logging.getLogger("jhybrid.hcache")


@dataclasses.dataclass(frozen=True)
class LayerCosts:
    """Per-layer seconds for restoring `num_tokens` tokens (see module docstring)."""

    num_tokens: int
    io_hidden: float
    project: float
    io_kv: float
    recompute: float


@dataclasses.dataclass(frozen=True)
class RestorePlan:
    """methods: per layer "recompute" | "hidden" | "kv"; estimated_seconds: simulated restore time;
    single_method_seconds: the estimate of each single-method plan, for comparison."""

    methods: tuple[str, ...]
    estimated_seconds: float
    single_method_seconds: dict

    def describe(self) -> str:
        counts = {m: self.methods.count(m) for m in ("recompute", "hidden", "kv") if m in self.methods}
        return " + ".join(f"{c} {m}" for m, c in counts.items())


def estimate_seconds(methods, costs: LayerCosts) -> float:
    """Simulated restore time of a plan: one I/O stream (hidden layers, then KV layers, in
    order) and one compute stream (recomputed prefix, then each hidden layer's projection once
    its rows have arrived); the restore ends when both streams are done."""
    io_done = compute_done = 0.0
    compute_done += methods.count("recompute") * costs.recompute
    for m in methods:
        if m == "hidden":
            io_done += costs.io_hidden
            compute_done = max(compute_done, io_done) + costs.project
    io_done += methods.count("kv") * costs.io_kv
    return max(io_done, compute_done)


def plan_restore(costs: LayerCosts, num_layers: int) -> RestorePlan:
    """The fastest (by estimate_seconds) plan of the form r x recompute, h x hidden, k x kv."""
    best = None
    for r in range(num_layers + 1):
        for h in range(num_layers - r + 1):
            methods = ("recompute",) * r + ("hidden",) * h + ("kv",) * (num_layers - r - h)
            seconds = estimate_seconds(methods, costs)
            if best is None or seconds < best[0] - 1e-12:
                best = (seconds, methods)
    singles = {m: estimate_seconds((m,) * num_layers, costs) for m in ("hidden", "kv", "recompute")}
    return RestorePlan(methods=best[1], estimated_seconds=best[0], single_method_seconds=singles)


def confirm_plan(plan: RestorePlan, measure, repeats: int = 3,
                 skip_estimated_slower: float | None = None) -> RestorePlan:
    """Checks the plan on the machine: measure(methods) -> seconds of one restore.

    Measures the plan and every single-method plan (interleaved rounds, so noise hits all alike)
    and returns the fastest by median. The estimate alone is not enough: on the H100 run
    (BENCHMARKS.md, HCache) the profiled costs ranked all-KV first for the GQA model at 1K-4K
    tokens while all-hidden measured 1.6x faster, and where transfer and compute share a resource
    (a CPU backend, checksummed disk reads) a mixed plan can lose to its estimate. Measuring all
    candidates is what makes the planner never slower than the best single method (up to noise).
    skip_estimated_slower: do not measure a single-method plan estimated more than this many
    times slower than the plan (e.g. recompute of 16K tokens: seconds per run); None measures all.
    """
    num_layers = len(plan.methods)
    candidates = {plan.methods: plan.estimated_seconds}
    for method, estimate in plan.single_method_seconds.items():
        if skip_estimated_slower is not None and estimate > skip_estimated_slower * plan.estimated_seconds:
            log.info("hcache planner: not measuring all-%s (estimated %.1fx the plan)", method,
                     estimate / plan.estimated_seconds)
            continue
        candidates.setdefault((method,) * num_layers, estimate)
    samples = {methods: [] for methods in candidates}
    for _ in range(repeats):
        for methods in candidates:
            samples[methods].append(measure(methods))
    medians = {methods: statistics.median(times) for methods, times in samples.items()}
    best = min(medians, key=medians.get)
    if best != plan.methods:
        chosen = dataclasses.replace(plan, methods=best, estimated_seconds=candidates[best])
        log.info("hcache planner: %s measured %.2f ms, %s %.2f ms; using the latter", plan.describe(),
                 medians[plan.methods] * 1e3, chosen.describe(), medians[best] * 1e3)
        return chosen
    return plan


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up (compilation, first touch)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def profile_costs(kernels: LayerKernels, num_tokens: int, fetch, repeats: int = 3,
                  recompute_chunk: int = 1024) -> LayerCosts:
    """Measures the four per-layer costs on this machine for a history of num_tokens.

    fetch(layer, method): a reader of layer 0 in the storage being planned for (disk or DRAM),
    returning device rows [num_tokens, row] (see restorer.restore_kv); it must leave no cache
    behind that the real restore would not have (e.g. drop the page cache for disk).
    """
    import jax

    config = kernels.config
    io_hidden = _median_seconds(lambda: jax.block_until_ready(fetch(0, "hidden")), repeats)
    io_kv = _median_seconds(lambda: jax.block_until_ready(fetch(0, "kv")), repeats)
    rows = fetch(0, "hidden")
    project = _median_seconds(lambda: jax.block_until_ready(kernels.project(0, rows)), repeats)
    tokens = np.zeros(num_tokens, np.int32)
    layers = min(2, config.num_layers)

    def recompute():
        sink = CollectingSink(layers)
        recompute_kv(kernels, tokens, layers, sink, recompute_chunk)
        sink.block()

    recompute_per_layer = _median_seconds(recompute, repeats) / layers
    return LayerCosts(num_tokens=num_tokens, io_hidden=io_hidden, project=project, io_kv=io_kv,
                      recompute=recompute_per_layer)
