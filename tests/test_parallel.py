"""jhybrid.parallel on 4 virtual CPU devices (each check runs in a subprocess: the device count
must be set before JAX starts). See tests/parallel_checks.py for what each check asserts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.hybrid_support import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


CHECKS = ["ring_attention", "ring_prefill", "ring_prefill_into_modes", "tensor_parallel", "tensor_parallel_offload",
          "generator_and_cli", "bench_tp",
          # recall, topk and streaming at TP 4 too (~30 s more on 2 cores)
          pytest.param("tensor_parallel_offload_every_degree", marks=pytest.mark.slow)]
# Seconds each check takes alone on 2 cores (the longest start first); a check not listed, first.
CHECK_SECONDS = {"tensor_parallel_offload": 95, "generator_and_cli": 45, "bench_tp": 26, "tensor_parallel": 24,
                 "ring_prefill_into_modes": 18, "ring_attention": 15, "ring_prefill": 12}


def check_seed(nodeid: str) -> int:
    """The seed test_parallel[...] of `nodeid` hands its check: the first draw of its `rng`."""
    import numpy as np

    from conftest import seed_of  # tests/conftest.py: the `rng` fixture's seed

    return int(np.random.default_rng(seed_of(nodeid)).integers(0, 2**31))


def run_check(check: str, seed: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLA_FLAGS": xla_flags(4), "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, os.path.join(ROOT, "tests", "parallel_checks.py"), check, str(seed)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def check_runs(request):
    """The subprocesses of every test_parallel check this session runs (selected, not skipped),
    started together on the module's first such test, two at a time: a check is mostly XLA
    compiling on one thread, so a second one uses the other core (the 7 checks ~45 s sooner on 2
    cores). Each still runs alone in its own process; each test asserts on its own check's result.
    -> {check: (seed, future of its CompletedProcess)}."""
    from concurrent.futures import ThreadPoolExecutor

    wanted = {}
    for item in request.session.items:
        if getattr(item, "originalname", None) == "test_parallel" and item.get_closest_marker("skip") is None:
            wanted[item.callspec.params["check"]] = check_seed(item.nodeid)
    pool = ThreadPoolExecutor(max_workers=2)
    runs = {check: (wanted[check], pool.submit(run_check, check, wanted[check]))
            for check in sorted(wanted, key=lambda c: -CHECK_SECONDS.get(c, 10**6))}
    yield runs
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("check", CHECKS)
def test_parallel(check, rng, check_runs):
    seed = int(rng.integers(0, 2**31))
    started_seed, future = check_runs[check]
    assert started_seed == seed, (check, started_seed, seed)
    result = future.result()
    assert result.returncode == 0, f"seed {seed}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    assert f"OK {check}" in result.stdout


def test_two_processes_equal_one(tmp_path, rng):
    """TP 2 as two CPU processes under jax.distributed (one device each, gloo) == TP 1 in this process:
    `full`, and hgca with each process holding the host side of its own KV heads."""
    import socket

    import numpy as np

    from jhybrid.hybrid import make_backend
    from jhybrid.models import create_model
    from tests.hybrid_support import WINDOW, run_forced
    from tests.parallel_checks import TP_CONFIG, TP_HYBRID, _decode_tp, distributed_prompts

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    seed = int(rng.integers(0, 2**31))
    out = str(tmp_path / "logits.npy")
    env = {**os.environ, "XLA_FLAGS": xla_flags(1), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": ROOT}
    script = os.path.join(ROOT, "tests", "distributed_check.py")
    procs = [subprocess.Popen([sys.executable, script, str(i), str(port), str(seed), out], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outputs = []
    try:  # the TP 1 references, computed here while the two processes start up and wait on each other
        tokens = np.random.default_rng(seed).integers(0, TP_CONFIG.vocab_size, (2, 24)).astype(np.int32)
        reference = _decode_tp(create_model(TP_CONFIG, seed=1), 1, tokens, 16)
        prompt, continuation = distributed_prompts(seed)
        hgca_reference, backend, _, _ = run_forced(create_model(TP_HYBRID, seed=1), make_backend("hgca", **WINDOW),
                                                   prompt, continuation)
        backend.close()
        for p in procs:
            outputs.append(p.communicate(timeout=600))
    finally:
        for p in procs:
            p.kill()
    for i, (p, (stdout, stderr)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0 and f"OK process {i}" in stdout, f"process {i}, seed {seed}:\n{stderr[-5000:]}"
    np.testing.assert_allclose(np.load(out), reference, atol=2e-4, rtol=0)
    np.testing.assert_allclose(np.load(out + ".hgca.npy"), hgca_reference, atol=2e-4, rtol=0)


@pytest.mark.parametrize("mode", ["hgca", "scout"])
def test_tensor_parallel_offload_on_one_device(mode, rng):
    """TensorParallel at degree 1 in this process, on the default device (the GPU's native exchange
    when there is one): the sharded backend's shard_map, its host-call routing by device ordinal and
    its per-step slicing of the cache give the plain backend's logits."""
    import jax
    import numpy as np

    from jhybrid.hybrid import make_backend
    from jhybrid.models import create_model
    from tests.hybrid_support import WINDOW, run_forced
    from tests.parallel_checks import MODE_SETTINGS, TP_HYBRID, forced_tp

    model = create_model(TP_HYBRID, seed=1)
    prompt = rng.integers(0, 96, (2, 40)).astype(np.int32)
    continuation = rng.integers(0, 96, (2, 32)).astype(np.int32)
    config = dict(WINDOW, **MODE_SETTINGS[mode])
    with jax.default_matmul_precision("highest"):  # a GPU's default TF32 would blur a float32 tolerance
        reference, backend, _, _ = run_forced(model, make_backend(mode, **config), prompt, continuation)
        backend.close()
        got, counters, sharded = forced_tp(model, make_backend(mode, **config), 1, prompt, continuation)
        sharded.close()
    assert counters["n_evicted_blocks"] > 0
    np.testing.assert_allclose(got, reference, atol=2e-4, rtol=0)
