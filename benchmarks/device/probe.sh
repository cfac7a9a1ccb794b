#!/usr/bin/env bash
# What the GPU machine offers for the native build (one-off facts for the design of the exchange).
echo "== machine"; nproc; free -g | head -2; lscpu | grep -E "Model name|NUMA|L3" ; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
echo "== tools"; which nvcc cmake ninja g++ gcc; nvcc --version | tail -2; g++ --version | head -1; cmake --version | head -1
python3 - <<'PY'
import jax, jaxlib, numba, numpy, sys, importlib
print("python", sys.version.split()[0], "jax", jax.__version__, "jaxlib", jaxlib.__version__, "numba", numba.__version__, "numpy", numpy.__version__)
print("ffi include", jax.ffi.include_dir())
for m in ("nanobind", "scikit_build_core", "flax", "orbax.checkpoint", "transformers", "torch", "ml_dtypes", "yaml", "rich", "gguf", "tokenizers", "safetensors", "matplotlib"):
    try:
        mod = importlib.import_module(m); print(m, getattr(mod, "__version__", "?"))
    except Exception as e:
        print(m, "MISSING", e)
print(jax.devices())
PY
