"""Where a serving step's time goes while a prompt prefills beside decoding requests (issue 32's
TBT target for the offloading modes): three requests decode while a fourth prefills one chunk a step.

Phases, each over the same running requests:
  decode      decode-only steps (the three requests decoding)
  chunk       steps that prefill one chunk of the fourth request and decode the three
  chunk-sync  the same, every model call waited for right after its dispatch: each call's own
              device time (its dispatch + wait), and the host work between calls no longer overlapped
  budget      steps that prefill the whole step budget (serving_step_tokens) beside the decoding requests
--trace-dir DIR: a profiler trace of one prefill call of each kind alone (a window-only chunk, one
attending a device copy), the device idle before it: DIR/<kind>/.
--compare OPTIONS (a JSON dict of XLA compile options, `ServingEngine.compiler_options`): instead of
the four phases, decode and chunk phases with the default options, with OPTIONS, and with the
default again (the running requests' contexts grow between passes: the repeat bounds that drift);
each pass's programs compiled in unmeasured steps before it (no `compile_steps`). E.g.
--compare '{"xla_gpu_enable_command_buffer": ""}' (kernels launched one by one, no CUDA graphs).
Per phase: the medians of the step, its host work (`before_step`), its calls, and the backend's
counters that grew, each call kind's dispatch (the time until it returned) and (sync) its whole
time; also the time of `_device_copy` dispatches (scout's recall snapshot).

    PYTHONPATH=. python3 benchmarks/probe_serving_steps.py configs/serving-h100-hybrid.yaml \
        --set benchmark.prefill_chunk=128 --output $OUT/probe-serving-steps.json
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

import numpy as np


def _median(values):
    """The median of seconds, in ms (None: no value)."""
    return round(1e3 * statistics.median(values), 2) if values else None


def _spread(values) -> dict:
    """{"n", "median", "max"} of seconds, in ms."""
    return {"n": len(values), "median": _median(values), "max": round(1e3 * max(values), 2) if values else None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--mode", default="scout")
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--output", required=True)
    parser.add_argument("--trace-dir")
    parser.add_argument("--compare", type=json.loads, help="a JSON dict of XLA compile options to compare")
    args = parser.parse_args()

    import jax

    from jhybrid.bench.offload import backend_for
    from jhybrid.bench.shapes import load_model
    from jhybrid.config.loading import load_config
    from jhybrid.config.sweep import expand_sweep
    from jhybrid.hybrid.modes import scout as scout_module
    from jhybrid.serving import PrefixCacheConfig, Request, ServingEngine

    run = load_config(args.config, args.overrides)
    point = next(p for p in expand_sweep(run) if p.offload.mode == args.mode)
    bench = point.benchmark
    model, _ = load_model(point.model)
    backend, window = backend_for(point.offload, args.context)
    prefix_cache = PrefixCacheConfig(device_bytes=None, host_bytes=int((bench.serving_prefix_cache_mb or 64) * 2**20))
    engine = ServingEngine(model, backend, slots=4, max_len=args.context + 512, prefill_chunk=bench.prefill_chunk,
                           step_token_budget=bench.serving_step_tokens or 4 * bench.prefill_chunk, step_log=100_000,
                           prefix_cache=prefix_cache, prefill_order="shortest",
                           decoding_step_token_budget=bench.prefill_chunk)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size

    # instruments: each call's time by name (sync phases), the recall snapshot dispatches
    calls = collections.defaultdict(list)
    trace, traced = {}, {}  # trace["next"]: the label of the next prefill call to profile (--trace-dir)
    dispatch = collections.defaultdict(list)  # every phase: the time until the call returned
    sync = {"on": False}
    run_call = engine._run

    def timed_run(name, fn, donate, *a):
        label = trace.pop("next", None) if name.startswith("prefill") else None
        if label:  # this call alone in a profiler trace: the device idle before it, waited for after
            jax.block_until_ready(a)
            jax.profiler.start_trace(f"{args.trace_dir}/{label}", create_perfetto_trace=True)
        start = time.perf_counter()
        out = run_call(name, fn, donate, *a)
        if label:
            jax.block_until_ready(out)
            traced[label] = round(1e3 * (time.perf_counter() - start), 2)
            jax.profiler.stop_trace()
        dispatch[name].append(time.perf_counter() - start)
        if sync["on"]:
            jax.block_until_ready(out)
            calls[name].append(time.perf_counter() - start)
        return out

    engine._run = timed_run
    copies = []
    device_copy = scout_module._device_copy

    def timed_copy(x):
        start = time.perf_counter()
        out = device_copy(x)
        copies.append(time.perf_counter() - start)
        return out

    scout_module._device_copy = timed_copy

    def prompt():
        return rng.integers(0, vocab, args.context).tolist()

    t0 = time.perf_counter()
    running = [engine.submit(Request(prompt=prompt(), max_tokens=500, request_id=f"d{i}")) for i in range(3)]
    while len(engine._decoding()) < 3:
        engine.step()
    for _ in range(8):  # the decode step compiled, recalls warm
        engine.step()
    print(f"three requests decoding after {time.perf_counter() - t0:.1f} s", flush=True)
    if args.compare is None:
        engine.compile_steps()

    phases = {}

    def measure(label, n, trace_at=None):
        copies.clear()
        calls.clear()
        dispatch.clear()
        first = len(engine.step_log())
        for i in range(n):
            if args.trace_dir and trace_at and i == trace_at[0]:
                trace["next"] = trace_at[1]
            engine.step()
        records = engine.step_log()[first:]
        grown = collections.defaultdict(list)
        for r in records:
            for name, s in r.backend_seconds:
                grown[name].append(s)
        phases[label] = {
            "steps": len(records), "step_ms": _median([r.seconds for r in records]),
            "step_ms_p90": round(1e3 * float(np.percentile([r.seconds for r in records], 90)), 2),
            "host_ms": _median([r.times.host_seconds for r in records]),
            "call_ms": _median([r.times.call_seconds for r in records]),
            "capture_ms": _median([r.times.capture_seconds for r in records]),
            "prefix_ms": _median([r.prefix_seconds for r in records]),
            "calls": statistics.median([r.times.calls for r in records]) if records else None,
            "prefill_tokens": sum(n for r in records for _, n in r.prefill),
            "backend_ms_median_per_step": {k: round(1e3 * statistics.median(v + [0.0] * (len(records) - len(v))), 2)
                                          for k, v in sorted(grown.items())},
            "device_copy_ms": _spread(copies),
            "dispatch_ms": {k: _spread(v) for k, v in dispatch.items()},
            "calls_ms": {k: _spread(v) for k, v in calls.items()},
        }
        print(label, json.dumps(phases[label]), flush=True)

    if args.compare is not None:
        for n, (label, options) in enumerate((("default", {}), ("compared", args.compare), ("default-again", {}))):
            engine.compiler_options = options
            for _ in range(2):  # this pass's decode step compiled (the first pass's is)
                engine.step()
            measure(f"decode-{label}", args.steps)
            newcomer = engine.submit(Request(prompt=prompt(), max_tokens=4, request_id=f"p{n}"))
            for _ in range(2):  # admitted, its first chunks (the chunk program compiled)
                engine.step()
            measure(f"chunk-{label}", args.steps)
            newcomer.cancel()
            engine.step()  # its row reset
        phases["compared_options"] = args.compare
    else:
        measure("decode", args.steps)
        newcomer = engine.submit(Request(prompt=prompt(), max_tokens=4, request_id="p"))
        engine.step()  # admitted, first chunk
        measure("chunk", args.steps, trace_at=(2, "window-only-chunk"))
        sync["on"] = True
        measure("chunk-sync", args.steps, trace_at=(5, "device-copy-chunk"))
        sync["on"] = False
        engine.decoding_step_token_budget = None  # the whole step budget beside the decoding requests
        measure("budget", max(4, args.steps // 3))
        newcomer.cancel()
    for handle in running:
        handle.cancel()
    while engine.step():
        pass
    out = {"device": str(jax.devices()[0].device_kind), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "command": "PYTHONPATH=. python3 benchmarks/probe_serving_steps.py " + " ".join(
               [args.config] + [f"--set {o}" for o in args.overrides]),
           "mode": args.mode, "context": args.context, "window": window, "layers": model.config.num_layers,
           "prefill_chunk": bench.prefill_chunk, "phases": phases, "traced_calls_ms": traced}
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)
    engine.close(drain=False)


if __name__ == "__main__":
    main()
