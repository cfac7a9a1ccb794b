#!/usr/bin/env bash
# Gemma 3 on the H100: the sliding-layer parity tests with the GPU kernels (head_dim 256, one KV
# head), then configs/throughput-h100-gemma3.yaml (full at its largest batch, hgca and scout at the
# same batch and at 512). Rows under $OUT.
set -uo pipefail
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 PYTHONPATH=. PYTHONUNBUFFERED=1
bash scripts/build_native.sh python3 2>&1 | tail -1
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_hybrid_sliding.py -x \
  -k "keep_all or layer_ahead or restored" 2>&1 | tail -4
timeout -s INT -k 15 390 python3 -m jhybrid.cli bench configs/throughput-h100-gemma3.yaml --output-dir $OUT 2>&1 \
  | grep -E "^done|^skipped|rror|failed" | head -30
rm -f $OUT/*.lock
