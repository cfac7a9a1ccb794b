#!/usr/bin/env bash
# Builds the native host exchange (host/native/exchange.cc -> build/native/lib/libjhybrid_exchange.so)
# with the environment's Python (for jax.ffi.include_dir()), cmake and a C++17 compiler (ninja if
# present). No CUDA toolkit is needed. Idempotent: skips when the library is newer than its sources.
# Usage: bash scripts/build_native.sh [python]   (default: .venv/bin/python, else python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
lib=build/native/lib/libjhybrid_exchange.so
if [ -f "$lib" ] && [ -z "$(find host/native -newer "$lib" -type f)" ]; then
  exit 0
fi
include=$("$PY" -c "import jax.ffi; print(jax.ffi.include_dir())")
generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
cmake -S host/native -B build/native "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DXLA_FFI_INCLUDE_DIR="$include" -DJHYBRID_OUTPUT_DIR="$PWD/build/native/lib" >/dev/null
cmake --build build/native >/dev/null
echo "[native] built $lib"
