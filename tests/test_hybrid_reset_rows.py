"""Continuous batching: `backend.reset_rows(cache, rows)` starts a new sequence in a row while the
other rows go on (CPU, the tiny model).

  * every offloading mode, and quest: a row reset after its sequence crossed evictions and filled
    the mode's state (kept tokens, selections, pool, recalls) runs its new sequence exactly as that
    sequence runs alone on a fresh backend, and the other row's logits never change;
  * 200 reuses of a row do not grow host memory, and the counters add up;
  * an empty rows array is a no-op; a row outside the batch is a ValueError naming it.

The runs take eviction_spread=False and eviction_lag_steps=0: with spreading, when a block's copy
starts depends on the batch's decode step count and the row's index (sequences' copies are
staggered over the batch on purpose), so a row's GPU/CPU split would differ from its run alone —
exact either way, but a real policy (what hgca keeps, what topk / scout select) sees the split.
scout runs with a recall schedule that does not depend on the batch (threshold 0, an interval of
1 and recall_lag_steps 1: every layer with CPU blocks recalls at every step); otherwise its trigger
is a batch-shared decision (the CPU share of a layer's selection over every row), by design.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from jhybrid.generation import make_step
from jhybrid.hybrid import make_backend
from jhybrid.models import create_model
from tests.hybrid_support import TINY as CONFIG, TOL, xla_flags

CHUNK, MAX_LEN = 16, 128
POLICY = dict(window_tokens=40, block_size=16, sink=8, host_threads=1, eviction_spread=False, eviction_lag_steps=0)
CASES = {
    "keep-all": dict(mode="hgca", beta=1e-30, budget=None),  # every offloaded token attended: full as hybrid
    "recall": dict(mode="recall"),
    "streaming": dict(mode="streaming"),
    "hgca": dict(mode="hgca", beta=1.0, alpha=0.3),  # a real salience threshold
    "topk": dict(mode="topk", budget=32),  # 2 of up to 3 offloaded blocks
    "scout": dict(mode="scout", budget=32, recall_blocks=2, recall_threshold=0.0, recall_min_interval=1,
                  recall_lag_steps=1, scout_exact_layers=1),  # layer 1 selects with the predicted query
    "quest": dict(mode="quest", budget=32),
}
PROMPTS = (50, 35)  # ragged; each row publishes a block at the last step before the reset
NEW_PROMPT = 56  # row 1's second sequence
STEPS = (24, 24)  # decode steps before and after the reset


@pytest.fixture(scope="module")
def model():
    return create_model(CONFIG, seed=0)


def backend_of(case):
    options = {**POLICY, **CASES[case]}
    if options["mode"] == "quest":  # no host side: the host settings do not apply
        options = {k: v for k, v in options.items() if k not in ("host_threads", "eviction_spread",
                                                                 "eviction_lag_steps")}
    return make_backend(options.pop("mode"), **options)


class Rows:
    """A batch driven row by row: prefill chunks of CHUNK tokens aligned to each row's own start
    (the other rows padded), decode steps of the active rows, resets. Teacher-forced."""

    def __init__(self, model, backend, batch, step=None, parallel=None):
        """step: (step, params) of make_step(model, backend), to reuse its executables; parallel: a
        jhybrid.parallel.TensorParallel whose backend, step and cache run instead (`backend` unused)."""
        if parallel is not None:
            backend, step = parallel.backend, parallel.make_step()
        self.backend, self.batch = backend, batch
        self.step, self.params = step or make_step(model, backend)
        backend.open(model.config, batch, MAX_LEN)
        self.cache = (model.init_cache(batch, MAX_LEN, backend) if parallel is None
                      else parallel.init_cache(batch, MAX_LEN))
        self.held = np.zeros(batch, np.int64)

    def _run(self, tokens, positions):
        self.cache = self.backend.before_step(self.cache, positions)
        logits, self.cache = self.step(self.params, tokens, positions, self.cache)
        return logits

    def prefill(self, row: int, prompt: np.ndarray) -> None:
        for start in range(0, len(prompt), CHUNK):
            part = prompt[start:start + CHUNK]
            tokens = np.zeros((self.batch, CHUNK), np.int32)
            positions = np.full((self.batch, CHUNK), -1, np.int32)
            tokens[row, :len(part)] = part
            positions[row, :len(part)] = self.held[row] + np.arange(len(part))
            self._run(tokens, positions)
            self.held[row] += len(part)

    def decode(self, tokens: np.ndarray, active=None) -> np.ndarray:
        """One token per active row (default: all; the others padded) -> logits [B, V]."""
        active = np.ones(self.batch, bool) if active is None else np.asarray(active)
        positions = np.where(active, self.held, -1)[:, None].astype(np.int32)
        logits = self._run(np.where(active, tokens, 0)[:, None].astype(np.int32), positions)
        self.held += active
        return np.asarray(logits[:, 0])

    def reset(self, rows) -> None:
        self.cache = self.backend.reset_rows(self.cache, np.asarray(rows))
        self.held[np.asarray(rows, np.int64)] = 0


def alone(model, backend, step, prompt, continuation):
    """The sequence alone in row 0 of a batch of 2 whose row 1 stays empty, on `backend` opened
    afresh (a new host side and cache; the same compiled step) -> decode logits [steps, V]."""
    run = Rows(model, backend, 2, step)
    run.prefill(0, prompt)
    return np.stack([run.decode(np.array([continuation[i], 0]), active=[True, False])[0]
                     for i in range(len(continuation))])


def sequences():
    """Prompts x, y (rows 0, 1), z (row 1 after its reset) and their forced continuations."""
    rng = np.random.default_rng(11)
    x, y, z = (rng.integers(0, 97, n).astype(np.int32) for n in (*PROMPTS, NEW_PROMPT))
    cx = rng.integers(0, 97, sum(STEPS)).astype(np.int32)  # row 0 decodes through both phases
    cy, cz = (rng.integers(0, 97, n).astype(np.int32) for n in STEPS)
    return x, y, z, cx, cy, cz


def scenario(run: Rows):
    """x in row 0 and y in row 1, STEPS[0] decode steps; row 1 reset, z prefilled there (row 0
    padded during its chunks), STEPS[1] decode steps of both -> the decode logits of the two
    phases ([STEPS[0], 2, V], [STEPS[1], 2, V])."""
    x, y, z, cx, cy, cz = sequences()
    run.prefill(0, x)
    run.prefill(1, y)
    first = np.stack([run.decode(np.array([cx[i], cy[i]])) for i in range(STEPS[0])])
    assert run.backend.counters().get("n_evicted_blocks", 1) > 0  # row 1's old sequence offloaded blocks
    run.reset([1])
    run.prefill(1, z)
    second = np.stack([run.decode(np.array([cx[STEPS[0] + i], cz[i]])) for i in range(STEPS[1])])
    return first, second


@pytest.mark.parametrize("case", list(CASES))
def test_reset_row_runs_its_new_sequence_as_alone(model, case):
    backend = backend_of(case)
    assert backend.reuses_rows
    step = make_step(model, backend)
    run = Rows(model, backend, 2, step)
    first, second = scenario(run)
    check_host_side(backend, run, case)  # before the reference runs reopen the backend

    assert_each_as_alone(model, backend, step, first, second)


def assert_each_as_alone(model, backend, step, first, second) -> None:
    """`scenario`'s logits (first [STEPS[0], 2, V], second [STEPS[1], 2, V]) equal x, y and z run
    alone (`alone`: reopens the backend)."""
    x, y, z, cx, cy, cz = sequences()
    want_x, want_y, want_z = (alone(model, backend, step, p, c) for p, c in ((x, cx), (y, cy), (z, cz)))
    np.testing.assert_allclose(np.concatenate([first[:, 0], second[:, 0]]), want_x, atol=TOL, rtol=0)
    np.testing.assert_allclose(first[:, 1], want_y, atol=TOL, rtol=0)
    np.testing.assert_allclose(second[:, 1], want_z, atol=TOL, rtol=0)


def test_scout_reset_leaves_a_recall_in_flight_and_it_skips_the_row(model):
    """A scout recall held in its background job (its plan already made, holding row 1's blocks)
    while row 1 is reset: the reset returns without waiting for it; the job, released only then,
    leaves row 1 out (its blocks are no longer in the store: reading them fails); row 1's new
    sequence z is prefilled and both rows' logits equal their runs alone (row 0's recalls land on
    schedule)."""
    backend = backend_of("scout")
    step = make_step(model, backend)
    run = Rows(model, backend, 2, step)
    x, y, z, cx, cy, cz = sequences()
    run.prefill(0, x)
    run.prefill(1, y)
    first = [run.decode(np.array([cx[i], cy[i]])) for i in range(STEPS[0] - 1)]
    scout = backend.runtime.mode_host
    gate, entered = threading.Event(), threading.Event()

    def hold():
        entered.set()
        assert gate.wait(120), "test gate never opened"

    scout.recall_hook = hold
    last = STEPS[0] - 1
    first.append(run.decode(np.array([cx[last], cy[last]])))  # its step start triggers recalls: held
    assert entered.wait(60) and scout.pending
    held = [plan for group in scout._groups() for plan in group.plans if plan.b.size]  # the job in the hook has planned
    assert held and any((plan.b == 1).any() for plan in held)
    reset = threading.Thread(target=run.reset, args=([1],))
    reset.start()
    reset.join(timeout=60)  # bounds the wait: a reset that waited for the job would still be in it
    returned = not reset.is_alive()
    scout.recall_hook = None
    gate.set()  # the job reads the store only now: row 1 holds an empty sequence, or z
    reset.join()
    assert returned, "reset_rows waited for the recall in flight"
    run.prefill(1, z)
    second = np.stack([run.decode(np.array([cx[STEPS[0] + i], cz[i]])) for i in range(STEPS[1])])
    assert not any((plan.b == 1).any() for plan in held)  # row 1 left out
    check_host_side(backend, run, "scout")
    assert_each_as_alone(model, backend, step, np.stack(first), second)


def check_host_side(backend, run, case) -> None:
    """The host side after the batched run: the store holds row 1's new sequence only."""
    if backend.config.mode == "quest":
        return
    runtime = backend.runtime
    runtime.evictor.publish_all()
    assert runtime.n_tokens.tolist() == run.held.tolist()
    for layer in range(CONFIG.num_layers):  # the store holds row 1's new sequence only
        assert [runtime.store.n_blocks(layer, b) for b in range(2)] == runtime.offloaded_blocks().tolist()
    assert runtime.offloaded_blocks()[1] == 3  # and it offloaded again
    if case == "scout":
        assert backend.counters()["n_recalls"] > 0
        assert_pool_matches_store(backend, run.cache)


def assert_pool_matches_store(backend, cache):
    """Every resident pool slot holds the host block its table names, of its own sequence."""
    runtime = backend.runtime
    store, bs = runtime.store, backend.config.block_size
    for layer, state in enumerate(cache.layers):
        blocks, k = np.asarray(state.pool.blocks), np.asarray(state.pool.k)
        slots = blocks.shape[2]
        for b, h, r in zip(*np.nonzero(blocks >= 0)):
            stored = store.read_blocks(layer, int(b), [int(blocks[b, h, r])])["k"][0][:, h]  # [bs, D]
            np.testing.assert_allclose(k[b * slots + r, h], stored.view(np.float32).reshape(bs, -1), atol=0)


def test_200_reuses_of_a_row_do_not_grow_host_memory(model):
    """Rows 0 and 1 take turns: reset, a new 48-token prompt (one block offloaded by its last chunk),
    decode steps with both rows. Host bytes and the store's arenas stay flat; counters add up."""
    rng = np.random.default_rng(3)
    backend = backend_of("hgca")
    run = Rows(model, backend, 2)
    runtime = backend.runtime
    store = runtime.store
    marks = {}
    sequences = 0
    for i in range(200):
        row = i % 2
        if i >= 2:
            run.reset([row])
        run.prefill(row, rng.integers(0, 97, 48).astype(np.int32))
        sequences += 1
        run.decode(rng.integers(0, 97, 2).astype(np.int32))
        if i in (9, 199):  # the same phase of the pattern
            runtime.evictor.publish_all()
            runtime.evictor.wait_background()
            marks[i] = (backend.host_bytes(), store.bytes_used(), store.bytes_reserved(),
                        [arena.pool.high_water for arena in store.layers])
    assert marks[199] == marks[9]
    assert marks[9][0] > 0
    counters = backend.counters()
    # every sequence reached 49 or 50 tokens: one block (of every layer) each
    assert counters["n_evicted_blocks"] == sequences * CONFIG.num_layers
    assert runtime.offloaded_blocks().tolist() == [1, 1]
    assert runtime.n_tokens.tolist() == run.held.tolist()
    for layer in range(CONFIG.num_layers):
        assert [store.n_blocks(layer, b) for b in range(2)] == [1, 1]


@pytest.fixture(scope="module")
def topk(model):
    """A topk backend and its compiled step, shared by the tests below (each reopens it)."""
    backend = backend_of("topk")
    return backend, make_step(model, backend)


def test_reset_waits_for_the_rows_copies_in_flight(model, topk):
    """A copy of row 1's old block still in flight when row 1 is reset lands in the old sequence's
    store rows (freed with them), never in the new sequence's; the other row's copy is published
    as if nothing happened."""
    backend, step = topk
    run = Rows(model, backend, 2, step)
    rng = np.random.default_rng(5)
    run.prefill(0, rng.integers(0, 97, 40).astype(np.int32))
    run.prefill(1, rng.integers(0, 97, 40).astype(np.int32))
    runtime = backend.runtime
    gate = threading.Event()
    runtime.evictor.background(gate.wait)  # the eviction thread waits at the gate ...
    run.decode(rng.integers(0, 97, 2))  # ... so the copies this step starts (block 0 of each row) stay queued
    assert [job.future.done() for job in runtime.evictor.jobs] == [False]
    reset = threading.Thread(target=run.reset, args=([1],))
    reset.start()
    reset.join(timeout=1.0)
    waited = reset.is_alive()
    gate.set()
    reset.join()
    assert waited  # reset_rows waited for the copy instead of freeing the row under it
    store = runtime.store
    assert [[store.n_blocks(layer, b) for b in range(2)] for layer in range(CONFIG.num_layers)] == [[1, 0]] * 2
    run.prefill(1, rng.integers(0, 97, 20).astype(np.int32))
    for _ in range(3):
        run.decode(rng.integers(0, 97, 2))
    runtime.evictor.publish_all()
    assert runtime.offloaded_blocks().tolist() == [1, 0]  # row 1's new sequence has 23 tokens: none offloaded
    assert [store.n_blocks(layer, 1) for layer in range(CONFIG.num_layers)] == [0, 0]


def test_empty_rows_is_a_no_op_and_a_bad_row_is_named(model, topk):
    backend, step = topk
    run = Rows(model, backend, 2, step)
    run.prefill(0, np.arange(40, dtype=np.int32))
    before = (backend.runtime.n_tokens.copy(), backend.host_bytes())
    cache = run.cache
    assert backend.reset_rows(cache, np.zeros(0, np.int64)) is cache
    assert backend.runtime.n_tokens.tolist() == before[0].tolist() and backend.host_bytes() == before[1]
    for bad in (2, -1):
        with pytest.raises(ValueError, match=f"row {bad} is out of range") as error:
            backend.reset_rows(cache, np.array([0, bad]))
        assert "\n" not in str(error.value)
    assert np.asarray(cache.lengths).tolist() == [40, 0]  # nothing was reset by the refused call
    quest = backend_of("quest")
    qcache = model.init_cache(2, MAX_LEN, quest)
    assert quest.reset_rows(qcache, []) is qcache
    with pytest.raises(ValueError, match="row 3 is out of range"):
        quest.reset_rows(qcache, [3])


def test_tensor_parallel_forwards_to_every_shard():
    """ShardedOffload.reset_rows at TP 2 == the single-device backend (tests/reset_rows_tp_check.py,
    in a subprocess with 2 virtual CPU devices)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "XLA_FLAGS": xla_flags(2), "JAX_PLATFORMS": "cpu", "PYTHONPATH": root}
    result = subprocess.run([sys.executable, os.path.join(root, "tests", "reset_rows_tp_check.py")], cwd=root,
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "OK reset_rows tp" in result.stdout, result.stderr[-5000:]
