"""jhybrid.parallel on 4 virtual CPU devices (each check runs in a subprocess: the device count
must be set before JAX starts). See tests/parallel_checks.py for what each check asserts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def xla_flags(devices: int) -> str:
    """This run's XLA_FLAGS (tests/conftest.py's compile setting) with `devices` virtual CPU devices."""
    return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()


@pytest.mark.parametrize("check", ["ring_attention", "ring_prefill", "ring_prefill_into_modes", "tensor_parallel",
                                   "tensor_parallel_offload", "generator_and_cli", "bench_tp",
                                   # recall, topk and streaming at TP 4 too (~30 s more on 2 cores)
                                   pytest.param("tensor_parallel_offload_every_degree", marks=pytest.mark.slow)])
def test_parallel(check, rng):
    env = {**os.environ, "XLA_FLAGS": xla_flags(4), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": ROOT}
    seed = int(rng.integers(0, 2**31))
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "parallel_checks.py"), check, str(seed)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
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
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=600))
    finally:
        for p in procs:
            p.kill()
    for i, (p, (stdout, stderr)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0 and f"OK process {i}" in stdout, f"process {i}, seed {seed}:\n{stderr[-5000:]}"
    tokens = np.random.default_rng(seed).integers(0, TP_CONFIG.vocab_size, (2, 24)).astype(np.int32)
    reference = _decode_tp(create_model(TP_CONFIG, seed=1), 1, tokens, 16)
    np.testing.assert_allclose(np.load(out), reference, atol=2e-4, rtol=0)
    prompt, continuation = distributed_prompts(seed)
    reference, backend, _, _ = run_forced(create_model(TP_HYBRID, seed=1), make_backend("hgca", **WINDOW), prompt,
                                          continuation)
    backend.close()
    np.testing.assert_allclose(np.load(out + ".hgca.npy"), reference, atol=2e-4, rtol=0)


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
