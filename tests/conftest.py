"""Shared pytest setup: markers for slow and GPU-only tests (skipped with a reason, never passed)."""

from __future__ import annotations

import os

import jax
import pytest


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    run_slow = os.environ.get("JHYBRID_RUN_SLOW") == "1"
    has_gpu = _has_gpu()
    skip_slow = pytest.mark.skip(reason="slow test: set JHYBRID_RUN_SLOW=1 to run it")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none is visible to JAX")
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)


@pytest.fixture
def rng(request):
    """A fresh NumPy generator per test, seeded from the test id and reported on failure."""
    import numpy as np
    import zlib

    seed = int.from_bytes(os.urandom(4), "little")
    request.node.user_properties.append(("seed", seed))
    print(f"[rng seed {seed} for {request.node.nodeid} ({zlib.crc32(request.node.nodeid.encode())})]")
    return np.random.default_rng(seed)
