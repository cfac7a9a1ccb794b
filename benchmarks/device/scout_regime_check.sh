#!/usr/bin/env bash
# One device call before the headline run of scout's new regime (issue 29): build the native exchange,
# the GPU tests of the new and changed paths, the host attention on scout's selected-block pattern
# against streaming (benchmarks/bench_host_attention.py --pattern scout), and a quick throughput check
# (configs/throughput-h100-l32-scout-check.yaml).
set -uo pipefail
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 PYTHONPATH=. PYTHONUNBUFFERED=1
bash scripts/build_native.sh python3 2>&1 | tail -1
timeout ${TEST_S:-200} python3 -m pytest -q -p no:cacheprovider -x tests/test_mode_quest.py tests/test_scout_regime.py \
  tests/test_hybrid_native_exchange.py "tests/test_hybrid_exactness.py::test_gpu_triton_kernels_keep_all" 2>&1 \
  | tee $OUT/gpu-tests-scout-regime.log | tail -4
timeout ${HOST_S:-110} python3 benchmarks/bench_host_attention.py --pattern scout --json $OUT/host-attention-scout.json \
  2>&1 | tail -14
timeout -s INT -k 10 ${BENCH_S:-240} python3 -m jhybrid.cli bench configs/throughput-h100-l32-scout-check.yaml \
  --output-dir $OUT 2>&1 | grep -E "^done|^skipped|rror" | head -20
rm -f $OUT/*.lock $OUT/*.png $OUT/*.csv
