#!/usr/bin/env bash
# Issue 32's offloading modes on one H100, one device call, the bench run under the stack sampler:
#   MODE=hgca bash benchmarks/device/serving_hybrid_h100.sh [extra jhybrid bench args, e.g. --set ...]
# 1. (beside step 2 unless SERIAL_WARM=1) the mode's Numba host kernels compiled for bf16 (the CPU serving point reaches the kernels the
#    H100 run uses; a fresh machine has no cache, a warm one keeps host/__pycache__ between calls, so a
#    second call skips the compile), the native exchange built;
#    BG_WARM=<other mode> compiles that mode's kernels too, in the background while the bench loads the
#    model and compiles its steps (both untimed; the log says when it ended, to check it ended before
#    the timed load), so that the next call on the same warm machine finds them;
# 2. configs/serving-h100-hybrid.yaml --only $MODE under benchmarks/stack_sample.py
#    ($OUT/serving-h100-$MODE-stacks.txt; STACK_EVERY seconds between samples, default 0.5, STACK_TOP
#    places per thread, default 15; STACK_PHASE=TEXT samples only in the bench phases containing TEXT,
#    e.g. "requests at" for the load: a 50 Hz sampler over the compiles made session p's warm-up 90 s
#    longer), cut by SIGINT at BENCH_S (default 520) seconds after the
#    script's start: a process killed mid-run holding ~35 GiB of pinned host memory took over a minute
#    to exit (a call ran past its 600 s and returned no row), so the margin is wide.
# JHYBRID_PROFILE=START:SECONDS:DIR traces SECONDS of the load (JHYBRID_PROFILE_PHASE=warmup or saturation:
# of that phase; START s after its first request) and
# sums the trace into $OUT/serving-h100-$MODE-trace.{txt,json} (benchmarks/trace_summary.py).
# JAX's compilation cache lives in /tmp/jhybrid-jax-cache: a second call on the same warm machine
# reuses the step compiles of the first. A fresh machine reuses a former call's compiles (Numba's and
# JAX's) when they travel with the tree (benchmarks/device/device_cache.sh): SAVE_CACHE=1 writes them
# to $OUT/device-cache.txz.part*; copy those into .device_cache/ here and name it in the call's carry.
# The kernels' warm-up through the CPU serving point is then skipped (the 32-layer exchange warm-up
# still runs, from the cache).
# PROBE=1 first times and traces one prefill-copy-sized upload and download (transfer_probe.py).
# DUMP_HLO=1 dumps the optimized HLO of the prefill steps and appends their copy instructions to the
# trace summary.
set -uo pipefail
mode=${MODE:?MODE=hgca or scout}
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 PYTHONPATH=. PYTHONUNBUFFERED=1 JHYBRID_LOG_LEVEL=INFO
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jhybrid-jax-cache}
start=$(date +%s); SECONDS=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
lscpu | grep "Model name"
source benchmarks/device/device_cache.sh
restored=0; device_cache_restore .device_cache && restored=1
bash scripts/build_native.sh python3 2>&1 | tail -1
if [ "${PROBE:-0}" = 1 ]; then python3 benchmarks/device/transfer_probe.py 2>&1 | grep -v "^W0\|^I0" | head -40; fi
if [ "${DUMP_HLO:-0}" = 1 ]; then
  hlo_flags="--xla_dump_to=/tmp/hlo --xla_dump_hlo_module_re=prefill --xla_dump_hlo_as_text"  # the bench's alone
fi
source benchmarks/device/warm_host.sh
# The mode's kernels and the 32-layer exchange worker compile side by side, and beside the bench's
# model load and step compiles (SERIAL_WARM=1: before the bench, as up to session m): on a fresh
# H200 the warms took 175 s and the bench's load + compile_steps 225 s, one after the other, leaving
# too little of a 600 s call for the load, saturation and fixed batches (session m, calls 1 and 2).
# The bench first calls the host kernels in its warm-up requests, after compile_steps; the lines
# "... compiled N s after the start" and "N s ... warm-up requests" say whether the warms ended
# before (if not, the warm-up requests compile what is missing themselves: untimed, and the cache
# writes race at worst into a recompile later, never into a wrong kernel).
if [ "$restored" = 1 ]; then echo "host kernels: from the device cache"; else warm_kernels "$mode" & warm_pid=$!; fi
# (WARM_EXCHANGE=0 leaves the exchange worker to the warm-up: 138 s here on a fresh machine, call 1 of
# 2026-11-27b; call 6 of 2026-11-27 traced 4 s of a warm-up step inside a Numba compile, the GPU idle)
if [ "${WARM_EXCHANGE:-1}" = 1 ]; then warm_exchange & exchange_pid=$!; fi
if [ "${SERIAL_WARM:-0}" = 1 ]; then
  [ -n "${warm_pid:-}" ] && wait "$warm_pid"
  [ -n "${exchange_pid:-}" ] && wait "$exchange_pid"
fi
if [ -n "${BG_WARM:-}" ] && [ "$restored" = 0 ]; then warm_kernels "$BG_WARM" & fi
left=$(( ${BENCH_S:-520} - ($(date +%s) - start) ))
[ -n "${hlo_flags:-}" ] && export XLA_FLAGS="${XLA_FLAGS:-} $hlo_flags"
timeout -s INT -k 10 "$left" python3 benchmarks/stack_sample.py --out "$OUT/serving-h100-$mode-stacks.txt" \
  --every "${STACK_EVERY:-0.5}" --top "${STACK_TOP:-15}" ${STACK_PHASE:+--phase "$STACK_PHASE"} -- \
  jhybrid.cli bench configs/serving-h100-hybrid.yaml --output-dir "$OUT" --only "$mode" "$@" 2>&1 \
  | while IFS= read -r line; do echo "${SECONDS}s $line"; done \
  | tee -a "$OUT/bench.log" | grep -E "s (done|skipped)|rror|resumed|slow step|Traceback|request [0-9]+/|step [0-9]+ took|load served" | awk 'NR <= 80'  # reads to the end: head would close the pipe and kill the bench
echo "bench ended after $(( $(date +%s) - start )) s"
if [ -n "${JHYBRID_PROFILE:-}" ]; then  # START:SECONDS:DIR, a trace of the load (jhybrid/bench/serving.py)
  python3 benchmarks/trace_summary.py "${JHYBRID_PROFILE#*:*:}" --top 30 --json "$OUT/serving-h100-$mode-trace.json" \
    --detail Memcpy > "$OUT/serving-h100-$mode-trace.txt" 2>&1; head -c 6000 "$OUT/serving-h100-$mode-trace.txt"
  grep -A12 "matching 'Memcpy'" "$OUT/serving-h100-$mode-trace.txt" | cut -c1-400
fi
if [ "${DUMP_HLO:-0}" = 1 ]; then  # the copies XLA kept in the optimized prefill programs
  for f in /tmp/hlo/*after_optimizations.txt; do
    echo "== $(basename "$f"): $(grep -c ' copy(' "$f") copies, $(grep -c 'copy-start' "$f") copy-starts, $(grep -c 'S(5)' "$f") S(5)"
    grep -oE '= [^ ]+ (copy|copy-start)\(' "$f" | sort | uniq -c | sort -rn | head -8
  done >> "$OUT/serving-h100-$mode-trace.txt" 2>&1
  tail -40 "$OUT/serving-h100-$mode-trace.txt"
fi
wait
rm -f "$OUT"/*.lock
if [ "${SAVE_CACHE:-0}" = 1 ]; then
  rm -f "$OUT"/*.csv "$OUT"/*.png  # the device tool returns 8 files: the rows are in the JSON
  device_cache_save "$OUT"
fi
ls -la "$OUT"
