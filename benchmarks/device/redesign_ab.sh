#!/usr/bin/env bash
# Issue 14's guard as a same-machine A/B: the code before the hybrid-core redesign (be7c769, unpacked
# by the caller into .ab/before: `git archive be7c769 jhybrid host pallas_kernels configs scripts
# pyproject.toml | tar -x -C .ab/before`) and the current code, one after the other in one device
# call, on configs/throughput-h100-l32-redesign.yaml (32-layer Llama-3-8B shape, batch 4, 32K, random
# contexts, fixed 25 % split): full, hgca, scout; the current code with the callback transport (the
# redesign's own behaviour) and with the native exchange (the default).
set -uo pipefail
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 PYTHONUNBUFFERED=1
bash scripts/build_native.sh python3 2>&1 | tail -1
CFG=configs/throughput-h100-l32-redesign.yaml
ONLY=(--only mode=full --only mode=hgca --only mode=scout)
(cd .ab/before && PYTHONPATH=. timeout -s INT -k 10 ${BEFORE_S:-200} python3 -m jhybrid.cli bench $CFG "${ONLY[@]}" \
  --output-dir $OUT/before 2>&1 | grep -E "^done|rror" | head)
PYTHONPATH=. timeout -s INT -k 10 ${AFTER_S:-200} python3 -m jhybrid.cli bench $CFG "${ONLY[@]}" \
  --set offload.host_exchange=callback --output-dir $OUT/callback 2>&1 | grep -E "^done|rror" | head
PYTHONPATH=. timeout -s INT -k 10 ${FFI_S:-130} python3 -m jhybrid.cli bench $CFG --only mode=hgca --only mode=scout \
  --set offload.host_exchange=ffi --output-dir $OUT/ffi 2>&1 | grep -E "^done|rror" | head
rm -f $OUT/*/*.lock $OUT/*/*.png $OUT/*/*.csv
