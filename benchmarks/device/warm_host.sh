#!/usr/bin/env bash
# The host side's Numba compiles of a fresh device machine, ahead of a timed run (sourced by the
# device scripts; `start` is the script's start, date +%s):
#   warm_kernels MODE   the mode's bf16 host kernels into host/__pycache__, through the CPU serving
#                       point (which reaches the kernels the GPU run uses)
#   warm_exchange       the native exchange worker's 32-layer specialization (a tuple's length is part
#                       of its type; the CPU point's model has 2 layers): otherwise compiled inside the
#                       first 32-layer decode step (138 s on a fresh H100, 2026-11-27b)
# A lock serialises their cache writes, so the two may run side by side.
warm_kernels() {
  JAX_PLATFORMS=cpu JHYBRID_LOG_LEVEL=WARNING timeout 300 python3 -m jhybrid.cli bench configs/serving-cpu.yaml \
    --output-dir "/tmp/numba-warm-$1" --only "$1" --set model.dtype=bfloat16 --set offload.prefill_offloaded=host \
    > "/tmp/numba-warm-$1.log" 2>&1
  local rc=$?
  echo "host kernels of $1 compiled $(( $(date +%s) - start )) s after the start (rc $rc)"
}

warm_exchange() {
  python3 scripts/warm_host_kernels.py --layers 32 --keep --jobs 8 > /tmp/numba-warm-32.log 2>&1
  local rc=$?
  echo "32-layer exchange worker compiled $(( $(date +%s) - start )) s after the start (rc $rc)"
}
