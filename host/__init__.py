"""Everything that runs on the CPU: KV store and layout, sparsification, Numba attention,
the executor and exchange worker that run it beside JAX. Never imports `jhybrid` or `pallas_kernels`.
(Which blocks leave the GPU window is decided on the JAX side: `jhybrid.hybrid.window` / `eviction`.)

Modules, in the order data flows through them:
  store_format    StoreConfig, stored dtypes and their conversions
  memory          host memory budget, address-space reservations, slot pools
  kv_store        growable host arenas of offloaded blocks (+ MAW, positions, key digests)
  context_cache   per-head packed copies of the tokens selected for CPU attention
  sparsify        MAW > beta / A.size selection at eviction, and re-evaluation after an append
  paged_view      the page lists every kernel reads; work-item planning
  attention       Numba kernels: (a) context cache, (b) all tokens, (c) chosen blocks -> (o, lse)
  reference       float64 NumPy reference of the attention contract
  executor        worker threads: submit / collect beside the JAX thread
  exchange_worker the native (XLA FFI) exchange's serving thread
  bridge          the host-callback exchange (fallback path)
  numba_threads   explicit thread-safe Numba threading layer (omp, else tbb)
"""

from host.attention import (THREADING_LAYER, attend_all, attend_blocks, attend_context, paged_attention,
                            paged_token_probabilities, token_probabilities)
from host.executor import Handle, HostExecutor
from host.kv_store import KVStore
from host.memory import HostMemoryCapError
from host.store_format import StoreConfig, from_storage, to_storage
from host.sparsify import reevaluate, salience_threshold, sparsify_evicted

__all__ = [
    "THREADING_LAYER", "attend_all", "attend_blocks", "attend_context", "paged_attention",
    "paged_token_probabilities", "token_probabilities",
    "Handle", "HostExecutor",
    "HostMemoryCapError", "KVStore", "StoreConfig", "from_storage", "to_storage",
    "reevaluate", "salience_threshold", "sparsify_evicted",
]
