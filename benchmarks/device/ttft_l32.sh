#!/usr/bin/env bash
# Time to first token at 8K on the 32-layer shape (configs/throughput-h100-l32-ttft.yaml).
set -uo pipefail
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 PYTHONPATH=. PYTHONUNBUFFERED=1
bash scripts/build_native.sh python3 2>&1 | tail -1
timeout -s INT -k 15 540 python3 -m jhybrid.cli bench configs/throughput-h100-l32-ttft.yaml --output-dir $OUT 2>&1 \
  | grep -E "^done|^skipped|rror|failed" | head -30
rm -f $OUT/*.lock
