"""Shared pytest setup: markers for slow and GPU-only tests (skipped with a reason, never passed);
XLA:CPU compiles without LLVM's optimizations (see _fast_xla_compiles)."""

from __future__ import annotations

import os

FAST_COMPILE_FLAG = "--xla_backend_optimization_level=0"


def _fast_xla_compiles() -> None:
    """Most of this suite's time is XLA compiling small programs (a fresh jit per backend and run),
    not running them: without LLVM's optimization passes XLA:CPU compiles them in about half the
    time (the whole suite ~40 % faster on 2 cores) and runs these tiny models as fast. The HLO and
    its numerics are XLA's either way. Set in XLA_FLAGS before JAX starts, so the tests' subprocesses
    inherit it; not where a GPU plugin is installed (a device run keeps XLA's defaults), nor with
    JHYBRID_XLA_OPT=default, nor where XLA_FLAGS already names an optimization level."""
    import importlib.util

    flags = os.environ.get("XLA_FLAGS", "")
    if (os.environ.get("JHYBRID_XLA_OPT") == "default" or "xla_backend_optimization_level" in flags
            or importlib.util.find_spec("jax_plugins") is not None):
        return
    os.environ["XLA_FLAGS"] = f"{flags} {FAST_COMPILE_FLAG}".strip()


_fast_xla_compiles()

import jax  # noqa: E402  (after XLA_FLAGS)
import pytest  # noqa: E402

COMPILE_CACHE_ENV = "JHYBRID_TEST_COMPILE_CACHE"


def _shared_compiles() -> None:
    """Many tests build the same small programs (the same model, backend and shapes, a fresh jit
    each time): JAX's persistent compilation cache lets every test after the first load them instead
    of compiling again, across the pytest workers and the tests' subprocesses (the directory travels
    in JAX_COMPILATION_CACHE_DIR). Keyed by the program, the compile options, the XLA flags and the JAX
    version, so a stale entry is never used. $JHYBRID_TEST_COMPILE_CACHE: the directory (default
    .pytest_cache/jax-compiles in the repository), or 0 to compile everything afresh."""
    where = os.environ.get(COMPILE_CACHE_ENV) or os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache", "jax-compiles")
    if where == "0":
        return
    os.environ["JAX_COMPILATION_CACHE_DIR"] = where  # the tests' subprocesses
    jax.config.update("jax_compilation_cache_dir", where)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)


_shared_compiles()


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


SEED_ENV = "JHYBRID_SEED"


def seed_of(nodeid: str) -> int:
    """The `rng` fixture's seed: crc32 of the test id, mixed with $JHYBRID_SEED when set (so a run
    with fresh seeds is JHYBRID_SEED=<anything>, and a failure replays with the same value)."""
    import zlib

    return zlib.crc32(f"{nodeid}|{os.environ.get(SEED_ENV, '')}".encode())


@pytest.fixture
def rng(request):
    """A NumPy generator per test, seeded from the test id (and $JHYBRID_SEED); the seed is
    added to the failure report (see pytest_runtest_makereport)."""
    import numpy as np

    seed = seed_of(request.node.nodeid)
    request.node.user_properties.append(("seed", seed))
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test that used `rng` reports its seed and how to replay it."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        seeds = [v for k, v in item.user_properties if k == "seed"]
        if seeds:
            replay = os.environ.get(SEED_ENV, "")
            report.sections.append(("rng seed", f"seed {seeds[0]} (replay: {SEED_ENV}={replay!r} "
                                                f"pytest '{item.nodeid}')"))


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct with its tokenizer (the GGUF scripts/setup.sh installs); skipped with
    the reason where it is not installed."""
    pytest.importorskip("gguf")
    from jhybrid.loading.pretrained import load_pretrained, smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except FileNotFoundError as error:  # pragma: no cover - setup.sh installs it
        pytest.skip(f"SmolLM2 GGUF not installed: {error}")
    return load_pretrained("smollm2")


@pytest.fixture(scope="session")
def _short_smollm2():
    pytest.importorskip("gguf")
    from tests.hybrid_support import short_smollm2

    try:
        return short_smollm2()
    except FileNotFoundError as error:  # pragma: no cover - setup.sh installs it
        pytest.skip(f"SmolLM2 GGUF not installed: {error}")


@pytest.fixture
def short_smollm2_cli(_short_smollm2, monkeypatch):
    """`jhybrid generate` (jhybrid.cli) loads a 2-layer SmolLM2 of random weights (its config,
    tokenizer and chat format otherwise: tests.hybrid_support.short_smollm2) instead of the real
    30 layers, for CLI tests of what runs around the model; returns it."""
    from jhybrid import cli

    real = cli._load_with_progress
    monkeypatch.setattr(cli, "_load_with_progress", lambda name, dtype: _short_smollm2
                        if (name, dtype) == ("smollm2", None) else real(name, dtype))
    return _short_smollm2


@pytest.fixture
def smollm2_cli(smollm2, monkeypatch):
    """`jhybrid generate` (jhybrid.cli) gets the session's SmolLM2 (the `smollm2` fixture: the same
    load_pretrained("smollm2"), real weights) instead of loading the GGUF again (~13 s on 2 cores);
    returns it. The CLI's own loader (its progress bar) still runs in `jhybrid serve`'s subprocess
    (tests/test_serving_http.py)."""
    from jhybrid import cli

    real = cli._load_with_progress
    monkeypatch.setattr(cli, "_load_with_progress", lambda name, dtype: smollm2
                        if (name, dtype) == ("smollm2", None) else real(name, dtype))
    return smollm2


@pytest.fixture
def sigint_raises(monkeypatch):
    """SIGINT raises KeyboardInterrupt in this test, as in a terminal, even where the test run was
    started in the background (a shell without job control starts background jobs with SIGINT
    ignored, and Python then installs no handler of its own)."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        yield
        signal.signal(signal.SIGINT, previous)
    else:
        yield
