"""Running one model over several devices with JAX's own machinery (a `jax.sharding.Mesh`,
`NamedSharding`, `shard_map`, XLA collectives):

  mesh         the device mesh and its checks (`tensor_mesh`, `sequence_mesh`)
  tensor       tensor parallelism (Megatron layout) of the parameters and the cache
  offload      the offloading modes under tensor parallelism: one host side per device
               (`ShardedOffload`, built by `TensorParallel` from any offloading backend)
  ring         ring-attention prefill (context parallelism) of one long prompt, handed to any mode
  distributed  one process per host under `jax.distributed` (each process serves its own devices)
"""

from jhybrid.parallel.mesh import sequence_mesh, tensor_mesh
from jhybrid.parallel.offload import ShardedOffload
from jhybrid.parallel.ring import ring_attention, ring_prefill, ring_prefill_cache
from jhybrid.parallel.tensor import TensorParallel

__all__ = ["tensor_mesh", "sequence_mesh", "TensorParallel", "ShardedOffload", "ring_attention", "ring_prefill",
           "ring_prefill_cache"]
