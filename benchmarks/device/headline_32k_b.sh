#!/usr/bin/env bash
# The 32-layer 32K headline (second run, after the first run's fixes).
set -uo pipefail
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 PYTHONPATH=. PYTHONUNBUFFERED=1
bash scripts/build_native.sh python3 2>&1 | tail -1
timeout -s INT -k 15 540 python3 -m jhybrid.cli bench configs/throughput-h100-l32.yaml --output-dir $OUT 2>&1 | grep -E "^done|^skipped|rror" | head -30
rm -f $OUT/*.lock
