"""Running one model over several devices with JAX's own machinery (a `jax.sharding.Mesh`,
`NamedSharding`, `shard_map`, XLA collectives):

  mesh       the device mesh and its checks (`tensor_mesh`, `sequence_mesh`)
  tensor     tensor parallelism (Megatron layout) of the parameters and the `full` cache
  ring       ring-attention prefill (context parallelism) of one long prompt, handed to any mode

What is not here yet, and says so with a clear error: the offloading modes at a tensor-parallel
degree above 1 (their host stores are not sharded per device), and multi-process runs under
`jax.distributed`.
"""

from jhybrid.parallel.mesh import sequence_mesh, tensor_mesh
from jhybrid.parallel.ring import ring_attention, ring_prefill, ring_prefill_cache
from jhybrid.parallel.tensor import TensorParallel

__all__ = ["tensor_mesh", "sequence_mesh", "TensorParallel", "ring_attention", "ring_prefill", "ring_prefill_cache"]
