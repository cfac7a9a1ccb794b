#!/usr/bin/env bash
# The parity suite's two "done when" checks of issue 20, run on the GPU machine's 16 CPU cores
# (JAX on CPU; the real-weight tests skip there: no GGUF package). Writes logs and a JSON summary
# under $OUT.
#   MUTATIONS=1: break one policy at a time in a scratch copy of the repository (the MAW update, the
#     salience threshold, the eviction schedule, the top-k order, the merge's max-subtraction, the
#     HCache planner's choice) plus an unbroken control; each broken copy must fail a CPU test of
#     tests/test_policy_oracles.py, test_merge.py, test_hcache_planner.py or test_host_sparsify.py.
#   SEED_RUNS_S=<seconds>: then repeat every test module that draws from the seeded `rng` fixture with a
#     fresh JHYBRID_SEED per run (pytest-xdist, 14 workers) until the time is spent.
# Usage (device tool): MUTATIONS=1 SEED_RUNS_S=300 bash benchmarks/device/suite_checks.sh
set -uo pipefail
export JAX_PLATFORMS=cpu PYTHONUNBUFFERED=1
ROOT=$(pwd)
OUT=${OUT:-/tmp/suite-checks}
mkdir -p "$OUT"
POLICY_TESTS="tests/test_policy_oracles.py tests/test_merge.py tests/test_hcache_planner.py tests/test_host_sparsify.py"

mutate() {  # name file old new cores
  local name=$1 dir=/tmp/mutant-$1
  rm -rf "$dir"; mkdir -p "$dir"
  tar --exclude=./build --exclude=./.git --exclude=./.venv --exclude=__pycache__ -cf - . | tar -xf - -C "$dir"
  python3 - "$dir/$2" "$3" "$4" <<'PY' || { echo "$name: could not apply" > "$OUT/mutant-$name.log"; return; }
import sys
path, old, new = sys.argv[1:]
text = open(path).read()
assert text.count(old) == 1, f"{path}: {old!r} found {text.count(old)} times"
open(path, "w").write(text.replace(old, new))
PY
  (cd "$dir" && PYTHONPATH=. taskset -c "$5" timeout 480 python3 -m pytest -q -x -p no:cacheprovider \
     $POLICY_TESTS > "$OUT/mutant-$name.log" 2>&1; echo "rc=$?" >> "$OUT/mutant-$name.log")
}

if [ "${MUTATIONS:-0}" = 1 ]; then
  start=$(date +%s)
  mutate control jhybrid/merge.py "m = jnp.max(lse_stack, axis=0)" "m = jnp.max(lse_stack, axis=0)" 0,1 &
  mutate maw_update jhybrid/hybrid/window.py \
    "new = (1.0 - cfg.alpha) * maw + cfg.alpha * probs.astype(jnp.float32)" \
    "new = (1.0 - cfg.alpha) * maw + probs.astype(jnp.float32)" 2,3 &
  mutate threshold host/sparsify.py "return float(beta) / float(a_size)" "return 0.5 * float(beta) / float(a_size)" 4,5 &
  mutate eviction_schedule jhybrid/hybrid/window.py \
    "return (over + cfg.block_size - 1) // cfg.block_size * (over > 0)" "return over // cfg.block_size * (over > 0)" 6,7 &
  mutate topk_order pallas_kernels/block_digest.py "_, ids = jax.lax.top_k(scores, k)" "_, ids = jax.lax.top_k(-scores, k)" 8,9 &
  mutate merge_stabilisation jhybrid/merge.py "m = jnp.max(lse_stack, axis=0)" \
    "m = jnp.zeros_like(jnp.max(lse_stack, axis=0))" 10,11 &
  mutate planner jhybrid/hcache/planner.py "seconds < best[0] - 1e-12" "seconds > best[0] + 1e-12" 12,13 &
  wait
  echo "mutations: $(( $(date +%s) - start )) s"
  for f in "$OUT"/mutant-*.log; do
    echo "$(basename "$f" .log): $(grep -E '^rc=' "$f") $(grep -E '^FAILED' "$f" | head -1) $(tail -3 "$f" | grep -E 'passed|failed' | head -1)"
  done | tee "$OUT/mutants.txt"
fi

if [ "${SEED_RUNS_S:-0}" -gt 0 ]; then
  RNG_TESTS=$(grep -lE "def test_[a-z0-9_]+\([^)]*\brng\b" tests/*.py | tr '\n' ' ')
  end=$(( $(date +%s) + SEED_RUNS_S ))
  run=0
  while [ "$(date +%s)" -lt "$end" ]; do
    run=$((run + 1)); seed="fresh-$(date +%s%N)"
    t0=$(date +%s)
    JHYBRID_SEED=$seed PYTHONPATH=. timeout $(( end - $(date +%s) + 20 )) python3 -m pytest -q -p no:cacheprovider \
      -n 14 $RNG_TESTS > "$OUT/seed-run-$run.log" 2>&1
    rc=$?
    echo "run $run JHYBRID_SEED=$seed rc=$rc $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/seed-run-$run.log")" | tee -a "$OUT/seed-runs.txt"
    grep -E "^(FAILED|ERROR)|rng seed|seed [0-9]+ \(replay" "$OUT/seed-run-$run.log" >> "$OUT/seed-runs.txt"
    rm -f "$OUT/seed-run-$run.log"
  done
fi
