#!/usr/bin/env bash
# Issue 32's serving benchmark on one H100 (configs/serving-h100.yaml), bounded to one device call:
#   bash benchmarks/device/serving_h100.sh                # ~9.5 min
#   RESUME=<previous JSON> bash benchmarks/device/serving_h100.sh   # continues the sweep
# The host kernels compile (numba, cold on a fresh machine) in the background while full mode runs.
set -uo pipefail
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 PYTHONPATH=. PYTHONUNBUFFERED=1
python3 benchmarks/bench_host_attention.py --pattern scout --batch 8 --arena-gib 0.25 --layers 16 --repeats 1 \
  --min-seconds 0 --block-sizes 64 --shares 0.1 --kv-formats bf16 --json /tmp/warm.json > /dev/null 2>&1 &
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
bash benchmarks/device/bench_resumable.sh configs/serving-h100.yaml ${BENCH_S:-550}
