#!/usr/bin/env bash
# 8-bit host KV on the H100 machine (issue 16): the host-attention kernels in both formats at
# Llama's head size (DRAM-sized points included), then the 32-layer throughput sweep of
# configs/throughput-h100-l32-int8.yaml. Results land in $OUT.
#   HOST_ATTN_S=0 skips the kernels, BENCH_S=0 the sweep; RESUME=<json> resumes a sweep's results.
set -uo pipefail
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 PYTHONPATH=. PYTHONUNBUFFERED=1
bash scripts/build_native.sh python3 2>&1 | tail -1
HOST_ATTN_S=${HOST_ATTN_S:-240}; BENCH_S=${BENCH_S:-400}
if [ "$HOST_ATTN_S" -gt 0 ]; then
  # the first call of each kernel compiles it (Numba, no cache on a fresh machine): tens of seconds
  timeout -s INT -k 10 $HOST_ATTN_S python3 benchmarks/bench_host_attention.py --dims 128 \
    --batch-heads 32 128 --tokens 4096 16384 65536 --kv-formats bf16 int8 --baseline-max-mib 0 \
    --time-budget $((HOST_ATTN_S - 60)) --out $OUT/host-attention-h100-8bit.json 2>&1 \
    | grep -vE "^append|^sparsify|^arena" | tail -25
fi
if [ "$BENCH_S" -gt 0 ]; then
  if [ -f "${RESUME:-}" ]; then cp "$RESUME" $OUT/; fi
  timeout -s INT -k 15 $BENCH_S python3 -m jhybrid.cli bench configs/throughput-h100-l32-int8.yaml \
    --output-dir $OUT --set benchmark.time_budget_s=$((BENCH_S - 40)) 2>&1 \
    | grep -E "^done|^skipped|rror|failed" | head -30
fi
rm -f $OUT/*.lock
