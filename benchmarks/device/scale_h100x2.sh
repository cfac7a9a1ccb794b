#!/usr/bin/env bash
# Issue 30 on nvidia-h100-x2 (two H100s of one host): rebuild the native exchange, the two-GPU tests
# (tests/test_parallel_gpu.py: TP 2 == TP 1 per mode), then configs/scale-h100x2.yaml in one run.
set -uo pipefail
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 PYTHONPATH=. PYTHONUNBUFFERED=1
bash scripts/build_native.sh python3 2>&1 | tail -1
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_parallel_gpu.py 2>&1 | tee $OUT/gpu-tests-tp2.log | tail -4
timeout -s INT -k 10 ${BENCH_S:-330} python3 -m jhybrid.cli bench configs/scale-h100x2.yaml --output-dir $OUT \
  2>&1 | grep -E "^done|error|Error|tok/s" | head -30
rm -f $OUT/*.lock
