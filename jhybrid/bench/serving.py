"""Serving task: a load of requests arriving over time through the continuous-batching engine
(`jhybrid.serving.ServingEngine`), against the same requests run as fixed batches (`Generator`).

The load (benchmark settings, jhybrid.config.schema.BenchmarkSpec): `serving_requests` requests of
random token prompts (random-weight shapes have no tokenizer), each prompt's length drawn uniformly
from `serving_contexts` (default: [context]); a share `serving_shared_share` of them starts with one
common prefix of `serving_shared_prefix` tokens followed by `serving_shared_suffix` random tokens
(without a suffix: their lengths drawn from the contexts longer than the prefix, the rest of the
prompt random, to its drawn length);
arrivals are a Poisson process of `serving_rate` requests/s. Each request decodes `decode_tokens`
greedy tokens (no stop token). Draws come from a fixed seed: the same config gives the same load.

The run, per point (its mode: the offload section, through `backend_for` like the throughput task):
  1. a ServingEngine of `serving_slots` slots, `max_len` = longest prompt + decode_tokens + 1 (rounded
     up to 64), `prefill_chunk`, `serving_step_tokens` prefill tokens per step (default: prefill_chunk;
     `serving_decoding_step_tokens` in a step that begins with requests decoding),
     `serving_prefill_order`, the prefix cache's device tier `serving_prefix_cache_mb` (default: the
     engine's) and host tier `serving_prefix_cache_host_mb`;
  2. warm-up (untimed): `engine.compile_steps()` (every prefill, packed and decode shape), then
     requests of its own random tokens: 1, 2, 4 ... (up to the slots) of the longest length
     together, one per prompt length, and, with a shared prefix, two per length carrying another
     prefix of the same length (compiles the prefix-copy steps);
  3. the load: each request submitted at its arrival time to the started engine; per request its
     TTFT (submit -> first token), its token times, whether it hit the prefix cache (cached_tokens > 0);
     once per entry of `serving_switch_intervals_ms` (`_run_load`), at that thread switch interval,
     the prefix cache forgetting the load's prompts between passes;
  4. saturation (unless `serving_saturation` is false), on the same warm engine: prompts of the
     load's lengths with fresh random tokens (no shared prefix, so no prefix-cache hit) all
     submitted at once; every token / seconds from the submit to the last token;
  5. the engine closed and freed, then THE SAME prompts as fixed batches of `serving_slots` (in arrival
     order, all arriving at once) through `Generator` with the same max_len and chunk (one untimed
     warm-up batch first; Generator excludes compile time from its prefill and decode seconds).

Row fields: task, model, layers, mode, window, slots, requests, rate, contexts, shared_prefix,
shared_share, decode_tokens, max_len, prefill_chunk, step_tokens, decoding_step_tokens, packs_decode (the running requests'
  decode tokens ride in the step's first prefill call: `ServingEngine`),
  completed (requests that ended with max_tokens tokens; every one should), lost (the others),
  ttft_p50_s, ttft_p99_s, tbt_p50_ms, tbt_p99_ms (gaps between consecutive tokens of a request,
  pooled over requests), span_s (first submit -> last token), request_throughput (requests / span_s),
  decode_tok_s (served decode throughput: tokens after each request's first / seconds from the first
  request's first token to the last token; bounded by the arrivals below saturation),
  served_tok_s (every token / span_s),
  fixed_decode_tok_s (decode tokens / decode seconds summed over the fixed batches, as Generator
  reports), fixed_tok_s (every token / prefill + decode seconds of the fixed batches),
  served_over_fixed (decode_tok_s / fixed_decode_tok_s), served_over_fixed_e2e (served_tok_s /
  fixed_tok_s) (both bounded by the arrival rate below saturation),
  saturated_tok_s (phase 4: every token / its seconds), saturated_s, saturated_over_fixed
  (saturated_tok_s / fixed_tok_s: the engine against fixed batches of the same prompt lengths, both
  with every request there from the start; the fixed batches' prefix sharing is irrelevant, as
  Generator has no prefix cache); with `serving_repeats` > 1 the fixed fields, saturated_tok_s and
  saturated_s are medians over the repeats, saturated_tok_s_repeats and fixed_tok_s_repeats list
  each repeat's,
  slo_ttft_s, slo_tbt_ms (the SLO used), slo_met (requests meeting it), goodput (slo_met / span_s,
  requests/s). SLO: a request meets it when its TTFT <= slo_ttft_s and the p99 of its own token gaps
  <= slo_tbt_ms; `serving_slo_ttft_s` / `serving_slo_tbt_ms` set them, else they are relative to the
  run: 2 x the median TTFT and 2 x the pooled TBT p50 (a request that waited or stalled twice the
  typical time misses it),
  prefix_hits / prefix_misses / prefix_hit_tokens (the engine's counts over the load, warm-up
  excluded; tensor-parallel offloading backends cannot use the prefix cache: every request a miss),
  prefix_hit_tokens_host / _disk (of the hit tokens, those brought back from the host / disk tier),
  prefix_bytes (bytes held per tier at the end of the load), prefix_step_s (the load's steps' seconds
  in the prefix cache: hits placed, prompts inserted, spill waits), prefix_spill_wait_s (of those,
  waiting for spills' device-to-host copies), slow_steps (the load's steps of 1 s or more),
  ttft_hit_over_miss (median TTFT of the requests that hit / of those that missed; None if either
  group is empty; queueing included, and the misses are of every drawn length),
  ttft_hit_over_shared_miss (the same over the misses among the requests carrying the shared prefix,
  e.g. the first of them: with serving_shared_suffix, prompts of the hits' own length),
  ttft_hit_over_shared_miss_admitted (the same with each TTFT counted from the request's admission
  into a slot: the queueing, which depends on what else runs when it arrives, left out),
  per_request (in arrival order: prompt and cached tokens, shared, queued_s, ttft_s),
  tbt_prefill_p99_ms (p99 of the token gaps that ended in an engine step that also prefilled another
  request's chunk: what a running request sees while a long prompt is prefilled, from the engine's
  step log), tbt_p99_over_p50 (tbt_prefill_p99_ms / tbt_p50_ms; None without such gaps),
  prefill_gaps (how many such gaps), prefill_gap_longest (the GAPS_SHOWN longest, each with its
  step's record: `_longest_gaps`),
  compiles_timed (executables compiled during the load: 0 when the warm-up covered every shape),
  first_runs_timed (executables whose first run in the process fell in the load: a GPU executable
  loads its module then), warmup_unrun_steps (the step shapes the warm-up left unrun:
  `ServingEngine.unrun_steps`),
  load_steps / saturated_steps (where the steps' time went, per phase: `_step_breakdown` of the
  engine's step log: the engine's host work before calls, the compiled calls, captures, the prefix
  cache), load_counters / saturated_counters (the backend's counters that changed over the phase),
  warmup_s, served_s, fixed_s (wall seconds of each phase), host_rss_bytes (after the load),
  device_memory (the first device's allocator after the load: DEVICE_MEMORY_SHOWN of its
  `memory_stats()`; None where the platform reports none, e.g. the CPU: how close the step
  buffers come to the limit, where an allocation may have to wait for the device),
  switch_interval_ms (the thread switch interval of the last load pass, the saturation and the fixed
  batches: `serving_switch_intervals_ms`' last entry; None: the interpreter's), load_passes (with
  more than one pass: each pass's TTFT, TBT, first runs, prefix hits and step breakdown,
  `_pass_summary`; None with one).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import json
import logging
import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from jax import monitoring

from jhybrid.bench.offload import PointSkipped, backend_for
from jhybrid.bench.progress import PointProgress, report_phase
from jhybrid.bench.throughput import device_memory, host_rss_bytes
from jhybrid.hybrid.registry import mode_class
from jhybrid.serving.gil import switch_interval
from jhybrid.serving.warmup import WARM_TOKENS, packed_waves, random_tokens, run_warm_up, shape_waves, tail_waves

if TYPE_CHECKING:
    from jhybrid.serving.api import EngineStats, RequestOutput
    from jhybrid.serving.engine import StepRecord

log = logging.getLogger(__name__)

SEED = 0
RESULT_TIMEOUT_S = 3600.0  # waiting for one request of the load (an engine that stopped raises sooner)
GAPS_SHOWN = 8  # prefill_gap_longest: the longest token gaps while a prompt prefills, with their steps
DEVICE_MEMORY_SHOWN = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit", "largest_free_block_bytes",
                       "num_allocs", "largest_alloc_size")  # device_memory: the allocator's state after the load
BACKEND_SHOWN = 12  # prefill_gap_longest: the backend time counters shown per gap


class PrefillGap(NamedTuple):
    """A token gap that ended in an engine step which also prefilled another request: its length,
    that step's record and the record before it (None for the log's first)."""

    seconds: float
    step: StepRecord
    previous: StepRecord | None


@dataclasses.dataclass(frozen=True)
class Load:
    """The requests of a point: prompts (int32 arrays), arrival offsets (s), shared flags."""

    prompts: list
    arrivals: np.ndarray
    shared: np.ndarray


def contexts_of(bench) -> list[int]:
    return list(bench.serving_contexts) if bench.serving_contexts else [bench.context]


def longest_prompt(bench) -> int:
    """The longest prompt of the load: the contexts, and prefix + suffix of the sharing requests."""
    return max(contexts_of(bench) + _carrying_lengths(bench))


def serving_max_len(bench) -> int:
    """Tokens per slot: the longest prompt, the decode tokens and one spare, rounded up to 64."""
    return -(-(longest_prompt(bench) + bench.decode_tokens + 1) // 64) * 64


def make_load(bench, vocab: int, seed: int = SEED) -> Load:
    """The point's requests (module docstring), the same for the same settings."""
    rng = np.random.default_rng(seed)
    n, contexts = bench.serving_requests, contexts_of(bench)
    lengths = rng.choice(np.asarray(contexts), n)
    shared = rng.random(n) < bench.serving_shared_share if bench.serving_shared_prefix else np.zeros(n, bool)
    longer = np.asarray(_carrying_lengths(bench))  # a request with the prefix draws a longer length
    lengths = np.where(shared, rng.choice(longer, n) if len(longer) else lengths, lengths)
    prefix = random_tokens(rng, vocab, bench.serving_shared_prefix)
    prompts = []
    for length, share in zip(lengths, shared):
        head = prefix if share else np.zeros(0, np.int32)
        prompts.append(np.concatenate([head, random_tokens(rng, vocab, int(length) - len(head))]))
    gaps = rng.exponential(1.0 / bench.serving_rate, n)
    arrivals = np.concatenate([[0.0], np.cumsum(gaps)[:-1]])
    return Load(prompts, arrivals, shared)


def _carrying_lengths(bench) -> list[int]:
    """The prompt lengths a request starting with the shared prefix draws from: prefix + suffix, or
    the contexts longer than the prefix."""
    if not bench.serving_shared_prefix:
        return []
    if bench.serving_shared_suffix is not None:
        return [bench.serving_shared_prefix + bench.serving_shared_suffix]
    return [c for c in contexts_of(bench) if c > bench.serving_shared_prefix]


def warmup_waves(bench, vocab: int, max_len: int, packed_row_counts: Sequence[int] = (),
                 call_widths: Mapping[int, int] | None = None) -> list[list[tuple[np.ndarray, int]]]:
    """Warm-up requests (prompt, max_tokens) in waves (each wave submitted once the previous one
    finished): R prompts of the longest length for each power of two R up to the slots (their prefill
    calls over R rows, from the first chunk to the last: an offloading mode compiles one per size of
    the offloaded prompt's device copies); one prompt per length; with a shared prefix, one per length
    carrying another prefix of the same length, then a second wave of those (prefix-cache hits:
    compiles the copies into and out of the rows). Then, with `call_widths`
    (`ServingEngine.call_widths`), the tail waves of calls narrower than a chunk (`tail_waves`), and
    for each row count C of a packed call (`ServingEngine.packed_row_counts`; none: the engine does
    not pack), a one-chunk prompt whose request decodes while min(C, slots - 1) prompts of the
    longest length prefill beside it: the packed calls over every size of the copies
    (`packed_waves`). Each shape runs before the load, not only compiles: a GPU
    executable's first run in a process loads its module and instantiates its CUDA graphs (a
    one-chunk packed step of 150-230 ms instead of 45-60 on the H200, session n, row n3).
    The generic waves are `jhybrid.serving.warmup`'s (`shape_waves`, `tail_waves`, `packed_waves`);
    the shared-prefix ones are this benchmark's."""
    rng = np.random.default_rng(SEED + 1)
    longest = max(contexts_of(bench))
    warm = min(WARM_TOKENS, bench.decode_tokens)
    waves = shape_waves(longest, contexts_of(bench), bench.serving_slots, warm, rng, vocab)
    if bench.serving_shared_prefix and bench.serving_shared_share > 0:
        prefix = random_tokens(rng, vocab, bench.serving_shared_prefix)
        carrying = lambda: [(np.concatenate([prefix, random_tokens(rng, vocab, c - len(prefix))]), warm)  # noqa: E731
                            for c in _carrying_lengths(bench)]
        waves[-1] += carrying()
        waves.append(carrying())
    return (waves + tail_waves(longest, bench.prefill_chunk, warm, call_widths or {}, rng, vocab)
            + packed_waves(longest, bench.serving_slots, bench.prefill_chunk, warm, max_len, packed_row_counts,
                           rng, vocab, call_widths))


def _pct(values, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def _round(value, digits: int):
    return None if value is None else round(value, digits)


def _ratio(a, b):
    return None if a is None or b is None or b <= 0 else a / b


def run_serving(model, pretrained, point, on_step: PointProgress | None = None, deadline=None) -> list[dict]:
    from jhybrid.serving import PrefixCacheConfig, Request, ServingEngine
    from jhybrid.serving.engine import SLOW_STEP_S

    bench, offload = point.benchmark, point.offload
    if not mode_class(offload.mode).offloads and longest_prompt(bench) + bench.decode_tokens >= \
            model.config.max_position_embeddings:
        raise PointSkipped(f"prompts of up to {longest_prompt(bench)} + {bench.decode_tokens} tokens exceed the "
                           f"model's context of {model.config.max_position_embeddings} (mode {offload.mode})")
    max_len = serving_max_len(bench)
    backend, window = backend_for(offload, longest_prompt(bench))
    slots = bench.serving_slots
    step_tokens = bench.serving_step_tokens or bench.prefill_chunk
    decoding_step_tokens = (None if bench.serving_decoding_step_tokens is None
                            else min(bench.serving_decoding_step_tokens, step_tokens))
    decoding_max_backlog = None if decoding_step_tokens is None else bench.serving_decoding_max_backlog
    vocab = model.config.vocab_size
    load = make_load(bench, vocab)
    n = len(load.prompts)
    intervals_ms = list(bench.serving_switch_intervals_ms or [None])  # one load pass each
    intervals_s = [None if ms is None else ms / 1e3 for ms in intervals_ms]
    base = {"task": "serving", "model": point.model.name, "layers": model.config.num_layers, "mode": offload.mode,
            "window": window, "slots": slots, "requests": n, "rate": bench.serving_rate,
            "contexts": contexts_of(bench), "shared_prefix": bench.serving_shared_prefix,
            "shared_share": bench.serving_shared_share, "shared_suffix": bench.serving_shared_suffix,
            "prefill_order": bench.serving_prefill_order, "decode_tokens": bench.decode_tokens, "max_len": max_len,
            "prefill_chunk": bench.prefill_chunk, "step_tokens": step_tokens,
            "decoding_step_tokens": decoding_step_tokens,
            "decoding_max_backlog": decoding_max_backlog,
            "packs_decode": bool(backend.packs_decode), "host_kv_dtype": offload.host_kv_dtype or "model"}
    prefix_cache = PrefixCacheConfig(
        device_bytes=None if bench.serving_prefix_cache_mb is None else int(bench.serving_prefix_cache_mb * 2**20),
        host_bytes=int(bench.serving_prefix_cache_host_mb * 2**20))
    # Steps over the whole run: warm-up and load, each request's prefill chunks and decode steps.
    steps = sum(math.ceil(len(p) / min(decoding_step_tokens or step_tokens, bench.prefill_chunk)) for p in load.prompts)
    step_log = 4 * len(intervals_ms) * (steps + n * bench.decode_tokens) + 1024

    report_phase(on_step, f"serving engine: {slots} slots of {max_len} tokens")
    engine = ServingEngine(model, backend, slots=slots, max_len=max_len, prefill_chunk=bench.prefill_chunk,
                           step_token_budget=step_tokens, prefix_cache=prefix_cache, step_log=step_log,
                           prefill_order=bench.serving_prefill_order,
                           decoding_step_token_budget=decoding_step_tokens,
                           decoding_budget_max_backlog=decoding_max_backlog)
    try:
        engine.start()
        t0 = time.perf_counter()
        report_phase(on_step, "compiling the engine's steps")
        engine.compile_steps()  # every step shape, several XLA compiles at once
        report_phase(on_step, "warm-up requests")
        with _profile_window("warmup"):
            waves = warmup_waves(bench, vocab, max_len, engine.packed_row_counts(), engine.call_widths())
            warm = run_warm_up(engine, waves, RESULT_TIMEOUT_S)
        if warm.unrun_steps:  # (some may be out of the load's reach: the host path beside prefill copies)
            log.info("%s: the warm-up left %d step shape(s) unrun (a load's first run of one waits for its "
                     "module to load): %s", offload.mode, len(warm.unrun_steps), ", ".join(warm.unrun_steps))
        warmup_s = time.perf_counter() - t0
        passes, summaries = [], []  # (summaries: with more than one pass, `load_passes`)
        for i, (interval_ms, interval_s) in enumerate(zip(intervals_ms, intervals_s)):
            if i:  # the former pass's prompts out of the prefix cache: each pass starts as cold as the first
                engine.forget_prompts([p.tolist() for p in load.prompts])
            with switch_interval(interval_s):
                passes.append(_run_load(engine, backend, load, bench, on_step))
            if len(intervals_ms) > 1:
                summaries.append(_pass_summary(passes[-1], bench, load))
                log.info("load pass %d of %d (switch interval %s ms): %s", i + 1, len(intervals_ms),
                         interval_ms, json.dumps(summaries[-1]))
        last = passes[-1]
        before, after, outputs, submitted = last.before, last.after, last.outputs, last.submitted
        records, load_records, load_counters = last.records, last.load_records, last.counters
        served_s, load_compiles = last.served_s, last.compiles
        rss = host_rss_bytes()
        memory = {k: v for k, v in device_memory().items() if k in DEVICE_MEMORY_SHOWN} or None
        saturated = None
        if bench.serving_saturation and (deadline is None or time.perf_counter() < deadline):
            report_phase(on_step, f"saturation: {n} requests at once")
            counters_before = backend.counters()
            with CompileRecorder() as saturated_compiles, switch_interval(intervals_s[-1]):
                saturated = _run_saturated(engine, Request, load, bench, vocab, deadline)
            saturated_records = [r for r in engine.step_log() if r.step > after.steps]
            saturated_counters = _counter_delta(counters_before, backend.counters())
            log.info("saturation served in %.1f s; its steps %s; the backend's counters %s; the prefix-cache "
                     "store worker %.1f s in all", saturated[1], json.dumps(_step_breakdown(saturated_records)),
                     json.dumps(saturated_counters), engine.store_seconds)
    finally:
        engine.close(drain=False)
    del engine  # the engine holds its cache and prefix pool until it is freed
    gc.collect()

    row = {**base, **_served_fields(outputs, submitted, records, bench, load.shared),
           "prefix_hits": after.prefix_hits - before.prefix_hits,
           "prefix_misses": after.prefix_misses - before.prefix_misses,
           "prefix_hit_tokens": after.prefix_hit_tokens - before.prefix_hit_tokens,
           "prefix_hit_tokens_host": after.prefix_hit_tokens_host - before.prefix_hit_tokens_host,
           "prefix_hit_tokens_disk": after.prefix_hit_tokens_disk - before.prefix_hit_tokens_disk,
           "prefix_bytes": {"device": after.prefix_bytes_device, "host": after.prefix_bytes_host,
                            "disk": after.prefix_bytes_disk},
           "prefix_spill_wait_s": round(after.prefix_spill_wait_seconds - before.prefix_spill_wait_seconds, 3),
           "prefix_step_s": round(sum(r.prefix_seconds for r in load_records), 3),
           "slow_steps": sum(r.seconds >= SLOW_STEP_S for r in load_records),
           "compiles_timed": after.compiles - before.compiles, "first_runs_timed": after.first_runs - before.first_runs,
           "warmup_s": round(warmup_s, 2), "warmup_unrun_steps": list(warm.unrun_steps),
           "served_s": round(served_s, 2), "host_rss_bytes": rss, "device_memory": memory,
           "saturated_tok_s": None if saturated is None else saturated[0],
           "saturated_s": None if saturated is None else saturated[1],
           "saturated_tok_s_repeats": None if saturated is None else saturated[2],
           "load_steps": _step_breakdown(load_records),
           "load_counters": load_counters,
           "load_jit_compiles": load_compiles.summary(),
           "saturated_jit_compiles": None if saturated is None else saturated_compiles.summary(),
           "saturated_steps": None if saturated is None else _step_breakdown(saturated_records),
           "saturated_counters": None if saturated is None else saturated_counters,
           "switch_interval_ms": intervals_ms[-1],
           "load_passes": summaries or None}
    if deadline is not None and time.perf_counter() >= deadline:
        row.update(fixed_decode_tok_s=None, fixed_tok_s=None, served_over_fixed=None, served_over_fixed_e2e=None,
                   saturated_over_fixed=None, fixed_note="time budget: the fixed batches were not run")
        return [row]
    report_phase(on_step, f"the same {n} requests as fixed batches of {slots}")
    fixed_backend, _ = backend_for(offload, longest_prompt(bench))
    with switch_interval(intervals_s[-1]):
        fixed = _run_fixed(model, fixed_backend, load, bench, slots, max_len, deadline)
    row.update(fixed)
    row["served_over_fixed"] = _round(_ratio(row["decode_tok_s"], fixed["fixed_decode_tok_s"]), 4)
    row["served_over_fixed_e2e"] = _round(_ratio(row["served_tok_s"], fixed["fixed_tok_s"]), 4)
    row["saturated_over_fixed"] = _round(_ratio(row["saturated_tok_s"], fixed["fixed_tok_s"]), 4)
    return [row]


@dataclasses.dataclass
class LoadPass:
    """One pass of the load through the warm engine (`_run_load`): the engine's stats before and
    after it, the requests' outputs (in arrival order) and submit times (perf_counter s), the step
    log then (`records`) and the pass's own steps (`load_records`), the backend's counters that
    changed over it, its wall seconds and the XLA compiles in it (`CompileRecorder`)."""

    before: EngineStats
    after: EngineStats
    outputs: list[RequestOutput]
    submitted: list[float]
    records: list[StepRecord]
    load_records: list[StepRecord]
    counters: dict[str, float]
    served_s: float
    compiles: CompileRecorder


def _run_load(engine, backend, load: "Load", bench, on_step: PointProgress | None) -> LoadPass:
    """The load's requests, each submitted at its arrival time to the started engine, and waited for.
    RuntimeError when the engine failed any of them (its own error, not a statistic of no tokens)."""
    from jhybrid.serving import EngineClosed, Request

    n = len(load.prompts)
    before = engine.stats()
    counters_before = backend.counters()
    report_phase(on_step, f"{n} requests at {bench.serving_rate:g}/s")
    handles, submitted, refused = [], [], None
    with _profile_window("load"), CompileRecorder() as compiles:
        start = time.perf_counter()
        for i, (prompt, at) in enumerate(zip(load.prompts, load.arrivals)):
            delay = start + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            submitted.append(time.perf_counter())
            try:
                handles.append(engine.submit(Request(prompt=prompt.tolist(), max_tokens=bench.decode_tokens,
                                                     request_id=f"r-{i}")))
            except EngineClosed as closed:  # a step failed before this arrival: the rest fail with it
                refused = closed
                break
        outputs = []
        for i, handle in enumerate(handles):
            outputs.append(handle.result(RESULT_TIMEOUT_S))
            out = outputs[-1]
            log.info("request %d/%d done at %.1f s: %d prompt tokens (%d cached), ttft %.2f s, %d tokens", i + 1, n,
                     time.perf_counter() - start, len(load.prompts[i]), out.cached_tokens, out.ttft or -1.0,
                     len(out.tokens))
            if on_step:
                on_step(i + 1, n)
        served_s = time.perf_counter() - start
    after = engine.stats()
    records = engine.step_log()
    load_records = [r for r in records if r.step > before.steps]  # the warm-up's (and former passes') left out
    counters = _counter_delta(counters_before, backend.counters())
    # logged now, not only in the row: a device call cut before the row is written still tells
    log.info("load served in %.1f s; its steps %s; the backend's counters %s; XLA compiles in it %s", served_s,
             json.dumps(_step_breakdown(load_records)), json.dumps(counters), json.dumps(compiles.summary()))
    failed = [o for o in outputs if o.finish_reason.value == "error"]
    if failed or refused is not None:
        error = failed[0].error if failed else str(refused)
        raise RuntimeError(f"the serving engine failed {n - len(outputs) + len(failed)} of {n} requests of the "
                           f"load: {error}")
    return LoadPass(before, after, outputs, submitted, records, load_records, counters, served_s, compiles)


def _pass_summary(load_pass: LoadPass, bench, load: "Load") -> dict:
    """A load pass's latency figures (`load_passes` of the row): TTFT and TBT as the row's fields, the
    first runs and prefix-cache hits in it, its steps' breakdown."""
    fields = _served_fields(load_pass.outputs, load_pass.submitted, load_pass.records, bench, load.shared)
    keep = ("ttft_p50_s", "ttft_p99_s", "tbt_p50_ms", "tbt_p99_ms", "tbt_prefill_p99_ms", "tbt_p99_over_p50",
            "prefill_gaps", "served_tok_s")
    return {**{k: fields[k] for k in keep}, "served_s": round(load_pass.served_s, 2),
            "first_runs_timed": load_pass.after.first_runs - load_pass.before.first_runs,
            "prefix_hits": load_pass.after.prefix_hits - load_pass.before.prefix_hits,
            "load_steps": _step_breakdown(load_pass.load_records)}


@contextlib.contextmanager
def _profile_window(phase: str):
    """JHYBRID_PROFILE="START:SECONDS:DIR" (a device call's diagnosis): a JAX profiler trace of SECONDS
    of the phase this wraps ("load", or "warmup" / "saturation" where JHYBRID_PROFILE_PHASE says so),
    START seconds after it begins, written to DIR in Perfetto JSON as well (`benchmarks/trace_summary.py`
    sums it); the phase's normal end waits for the trace. Nothing without the variable or in another phase."""
    spec = os.environ.get("JHYBRID_PROFILE")
    if not spec or os.environ.get("JHYBRID_PROFILE_PHASE", "load") != phase:
        yield
        return
    start_s, seconds, out = spec.split(":", 2)

    def trace():
        import jax

        time.sleep(float(start_s))
        jax.profiler.start_trace(out, create_perfetto_trace=True)
        log.info("profiling %s s of the %s into %s", seconds, phase, out)
        time.sleep(float(seconds))
        jax.profiler.stop_trace()
        log.info("profile written")

    thread = threading.Thread(target=trace, name="jhybrid-profile", daemon=True)
    thread.start()
    yield  # an error in the phase propagates without waiting for the trace (a daemon thread)
    thread.join()


def _run_saturated(engine, request_type, load: Load, bench, vocab: int,
                   deadline: float | None) -> tuple[float, float, list[float]]:
    """Phase 4 (module docstring), `serving_repeats` times (fewer past the deadline; each with fresh
    prompts): (the median of every token / seconds, the median seconds, each repeat's tokens/s)."""
    rng = np.random.default_rng(SEED + 3)
    rates, spans = [], []
    with _profile_window("saturation"):
        for repeat in range(bench.serving_repeats):
            if repeat and deadline is not None and time.perf_counter() >= deadline:
                log.info("time budget: saturation ran %d of %d repeats", repeat, bench.serving_repeats)
                break
            start = time.perf_counter()
            handles = [engine.submit(request_type(prompt=random_tokens(rng, vocab, len(p)).tolist(),
                                                  max_tokens=bench.decode_tokens, request_id=f"sat-{repeat}-{i}"))
                       for i, p in enumerate(load.prompts)]
            tokens = sum(len(h.result(RESULT_TIMEOUT_S).tokens) for h in handles)
            spans.append(time.perf_counter() - start)
            rates.append(tokens / spans[-1])
    return round(float(np.median(rates)), 2), round(float(np.median(spans)), 2), [round(r, 2) for r in rates]


def _step_breakdown(records) -> dict:
    """{"prefill": ..., "decode": ...}: the steps that prefilled (with or without decode tokens) and
    those that only decoded, each {steps, median_ms, p90_ms, max_ms, and the sums seconds, host_s,
    host_cpu_s (the engine thread's CPU time in host_s: the rest it waited, for the GIL or the device),
    overlap_s (the backend's host work in the calls' shadow, `ServingEngine._after_dispatch`),
    launch_s (of call_s, inside the compiled calls' launches: `StepTimes.launch_seconds`),
    gc_s (garbage collections in the engine thread during the steps: `StepTimes.gc_seconds`),
    call_s, capture_s, reset_s, prefix_s (StepRecord's breakdown), calls, first_runs (calls of an
    executable run for the first time in the process), longest_first_runs (those of the longest
    step: was it a first run?), prompt_tokens}, the prefill steps
    also budgets {budget: steps} (the budget each step could take: StepRecord.budget); None for a
    kind without steps."""
    out = {}
    for kind, chosen in (("prefill", [r for r in records if r.prefill]),
                         ("decode", [r for r in records if not r.prefill and r.decode])):
        if not chosen:
            out[kind] = None
            continue
        times = np.array([r.seconds for r in chosen])
        out[kind] = {"steps": len(chosen), "median_ms": round(float(np.median(times)) * 1e3, 2),
                     "p90_ms": round(_pct(times, 90) * 1e3, 2), "max_ms": round(float(times.max()) * 1e3, 2),
                     "seconds": round(float(times.sum()), 3),
                     "host_s": round(sum(r.times.host_seconds for r in chosen), 3),
                     "host_cpu_s": round(sum(r.times.host_cpu_seconds for r in chosen), 3),
                     "overlap_s": round(sum(r.times.overlap_seconds for r in chosen), 3),
                     "launch_s": round(sum(r.times.launch_seconds for r in chosen), 3),
                     "gc_s": round(sum(r.times.gc_seconds for r in chosen), 3),
                     "call_s": round(sum(r.times.call_seconds for r in chosen), 3),
                     "capture_s": round(sum(r.times.capture_seconds for r in chosen), 3),
                     "reset_s": round(sum(r.times.reset_seconds for r in chosen), 3),
                     "prefix_s": round(sum(r.prefix_seconds for r in chosen), 3),
                     "calls": sum(r.times.calls for r in chosen),
                     "first_runs": sum(r.times.first_runs for r in chosen),
                     "longest_first_runs": max(chosen, key=lambda r: r.seconds).times.first_runs,
                     "prompt_tokens": sum(t for r in chosen for _, t in r.prefill)}
        if kind == "prefill":
            budgets = collections.Counter(r.budget for r in chosen)
            out[kind]["budgets"] = {str(b): budgets[b] for b in sorted(budgets)}
    return out


def _counter_delta(before: dict, after: dict) -> dict:
    """The backend's counters (`counters()`) that changed between two reads: after - before, rounded."""
    delta = {}
    for key, value in after.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            change = value - before.get(key, 0)
            if change:
                delta[key] = round(change, 4) if isinstance(change, float) else change
    return delta


BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch's name for it


class CompileRecorder:
    """Every XLA compile in the process while it is active (a `with` block), the engine's steps and
    any other jitted function (the offloading backends' helpers, a mode's recall scatter): what a
    timed phase compiled that its warm-up did not. `summary()`: {count, seconds, by_name: the five
    costliest functions' [name, count, seconds]}. A persistent compilation cache's hit counts too
    (it is loaded in the same place)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._events: list[tuple[str, float]] = []

    def _listen(self, event: str, seconds: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT:
            with self._lock:
                self._events.append((str(kwargs.get("fun_name", "?")), seconds))

    def __enter__(self) -> "CompileRecorder":
        monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc) -> None:
        monitoring.unregister_event_duration_listener(self._listen)

    def summary(self) -> dict:
        with self._lock:
            events = list(self._events)
        by_name: dict[str, list] = {}
        for name, seconds in events:
            entry = by_name.setdefault(name, [name, 0, 0.0])
            entry[1] += 1
            entry[2] += seconds
        costliest = sorted(by_name.values(), key=lambda e: -e[2])[:5]
        return {"count": len(events), "seconds": round(sum(s for _, s in events), 3),
                "by_name": [[name, count, round(seconds, 3)] for name, count, seconds in costliest]}


def _served_fields(outputs, submitted, records, bench, shared) -> dict:
    """The load's latency and throughput fields from the finished requests and the step log."""
    n = len(outputs)
    completed = sum(o.finish_reason.value == "length" and len(o.tokens) == bench.decode_tokens for o in outputs)
    ttft = np.array([o.ttft for o in outputs if o.ttft is not None])
    gaps = {o.request_id: np.diff(o.token_times) for o in outputs}
    pooled = np.concatenate([g for g in gaps.values()]) if gaps else np.zeros(0)
    first = min(s + o.token_times[0] for s, o in zip(submitted, outputs) if o.token_times)
    last = max(s + o.token_times[-1] for s, o in zip(submitted, outputs) if o.token_times)
    span = last - submitted[0]
    tokens = sum(len(o.tokens) for o in outputs)
    decode_tokens = sum(max(len(o.tokens) - 1, 0) for o in outputs)
    tbt_p50 = _pct(pooled, 50)

    slo_ttft = bench.serving_slo_ttft_s if bench.serving_slo_ttft_s is not None else 2 * float(np.median(ttft))
    slo_tbt_s = bench.serving_slo_tbt_ms / 1e3 if bench.serving_slo_tbt_ms is not None else 2 * (tbt_p50 or 0.0)
    met = sum(o.ttft is not None and o.ttft <= slo_ttft and
              (len(gaps[o.request_id]) == 0 or _pct(gaps[o.request_id], 99) <= slo_tbt_s) for o in outputs)

    hits = [o.ttft for o in outputs if o.cached_tokens > 0 and o.ttft is not None]
    misses = [o.ttft for o in outputs if o.cached_tokens == 0 and o.ttft is not None]
    hit_over_miss = _ratio(float(np.median(hits)), float(np.median(misses))) if hits and misses else None
    shared_misses = [o.ttft for o, s in zip(outputs, shared) if s and o.cached_tokens == 0 and o.ttft is not None]
    hit_over_shared_miss = (_ratio(float(np.median(hits)), float(np.median(shared_misses)))
                            if hits and shared_misses else None)

    # the same from admission (queueing excluded): what the prefix cache itself saves
    admitted = {o.request_id: o.ttft - o.queued for o in outputs if o.ttft is not None and o.queued is not None}
    hits_admitted = [admitted[o.request_id] for o in outputs if o.cached_tokens > 0 and o.request_id in admitted]
    shared_misses_admitted = [admitted[o.request_id] for o, s in zip(outputs, shared)
                              if s and o.cached_tokens == 0 and o.request_id in admitted]
    hit_over_shared_miss_admitted = (_ratio(float(np.median(hits_admitted)), float(np.median(shared_misses_admitted)))
                                     if hits_admitted and shared_misses_admitted else None)
    prefill_gaps = _gaps_during_prefill(outputs, records)
    prefill_p99 = _pct([g.seconds for g in prefill_gaps], 99)
    decode_span = last - first
    return {"completed": int(completed), "lost": n - int(completed),
            "ttft_p50_s": _round(_pct(ttft, 50), 4), "ttft_p99_s": _round(_pct(ttft, 99), 4),
            "tbt_p50_ms": _round(None if tbt_p50 is None else tbt_p50 * 1e3, 3),
            "tbt_p99_ms": _round(None if len(pooled) == 0 else _pct(pooled, 99) * 1e3, 3),
            "span_s": round(span, 3), "request_throughput": round(n / span, 4) if span > 0 else None,
            "decode_tok_s": round(decode_tokens / decode_span, 2) if decode_span > 0 else None,
            "served_tok_s": round(tokens / span, 2) if span > 0 else None,
            "slo_ttft_s": round(slo_ttft, 4), "slo_tbt_ms": round(slo_tbt_s * 1e3, 3), "slo_met": int(met),
            "goodput": round(met / span, 4) if span > 0 else None,
            "ttft_hit_over_miss": _round(hit_over_miss, 4),
            "ttft_hit_over_shared_miss": _round(hit_over_shared_miss, 4),
            "ttft_hit_over_shared_miss_admitted": _round(hit_over_shared_miss_admitted, 4),
            "per_request": [{"prompt": o.prompt_tokens, "cached": o.cached_tokens, "shared": bool(s),
                             "queued_s": _round(o.queued, 4), "ttft_s": _round(o.ttft, 4)}
                            for o, s in zip(outputs, shared)],
            "tbt_prefill_p99_ms": _round(None if prefill_p99 is None else prefill_p99 * 1e3, 3),
            "tbt_p99_over_p50": _round(_ratio(prefill_p99, tbt_p50), 3),
            "prefill_gaps": len(prefill_gaps), "prefill_gap_longest": _longest_gaps(prefill_gaps)}


def _gaps_during_prefill(outputs, records) -> list[PrefillGap]:
    """Token gaps of requests whose token came from an engine step that also prefilled another
    request. A request's k-th decode step
    (k >= 1) emits its token k (token 0 comes from its prefill), so the step log maps each gap
    token[k-1] -> token[k] to the step that ended it."""
    by_id = {o.request_id: o for o in outputs}
    seen: dict[str, int] = {}
    gaps = []
    previous = None
    for record in records:
        prefilling = {rid for rid, _ in record.prefill}
        for rid in record.decode:
            if rid not in by_id:
                continue
            k = seen[rid] = seen.get(rid, 0) + 1
            times = by_id[rid].token_times
            if k < len(times) and prefilling - {rid}:
                gaps.append(PrefillGap(times[k] - times[k - 1], record, previous))
        previous = record
    return gaps


def _longest_gaps(gaps: list[PrefillGap], n: int = GAPS_SHOWN) -> list[dict]:
    """The n longest gaps, one per step (the requests a step decodes share its gap), each with what
    its step did (what sets the p99): gap_ms, step_ms (the
    step that ended it), prefix_ms (of which in the prefix cache), host_ms, host_cpu_ms, overlap_ms,
    launch_ms, gc_ms, call_ms, capture_ms and calls, first_runs (`StepTimes`), between_ms (from the previous step's end to this one's start),
    previous_step_ms and previous_reset_ms (the previous step's time and, of it, the rows reset after
    its tokens: part of this gap, not of this step), prefill_tokens, decode_rows, admitted, and backend_ms: the backend's time counters that grew
    in the step (the largest BACKEND_SHOWN, ms; background threads' included)."""
    rows, shown = [], set()
    for gap, record, previous in sorted(gaps, key=lambda g: -g.seconds):
        if len(rows) == n:
            break
        if record.step in shown:
            continue
        shown.add(record.step)
        between = None if previous is None else record.started - previous.started - previous.seconds
        rows.append({"gap_ms": round(gap * 1e3, 2), "step": record.step, "step_ms": round(record.seconds * 1e3, 2),
                     "prefix_ms": round(record.prefix_seconds * 1e3, 2),
                     "host_ms": round(record.times.host_seconds * 1e3, 2),
                     "host_cpu_ms": round(record.times.host_cpu_seconds * 1e3, 2),
                     "overlap_ms": round(record.times.overlap_seconds * 1e3, 2),
                     "launch_ms": round(record.times.launch_seconds * 1e3, 2),
                     "gc_ms": round(record.times.gc_seconds * 1e3, 2),
                     "call_ms": round(record.times.call_seconds * 1e3, 2),
                     "capture_ms": round(record.times.capture_seconds * 1e3, 2), "calls": record.times.calls,
                     "first_runs": record.times.first_runs,
                     "between_ms": None if between is None else round(between * 1e3, 2),
                     "previous_step_ms": None if previous is None else round(previous.seconds * 1e3, 2),
                     "previous_reset_ms": None if previous is None else round(previous.times.reset_seconds * 1e3, 2),
                     "prefill_tokens": sum(t for _, t in record.prefill), "decode_rows": len(record.decode),
                     "admitted": record.admitted,
                     "backend_ms": {name: round(d * 1e3, 2) for name, d in record.backend_seconds[:BACKEND_SHOWN]}})
    return rows


def _run_fixed(model, backend, load: Load, bench, slots: int, max_len: int, deadline: float | None) -> dict:
    """The load's prompts as fixed batches of `slots` through Generator (after an untimed batch),
    `serving_repeats` times (fewer past the deadline): each field the median over the repeats (as
    the saturation's), fixed_tok_s_repeats every repeat's tokens/s."""
    from jhybrid.generation import Generator

    generator = Generator(model, backend, prefill_chunk=bench.prefill_chunk, max_len=max_len)
    start = time.perf_counter()
    repeats = []
    try:
        rng = np.random.default_rng(SEED + 2)
        warm = [random_tokens(rng, model.config.vocab_size, len(p)).tolist() for p in load.prompts[:slots]]
        generator.generate(warm, max_new_tokens=min(4, bench.decode_tokens))
        for repeat in range(bench.serving_repeats):
            if repeat and deadline is not None and time.perf_counter() >= deadline:
                log.info("time budget: the fixed batches ran %d of %d repeats", repeat, bench.serving_repeats)
                break
            prefill_s = decode_s = 0.0
            tokens = decode_tokens = 0
            for begin in range(0, len(load.prompts), slots):
                batch = [p.tolist() for p in load.prompts[begin:begin + slots]]
                result = generator.generate(batch, max_new_tokens=bench.decode_tokens)
                prefill_s += result.prefill_seconds
                decode_s += result.decode_seconds
                tokens += sum(len(t) for t in result.tokens)
                decode_tokens += sum(max(len(t) - 1, 0) for t in result.tokens)  # as decode_tokens_per_second
            repeats.append({
                "fixed_decode_tok_s": round(decode_tokens / decode_s, 2) if decode_s > 0 else None,
                "fixed_tok_s": round(tokens / (prefill_s + decode_s), 2) if prefill_s + decode_s > 0 else None,
                "fixed_prefill_s": round(prefill_s, 3), "fixed_decode_s": round(decode_s, 3)})
    finally:
        generator.close()
        gc.collect()
    def median(field):
        values = [r[field] for r in repeats if r[field] is not None]
        return round(float(np.median(values)), 3) if values else None

    return {**{field: median(field) for field in repeats[0]},
            "fixed_tok_s_repeats": [r["fixed_tok_s"] for r in repeats],
            "fixed_s": round(time.perf_counter() - start, 2)}


__all__ = ["run_serving", "make_load", "serving_max_len", "contexts_of"]
