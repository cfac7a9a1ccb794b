#!/usr/bin/env bash
# Issue 32 on one H100, bounded to one device call:
#   bash benchmarks/device/serving_h100.sh                          # kernel check + serving sweep
#   KERNEL=0 RESUME=<previous JSON> bash benchmarks/device/serving_h100.sh   # continues the sweep
#   TESTS=1: first the packed-step parity test on the GPU (tests/test_full_packed.py, Triton kernel)
#            and the prefill copies kept across decode steps (tests/test_hybrid_prefill_upload.py)
#   ONLY=TEXT: only the sweep's points whose key contains TEXT (e.g. ONLY=hgca)
#   CONFIG=configs/serving-h100-hybrid.yaml: another serving config (the offloading modes' load)
#   With ONLY naming an offloading mode, the mode's host kernels are compiled BEFORE the bench starts
#   (a kernel the bench reaches while another process still compiles it is compiled again in the
#   bench: one engine step of an earlier hgca call took 158 s).
# 1. benchmarks/bench_prefill_attention.py: the prefill flash kernel checked and timed against the
#    jnp path it replaced ($OUT/prefill-attention-h100.json);
# 2. configs/serving-h100.yaml through bench_resumable.sh (the rest of the call's time).
# The scout host-attention kernels compile (numba, cold on a fresh machine) in the background meanwhile.
set -uo pipefail
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 PYTHONPATH=. PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jhybrid-jax-cache}  # points share compiles
python3 benchmarks/bench_host_attention.py --pattern scout --batch 8 --arena-gib 0.25 --layers 16 --repeats 1 \
  --min-seconds 0 --block-sizes 64 --shares 0.1 --kv-formats bf16 --json /tmp/warm.json > /dev/null 2>&1 &
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
start=$(date +%s)
if [ -n "${ONLY:-}" ] && [ "${ONLY}" != full ]; then
  # The mode's host kernels (Numba, cached on disk) compiled for bf16: the tiny model's serving point
  # on the CPU reaches the kernels the H100 run uses (a fresh machine has no cache).
  JAX_PLATFORMS=cpu JHYBRID_LOG_LEVEL=WARNING timeout 300 python3 -m jhybrid.cli bench configs/serving-cpu.yaml \
    --output-dir /tmp/numba-warm --only "$ONLY" --set model.dtype=bfloat16 --set offload.prefill_offloaded=host \
    > /tmp/numba-warm.log 2>&1
  rc=$?
  echo "host kernels compiled in $(( $(date +%s) - start )) s (rc $rc)"
fi
if [ "${TESTS:-0}" = 1 ]; then
  timeout -k 10 150 python3 -m pytest -q -p no:cacheprovider tests/test_full_packed.py \
    "tests/test_hybrid_prefill_upload.py::test_device_prefill_between_decode_steps_extends_and_uploads_each_row_once" 2>&1 | tail -3
fi
if [ "${KERNEL:-1}" = 1 ]; then
  timeout -k 10 ${KERNEL_S:-200} python3 benchmarks/bench_prefill_attention.py --out "$OUT/prefill-attention-h100.json" \
    --repeats 10 2>&1 | grep -v "^done" | tail -40
fi
left=$(( ${BENCH_S:-575} - ($(date +%s) - start) ))
bash benchmarks/device/bench_resumable.sh "${CONFIG:-configs/serving-h100.yaml}" $left
