"""Benchmark of HCache restore (issue 7): time to rebuild a history's KV (the TTFT share of a
restored session) for hidden / kv / recompute / planner, from host DRAM and from disk.

Models (random weights, bf16): a Llama-2-7B-shaped MHA model (32 layers, d 4096, 32 heads of 128,
MLP 11008) and a Llama-3-8B-shaped GQA model (8 KV heads, MLP 14336). Batch 1.

Per model: one real prefill of `--check-tokens` tokens gives each layer's hidden states and KV;
every method (and the planner's plan) is restored from them and checked against the prefill's KV
before anything is timed. Longer histories reuse those rows, tiled (timing does not depend on
values). Storage:
  dram  per layer, pinned host buffers (`memory_kind="pinned_host"`, GPU) in pieces of
        check-tokens rows, copied with one device_put per layer; NumPy arrays on CPU;
  disk  the library's chunk files (64-token chunks, all chunks of a layer contiguous) read with
        SessionFileSource (one sequential preadv per layer, crc32 verified); the page cache of
        every file is dropped with posix_fadvise(DONTNEED) after fsync before each read (no
        O_DIRECT), so reads come from the device.
The planner profiles per-layer costs (layer-0 transfer of hidden and KV, one projection; the
recompute cost per layer is the measured recompute restore / L), picks per layer a method, and
(confirm_plan) measures that plan against every single-method plan and keeps the fastest.
restore_ms: median wall time of restore_kv until every layer's K, V is on the device (and
restore_ms_min, the fastest run: on a shared machine the less noisy of the two).
Pipelines (`--pipelines reader,in_jit,...`, restore_kv's `pipeline`): every row has a `pipeline`;
the four methods run with "reader" (the default pipeline); at the `--pipeline-histories` of the
dram storage, "hidden" and "kv" also run with each other pipeline listed (rows method hidden/kv,
pipeline <name>, pipeline_used = what restore_kv reports, e.g. a logged fallback), timed in the
same interleaved rounds as the reader rows, and checked against the prefill first.

    PYTHONPATH=. python3 benchmarks/bench_hcache.py --out $OUT/hcache-h100.json      # GPU, < 5 min
    PYTHONPATH=. python3 benchmarks/bench_hcache.py --quick --out benchmarks/results/hcache-cpu2.json
    # pipelines compared in one GPU run (MHA 1K/4K/16K, GQA 4K, DRAM only):
    PYTHONPATH=. python3 benchmarks/bench_hcache.py --out $OUT/hcache-pipelines-h100.json \
        --histories 1024 4096 16384 --model-histories llama3-8b-gqa=4096 --disk-max-tokens 0 \
        --pipelines reader,upfront,in_jit,in_jit_lhs --pipeline-histories 1024 4096 16384
"""

from __future__ import annotations

import argparse
import gc
import os

# Two 7B/8B-sized models one after the other and long recompute temporaries: let XLA use most of
# the GPU (default 75%). Must be set before jax is imported.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
import logging
import shutil
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from rich.console import Console
from rich.progress import Progress

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import device_description, print_table, write_results  # noqa: E402
from jhybrid.hcache.planner import LayerCosts, confirm_plan, plan_restore  # noqa: E402
from jhybrid.hcache.restorer import (PIPELINES, CollectingSink, LayerKernels,  # noqa: E402
                                     SessionFileSource, bytes_per_token, restore_kv, to_device)
from jhybrid.hcache.saver import pinned_host_sharding  # noqa: E402
from jhybrid.hcache.storage import ChunkLayout, LayerAppender, drop_page_cache  # noqa: E402
from jhybrid.models import ModelConfig, create_model  # noqa: E402

console = Console(stderr=True)
METHODS = ("hidden", "kv", "recompute")


def model_configs(quick: bool) -> dict[str, ModelConfig]:
    if quick:
        common = dict(family="llama", vocab_size=1000, d_model=256, num_layers=4, head_dim=64,
                      mlp_dim=688, max_position_embeddings=8192, dtype="bfloat16")
        return {"mha-tiny": ModelConfig(num_heads=4, num_kv_heads=4, **common),
                "gqa-tiny": ModelConfig(num_heads=4, num_kv_heads=1, **common)}
    common = dict(family="llama", d_model=4096, num_layers=32, num_heads=32, head_dim=128,
                  max_position_embeddings=32768, norm_eps=1e-5, dtype="bfloat16")
    return {
        "llama2-7b-mha": ModelConfig(vocab_size=32000, num_kv_heads=32, mlp_dim=11008, **common),
        "llama3-8b-gqa": ModelConfig(vocab_size=128256, num_kv_heads=8, mlp_dim=14336,
                                     rope_theta=500000.0, **common),
    }


def build_model(config: ModelConfig):
    """Random bf16 weights (N(0, 0.02); norm scales 1, biases 0), created leaf by leaf from the
    abstract model so a 7B/8B model never exists in float32 (NNX creates float32 parameters)."""
    abstract = nnx.eval_shape(lambda: create_model(config, seed=0))
    graphdef, state = nnx.split(abstract)
    keys = iter(jax.random.split(jax.random.key(0), 100_000))

    def init(path, leaf):
        name = jax.tree_util.keystr(path)
        if "scale" in name:
            return jnp.ones(leaf.shape, jnp.bfloat16)
        if "bias" in name:
            return jnp.zeros(leaf.shape, jnp.bfloat16)
        return jax.random.normal(next(keys), leaf.shape, jnp.bfloat16) * jnp.bfloat16(0.02)

    state = jax.tree_util.tree_map_with_path(init, state)
    model = nnx.merge(graphdef, state)
    jax.block_until_ready(nnx.state(model))
    return model


def reference_prefill(model, tokens: np.ndarray):
    """One forward over tokens -> (hidden [L, n, d], kv rows [L, n, 2*Hkv*D]) as host arrays."""
    n = len(tokens)
    _, cache, hidden = model(jnp.asarray(tokens)[None], jnp.arange(n, dtype=jnp.int32)[None],
                             model.init_cache(1, n), return_hidden_states=True)
    kv = jnp.stack([jnp.stack([c["k"][0], c["v"][0]], axis=1).reshape(n, -1) for c in cache.layers])
    return np.asarray(hidden[:, 0]), np.asarray(kv)


def max_relative_error(sink: CollectingSink, kv_rows: np.ndarray) -> float:
    """Worst layer's ||restored - prefill|| / ||prefill|| over its K and V (float32)."""
    worst = 0.0
    for layer, (k, v) in enumerate(sink.layers):
        got = np.concatenate([np.asarray(k[0], np.float32), np.asarray(v[0], np.float32)], axis=1)
        want = kv_rows[layer].astype(np.float32).reshape(got.shape)
        worst = max(worst, float(np.linalg.norm(got - want) / (np.linalg.norm(want) + 1e-12)))
    return worst


class DramStore:
    """Per layer and method, the rows of n_max tokens as pieces of `piece` rows in (pinned) host
    memory; fetch(layer, method) moves the first n rows to the device (one device_put call)."""

    def __init__(self, hidden: np.ndarray, kv: np.ndarray, n_max: int, layers: int):
        device = jax.devices()[0]
        self.device, self.piece = device, hidden.shape[1]
        self.sharding = pinned_host_sharding(device)
        self.copy_path = ("pinned_host device_put" if self.sharding is not None
                          else "np.asarray / jnp.array copy (no pinned_host on this backend)")
        self.pieces = {}
        for method, rows in (("hidden", hidden), ("kv", kv)):
            per_layer = []
            for layer in range(layers):
                src = rows[layer % len(rows)]
                count = n_max // self.piece
                if self.sharding is not None:
                    per_layer.append([jax.device_put(src, self.sharding) for _ in range(count)])
                else:
                    per_layer.append([src.copy() for _ in range(count)])
            self.pieces[method] = per_layer
        jax.block_until_ready([p for m in self.pieces.values() for l in m for p in l
                               if isinstance(p, jax.Array)])
        self.num_tokens = n_max

    def fetch(self, layer: int, method: str):
        """-> the pieces on the device (a tuple): transfers only. Joining them here would
        dispatch a concatenate from the reader thread, which queues in the compute stream ahead of
        earlier layers' projections (restore_kv's docstring); restore_kv joins them in the jit."""
        pieces = self.pieces[method][layer][:self.num_tokens // self.piece]
        if self.sharding is None:
            return tuple(to_device(p) for p in pieces)
        return tuple(jax.device_put(pieces, jax.sharding.SingleDeviceSharding(self.device)))

    __call__ = fetch  # restore_kv's fetch is the store itself for the other pipelines

    def host_rows(self, layer: int, method: str):
        """-> the pieces still in host memory (pinned_host jax arrays on GPU, NumPy on CPU): the
        in_jit pipelines move them to the device inside their one program."""
        return tuple(self.pieces[method][layer][:self.num_tokens // self.piece])


class DiskStore:
    """The library's chunk files for every layer, hidden and kv, n_max tokens (tiled rows)."""

    def __init__(self, folder: str, hidden: np.ndarray, kv: np.ndarray, n_max: int, layers: int,
                 chunk_tokens: int = 64):
        self.layout = ChunkLayout(stripe_dirs=(folder,), chunk_tokens=chunk_tokens)
        self.manifests = {}
        self.files = []
        for method, rows in (("hidden", hidden), ("kv", kv)):
            sid = f"bench-{method}"
            crcs = []
            for layer in range(layers):
                src = rows[layer % len(rows)]
                appender = LayerAppender(self.layout, sid, layer, 0, src[:chunk_tokens].nbytes)
                crcs.append([appender.append(src[(c * chunk_tokens) % len(src):][:chunk_tokens])
                             for c in range(n_max // chunk_tokens)])
                appender.sync()
                appender.close()
                self.files.append(self.layout.layer_file(0, sid, layer))
            self.manifests[method] = {"session_id": sid, "methods": [method] * layers,
                                      "row_values": [rows.shape[-1]] * layers,
                                      "num_full_chunks": n_max // chunk_tokens, "chunk_crc": crcs,
                                      "num_tokens": n_max}
        self.dtype = hidden.dtype
        self.sources, self.num_tokens = {}, None

    def prepare(self, num_tokens: int) -> None:
        """Readers for num_tokens (host buffers allocated once and reused, as the engine does)
        and a cold page cache."""
        if num_tokens != self.num_tokens:
            self.num_tokens = num_tokens
            self.sources = {m: SessionFileSource(self.layout, man, num_tokens, self.dtype)
                            for m, man in self.manifests.items()}
        for path in self.files:
            drop_page_cache(path)

    def fetch(self, layer: int, method: str) -> jax.Array:
        return self.sources[method](layer, method)


def filesystem_of(path: str) -> str:
    """'ext4 /dev/nvme0n1p1 on /' for the mount holding path (from /proc/mounts), or 'unknown'."""
    path, best = os.path.realpath(path), None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                device, mount, fstype = line.split()[:3]
                if path == mount or path.startswith(mount.rstrip("/") + "/"):
                    if best is None or len(mount) > len(best[1]):
                        best = (device, mount, fstype)
    except OSError:
        return "unknown"
    return "unknown" if best is None else f"{best[2]} {best[0]} on {best[1]}"


def model_histories(args, name: str) -> list[int]:
    """--histories, or this model's --model-histories override."""
    return args.model_histories.get(name, args.histories)


def median_seconds(fn, prepare, repeats: int = 3) -> float:
    prepare()
    fn()
    samples = []
    for _ in range(repeats):
        prepare()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def bench_model(name, config, args, rows, checks, progress, deadline):
    console.log(f"[bold]{name}[/]: building random bf16 weights")
    model = build_model(config)
    kernels = LayerKernels(model)
    L = config.num_layers
    rng = np.random.default_rng(0)
    tokens_check = rng.integers(0, config.vocab_size, args.check_tokens).astype(np.int32)
    hidden, kv = reference_prefill(model, tokens_check)
    itemsize = hidden.dtype.itemsize
    histories = [n for n in model_histories(args, name) if n % args.check_tokens == 0]
    extra_pipelines = [p for p in args.pipelines if p != "reader"]
    n_max = max(histories)
    stores: dict = {}
    console.log(f"{name}: filling DRAM store ({n_max} tokens)")
    stores["dram"] = DramStore(hidden, kv, n_max, L)
    os.makedirs(args.disk_dir, exist_ok=True)
    disk_dir = tempfile.mkdtemp(prefix="hcache-bench-", dir=args.disk_dir)
    try:
        args.disk_filesystem = filesystem_of(disk_dir)
        if args.disk_filesystem.split()[0] in ("tmpfs", "ramfs", "overlay", "unknown"):
            console.log(f"[yellow]disk rows: {disk_dir} is on {args.disk_filesystem}; page-cache "
                        "drops may not reach a real device there (pass --disk-dir on a disk)")
        disk_histories = [n for n in histories if n <= args.disk_max_tokens]
        if disk_histories:
            console.log(f"{name}: writing chunk files ({max(disk_histories)} tokens) to {disk_dir}")
            stores["disk"] = DiskStore(disk_dir, hidden, kv, max(disk_histories), L)
        # Correctness first: every method and a mixed plan against the prefill's KV.
        n = args.check_tokens
        for storage_name, store in stores.items():
            prepare = (lambda s=store: s.prepare(n)) if storage_name == "disk" else \
                (lambda s=store: setattr(s, "num_tokens", n))
            mixed = ("recompute",) * (L // 4) + ("hidden",) * (L // 2) + ("kv",) * (L - L // 4 - L // 2)
            for methods in [(m,) * L for m in METHODS] + [mixed]:
                prepare()
                sink = CollectingSink(L)
                restore_kv(kernels, methods, tokens_check, store.fetch, sink, args.recompute_chunk)
                sink.block()
                err = max_relative_error(sink, kv)
                label = methods[0] if len(set(methods)) == 1 else "mixed"
                # Recomputed layers run in other XLA fusions than the eager reference prefill;
                # bf16 rounding then drifts through the layers (~1.3e-2 after 32 layers on CPU).
                tolerance = args.tolerance * (5 if "recompute" in methods else 1)
                if err > tolerance:
                    raise SystemExit(f"{name} {storage_name} {label}: restored KV differs from the "
                                     f"prefill's (relative error {err:.3g} > {tolerance})")
                checks.append({"model": name, "storage": storage_name, "method": label,
                               "pipeline": "reader", "history_tokens": n, "relative_error": err,
                               "tolerance": tolerance})
                console.log(f"{name} {storage_name} {label}: restored KV matches the prefill "
                            f"(relative error {err:.2g} <= {tolerance})")
            if storage_name != "dram":
                continue
            for pipeline in extra_pipelines:
                for method in ("hidden", "kv"):
                    prepare()
                    sink = CollectingSink(L)
                    used = restore_kv(kernels, (method,) * L, tokens_check, store, sink,
                                      args.recompute_chunk, pipeline=pipeline)
                    sink.block()
                    err = max_relative_error(sink, kv)
                    if err > args.tolerance:
                        raise SystemExit(f"{name} {storage_name} {method} ({pipeline}): restored KV "
                                         f"differs from the prefill's ({err:.3g} > {args.tolerance})")
                    checks.append({"model": name, "storage": storage_name, "method": method,
                                   "pipeline": pipeline, "pipeline_used": used, "history_tokens": n,
                                   "relative_error": err, "tolerance": args.tolerance})
                    console.log(f"{name} {storage_name} {method} ({pipeline} -> {used}): restored "
                                f"KV matches the prefill (relative error {err:.2g})")
        # Every other history first (1K, 4K, 16K; disk 1K, 4K), then the ones between: when the
        # time budget runs out, what is skipped are the fill-ins, not a whole storage.
        points = ([("dram", n) for n in histories[::2]] + [("disk", n) for n in disk_histories[::2]]
                  + [("dram", n) for n in histories[1::2]] + [("disk", n) for n in disk_histories[1::2]])
        for storage_name, n in points:
            tokens = np.resize(tokens_check, n)
            store = stores[storage_name]
            if time.monotonic() > deadline:
                console.log(f"[yellow]time budget spent: skipping {name} {storage_name} n={n}")
                continue
            if storage_name == "disk":
                prepare = lambda s=store, n=n: s.prepare(n)  # noqa: E731
            else:
                prepare = lambda s=store, n=n: setattr(s, "num_tokens", n)  # noqa: E731
            # One untimed run of each single method (compilation, and the recompute cost the
            # planner needs), then the planner's plan, then all four timed in interleaved rounds
            # so that machine noise hits them alike.
            def run(methods, pipeline="reader"):
                sink = CollectingSink(L)
                # the store itself: fetch(layer, method) and, for the in_jit pipelines, host_rows
                fetch = store if pipeline != "reader" else store.fetch
                used = restore_kv(kernels, methods, tokens, fetch, sink, args.recompute_chunk,
                                  pipeline=pipeline)
                sink.block()
                return used

            plans = {m: (m,) * L for m in METHODS}
            warm = {}
            for method, methods in plans.items():
                prepare()
                start = time.perf_counter()
                run(methods)
                warm[method] = time.perf_counter() - start
            prepare()
            rows_hidden = store.fetch(0, "hidden")
            costs = LayerCosts(
                num_tokens=n,
                io_hidden=median_seconds(lambda: jax.block_until_ready(store.fetch(0, "hidden")), prepare),
                io_kv=median_seconds(lambda: jax.block_until_ready(store.fetch(0, "kv")), prepare),
                project=median_seconds(
                    lambda: jax.block_until_ready(kernels.project(0, rows_hidden)), lambda: None),
                recompute=warm["recompute"] / L)
            plan = plan_restore(costs, L)
            prepare()
            run(plan.methods)  # compile what the plan needs

            def measure(methods):
                prepare()
                start = time.perf_counter()
                run(methods)
                return time.perf_counter() - start

            plan = confirm_plan(plan, measure, repeats=2, skip_estimated_slower=args.confirm_skip)
            # Overlap diagnosis of the hidden path: all layers' transfers alone, all projections
            # alone (rows already on the device); restore ~ max of the two when they overlap,
            # ~ their sum when they serialise.
            prepare()
            start = time.perf_counter()
            jax.block_until_ready([store.fetch(l, "hidden") for l in range(L)])
            io_only = time.perf_counter() - start
            resident = [rows_hidden] * L
            jax.block_until_ready([kernels.project(l, resident[l]) for l in range(L)])
            start = time.perf_counter()
            jax.block_until_ready([kernels.project(l, resident[l]) for l in range(L)])
            project_only = time.perf_counter() - start
            plans["planner"] = plan.methods
            # The other pipelines (dram, --pipeline-histories): "hidden@in_jit" etc., one untimed
            # run each (compilation; records what restore_kv used), then timed with the rest.
            pipeline_of = {m: "reader" for m in plans}
            used_of = {m: "reader" for m in plans}
            if storage_name == "dram" and n in args.pipeline_histories:
                for pipeline in extra_pipelines:
                    for method in ("hidden", "kv"):
                        label = f"{method}@{pipeline}"
                        plans[label], pipeline_of[label] = (method,) * L, pipeline
                        prepare()
                        used_of[label] = run(plans[label], pipeline)
            repeats = args.disk_repeats if storage_name == "disk" else args.repeats
            samples = {m: [] for m in plans}
            order = list(plans)
            for round_index in range(repeats):
                # Rotate the order each round: what ran just before a method (e.g. recompute's
                # large temporaries being freed) must not always hit the same method.
                shift = round_index % len(order)
                for method in order[shift:] + order[:shift]:
                    methods = plans[method]
                    if method == "recompute" and len(samples[method]) >= max(1, repeats - 1):
                        continue  # the slowest by far: one run fewer
                    prepare()
                    gc.collect()
                    start = time.perf_counter()
                    run(methods, pipeline_of[method])
                    samples[method].append((time.perf_counter() - start) * 1e3)
            measured = {m: statistics.median(v) for m, v in samples.items()}
            best = min(measured[m] for m in METHODS)
            best_min = min(min(samples[m]) for m in METHODS)
            for label, methods in plans.items():
                method, pipeline = label.split("@")[0], pipeline_of[label]
                suffix = "" if pipeline == "reader" else f"@{pipeline}"
                row = {"model": name, "history_tokens": n, "method": method,
                       "pipeline": pipeline, "storage": storage_name,
                       "restore_ms": round(measured[label], 3),
                       "restore_ms_min": round(min(samples[label]), 3),
                       "bytes_per_token": bytes_per_token(config, methods, itemsize)}
                if pipeline != "reader":
                    row["pipeline_used"] = used_of[label]
                    row["vs_reader"] = round(measured[method] / measured[label], 3)
                if method == "hidden":
                    hidden_ms = measured[label]
                    row["kv_over_hidden"] = round(measured["kv" + suffix] / hidden_ms, 3)
                    # the target: hidden restore vs the plain KV restore, reader pipeline
                    row["kv_reader_over_hidden"] = round(measured["kv"] / hidden_ms, 3)
                    row["kv_reader_over_hidden_min"] = round(min(samples["kv"]) / min(samples[label]), 3)
                    if pipeline == "reader":
                        row["recompute_over_hidden"] = round(measured["recompute"] / hidden_ms, 3)
                    row["io_only_ms"] = round(io_only * 1e3, 3)
                    row["project_only_ms"] = round(project_only * 1e3, 3)
                    # 1 = transfer and projection fully overlapped, 0 = serialised
                    row["overlap"] = round((io_only + project_only - hidden_ms / 1e3)
                                           / max(1e-9, min(io_only, project_only)), 3)
                if method == "planner":
                    row["plan"] = plan.describe()
                    row["estimated_ms"] = round(plan.estimated_seconds * 1e3, 3)
                    row["vs_best_single"] = round(measured["planner"] / best, 3)
                    row["vs_best_single_min"] = round(min(samples["planner"]) / best_min, 3)
                    # never slower than the best single method, up to 5% noise (median or min)
                    row["planner_ok"] = bool(min(row["vs_best_single"], row["vs_best_single_min"]) <= 1.05)
                rows.append(row)
                progress.advance(progress.task_ids[0])
            console.log(f"{name} {storage_name} n={n}: " + ", ".join(
                f"{m} {t:.1f} ms" for m, t in measured.items()))
            for label, used in used_of.items():
                if used != pipeline_of[label]:
                    console.log(f"[yellow]{name} n={n} {label}: restore_kv used {used}")
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)
        try:
            os.rmdir(args.disk_dir)  # only if empty
        except OSError:
            pass
        copy_path = stores["dram"].copy_path if "dram" in stores else None
        del stores, model, kernels
        gc.collect()
    return copy_path


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/hcache-<tag>.json)")
    p.add_argument("--quick", action="store_true", help="tiny shapes for a CPU machine")
    p.add_argument("--histories", type=int, nargs="+", default=None,
                   help="history lengths (multiples of --check-tokens)")
    p.add_argument("--check-tokens", type=int, default=None, help="real prefill length (and DRAM piece)")
    p.add_argument("--disk-max-tokens", type=int, default=None, help="disk rows up to this history")
    p.add_argument("--disk-dir", default=".hcache-bench",
                   help="folder for the chunk files (default ./.hcache-bench, removed afterwards; "
                        "its filesystem is recorded)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per point (default 4; 8 with --quick)")
    p.add_argument("--disk-repeats", type=int, default=None, help="timed runs per disk point (default 2; 8 with --quick)")
    p.add_argument("--recompute-chunk", type=int, default=None, help="tokens per recompute chunk")
    p.add_argument("--tolerance", type=float, default=1e-2,
                   help="max relative KV error (Frobenius, per layer) of hidden/kv; x5 with recompute")
    p.add_argument("--time-budget", type=float, default=210.0, help="seconds; later points are skipped")
    p.add_argument("--models", nargs="+", default=None)
    p.add_argument("--model-histories", nargs="+", default=[], metavar="MODEL=N,N",
                   help="per-model history lengths replacing --histories, e.g. llama3-8b-gqa=4096")
    p.add_argument("--pipelines", default="reader",
                   help=f"comma-separated restore_kv pipelines to compare ({', '.join(PIPELINES)}); "
                        "reader always runs (all methods); the others add hidden and kv rows on "
                        "dram at --pipeline-histories")
    p.add_argument("--pipeline-histories", type=int, nargs="+", default=None,
                   help="histories where the other pipelines run (default 4096 16384; every "
                        "history with --quick)")
    p.add_argument("--confirm-skip", type=float, default=4.0,
                   help="confirm_plan does not measure a single method estimated this many times "
                        "slower than the plan (recompute at 16K: seconds per run)")
    args = p.parse_args()
    args.pipelines = ["reader"] + [q for q in dict.fromkeys(x.strip() for x in
                                                            args.pipelines.split(","))
                                   if q and q != "reader"]
    bad = [q for q in args.pipelines if q not in PIPELINES]
    if bad:
        p.error(f"unknown pipelines {bad} (known: {', '.join(PIPELINES)})")
    overrides = {}
    for item in args.model_histories:
        model_name, _, lengths = item.partition("=")
        if not lengths:
            p.error(f"--model-histories takes MODEL=N,N,...; got {item!r}")
        overrides[model_name] = [int(x) for x in lengths.split(",") if x]
    args.model_histories = overrides
    if args.quick:
        args.histories = args.histories or [256, 512, 1024]
        args.check_tokens = args.check_tokens or 256
        args.disk_max_tokens = 1024 if args.disk_max_tokens is None else args.disk_max_tokens
        args.recompute_chunk = args.recompute_chunk or 256
        args.repeats = args.repeats or 8
        args.disk_repeats = args.disk_repeats or 8
    else:
        args.histories = args.histories or [1024, 2048, 4096, 8192, 16384]
        args.check_tokens = args.check_tokens or 1024
        args.disk_max_tokens = 4096 if args.disk_max_tokens is None else args.disk_max_tokens
        args.recompute_chunk = args.recompute_chunk or 2048
        args.repeats = args.repeats or 4
        args.disk_repeats = args.disk_repeats or 2
    if args.pipeline_histories is None:
        args.pipeline_histories = list(args.histories) if args.quick else [4096, 16384]
    logging.basicConfig(level=logging.WARNING)
    configs = model_configs(args.quick)
    if args.models:
        configs = {k: v for k, v in configs.items() if k in args.models}
    start = time.monotonic()
    deadline = start + args.time_budget
    rows: list[dict] = []
    checks: list[dict] = []
    unknown = set(args.model_histories) - set(configs)
    if unknown:
        p.error(f"--model-histories for unknown models {sorted(unknown)} (models: {list(configs)})")
    # budget weights: the tokens restored per model (the long histories dominate the time)
    points = {name: sum(model_histories(args, name)) for name in configs}
    total = sum(len(model_histories(args, name)) * 4 * 2 for name in configs)
    copy_path = None
    with Progress(console=console, transient=True) as progress:
        progress.add_task("restores", total=total)
        names = list(configs)
        for i, (name, config) in enumerate(configs.items()):
            # Each model gets a share of what is left of the budget in proportion to its tokens.
            left = sum(points[m] for m in names[i:])
            share = (deadline - time.monotonic()) * points[name] / max(1, left)
            copy_path = bench_model(name, config, args, rows, checks, progress,
                                    time.monotonic() + share)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   "hcache-" + ("cpu" if args.quick else "gpu") + ".json")
    config = {
        "models": {k: {f: getattr(v, f) for f in ("d_model", "num_layers", "num_heads",
                                                  "num_kv_heads", "head_dim", "mlp_dim", "dtype")}
                   for k, v in configs.items()},
        "batch": 1, "histories": args.histories, "model_histories": args.model_histories,
        "check_tokens": args.check_tokens,
        "pipelines": args.pipelines, "pipeline_histories": args.pipeline_histories,
        "pipeline_storage": "dram only (the disk source has no host_rows: in_jit would fall back)",
        "disk_max_tokens": args.disk_max_tokens, "repeats": args.repeats,
        "disk_repeats": args.disk_repeats,
        "recompute_chunk": args.recompute_chunk, "chunk_tokens": 64,
        "dram_copy_path": copy_path,
        "disk_dir": os.path.abspath(args.disk_dir),
        "disk_filesystem": getattr(args, "disk_filesystem", None),
        "disk_cache_policy": "fsync + posix_fadvise(DONTNEED) on every file before each read; no O_DIRECT",
        "disk_checksums": "crc32 of every 64-token chunk verified on read (8-thread pool)",
        "restore_end": "every layer's K, V [1, n, Hkv, D] on the device (CollectingSink, blocked)",
        "recompute": "chunked prefill of all layers (full backend, plain-jnp attention)",
        "planner": "profiled per point: layer-0 hidden/KV transfer, one projection; recompute per "
                   "layer = measured recompute restore / L; plan_restore, then confirm_plan "
                   "(2 interleaved runs vs every single-method plan estimated within "
                   f"{args.confirm_skip}x of the plan)",
        "overlap": "hidden rows: io_only_ms = every layer's transfer alone, project_only_ms = every "
                   "projection alone (rows resident); overlap = (io + project - restore) / min(io, "
                   "project): 1 fully overlapped, 0 serialised",
        "correctness": checks,
        "elapsed_s": round(time.monotonic() - start, 1),
    }
    order = {m: i for i, m in enumerate(METHODS + ("planner",))}
    rows.sort(key=lambda r: (list(configs).index(r["model"]), r["storage"] != "dram",
                             r["history_tokens"], args.pipelines.index(r["pipeline"]),
                             order[r["method"]]))
    write_results(out, "hcache-restore", config, rows)
    console.log(f"wrote {out} ({device_description()}, {config['elapsed_s']} s)")
    print_table(rows, ["model", "history_tokens", "storage", "pipeline", "method", "restore_ms",
                       "restore_ms_min", "bytes_per_token", "kv_over_hidden", "kv_reader_over_hidden",
                       "vs_reader", "recompute_over_hidden", "overlap", "plan", "vs_best_single",
                       "vs_best_single_min", "planner_ok", "pipeline_used"])


if __name__ == "__main__":
    main()
