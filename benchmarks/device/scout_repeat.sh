#!/usr/bin/env bash
# scout at 64K repeated (configs/throughput-h100-scout-repeat.yaml); rerun with the first call's JSON
# copied into $OUT (RESUME=path) to finish the sweep.
set -uo pipefail
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 PYTHONPATH=. PYTHONUNBUFFERED=1
[ -n "${RESUME:-}" ] && cp "$RESUME" $OUT/
bash scripts/build_native.sh python3 2>&1 | tail -1
timeout -s INT -k 15 560 python3 -m jhybrid.cli bench configs/throughput-h100-scout-repeat.yaml --output-dir $OUT 2>&1 \
  | grep -E "^done|^skipped|rror|resumed" | head -30
rm -f $OUT/*.lock
