"""The stream-ordered native exchange (host/native/exchange.cc + host.exchange_worker) on XLA:CPU.

The same protocol runs on a GPU with stream memory operations instead of memcpy / atomics; here CI
checks: decode steps go through the custom calls (no callback per layer) and give exactly the
callback transport's logits and, at keep-all, full attention's; a worker error surfaces at the next
step start with the layer and the worker's traceback, a step nobody serves is an error after the
timeout, never a hang; a missing library is a logged fallback ("auto") or a one-line error ("ffi").
"""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

import host.exchange_worker as worker_module
from jhybrid.hybrid import make_backend
from jhybrid.models import create_model
from tests.hybrid_support import KEEP_ALL, SCOUT_RECALLS, TINY, TOL, run_forced, window_only_chunks

B, PROMPT, STEPS = 2, 40, 24

pytestmark = pytest.mark.skipif(not __import__("os").path.exists(worker_module.library_path()),
                                reason="the native exchange is not built (bash scripts/build_native.sh)")


@pytest.fixture(autouse=True, scope="module")
def full_float32_matmuls():
    """On a GPU, XLA's float32 matmuls default to TF32 (~1e-3 relative): these tolerances are for
    float32 arithmetic (the same file then checks the GPU's stream-ordered path)."""
    import jax

    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(scope="module")
def model():
    return create_model(TINY, seed=0)


@pytest.fixture(scope="module")
def tokens():
    rng = np.random.default_rng(4321)
    return rng.integers(0, 97, (B, PROMPT)).astype(np.int32), rng.integers(0, 97, (B, STEPS)).astype(np.int32)


@pytest.fixture(scope="module")
def reference(model, tokens):
    return run_forced(model, make_backend("full"), *tokens)[0]


CASES = {
    "hgca": dict(mode="hgca", **KEEP_ALL),
    "hgca-beta": dict(mode="hgca", **{**KEEP_ALL, "beta": 1.0}),  # a real threshold: sparsify must precede
    "topk": dict(mode="topk", **KEEP_ALL),
    "topk-budget": dict(KEEP_ALL, mode="topk", budget=16),
    "scout-exact": dict(mode="scout", predict_query=False, **SCOUT_RECALLS, **KEEP_ALL),
    "scout-predicted": dict(mode="scout", **SCOUT_RECALLS, **KEEP_ALL),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ffi_equals_callbacks_and_keep_all_equals_full(model, tokens, reference, case):
    runs = {}
    for transport in ("callback", "ffi"):
        backend = make_backend(host_exchange=transport, **CASES[case])
        logits, backend, _, _ = run_forced(model, backend, *tokens)
        runs[transport] = (logits, backend.counters(), type(backend.exchange).__name__)
        backend.close()
    (cb, cb_counters, cb_kind), (ffi, ffi_counters, ffi_kind) = runs["callback"], runs["ffi"]
    assert (cb_kind, ffi_kind) == ("CallbackExchange", "FfiExchange")
    np.testing.assert_allclose(ffi, cb, atol=1e-6, rtol=0)
    if case in ("hgca", "topk", "scout-exact"):
        np.testing.assert_allclose(ffi, reference, atol=TOL, rtol=0)
    assert ffi_counters["exchange_steps"] == STEPS  # every decode step through the custom calls ...
    # the worker's wait for the queries is part of its serve time
    assert 0 < ffi_counters["exchange_idle_s"] <= ffi_counters["exchange_serve_s"]
    # per layer and prefill chunk: hgca hands its host part the chunk's queries, and a chunk with
    # offloaded tokens submits and collects (the others attend to the window alone)
    hgca = CASES[case]["mode"] == "hgca"
    chunks, window_only = -(-PROMPT // 16), window_only_chunks(PROMPT)
    prefill_callbacks = TINY.num_layers * (hgca * chunks + 2 * (chunks - window_only))
    assert ffi_counters["n_callbacks"] == prefill_callbacks  # ... and no callback in any of them
    assert cb_counters["n_callbacks"] > prefill_callbacks


def test_the_tick_counter_measures_time_as_perf_counter_does():
    """The worker times its wait for queries in `_ticks` (no clock call in nopython code): the
    calibrated tick length turns a tick interval into the seconds perf_counter sees over it."""
    seconds = worker_module.tick_seconds()
    assert seconds > 0  # x86 and AArch64 (CI's machines) have a counter
    t0, c0 = time.perf_counter(), worker_module._now_ticks()
    time.sleep(0.2)
    t1, c1 = time.perf_counter(), worker_module._now_ticks()
    # the same interval on two clocks (a preemption between the paired reads shifts both ends)
    assert (c1 - c0) * seconds == pytest.approx(t1 - t0, rel=0.2)


def test_worker_error_surfaces_with_the_layer_and_traceback(model, tokens, monkeypatch):
    def broken(*args):
        raise ZeroDivisionError("host attention exploded")

    monkeypatch.setattr(worker_module, "serve_context", broken)
    backend = make_backend("hgca", host_exchange="ffi", **KEEP_ALL)
    with pytest.raises(Exception) as info:  # bounded: the exchange times out after exchange_timeout_s
        run_forced(model, backend, *tokens)
    text = str(info.value) + "".join(getattr(info.value, "__notes__", []))
    assert "host attention exploded" in text
    backend.close()


def test_a_step_nobody_serves_is_an_error_not_a_hang(model, tokens, monkeypatch):
    original = worker_module.ExchangeWorker._serve

    def stuck(self, plan, pages):
        time.sleep(5)  # past the timeout below
        return original(self, plan, pages)

    monkeypatch.setattr(worker_module.ExchangeWorker, "_serve", stuck)
    backend = make_backend("topk", host_exchange="ffi", exchange_timeout_s=1.0, **KEEP_ALL)
    with pytest.raises(Exception, match="not served within 1.0 s|not answered after"):
        run_forced(model, backend, *tokens)
    backend.close()


def test_missing_library_falls_back_or_is_a_clear_error(monkeypatch, caplog):
    import jhybrid.hybrid.transfer as transfer

    monkeypatch.setenv(worker_module.LIB_ENV, "/nonexistent/libjhybrid_exchange.so")
    monkeypatch.setattr(worker_module, "_LIB", [])
    monkeypatch.setattr(transfer, "_logged", set())
    with caplog.at_level(logging.WARNING, logger="jhybrid.hybrid"):
        backend = make_backend("hgca", **KEEP_ALL)  # host_exchange="auto"
    assert type(backend.exchange).__name__ == "CallbackExchange"
    assert "native host exchange is not usable" in caplog.text and "/nonexistent" in caplog.text
    with pytest.raises(RuntimeError, match="host_exchange='ffi'.*/nonexistent/libjhybrid_exchange.so not found"):
        make_backend("hgca", host_exchange="ffi", **KEEP_ALL)
    assert type(make_backend("recall", **KEEP_ALL).exchange).__name__ == "CallbackExchange"  # no host decode


def test_a_process_exiting_with_an_armed_step_stops_the_worker_first():
    """A decode step armed (before_step) but never run, its backend never closed (an error or an
    interrupt between the two): at interpreter exit the worker is closed before the native exchange
    is released (its wait would poll freed mailboxes): the exit functions leave no live worker and
    no error. The subprocess runs them explicitly, then leaves with os._exit (no second run)."""
    import os
    import subprocess
    import sys

    code = """
import atexit, os
import numpy as np
from jhybrid.hybrid import make_backend
from jhybrid.models import create_model
from tests.hybrid_support import TINY, WINDOW
model = create_model(TINY, seed=0)
backend = make_backend("topk", **WINDOW)
backend.open(model.config, 2, 128)
cache = model.init_cache(2, 128, backend)
worker = backend.runtime.worker
assert worker is not None, "no native exchange worker"
cache = backend.before_step(cache, np.zeros((2, 1), np.int32))  # a decode step armed, never run
assert not worker._idle.is_set()
atexit._run_exitfuncs()
print("worker alive:", worker._thread.is_alive(), "error:", worker.error, flush=True)
os._exit(0)
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "worker alive: False error: None" in done.stdout, (done.stdout, done.stderr[-2000:])
    assert "host exchange failed" not in done.stderr
