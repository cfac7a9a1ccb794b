#!/usr/bin/env bash
# One device call on a one-GPU machine after the tensor-parallel change of the native exchange
# (handlers take the XLA device ordinal and route by it): rebuild the exchange, re-run the GPU tests of
# the native exchange and the Triton keep-all parity, the in-process tensor-parallel backend at degree
# 1 on the GPU (its routing by device ordinal through the real stream-ordered exchange), then the
# 32-layer Llama-3-8B headline points at batch 4 (full, hgca, scout; calibrated 32K contexts).
set -uo pipefail
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 PYTHONPATH=. PYTHONUNBUFFERED=1
bash scripts/build_native.sh python3 2>&1 | tail -1
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_hybrid_native_exchange.py \
  "tests/test_hybrid_exactness.py::test_gpu_triton_kernels_keep_all" \
  "tests/test_parallel.py::test_tensor_parallel_offload_on_one_device" 2>&1 | tee $OUT/gpu-tests-tp.log | tail -6
timeout -s INT -k 10 ${BENCH_S:-220} python3 -m jhybrid.cli bench configs/throughput-h100-l32.yaml \
  --only batch=4 --output-dir $OUT 2>&1 | grep -E "^done|error|Error" | head -20
rm -f $OUT/*.lock $OUT/*.png
