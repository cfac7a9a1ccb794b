"""reset_rows under tensor parallelism, run by tests/test_hybrid_reset_rows.py in a subprocess with 2
virtual CPU devices (the device count must be set before JAX starts): the reset scenario of that
test (a row reset while the other goes on) through `ShardedOffload` at TP 2 gives the single-device
backend's logits, in scout (pool, recalls, the shards' shared recall trigger). Usage: python
tests/reset_rows_tp_check.py"""

from __future__ import annotations

import numpy as np

from jhybrid.models import create_model
from jhybrid.parallel import TensorParallel, tensor_mesh
from tests.test_hybrid_reset_rows import CONFIG, TOL, Rows, backend_of, scenario


def main() -> None:
    model = create_model(CONFIG, seed=0)
    want = scenario(Rows(model, backend_of("scout"), 2))
    parallel = TensorParallel(model, tensor_mesh(2, model.config), backend_of("scout"))
    assert parallel.backend.reuses_rows
    got = scenario(Rows(model, None, 2, parallel=parallel))
    for phase, (a, b) in enumerate(zip(want, got)):
        np.testing.assert_allclose(b, a, atol=TOL, rtol=0, err_msg=f"phase {phase}")
    counters = parallel.backend.counters()
    assert counters["n_recalls"] > 0 and counters["n_evicted_blocks"] > 0, counters
    for runtime in parallel.backend.runtimes.values():  # each shard's store: row 1's new sequence only
        runtime.evictor.publish_all()
        assert runtime.store.n_blocks(0, 1) == runtime.offloaded_blocks()[1] == 3
    print("OK reset_rows tp")


if __name__ == "__main__":
    main()
