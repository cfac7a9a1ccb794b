"""Everything that runs on the CPU: KV store and layout, eviction, sparsification, Numba attention,
the executor that runs it beside JAX. Never imports `jhybrid` or `pallas_kernels`."""
