#!/usr/bin/env bash
# One H100 call: HF transformers' caches on the same shape (peer baseline), then the 32-layer 32K headline.
set -uo pipefail
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 PYTHONPATH=. PYTHONUNBUFFERED=1
bash scripts/build_native.sh python3 2>&1 | tail -1
timeout 150 python3 benchmarks/bench_hf_peer.py --batch 4 --context 32768 --warmup 1 --steps 6 --out $OUT/peer-hf-h100.json 2>&1 | tail -3
timeout -s INT -k 15 420 python3 -m jhybrid.cli bench configs/throughput-h100-l32.yaml --output-dir $OUT 2>&1 | grep -E "^done|^skipped|rror" | head -30
rm -f $OUT/*.lock
