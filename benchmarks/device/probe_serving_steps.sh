#!/usr/bin/env bash
# benchmarks/probe_serving_steps.py on one GPU (two of its prefill calls traced: $OUT/probe-trace-*):
#   bash benchmarks/device/probe_serving_steps.sh [extra probe args, e.g. --compare '{"xla_gpu_enable_command_buffer": ""}']
# With the device cache carried (.device_cache, benchmarks/device/device_cache.sh) the host kernels come
# from it; without one (a fresh machine, or another kind: Numba's code is keyed by the CPU model and
# JAX's programs by the device kind) they are compiled first (benchmarks/device/warm_host.sh).
# SAVE_CACHE=1 writes this call's compiles to $OUT/device-cache.txz.part*.
set -uo pipefail
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 PYTHONPATH=. PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jhybrid-jax-cache}
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
lscpu | grep "Model name"
source benchmarks/device/device_cache.sh
source benchmarks/device/warm_host.sh
restored=0; device_cache_restore .device_cache && restored=1
bash scripts/build_native.sh python3 2>&1 | tail -1
if [ "$restored" = 0 ]; then
  warm_kernels scout & warm_pid=$!
  warm_exchange
  wait "$warm_pid"
fi
left=$(( ${PROBE_S:-540} - ($(date +%s) - start) ))
timeout -s INT -k 10 "$left" python3 benchmarks/probe_serving_steps.py configs/serving-h100-hybrid.yaml \
  --set benchmark.prefill_chunk=128 --output "$OUT/probe-serving-steps.json" --trace-dir /tmp/ptrace "$@" 2>&1 \
  | grep -v "^W0\|^I0" | tail -40
for kind in window-only-chunk device-copy-chunk; do  # each traced prefill call's device time, per kernel and op
  [ -d "/tmp/ptrace/$kind" ] || continue
  timeout 60 python3 benchmarks/trace_summary.py "/tmp/ptrace/$kind" --top 60 --detail "." \
    --json "$OUT/probe-trace-$kind.json" > "$OUT/probe-trace-$kind.txt" 2>&1
  grep -A30 "^/device:GPU:0" "$OUT/probe-trace-$kind.txt" | head -34 | cut -c1-200
done
echo "probe ended after $(( $(date +%s) - start )) s"
rm -f "$OUT"/*.lock
if [ "${SAVE_CACHE:-0}" = 1 ]; then device_cache_save "$OUT"; fi
