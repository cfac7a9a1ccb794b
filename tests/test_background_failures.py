"""No host failure passes silently: every kind of background host work that raises surfaces as an
error at a following step start (naming what failed, with the worker's traceback), never a hang or a
wrong result. Kinds: sparsification of evicted blocks, the store append of an eviction,
re-evaluation, scout's recall, the native exchange's worker."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import jhybrid.hybrid.modes.hgca as hgca_module
from jhybrid.hybrid import make_backend
from jhybrid.models import create_model
from tests.hybrid_support import KEEP_ALL, SCOUT_RECALLS, TINY, run_forced

B, PROMPT, STEPS = 2, 56, 24


@pytest.fixture(scope="module")
def model():
    return create_model(TINY, seed=0)


@pytest.fixture(scope="module")
def tokens():
    rng = np.random.default_rng(77)
    return rng.integers(0, 97, (B, PROMPT)).astype(np.int32), rng.integers(0, 97, (B, STEPS)).astype(np.int32)


# How long a run may wait for a background failure to surface before the test calls it a hang:
# a bound on that wait (the run's thread joined with a timeout), far above any run's duration even
# on a loaded machine, not a bound on the run's time (nothing here asserts how long a run took).
HANG_TIMEOUT_S = 900


def run_to_failure(model, backend, tokens) -> BaseException | None:
    """run_forced in a daemon thread; -> what it raised (None if it returned). A run still going
    after HANG_TIMEOUT_S is a hang: the test fails (the daemon thread is left behind)."""
    outcome: dict = {}

    def run():
        try:
            run_forced(model, backend, *tokens)
        except BaseException as error:  # noqa: BLE001 - handed to the test thread
            outcome["error"] = error

    thread = threading.Thread(target=run, name="background-failure-run", daemon=True)
    thread.start()
    thread.join(timeout=HANG_TIMEOUT_S)
    assert not thread.is_alive(), f"a background failure hung the run (no error within {HANG_TIMEOUT_S} s)"
    return outcome.get("error")


def expect_failure(model, backend, tokens, message):
    error = run_to_failure(model, backend, tokens)
    assert error is not None, "the background failure passed silently: the run returned"
    text = str(error) + str(error.__cause__) + "".join(
        getattr(error, "__notes__", []) + getattr(error.__cause__, "__notes__", []))
    assert message in text, text[:500]
    backend.close()
    return text


@pytest.mark.parametrize("transport", ["ffi", "callback"])
def test_sparsification_failure_surfaces(model, tokens, monkeypatch, transport):
    def broken(*args, **kwargs):
        raise ZeroDivisionError("sparsify exploded")

    monkeypatch.setattr(hgca_module, "sparsify_evicted", broken)
    text = expect_failure(model, make_backend("hgca", host_exchange=transport, **KEEP_ALL), tokens,
                          "sparsify exploded")
    assert "eviction" in text and "eviction thread" in text  # what failed, and the worker's traceback


def test_store_append_failure_surfaces(model, tokens, monkeypatch):
    from jhybrid.hybrid.runtime import HostRuntime

    def broken(self, *args):
        raise MemoryError("host store full")

    monkeypatch.setattr(HostRuntime, "append_blocks", broken)
    expect_failure(model, make_backend("topk", **KEEP_ALL), tokens, "host store full")


def test_reevaluation_failure_surfaces(model, tokens, monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("re-evaluation exploded")

    monkeypatch.setattr(hgca_module, "reevaluate", broken)
    text = expect_failure(model, make_backend("hgca", **KEEP_ALL), tokens, "re-evaluation exploded")
    assert "background" in text


def test_recall_failure_surfaces(model, tokens):
    backend = make_backend("scout", predict_query=False, **SCOUT_RECALLS, **KEEP_ALL)

    def broken():
        raise OSError("pinned upload exploded")

    original_open = backend.open

    def open_with_hook(*args, **kwargs):
        out = original_open(*args, **kwargs)
        backend.runtime.mode_host.recall_hook = broken
        return out

    backend.open = open_with_hook
    text = expect_failure(model, backend, tokens, "scout recall of layer")
    assert "pinned upload exploded" in text
