"""Past one machine: one process per host under `jax.distributed` (JAX's own coordination and
collectives; NCCL between GPUs, gloo between CPU processes), no transport of our own.

Every process runs the same program: it calls `initialize(...)` first, builds the same model (same
weights: the same checkpoint or seed), then a mesh over `jax.devices()` (every process's devices);
`TensorParallel` places each parameter shard on the process that owns its device
(`jax.make_array_from_callback`), and the jitted step runs as one SPMD program over all processes.

Launch, one command per host (or per process on one host), the same script everywhere:

    JHYBRID_COORDINATOR=host0:12355 JHYBRID_NUM_PROCESSES=2 JHYBRID_PROCESS_ID=0 python my_run.py   # host 0
    JHYBRID_COORDINATOR=host0:12355 JHYBRID_NUM_PROCESSES=2 JHYBRID_PROCESS_ID=1 python my_run.py   # host 1

with `jhybrid.parallel.distributed.initialize_from_env()` at the top of my_run.py (a no-op when the
variables are unset). tests/test_parallel.py checks two CPU processes against one.
"""

from __future__ import annotations

import os

import jax


def initialize(coordinator: str, num_processes: int, process_id: int, local_device_ids=None) -> None:
    """jax.distributed.initialize, with CPU collectives (gloo) when the processes run on CPU."""
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes={num_processes!r}: expected a positive int")
    if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id!r}: expected an int in [0, {num_processes})")
    if os.environ.get("JAX_PLATFORMS", "").startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id,
                               local_device_ids=local_device_ids)


def initialize_from_env() -> bool:
    """initialize() from JHYBRID_COORDINATOR / JHYBRID_NUM_PROCESSES / JHYBRID_PROCESS_ID; False (and
    nothing done) when JHYBRID_COORDINATOR is unset."""
    coordinator = os.environ.get("JHYBRID_COORDINATOR")
    if not coordinator:
        return False
    try:
        n, pid = int(os.environ["JHYBRID_NUM_PROCESSES"]), int(os.environ["JHYBRID_PROCESS_ID"])
    except (KeyError, ValueError) as error:
        raise ValueError(f"JHYBRID_COORDINATOR={coordinator!r} needs JHYBRID_NUM_PROCESSES and JHYBRID_PROCESS_ID "
                         f"as ints ({error})") from None
    initialize(coordinator, n, pid)
    return True


__all__ = ["initialize", "initialize_from_env"]
