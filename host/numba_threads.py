"""Choose Numba's threading layer explicitly, before any parallel kernel runs.

The CPU attention kernels are `parallel=True` functions called from several Python threads at once
(executor workers beside the JAX thread). Numba's `workqueue` layer is not thread safe and aborts
the process in that situation, so we require `omp` (preferred: GNU/Intel OpenMP, shipped with
numba's wheels on Linux) or `tbb` (needs the `tbb` package). `NUMBA_THREADING_LAYER` may name one
of those two; anything else is an error. `numba.set_num_threads` is thread-local: each executor
worker sets its own count.
"""

from __future__ import annotations

import importlib
import logging
import os

import numba

log = logging.getLogger(__name__)

SAFE_LAYERS = ("omp", "tbb")
_MODULE_OF_LAYER = {"omp": "numba.np.ufunc.omppool", "tbb": "numba.np.ufunc.tbbpool"}
_chosen: str | None = None


def _importable(layer: str) -> str | None:
    try:
        importlib.import_module(_MODULE_OF_LAYER[layer])
        return None
    except Exception as exc:  # ImportError, or OSError for a missing libtbb / libgomp
        return f"{type(exc).__name__}: {exc}"


def configure_threading_layer() -> str:
    """Set `numba.config.THREADING_LAYER` to 'omp' or 'tbb' (first importable one); return it.

    Raises RuntimeError when neither is importable, when NUMBA_THREADING_LAYER asks for an unsafe
    layer, or when Numba already launched its threads with an unsafe layer.
    """
    global _chosen
    if _chosen is not None:
        return _chosen
    requested = os.environ.get("NUMBA_THREADING_LAYER", "").strip().lower()
    if requested and requested not in SAFE_LAYERS + ("default", "safe", "threadsafe"):
        raise RuntimeError(f"NUMBA_THREADING_LAYER={requested!r}; host/ needs one of {SAFE_LAYERS} because its "
                           "parallel kernels run from several Python threads (workqueue aborts there)")
    candidates = (requested,) if requested in SAFE_LAYERS else SAFE_LAYERS
    errors = {}
    for layer in candidates:
        err = _importable(layer)
        if err is None:
            try:
                active = numba.threading_layer()  # raises ValueError if threads not launched yet
            except ValueError:
                active = None
            if active is not None and active != layer:
                if active in SAFE_LAYERS:
                    log.info("Numba threads already launched with the %r layer; keeping it", active)
                    _chosen = active
                    return active
                raise RuntimeError(f"Numba already runs the {active!r} threading layer; host/ needs {SAFE_LAYERS}. "
                                   "Import host before running any parallel Numba code.")
            numba.config.THREADING_LAYER = layer
            _chosen = layer
            log.info("Numba threading layer: %s", layer)
            return layer
        errors[layer] = err
        log.warning("Numba threading layer %r is not usable here (%s)", layer, err)
    raise RuntimeError(f"none of the thread-safe Numba threading layers {candidates} is importable: {errors}. "
                       "Install numba's OpenMP runtime (libgomp) or the `tbb` package.")
