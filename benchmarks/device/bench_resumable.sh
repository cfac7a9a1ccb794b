#!/usr/bin/env bash
# One config on the GPU machine, bounded so the device call returns its rows:
#   bash benchmarks/device/bench_resumable.sh CONFIG [SECONDS]      (default 530 s)
# RESUME=path/to/previous.json copies an earlier call's results into $OUT first, so the sweep
# continues where that call stopped (jhybrid bench skips the points already in the JSON).
# ONLY=TEXT runs only the points whose key contains TEXT (jhybrid bench --only).
set -uo pipefail
config=${1:?usage: bench_resumable.sh CONFIG [SECONDS]}
seconds=${2:-530}
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 PYTHONPATH=. PYTHONUNBUFFERED=1 JHYBRID_LOG_LEVEL=${JHYBRID_LOG_LEVEL:-INFO}
[ -n "${RESUME:-}" ] && cp "$RESUME" "$OUT"/
bash scripts/build_native.sh python3 2>&1 | tail -1
only=()
[ -n "${ONLY:-}" ] && only=(--only "$ONLY")
timeout -s INT -k 15 "$seconds" python3 -m jhybrid.cli bench "$config" --output-dir "$OUT" "${only[@]}" 2>&1 \
  | tee -a "$OUT/bench.log" | grep -E "^done|^skipped|rror|resumed" | head -30
rm -f "$OUT"/*.lock
