#!/usr/bin/env bash
# One device call: build the native exchange on the GPU machine, run the GPU parity tests of the
# hybrid modes and of the native exchange (H100: stream memory operations, pinned slots), then the
# issue-14 "after" point set (32-layer Llama-3-8B shape, B=4, 32K, every mode, callback transport =
# the redesign's behaviour) and the same hgca / scout / topk points through the native exchange.
set -uo pipefail
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 PYTHONPATH=. PYTHONUNBUFFERED=1
bash scripts/build_native.sh python3 2>&1 | tail -3
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_hybrid_native_exchange.py \
  "tests/test_hybrid_exactness.py::test_gpu_triton_kernels_keep_all" 2>&1 | tee $OUT/gpu-tests.log | tail -15
timeout -s INT -k 10 230 python3 -m jhybrid.cli bench configs/throughput-h100-l32-redesign.yaml \
  --set offload.host_exchange=callback --output-dir $OUT 2>&1 | grep -E "^done|error|Error" | head -20
mv $OUT/throughput-h100-l32-redesign.json $OUT/throughput-h100-l32-redesign-after.json 2>/dev/null
timeout -s INT -k 10 150 python3 -m jhybrid.cli bench configs/throughput-h100-l32-redesign.yaml \
  --set offload.host_exchange=ffi --only hgca --only scout --only topk --output-dir $OUT/ffi 2>&1 | grep -E "^done|error|Error" | head -20
rm -f $OUT/*.lock $OUT/ffi/*.lock $OUT/*.png $OUT/ffi/*.png $OUT/*.csv $OUT/ffi/*.csv
