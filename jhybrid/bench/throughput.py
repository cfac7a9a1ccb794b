"""Throughput task: decode speed, time between tokens, time to first token, memory, per mode.

Two ways to get a context (benchmark.fill):
  prefill    `batch` random prompts of `context` tokens through a real chunked prefill (Generator),
             then `decode_tokens` greedy steps: measures time to first token (ttft_s) and decode.
  synthetic  the context is written directly as random KV (jhybrid.bench.synthetic): long contexts
             in seconds, no ttft. `warmup_steps` untimed decode steps, then `decode_tokens` timed.

Before anything is allocated, the point's device and host bytes are predicted
(jhybrid.bench.budget.point_memory). For `full` with a synthetic fill the decode step's transient
device bytes come from XLA itself: the step is compiled from ShapeDtypeStructs (nothing allocated)
and `memory_analysis()` gives its temp bytes, fitted over batches and, for 'max', confirmed by
compiling at the max (fits) and max + 1 (does not); the run reuses the compile of its batch. Other
modes (whose steps carry host-runtime state) and prediction-only points keep the arithmetic
estimate; each row says which (pred_temp_source: xla / arithmetic, pred_step_temp_bytes,
pred_max_batch_checked: the max confirmed by compiles). A point predicted not to fit is skipped with the reason
(unless benchmark.run_over_capacity), and an out-of-memory error during a run is recorded the
same way. benchmark.batch 'max' / 'max+1' resolve to the predicted largest batch / the one after.

Row keys: task, model, layers, mode, fill, batch, batch_spec, context, window, decode_tok_s,
tbt_p50_ms, tbt_p99_ms, tbt_mean_ms, steps, ttft_s, compile_s, fill_s, device_in_use_bytes
(after the last step, cache alive), device_peak_bytes (peak of the whole process so far: JAX has
no per-point reset), host_rss_bytes (after the last step), host_rss_peak_bytes (process peak so far),
host_kv_bytes, the per-step breakdown (between_steps_ms: the runtime's work before each step,
eviction / recall uploads / scout's block recall; callback_ms: time inside host callbacks, the GPU
stalled; compute_ms: the rest of the step = GPU compute + dispatch; plus cpu_attn_ms, wait_ms,
evict_ms, recall_ms, transfer_ms from the runtime's counters) and the prediction (pred_*,
predict_s: its seconds, compiles for XLA's account included). Times exclude compilation (compile_s
apart: the compile of the timed step, wherever it was made).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import resource
import time

import jax
import jax.numpy as jnp
import numpy as np

from jhybrid.bench import synthetic
from jhybrid.bench.budget import PointMemory, human_bytes, point_memory
from jhybrid.bench.offload import PointSkipped, backend_for, resolve
from jhybrid.bench.progress import PointProgress, report_phase
from jhybrid.hybrid.modes.base import Workload
from jhybrid.hybrid.registry import mode_class

log = logging.getLogger(__name__)

GIB = 2**30
_HOST_CONTEXT: dict = {}  # the one synthetic.HostContext kept for reuse (key -> context)


def device_memory() -> dict:
    """memory_stats() of the first device ({} where the platform does not report them, e.g. CPU)."""
    return jax.devices()[0].memory_stats() or {}


def host_memory_bytes() -> int:
    """Physical memory, or the cgroup's memory limit where a container sets a smaller one."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def host_available_bytes() -> int | None:
    """Memory the kernel can still give this process (Linux MemAvailable), None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


HOST_HEADROOM = 2 * GIB  # kept free when a host context is allocated (the process's other growth)


def check_host_available(needed: int, released: int) -> None:
    """PointSkipped when the host cannot give `needed` bytes now (counting the `released` bytes the
    previous host context frees first): a clear row instead of the kernel's OOM killer."""
    available = host_available_bytes()
    if available is None:
        return
    if needed + HOST_HEADROOM > available + released:
        raise PointSkipped(f"host memory: the host context needs {human_bytes(needed)} (+ "
                           f"{human_bytes(HOST_HEADROOM)} headroom); {human_bytes(available)} available now "
                           f"+ {human_bytes(released)} the previous context frees")


def host_rss_bytes() -> int | None:
    """Current resident set size of this process (Linux /proc), None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def host_rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def params_bytes(model) -> int:
    from flax import nnx

    _, params = nnx.split(model)
    return int(sum(x.nbytes for x in jax.tree_util.tree_leaves(params)))


def is_oom(error: Exception) -> bool:
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower() or isinstance(error, MemoryError)


def max_len_for(bench) -> int:
    """Cache tokens per sequence: the context, the decode steps and one spare, rounded up to 64."""
    warmup = bench.warmup_steps if bench.fill != "prefill" else 2
    return -(-(bench.context + warmup + bench.decode_tokens + 1) // 64) * 64


def decode_step(model, backend):
    """(decode(params, tokens [B], positions [B], cache) -> (tokens, cache), params): the step the
    synthetic fill times, jitted with the cache donated."""
    from flax import nnx

    graphdef, params = nnx.split(model)

    def decode(params, tokens, positions, cache):
        logits, cache = nnx.merge(graphdef, params)(tokens[:, None], positions[:, None], cache, backend)
        return jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32), cache

    return jax.jit(decode, donate_argnums=(3,)), params


def compile_step(model, backend, batch: int, max_len: int):
    """The decode step compiled for [batch] tokens over a cache of max_len, from shapes only
    (ShapeDtypeStructs: nothing is allocated). Its memory_analysis() is XLA's own account."""
    step, params = decode_step(model, backend)
    spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
    cache = jax.eval_shape(lambda: model.init_cache(batch, max_len, backend))
    tokens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    return step.lower(jax.tree_util.tree_map(spec, params), tokens, tokens, cache).compile()


def step_temp_bytes(compiled) -> int:
    """Transient device bytes of a compiled step: XLA's temp buffer plus outputs it cannot alias
    to donated inputs."""
    m = compiled.memory_analysis()
    return int(m.temp_size_in_bytes + max(0, m.output_size_in_bytes - m.alias_size_in_bytes))


# (id(model), mode, context, max_len, device limit) -> {batch: temp bytes}: compiled steps' temps,
# shared by the 'max' and 'max+1' points of one shape.
_XLA_TEMPS: dict = {}
XLA_MAX_COMPILES = 6  # compiles one max-batch search may spend (each a few seconds on the GPU)


def xla_predicts(point) -> bool:
    """XLA, not arithmetic, predicts the step's transient bytes for run points of a mode that keeps
    every token on the device (`full`; the device-bound modes) with a synthetic fill (the offloading
    modes' steps hold host-runtime state and keep the arithmetic estimate, as do prediction-only
    points, which have no model)."""
    return not mode_class(point.offload.mode).offloads and point.benchmark.fill != "prefill"


def xla_memory(model, point, backend, memory: PointMemory, batch_spec, compile_fn=None) -> PointMemory:
    """The prediction with the step's transient bytes from XLA: temp(b) = fixed + b x per sequence,
    fitted through the compiled step at the arithmetic max batch and at half of it; for 'max' / 'max+1'
    the largest batch is then confirmed by compiling at it (fits) and at the one after (does not).
    Returns the prediction at the resolved batch with XLA's temp measured there; its `compiled`
    attribute is that batch's compiled step when this call compiled it (the run reuses it)."""
    compile_fn = compile_fn or (lambda b: compile_step(model, backend, b, memory.max_len))
    key = (id(model), point.offload.mode, point.benchmark.context, memory.max_len, memory.device_limit)
    temps = _XLA_TEMPS.setdefault(key, {})
    compiled: dict = {}
    seconds: dict = {}

    def temp(b: int) -> int:
        if b not in temps:
            start = time.perf_counter()
            compiled[b] = compile_fn(b)
            seconds[b] = time.perf_counter() - start
            temps[b] = step_temp_bytes(compiled[b])
        return temps[b]

    def fits(b: int) -> bool:
        if memory.device_limit is None:
            return True
        return memory.device_fixed + b * memory.device_cache_per_seq + temp(b) <= memory.device_limit

    guess = max(2, memory.max_batch_device or 2)
    low = guess // 2 if guess >= 4 else 1  # (batch 1 may take another formulation: fit above it)
    per_seq = max(0, -(-(temp(guess) - temp(low)) // (guess - low)))
    fixed = max(0, temp(low) - low * per_seq)
    fitted = dataclasses.replace(memory, temp_source="xla", device_activations_per_seq=per_seq,
                                 step_temp_fixed=fixed)
    checked = None
    if not isinstance(batch_spec, int) and memory.device_limit is not None:
        b = max(1, fitted.max_batch_device or 0)
        spent = 0
        while spent < XLA_MAX_COMPILES:  # walk to the largest b that fits with b + 1 not fitting
            spent += int(b not in temps) + int(b + 1 not in temps)
            if not fits(b):
                if b == 1:
                    b = 0
                    break
                b -= 1
            elif fits(b + 1):
                b += 1
            else:
                break
        else:
            log.warning("max batch search: %d compiles spent; %d from the linear fit", XLA_MAX_COMPILES, b)
        checked = b
    fitted = dataclasses.replace(fitted, max_batch_device_checked=checked)
    if isinstance(batch_spec, int):
        batch = batch_spec
    else:
        if fitted.max_batch is None or fitted.max_batch < 1:
            return fitted
        batch = fitted.max_batch + (1 if batch_spec == "max+1" else 0)
    return dataclasses.replace(fitted, batch=batch, step_temp_measured=temp(batch), compiled=compiled.get(batch),
                               compile_seconds=seconds.get(batch))


def workload_of(bench) -> Workload:
    """The attention statistics a point assumes (benchmark.hgca_keep, benchmark.selection_overlap)."""
    return Workload(kept_share=bench.hgca_keep, resident_share=bench.selection_overlap)


def predict(model_config, point, batch: int, weights: int) -> PointMemory:
    """The point's memory prediction at `batch` (jhybrid.bench.budget.point_memory)."""
    bench, tp = point.benchmark, point.parallel.tp
    limit = bench.device_memory_gib * GIB if bench.device_memory_gib else device_memory().get("bytes_limit")
    host = bench.host_memory_gib * GIB if bench.host_memory_gib else host_memory_bytes()
    # Over tp devices the weights and the KV heads split evenly: the whole model against tp devices'
    # memory and reserves is the per-device check (as `jhybrid budget --tp`).
    return point_memory(model_config, resolve(point.offload, bench.context), batch, bench.context,
                        max_len_for(bench), weights=weights,
                        device_limit=None if limit is None else int(limit) * tp,
                        host_limit=int(host), device_reserve=int(bench.device_reserve_gib * GIB) * tp,
                        host_reserve=int(bench.host_reserve_gib * GIB), workload=workload_of(bench))


def resolve_batch(model_config, point, weights, model=None, backend=None) -> tuple[int, object]:
    """(batch, prediction) for the point; 'max' / 'max+1' from the prediction at batch 1. With a
    model and its backend and xla_predicts(point), the step's transient bytes come from XLA
    (xla_memory)."""
    spec = point.benchmark.batch
    if backend is not None and xla_predicts(point):
        memory = xla_memory(model, point, backend, predict(model_config, point, 1, weights), spec)
        if isinstance(spec, int):
            return spec, memory
        probe = memory
    elif isinstance(spec, int):
        return spec, predict(model_config, point, spec, weights)
    else:
        probe = predict(model_config, point, 1, weights)
    if probe.max_batch is None:
        raise PointSkipped(f"batch {spec!r}: neither the device nor the host reports a memory limit "
                           "(set benchmark.device_memory_gib / host_memory_gib)", **probe.fields())
    if probe.max_batch < 1:
        raise PointSkipped(f"batch {spec!r}: not even one sequence fits: {probe.over_capacity()}",
                           **probe.fields())
    batch = probe.max_batch + (1 if spec == "max+1" else 0)
    if probe.temp_source == "xla":
        return batch, probe
    return batch, predict(model_config, point, batch, weights)


PREDICTION_ONLY = "prediction only, not run"


def predict_throughput(point) -> list[dict]:
    """benchmark.predict_only: the point's prediction as a row, without a model (PointSkipped with
    reason 'prediction only, not run: <fits / over capacity ...>' and the prediction fields)."""
    from jhybrid.bench.budget import weight_bytes
    from jhybrid.bench.shapes import spec_config

    bench, offload = point.benchmark, point.offload
    config = spec_config(point.model)
    resolved = resolve(offload, bench.context)
    window = resolved.window_tokens if mode_class(offload.mode).offloads else None
    weights = weight_bytes(config)
    batch, memory = resolve_batch(config, point, weights)
    verdict = memory.over_capacity() or "predicted to fit"
    raise PointSkipped(f"{PREDICTION_ONLY}: {verdict}", task="throughput", model=point.model.name,
                       layers=config.num_layers, mode=offload.mode, fill=bench.fill, batch_spec=str(bench.batch),
                       context=bench.context, batch=batch, window=window, weight_bytes=weights, **memory.fields())


def run_throughput(model, pretrained, point, on_step: PointProgress | None = None, deadline=None) -> list[dict]:
    bench, offload = point.benchmark, point.offload
    base = {"task": "throughput", "model": point.model.name, "layers": model.config.num_layers,
            "tp": point.parallel.tp, "mode": offload.mode, "fill": bench.fill, "batch_spec": str(bench.batch),
            "context": bench.context, "host_kv_dtype": offload.host_kv_dtype or "model"}
    balanced = bench.split == "balanced" and mode_class(offload.mode).offloads
    if balanced:  # the split chooses the mode's budget
        offload = dataclasses.replace(offload, budget=None)
        point = dataclasses.replace(point, offload=offload)
    backend, window = backend_for(offload, bench.context)
    weights = params_bytes(model)
    start = time.perf_counter()
    report_phase(on_step, f"predicting memory at batch {bench.batch} (compiles the step from shapes)")
    batch, memory = resolve_batch(model.config, point, weights, model, backend)
    split = {}
    # The balanced split sizes its own window: a point the fixed ratio does not fit (too little host for
    # its offloaded part, say) may fit with it; _balanced_point skips the point when nothing fits.
    if balanced:
        report_phase(on_step, "balanced split: measuring the machine, sizing the window")
        point, split = _balanced_point(model, point, batch, weights)
        offload = point.offload
        backend, window = backend_for(offload, bench.context)
        memory = predict(model.config, point, batch, weights)
    predict_s = time.perf_counter() - start
    base.update(batch=batch, window=window, gpu_ratio=offload.gpu_ratio if window else None, **backend.row_fields(),
                **split, weight_bytes=weights, **memory.fields(), predict_s=round(predict_s, 2))
    reason = memory.over_capacity()
    if reason and not bench.run_over_capacity:
        raise PointSkipped(reason, **base)
    try:
        if bench.fill != "prefill":
            row = _run_synthetic(model, point, backend, batch, window, on_step, deadline, memory)
        else:
            row = _run_prefill(model, point, backend, batch, on_step)
    except PointSkipped as skip:
        skip.fields = {**base, **skip.fields}
        raise
    except Exception as error:  # noqa: BLE001 - an out-of-memory point is recorded, others re-raised
        if is_oom(error):
            gc.collect()
            predicted = f" (predicted: {reason})" if reason else " (predicted to fit)"
            stats = device_memory()  # where the allocator stood: fragmentation shows as a small
            state = "".join(f", {label} {human_bytes(stats[key])}" for label, key in  # largest block
                            (("device in use", "bytes_in_use"), ("largest free block", "largest_free_block_bytes"))
                            if stats.get(key) is not None)
            raise PointSkipped(f"out of memory{predicted}: {type(error).__name__}: "
                               f"{str(error).splitlines()[0][:300]}{state}", **base) from None
        raise
    finally:
        _release(backend)
    return [{**base, **row}]


def _balanced_point(model, point, batch: int, weights: int):
    """The point with its window / budget / pool from the balanced split (jhybrid.hybrid.split):
    the window as large as the device allows at this batch, the CPU's share what the host attends
    in the GPU's time per layer (this machine's measured profile). -> (point, row fields)."""
    from jhybrid.bench.budget import parameter_count
    from jhybrid.hybrid.split import balanced_split, machine_profile

    config, bench = model.config, point.benchmark
    embeddings = config.vocab_size * config.d_model * (1 if config.tie_embeddings else 2)
    per_layer = (parameter_count(config) - embeddings) * weights // max(1, parameter_count(config)) // config.num_layers

    # The arithmetic misses some of XLA's transient buffers around a large window: keep 10 % of the
    # device free on top of the reserve (the first balanced runs at the limit went out of memory).
    limit = bench.device_memory_gib or (device_memory().get("bytes_limit") or 0) / GIB
    margin = dataclasses.replace(bench, device_reserve_gib=bench.device_reserve_gib + 0.1 * limit)

    def memory(offload):
        candidate = dataclasses.replace(point, offload=offload, benchmark=margin)
        return predict(config, candidate, batch, weights)

    try:
        offload, report = balanced_split(config, point.offload, batch, bench.context,
                                         lambda offload: memory(offload).fits_device,
                                         machine_profile(n_threads=point.offload.host_threads,
                                                         host_attention_gbps=bench.split_host_gbps), per_layer,
                                         workload=workload_of(bench),
                                         host_fits=lambda offload: memory(offload).fits_host)
    except ValueError as error:
        raise PointSkipped(str(error)) from None
    return dataclasses.replace(point, offload=offload), report.fields()


def _release(backend) -> None:
    """Close the point's host side (threads, recall mirror) now: compiled steps may outlive it."""
    backend.close()
    gc.collect()


def _memory_now(backend) -> dict:
    stats = device_memory()
    return {"device_in_use_bytes": stats.get("bytes_in_use"), "device_peak_bytes": stats.get("peak_bytes_in_use"),
            "host_rss_bytes": host_rss_bytes(), "host_rss_peak_bytes": host_rss_peak_bytes(),
            "host_kv_bytes": backend.host_bytes() or None}


def _times(seconds: list[float], batch: int) -> dict:
    ms = np.asarray(seconds) * 1e3
    return {"decode_tok_s": round(batch * len(ms) / (ms.sum() / 1e3), 2) if len(ms) else None,
            "tbt_p50_ms": round(float(np.percentile(ms, 50)), 3) if len(ms) else None,
            "tbt_p99_ms": round(float(np.percentile(ms, 99)), 3) if len(ms) else None,
            "tbt_mean_ms": round(float(ms.mean()), 3) if len(ms) else None, "steps": len(ms)}


# ---------------------------------------------------------------------------- synthetic context

def _host_context(model_config, offload, keep: float):
    shape = synthetic.host_shape(model_config, offload.block_size, offload.host_kv_dtype)
    key = (shape, offload.sink, keep)
    if key not in _HOST_CONTEXT:
        _HOST_CONTEXT.clear()  # one at a time: free the previous shape's store first
        gc.collect()
        _HOST_CONTEXT[key] = synthetic.HostContext(shape, offload.sink, keep)
    return _HOST_CONTEXT[key]


def _run_synthetic(model, point, backend, batch, window, on_step, deadline, memory) -> dict:
    from jhybrid.hybrid.window import evicted_blocks

    bench, offload = point.benchmark, point.offload
    max_len = max_len_for(bench)
    fill_start = time.perf_counter()
    if not mode_class(offload.mode).offloads:
        cache = synthetic.fill_device_cache(model, backend, batch, max_len, bench.context)
    else:
        host = _host_context(model.config, offload, bench.hgca_keep)
        e = int(evicted_blocks(np.int64(bench.context), backend.config))
        reusable = host.reusable_for(batch, e)
        if not reusable and deadline is not None:
            seconds = synthetic.predicted_fill_seconds(batch * memory.host_per_seq)
            left = deadline - time.perf_counter()
            if seconds is not None and seconds > left:
                raise PointSkipped(f"time budget: the host context ({human_bytes(batch * memory.host_per_seq)}) "
                                   f"would take ~{seconds:.0f} s to write at the rate measured so far; "
                                   f"{max(left, 0):.0f} s left")
        slack = -(-(max_len - bench.context) // offload.block_size) + 1
        if not reusable:
            held = host.store.bytes_reserved() if host.store is not None else 0
            held = min(held, host_rss_bytes() or held)  # reserved address space is not all resident
            check_host_available(batch * memory.host_per_seq, held)
            report_phase(on_step, f"writing the host context ({human_bytes(batch * memory.host_per_seq)})")
        host.prepare(batch, e, slack)
        backend.open(model.config, batch, max_len)
        cache = model.init_cache(batch, max_len, backend)
        overlap = bench.selection_overlap if bench.fill == "calibrated" else None
        cache = synthetic.load_hybrid_cache(cache, backend, host, batch, bench.context, overlap=overlap,
                                            drift=bench.selection_drift)
    jax.block_until_ready(cache)
    fill_s = time.perf_counter() - fill_start

    jitted, params = decode_step(model, backend)
    tokens = np.zeros(batch, np.int32)
    held = np.full(batch, bench.context, np.int32)
    start = time.perf_counter()
    step = memory.compiled  # compiled from shapes for the prediction: reused
    if step is None:
        report_phase(on_step, f"compiling the decode step (batch {batch})")
        step = jitted.lower(params, tokens, held, cache).compile()
        compile_s = time.perf_counter() - start
    else:
        compile_s = memory.compile_seconds
    step_s, hook_s = [], []
    overlaps, previous, selected_blocks = [], None, 0
    planned = bench.warmup_steps + bench.decode_tokens
    i = 0
    while i < planned:
        if i == bench.warmup_steps:
            backend.reset_counters()
            step_s, hook_s = [], []
            if deadline is not None and i > 0:  # fewer timed steps where the budget is short
                last = max(time.perf_counter() - t0, 1e-6)
                fit = int((deadline - time.perf_counter()) / last)
                planned = i + max(3, min(bench.decode_tokens, fit))
        t0 = time.perf_counter()
        cache = backend.before_step(cache, held[:, None])
        t1 = time.perf_counter()
        tokens, cache = step(params, tokens, held, cache)
        tokens = np.asarray(tokens)  # waits for the step: the produced tokens are ready
        t2 = time.perf_counter()
        step_s.append(t2 - t0)
        hook_s.append(t1 - t0)
        selections = backend.selections(cache) if i >= bench.warmup_steps else None  # outside the timed span
        if selections is not None:
            overlaps.append(_selection_overlap(selections, previous))
            selected_blocks += sum(int((ids >= 0).sum()) for ids in selections)
            previous = selections
        held = held + 1
        i += 1
        if on_step:
            on_step(i, planned)
    row = {**_times(step_s, batch), "ttft_s": None, "compile_s": round(compile_s, 2), "fill_s": round(fill_s, 2)}
    if len(step_s) < bench.decode_tokens:
        row["steps_note"] = f"time budget: {len(step_s)} of {bench.decode_tokens} timed steps"
    row.update(_memory_now(backend))
    counters = backend.counters()
    row.update(_breakdown(step_s, hook_s, counters))
    row.update(_selection_fields(counters, [o for o in overlaps if o is not None],
                                 selected_blocks * point.offload.block_size))
    row.update(backend.row_fields())
    del cache
    return row


def _selection_overlap(current: list[np.ndarray], previous: list[np.ndarray] | None) -> float | None:
    """Share of this step's top-k blocks (every layer's [B, Hkv, k] ids, -1 = none) that the previous
    step selected, per (sequence, KV head)."""
    if previous is None:
        return None
    same = total = 0
    for cur, prev in zip(current, previous):
        valid = cur >= 0
        same += int(((cur[..., None] == prev[:, :, None, :]).any(-1) & valid).sum())
        total += int(valid.sum())
    return same / total if total else None


def _selection_fields(counters: dict, overlaps: list[float], selected_tokens: int) -> dict:
    """Selecting modes: the measured step-to-step top-k overlap and the CPU's share of the selected
    tokens (the rest sat on the GPU)."""
    if not overlaps:
        return {}
    return {"topk_overlap": round(float(np.mean(overlaps)), 4),
            "cpu_share_of_selection": round(counters.get("cpu_tokens", 0) / max(selected_tokens, 1), 4)}


def _breakdown(step_s, hook_s, c: dict) -> dict:
    """The per-step breakdown from the backend's counters `c` over the timed steps."""
    n = max(len(step_s), 1)
    step_ms = 1e3 * sum(step_s) / n
    between = 1e3 * sum(hook_s) / n
    per = lambda key: round(1e3 * c.get(key, 0.0) / n, 3)  # noqa: E731
    callback = per("callback_s")
    return {"step_ms": round(step_ms, 3), "between_steps_ms": round(between, 3), "callback_ms": callback,
            "compute_ms": round(max(step_ms - between - callback, 0.0), 3),
            "cpu_attn_ms": per("cpu_attn_s"), "wait_ms": per("wait_s"), "evict_ms": per("evict_s"),
            "recall_ms": per("recall_s"), "transfer_ms": per("transfer_s"),
            "callbacks_per_step": round(c.get("n_callbacks", 0) / n, 2),
            "host_exchange": None if not c else ("ffi" if "exchange_steps" in c else "callback"),
            "exchange_serve_ms": per("exchange_serve_s"),
            # before the worker serves a step's first layer: waiting for the store's lock, then the
            # page snapshot
            "exchange_barrier_ms": per("exchange_barrier_s"), "exchange_snapshot_ms": per("exchange_snapshot_s"),
            # inside the serve time: the worker waiting for the device's queries (the rest is the
            # snapshot and the host attention)
            "exchange_idle_ms": per("exchange_idle_s"),
            **_exchange_timing(c, n, step_ms)}


def _exchange_timing(c: dict, steps: int, step_ms: float) -> dict:
    """With exchange_timing: the share of the step the GPU stream waited for the host (gpu_idle_frac)
    and the exchange's own GPU cost per layer (bridge_us_per_layer), from CUDA events."""
    layers = c.get("exchange_timed_layers", 0)
    if not layers:
        return {}
    wait_ms = 1e3 * c["exchange_wait_s"] / steps
    return {"gpu_idle_frac": round(min(1.0, wait_ms / max(step_ms, 1e-9)), 4),
            "bridge_us_per_layer": round(1e6 * c["exchange_gpu_s"] / layers, 2)}


# ---------------------------------------------------------------------------- real prefill

def _run_prefill(model, point, backend, batch, on_step) -> dict:
    """A real chunked prefill of random prompts, then timed decode (at parallel.tp > 1 over that many
    devices, each with its own host side, closed here)."""
    from jhybrid.generation import Generator

    bench = point.benchmark
    max_len = max_len_for(bench)
    if point.parallel.tp == 1:
        generator = Generator(model, backend, prefill_chunk=bench.prefill_chunk, max_len=max_len)
        return _time_generations(model, point, generator, backend, batch, on_step)
    from jhybrid.parallel import TensorParallel, tensor_mesh

    parallel = TensorParallel(model, tensor_mesh(point.parallel.tp, model.config), backend)
    generator = Generator(model, prefill_chunk=bench.prefill_chunk, max_len=max_len, parallel=parallel)
    try:
        return _time_generations(model, point, generator, parallel.backend, batch, on_step)
    finally:
        _release(parallel.backend)


def _time_generations(model, point, generator, backend, batch, on_step) -> dict:
    bench = point.benchmark
    rng = np.random.default_rng(0)
    stamps: list[float] = []

    def on_tokens(tokens, emitted):
        stamps.append(time.perf_counter())
        if on_step:
            on_step(len(stamps), bench.decode_tokens)

    # Warm-up on other prompts of the same length: compiles the prefill chunks, the decode step and
    # every host-side program the first steps after a prefill use (eviction gathers of a whole chunk,
    # hgca's re-evaluation), so the timed runs measure none of them.
    warm = rng.integers(0, model.config.vocab_size, (batch, bench.context))
    report_phase(on_step, "warm-up prompt: compiling the prefill chunks and the decode step")
    generator.generate(warm.tolist(), max_new_tokens=min(4, bench.decode_tokens))
    ttft, gaps, decode_s, decode_tokens, compile_s = [], [], 0.0, 0, 0.0
    for _ in range(bench.prefill_repeats):  # fresh prompts each time: no run reuses another's KV
        prompts = rng.integers(0, model.config.vocab_size, (batch, bench.context))
        stamps.clear()
        result = generator.generate(prompts.tolist(), max_new_tokens=bench.decode_tokens, on_tokens=on_tokens)
        ttft.append(result.prefill_seconds)
        gaps += list(np.diff(stamps))
        decode_s += result.decode_seconds
        decode_tokens += sum(max(len(t) - 1, 0) for t in result.tokens)  # as decode_tokens_per_second
        compile_s += result.compile_seconds
    row = {**_times(gaps, batch), "ttft_s": round(float(np.median(ttft)), 4),
           "ttft_runs_s": [round(t, 4) for t in ttft],
           "prefill_tok_s": round(batch * bench.context / float(np.median(ttft)), 1),
           "compile_s": round(compile_s, 2), "fill_s": None}
    row["decode_tok_s"] = round(decode_tokens / decode_s, 2) if decode_s > 0 else None
    counters = backend.counters()
    if counters:  # which path the chunks took over the offloaded prompt (device copies or CPU)
        row.update(prefill_offloaded=point.offload.prefill_offloaded,
                   prefill_device_chunks=counters.get("n_prefill_device_chunks"),
                   prefill_extends=counters.get("n_prefill_extends"),
                   prefill_row_uploads=counters.get("n_prefill_row_uploads"),
                   prefill_host_chunks=counters.get("n_prefill_host_chunks"))
    row.update(_memory_now(backend))
    return row


__all__ = ["run_throughput", "device_memory", "host_memory_bytes", "max_len_for", "predict"]
