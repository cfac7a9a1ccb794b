#!/usr/bin/env bash
# scout at 64K, named batch and max (configs/throughput-h100-scout-max.yaml); rerun with the first call's JSON
# copied into $OUT (RESUME=path) to finish the sweep.
set -uo pipefail
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 PYTHONPATH=. PYTHONUNBUFFERED=1
[ -n "${RESUME:-}" ] && cp "$RESUME" $OUT/
bash scripts/build_native.sh python3 2>&1 | tail -1
timeout -s INT -k 15 500 python3 -m jhybrid.cli bench configs/throughput-h100-scout-max.yaml --output-dir $OUT 2>&1 \
  | grep -E "^done|^skipped|rror|resumed" | head -30
rm -f $OUT/*.lock
