"""Everything that runs on the CPU: KV store and layout, eviction, sparsification, Numba attention,
the executor that runs it beside JAX. Never imports `jhybrid` or `pallas_kernels`.

Modules, in the order data flows through them:
  eviction        which full blocks leave the GPU ring (HGCA Algorithm 1)
  kv_store        growable host arenas of offloaded blocks (+ MAW, positions, key digests)
  context_cache   per-head packed copies of the tokens selected for CPU attention
  sparsify        MAW > beta / A.size selection at eviction, and re-evaluation after an append
  paged_view      the page lists every kernel reads; work-item planning
  attention       Numba kernels: (a) context cache, (b) all tokens, (c) chosen blocks -> (o, lse)
  reference       float64 NumPy reference of the attention contract
  executor        worker threads: submit / collect beside the JAX thread
  numba_threads   explicit thread-safe Numba threading layer (omp, else tbb)
"""

from host.attention import THREADING_LAYER, attend_all, attend_blocks, attend_context, paged_attention
from host.eviction import EvictionPlan, RingConfig, RingState, commit, plan_eviction
from host.executor import Handle, HostExecutor
from host.kv_store import HostMemoryCapError, KVStore, StoreConfig, from_storage, to_storage
from host.sparsify import reevaluate, salience_threshold, sparsify_evicted

__all__ = [
    "THREADING_LAYER", "attend_all", "attend_blocks", "attend_context", "paged_attention",
    "EvictionPlan", "RingConfig", "RingState", "commit", "plan_eviction",
    "Handle", "HostExecutor",
    "HostMemoryCapError", "KVStore", "StoreConfig", "from_storage", "to_storage",
    "reevaluate", "salience_threshold", "sparsify_evicted",
]
