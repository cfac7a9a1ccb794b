#!/usr/bin/env bash
# Issue 32's offloading modes on one H100, one device call, the bench run under the stack sampler:
#   MODE=hgca bash benchmarks/device/serving_hybrid_h100.sh [extra jhybrid bench args, e.g. --set ...]
# 1. the mode's Numba host kernels compiled for bf16 (the CPU serving point reaches the kernels the
#    H100 run uses; a fresh machine has no cache), the native exchange built;
# 2. configs/serving-h100-hybrid.yaml --only $MODE under benchmarks/stack_sample.py
#    ($OUT/serving-h100-$MODE-stacks.txt), cut by SIGINT at BENCH_S (default 520) seconds after the
#    script's start: a process killed mid-run holding ~35 GiB of pinned host memory took over a minute
#    to exit (a call ran past its 600 s and returned no row), so the margin is wide.
set -uo pipefail
mode=${MODE:?MODE=hgca or scout}
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 PYTHONPATH=. PYTHONUNBUFFERED=1 JHYBRID_LOG_LEVEL=INFO
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jhybrid-jax-cache}
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
bash scripts/build_native.sh python3 2>&1 | tail -1
JAX_PLATFORMS=cpu JHYBRID_LOG_LEVEL=WARNING timeout 300 python3 -m jhybrid.cli bench configs/serving-cpu.yaml \
  --output-dir /tmp/numba-warm --only "$mode" --set model.dtype=bfloat16 --set offload.prefill_offloaded=host \
  > /tmp/numba-warm.log 2>&1
rc=$?
echo "host kernels compiled in $(( $(date +%s) - start )) s (rc $rc)"
left=$(( ${BENCH_S:-520} - ($(date +%s) - start) ))
timeout -s INT -k 10 "$left" python3 benchmarks/stack_sample.py --out "$OUT/serving-h100-$mode-stacks.txt" --every 0.5 -- \
  jhybrid.cli bench configs/serving-h100-hybrid.yaml --output-dir "$OUT" --only "$mode" "$@" 2>&1 \
  | tee -a "$OUT/bench.log" | grep -E "^done|^skipped|rror|resumed|slow step|Traceback" | head -40
echo "bench ended after $(( $(date +%s) - start )) s"
rm -f "$OUT"/*.lock
