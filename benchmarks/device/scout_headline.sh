#!/usr/bin/env bash
# Issue 29's headline in two device calls of one machine kind (H100): full, quest (GPU-only
# block-sparse) and scout (bf16 / int8 host KV) at their largest batches, 32K then 64K, calibrated
# contexts (Gemma 3 statistics) with SmolLM2-calibrated and random rows beside them, batch 1 at 32K.
#   bash benchmarks/device/scout_headline.sh            # first call (~9 min)
#   RESUME=<first call's JSON> bash benchmarks/device/scout_headline.sh   # second call continues
# Compile warm-up of the host kernels (2.5 min on a fresh machine otherwise): the scout pattern of
# benchmarks/bench_host_attention.py at a small size, in the background while the first point fills.
set -uo pipefail
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 PYTHONPATH=. PYTHONUNBUFFERED=1
python3 benchmarks/bench_host_attention.py --pattern scout --batch 8 --arena-gib 0.25 --layers 16 --repeats 1 \
  --min-seconds 0 --block-sizes 16 --shares 0.1 --kv-formats int8 bf16 --json /tmp/warm.json > /dev/null 2>&1 &
bash benchmarks/device/bench_resumable.sh ${BENCH_CONFIG:-configs/throughput-h100-l32-scout.yaml} ${BENCH_S:-540}
