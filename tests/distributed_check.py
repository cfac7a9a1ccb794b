"""One process of the two-process tensor-parallel check (tests/test_parallel.py): each process owns
one CPU device; together they run TP 2 under jax.distributed (gloo collectives), each with the host
side of its own KV heads. Process 0 writes the logits of a prefill + 16 greedy decode steps (`full`)
to OUT, and those of a 40-token prompt + 24 forced decode steps through hgca (evictions, the host
store split over the two processes) to OUT.hgca.npy. Usage: python tests/distributed_check.py
PROCESS_ID PORT SEED OUT"""

from __future__ import annotations

import sys

from jhybrid.parallel.distributed import initialize

if __name__ == "__main__":
    process_id, port, seed, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    initialize(f"localhost:{port}", 2, process_id)

    import jax
    import numpy as np

    from jhybrid.hybrid import make_backend
    from jhybrid.models import create_model
    from tests.hybrid_support import WINDOW
    from tests.parallel_checks import TP_CONFIG, TP_HYBRID, _decode_tp, distributed_prompts, forced_tp

    assert jax.process_count() == 2 and len(jax.devices()) == 2 and len(jax.local_devices()) == 1
    model = create_model(TP_CONFIG, seed=1)
    tokens = np.random.default_rng(seed).integers(0, TP_CONFIG.vocab_size, (2, 24)).astype(np.int32)
    logits = _decode_tp(model, 2, tokens, 16)
    prompt, continuation = distributed_prompts(seed)
    hgca, counters, sharded = forced_tp(create_model(TP_HYBRID, seed=1), make_backend("hgca", **WINDOW), 2, prompt,
                                        continuation)
    assert len(sharded.shards) == 1 and counters["n_evicted_blocks"] > 0, counters
    sharded.close()
    if process_id == 0:
        np.save(out, logits)
        np.save(out + ".hgca.npy", hgca)
    print("OK process", process_id)
