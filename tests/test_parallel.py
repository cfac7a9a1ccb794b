"""jhybrid.parallel on 4 virtual CPU devices (each check runs in a subprocess: the device count
must be set before JAX starts). See tests/parallel_checks.py for what each check asserts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("check", ["ring_attention", "ring_prefill", "ring_prefill_into_modes", "tensor_parallel"])
def test_parallel(check, rng):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": ROOT}
    seed = int(rng.integers(0, 2**31))
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "parallel_checks.py"), check, str(seed)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"seed {seed}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    assert f"OK {check}" in result.stdout


def test_two_processes_equal_one(tmp_path, rng):
    """TP 2 as two CPU processes under jax.distributed (one device each, gloo) == TP 1 in this process."""
    import socket

    import numpy as np

    from jhybrid.models import create_model
    from tests.parallel_checks import TP_CONFIG, _decode_tp

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    seed = int(rng.integers(0, 2**31))
    out = str(tmp_path / "logits.npy")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu",
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
