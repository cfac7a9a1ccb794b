"""scout's asynchronous, incremental recall into the GPU pool (jhybrid.hybrid.modes.scout) on CPU.

At keep-all (every block selected) any pool content is exact, so the logits must equal `full`
whatever the recalls do; on top of that the pool must hold byte-exact copies of the host blocks
its table names, recalls must be applied at a later step than they were started, a recall held
back while the ring evicts stays consistent, and a recall of a previous batch is never applied.
"""

from __future__ import annotations

import collections
import threading

import numpy as np
import pytest

from jhybrid.generation import make_step
from jhybrid.hybrid import make_backend
from jhybrid.hybrid.modes.scout import plan_recall
from jhybrid.models import create_model
from tests.hybrid_support import CHUNK, MAX_LEN, SCOUT_RECALLS, TINY as CONFIG, TOL, WINDOW

# Window 40 = 8 sinks + 2 blocks of 16; 56 prompt + 40 decode tokens offload up to 4 blocks.
KEEP_ALL = dict(WINDOW, **SCOUT_RECALLS)
B, PROMPT, STEPS = 2, 56, 40  # the prompt already offloads blocks: recalls can start at step 1


@pytest.fixture(scope="module", autouse=True)
def full_float32_matmuls():
    """Full float32 matmuls on both sides of every comparison with `full` (a no-op on the CPU; on a
    GPU, XLA's default TF32 put the logits ~6e-4 apart, past TOL: the H200, session r)."""
    import jax

    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(scope="module")
def model():
    return create_model(CONFIG, seed=0)


@pytest.fixture(scope="module")
def tokens():
    rng = np.random.default_rng(99)
    return rng.integers(0, 97, (B, PROMPT)).astype(np.int32), rng.integers(0, 97, (B, STEPS)).astype(np.int32)


_STEPS: dict = {}


class Run:
    """Teacher-forced run, one decode step per `next()`; `before(i, scout)` runs before step i
    (scout: the runtime's ScoutHost). Runs on one backend share its compiled step (each run opens
    the backend anew: a new host runtime)."""

    def __init__(self, model, backend, prompt, continuation):
        if id(backend) not in _STEPS:
            _STEPS[id(backend)] = (backend, make_step(model, backend))
        self.step, self.params = _STEPS[id(backend)][1]
        self.backend, self.continuation = backend, continuation
        backend.open(model.config, B, MAX_LEN)
        self.cache = model.init_cache(B, MAX_LEN, backend)
        self.runtime = getattr(backend, "runtime", None)  # None for full
        self.scout = None if self.runtime is None else self.runtime.mode_host
        self.hook = backend.before_step
        for s in range(0, prompt.shape[1], CHUNK):
            part = prompt[:, s:s + CHUNK]
            pos = (s + np.arange(part.shape[1]))[None].repeat(B, 0).astype(np.int32)
            self.cache = self.hook(self.cache, pos)
            _, self.cache = self.step(self.params, part, pos, self.cache)
        self.held, self.i, self.logits = prompt.shape[1], 0, []

    def next(self):
        pos = np.full((B, 1), self.held, np.int32)
        self.cache = self.hook(self.cache, pos)
        logits, self.cache = self.step(self.params, self.continuation[:, self.i:self.i + 1], pos, self.cache)
        self.logits.append(np.asarray(logits[:, 0]))
        self.held += 1
        self.i += 1

    def run(self, n, before=None):
        for _ in range(n):
            if before is not None:
                before(self.i, self.scout)
            self.next()
        return np.stack(self.logits, 1)


@pytest.fixture(scope="module")
def reference(model, tokens):
    run = Run(model, make_backend("full"), *tokens)
    return run.run(STEPS)


def wait_all(_i, scout):
    """Make the run deterministic: every recall is staged before the next decode step start applies it."""
    scout.wait()


def assert_pool_matches_store(run):
    """Every pool slot named by the pool table holds the host block's rows of its KV head, bit for bit;
    the runtime's host copy of the table and scout's layer-ahead copy agree with the device's."""
    runtime, cfg = run.runtime, run.backend.config
    r = cfg.recall_blocks
    checked = 0
    for layer, state in enumerate(run.cache.layers):
        table = np.asarray(state.pool.blocks)  # [B, Hkv, R]
        np.testing.assert_array_equal(table, run.scout.pool_ids[layer])
        if layer > 0 and run.cache.layers[layer - 1].next_pool_blocks is not None:
            np.testing.assert_array_equal(np.asarray(run.cache.layers[layer - 1].next_pool_blocks), table)
        pool_k, pool_v = np.asarray(state.pool.k), np.asarray(state.pool.v)
        for b, h, slot in zip(*np.nonzero(table >= 0)):
            block = runtime.store.read_blocks(layer, int(b), [int(table[b, h, slot])])  # [1, bs, Hkv, D] fp32
            for name, pool in (("k", block["k"]), ("v", block["v"])):
                want = pool[0, :, h].view(np.uint32)
                got = (pool_k if name == "k" else pool_v)[b * r + slot, h].view(np.uint32)
                np.testing.assert_array_equal(got, want, err_msg=f"layer {layer} b {b} h {h} slot {slot} {name}")
            checked += 1
    return checked


@pytest.fixture(scope="module")
def exact_scout():
    """One scout backend (exact query) shared by the tests below: compiled once."""
    return make_backend("scout", predict_query=False, **KEEP_ALL)


@pytest.mark.parametrize("predict", [False, True])
def test_async_recall_applied_later_exact_and_byte_equal(model, tokens, reference, predict, exact_scout):
    backend = exact_scout if not predict else make_backend("scout", predict_query=True, **KEEP_ALL)
    run = Run(model, backend, *tokens)
    logits = run.run(STEPS, before=wait_all)
    log = run.scout.recall_log
    assert log and all(entry["apply_step"] > entry["trigger_step"] for entry in log)
    assert {entry["layer"] for entry in log if entry["warm"]} == {0, 1}  # warm start of every layer
    first = {}
    for entry in log:
        first.setdefault(entry["layer"], entry)
    assert all(entry["warm"] for entry in first.values())  # each layer's first recall is its warm start
    assert assert_pool_matches_store(run) > 0
    counters = run.runtime.counters()
    assert counters["n_recalls"] == len(log) and counters["recall_bg_s"] > 0
    if not predict:  # exact query: keep-all parity with full, with recalls landing mid-run
        np.testing.assert_allclose(logits, reference, atol=TOL, rtol=0)
    else:            # predicted query: approximate, but the pool path stays consistent
        assert np.isfinite(logits).all()


def test_recall_layers_per_step_spreads_a_burst_over_steps(model, tokens, reference, exact_scout):
    """recall_layers_per_step=1 on the two-layer model: uncapped, both layers' warm starts trigger
    (and land) at one step start; capped, each step start triggers and applies at most one recall,
    the second layer's warm start comes at the next step start (its warm flag kept), every layer still
    recalls, and the pool holds the store's bytes and the logits full attention's (exact query)."""
    def per_step(log, field):
        return collections.Counter(entry[field] for entry in log)

    uncapped = Run(model, exact_scout, *tokens)
    uncapped.run(STEPS, before=wait_all)
    assert max(per_step(uncapped.scout.recall_log, "trigger_step").values()) == 2  # a burst to spread
    assert max(per_step(uncapped.scout.recall_log, "apply_step").values()) == 2

    capped = Run(model, make_backend("scout", predict_query=False, recall_layers_per_step=1, **KEEP_ALL), *tokens)
    logits = capped.run(STEPS, before=wait_all)
    log = capped.scout.recall_log
    assert max(per_step(log, "trigger_step").values()) == 1
    assert max(per_step(log, "apply_step").values()) == 1
    warm = sorted(entry["trigger_step"] for entry in log if entry["warm"])
    assert {entry["layer"] for entry in log if entry["warm"]} == {0, 1} and warm[1] == warm[0] + 1
    assert {entry["layer"] for entry in log if not entry["warm"]} == {0, 1}  # both keep recalling, in turn
    assert assert_pool_matches_store(capped) > 0
    np.testing.assert_allclose(logits, reference, atol=TOL, rtol=0)


class OverlapRun(Run):
    """A Run whose driver `overlap_dispatch`es: `after_dispatch` right after every step's call (as the
    serving engine and Generator do)."""

    def __init__(self, model, backend, prompt, continuation):
        super().__init__(model, backend, prompt, continuation)
        self.overlaps = backend.overlap_dispatch()

    def next(self):
        pos = np.full((B, 1), self.held, np.int32)
        self.cache = self.hook(self.cache, pos)
        logits, self.cache = self.step(self.params, self.continuation[:, self.i:self.i + 1], pos, self.cache)
        self.cache = self.backend.after_dispatch(self.cache)
        self.logits.append(np.asarray(logits[:, 0]))
        self.held += 1
        self.i += 1


def test_recalls_applied_in_the_shadow_of_the_call_stay_exact(model, tokens, reference, exact_scout):
    """recall_after_dispatch: every recall is applied right after a call's dispatch (`overlap_dispatch`),
    none at a step start; each lands after its trigger, the pool holds the store's bytes and the
    logits are full attention's (exact query, keep-all). Without it (the default), recalls keep their
    step-start schedule (overlap_dispatch is False)."""
    run = OverlapRun(model, make_backend("scout", predict_query=False, recall_after_dispatch=True, **KEEP_ALL),
                     *tokens)
    assert run.overlaps
    logits = run.run(STEPS, before=wait_all)
    counters = run.runtime.counters()
    assert counters["n_recalls"] > 0 and counters["n_recalls_after_dispatch"] == counters["n_recalls"]
    assert all(entry["apply_step"] > entry["trigger_step"] for entry in run.scout.recall_log)
    assert assert_pool_matches_store(run) > 0
    np.testing.assert_allclose(logits, reference, atol=TOL, rtol=0)

    at_starts = OverlapRun(model, exact_scout, *tokens)
    assert not at_starts.overlaps
    at_starts.run(STEPS)
    counters = at_starts.runtime.counters()
    assert counters["n_recalls"] > 0 and counters["n_recalls_after_dispatch"] == 0


def test_precompiled_host_work_leaves_no_recall_scatter_to_compile(model, tokens, exact_scout, monkeypatch):
    """`precompile_host` compiles `apply_recalls` for every padded size and pool layout a recall can
    stage: a run's recalls then compile nothing (a compile on the recall thread holds the GIL the
    serving engine's thread needs). With an empty compile cache, so the run would compile its sizes."""
    from jhybrid.hybrid.modes import scout as scout_module

    lowered = []
    real = scout_module.apply_recalls

    class Counting:
        def lower(self, *specs):
            lowered.append(specs)
            return real.lower(*specs)

    monkeypatch.setattr(scout_module, "apply_recalls", Counting())
    monkeypatch.setattr(scout_module, "_compiled", {})
    run = Run(model, exact_scout, *tokens)
    exact_scout.precompile_host(run.cache)
    precompiled = len(lowered)
    assert precompiled >= 1
    run.run(STEPS, before=wait_all)
    assert run.scout.recall_log, "no recall ran: the check below would be empty"
    assert len(lowered) == precompiled


def test_recall_racing_with_eviction_stays_consistent(model, tokens, reference, exact_scout):
    """The background job is held while steps go on and the ring evicts blocks into the store;
    steps never wait for it, and once released it is applied and exact."""
    backend = exact_scout
    run = Run(model, backend, *tokens)
    gate, entered = threading.Event(), threading.Event()

    def hold():
        entered.set()
        assert gate.wait(60), "test gate never opened"

    run.scout.recall_hook = hold
    run.run(2)  # step 1 starts the warm recall
    assert entered.wait(30) and run.scout.pending
    evicted = run.runtime.counters()["n_evicted_blocks"]
    run.run(20)  # 20 steps cross a block boundary: the ring evicts while the job is held
    assert run.runtime.counters()["n_evicted_blocks"] > evicted
    assert run.scout.pending and run.runtime.counters()["n_recalls"] == 0  # never waited for
    run.scout.recall_hook = None
    gate.set()
    logits = run.run(STEPS - 22, before=wait_all)
    assert run.runtime.counters()["n_recalls"] > 0
    np.testing.assert_allclose(logits, reference, atol=TOL, rtol=0)
    assert assert_pool_matches_store(run) > 0


def test_no_recall_applied_after_new_batch(model, tokens, reference, exact_scout):
    """A recall in flight when the cache is rebuilt (new batch = new host runtime) is never applied."""
    backend = exact_scout
    gate = threading.Event()
    first = Run(model, backend, *tokens)
    old = first.runtime
    old.mode_host.recall_hook = lambda: gate.wait(60)
    first.run(2)
    assert old.mode_host.pending
    second = Run(model, backend, *tokens)  # open: a new runtime, the old one closed
    assert backend.runtime is not old and not old.mode_host.pending
    gate.set()
    logits = second.run(STEPS, before=wait_all)
    assert old.counters()["n_recalls"] == 0
    np.testing.assert_allclose(logits, reference, atol=TOL, rtol=0)
    assert second.runtime.counters()["n_recalls"] > 0
    assert assert_pool_matches_store(second) > 0


def test_last_block_ids_wait_for_the_step_that_has_not_marked_itself_served(model, tokens, exact_scout):
    """The exchange worker hands a step's last layer to the device before it marks the step served:
    a decode step start in between (a loaded machine) must wait for it, not read "no step yet"
    (scout's first recall trigger then saw no ids, and test_no_recall_applied_after_new_batch
    failed once on the CI machine). The worker is held between the two here."""
    run = Run(model, exact_scout, *tokens)
    worker = run.runtime.worker
    if worker is None:
        pytest.skip("the native exchange is not built (scripts/setup.sh)")
    run.run(1)
    assert worker.wait_idle(60) and worker.served_any
    worker.served_any = False  # as between the hand-over and the worker's `finally`
    worker._idle.clear()
    done = threading.Event()

    def finish():
        done.wait(60)
        worker.served_any = True
        worker._idle.set()

    thread = threading.Thread(target=finish)
    thread.start()
    got = []
    reader = threading.Thread(target=lambda: got.append(run.runtime.last_block_ids(0)))
    reader.start()
    reader.join(0.2)
    assert reader.is_alive()  # it waits for the worker (with the old order it returned None at once)
    done.set()
    reader.join(60)
    thread.join(60)
    assert not reader.is_alive() and got[0] is not None and got[0].shape[:1] == (B,)


def test_plan_recall_fills_free_then_lru_slots_never_used_ones():
    # 1 sequence, 2 heads, k = 3, R = 3. Head 0: slots hold 5 (used at the last step, pos 9),
    # 6 (used at pos 4) and nothing; head 1: all slots used at the last step.
    cpu_ids = np.array([[[7, -1, 8], [2, 3, -1]]])
    pool_ids = np.array([[[5, 6, -1], [0, 1, 4]]])
    pool_used = np.array([[[9, 4, -1], [9, 9, 9]]])
    b, h, r, block = plan_recall(cpu_ids, pool_ids, pool_used, np.array([9]))
    assert b.tolist() == [0, 0] and h.tolist() == [0, 0]
    assert r.tolist() == [2, 1]          # the empty slot first, then the least recently used
    assert block.tolist() == [7, 8]      # the CPU's blocks in selection order
    b, h, r, block = plan_recall(cpu_ids, pool_ids, pool_used, np.array([10]))  # nothing used at 10
    assert list(zip(h.tolist(), r.tolist(), block.tolist())) == [(0, 2, 7), (0, 1, 8), (1, 0, 2), (1, 1, 3)]


def _reference_scatter(pools, next_blocks, b, h, r, block, layer, k, v, now):
    """NumPy oracle of `apply_recalls`: entry i (b < B) goes to slot r of (b, h) of layer `layer`."""
    pools = [None if p is None else {name: np.array(x) for name, x in p.items()} for p in pools]
    next_blocks = [None if x is None else np.array(x) for x in next_blocks]
    batch = now.shape[0]
    for i in range(b.shape[0]):
        n = int(layer[i])
        if b[i] >= batch or n < 0 or pools[n] is None:
            continue
        slots = pools[n]["blocks"].shape[2]
        row = b[i] * slots + r[i]
        pools[n]["k"][row, h[i]] = k[i]
        pools[n]["v"][row, h[i]] = v[i]
        pools[n]["blocks"][b[i], h[i], r[i]] = block[i]
        pools[n]["used"][b[i], h[i], r[i]] = now[b[i]]
        if n > 0 and next_blocks[n - 1] is not None:
            next_blocks[n - 1][b[i], h[i], r[i]] = block[i]
    return pools, next_blocks


def test_apply_recalls_matches_a_numpy_scatter_per_layer():
    """One group's scatter over several layers: each layer takes exactly its own entries (a layer
    without a pool, one without next_pool_blocks, one with no entry; padding and void rows
    dropped), against a NumPy oracle; every output poisoned first (random, not zeros)."""
    import jax
    import jax.numpy as jnp

    from jhybrid.hybrid.modes.scout import apply_recalls
    from jhybrid.hybrid.state import Pool

    rng = np.random.default_rng(7)
    batch, hkv, slots, bs, d = 3, 2, 4, 4, 8
    layers = 5  # layer 1: no pool (a sliding layer); layer 4: no entry; layer 3: no next_pool_blocks

    def pool():
        return {"k": rng.standard_normal((batch * slots, hkv, bs, d)).astype(np.float32),
                "v": rng.standard_normal((batch * slots, hkv, bs, d)).astype(np.float32),
                "blocks": rng.integers(-1, 50, (batch, hkv, slots)).astype(np.int32),
                "used": rng.integers(-1, 50, (batch, hkv, slots)).astype(np.int32)}

    pools = [pool(), None, pool(), pool(), pool()]
    next_blocks = [rng.integers(-1, 50, (batch, hkv, slots)).astype(np.int32) for _ in range(layers)]
    next_blocks[0] = None  # layer 1 has no pool: layer 0 keeps no copy of its table
    next_blocks[2] = None  # layer 3 has no layer-ahead copy kept by layer 2
    entries = []  # distinct (layer, b, h, r) per layer, as plan_recall makes them
    for n in (0, 2, 3):
        for b in range(batch):
            for h in range(hkv):
                for r in rng.choice(slots, 2, replace=False):
                    entries.append((b, h, r, rng.integers(0, 99), n))
    entries = np.array(entries, np.int32)
    entries[rng.choice(len(entries), 3, replace=False), 0] = batch  # rows voided since the trigger
    size = 64
    assert size >= len(entries)
    pad = np.array([[batch, 0, 0, -1, -1]] * (size - len(entries)), np.int32)
    b, h, r, block, layer = np.concatenate([entries, pad]).T
    k = rng.standard_normal((size, bs, d)).astype(np.float32)
    v = rng.standard_normal((size, bs, d)).astype(np.float32)
    now = rng.integers(0, 1000, batch).astype(np.int32)

    as_pool = lambda p: None if p is None else Pool(**{name: jnp.asarray(x) for name, x in p.items()})  # noqa: E731
    got_pools, got_next = apply_recalls(tuple(as_pool(p) for p in pools),
                                        tuple(None if x is None else jnp.asarray(x) for x in next_blocks),
                                        *(jnp.asarray(x) for x in (b, h, r, block, layer, k, v, now)))
    want_pools, want_next = _reference_scatter(pools, next_blocks, b, h, r, block, layer, k, v, now)
    for n in range(layers):
        if want_pools[n] is None:
            assert got_pools[n] is None
        else:
            for name in ("k", "v", "blocks", "used"):
                np.testing.assert_array_equal(np.asarray(getattr(got_pools[n], name)), want_pools[n][name],
                                              err_msg=f"layer {n} {name}")
        if want_next[n] is None:
            assert got_next[n] is None
        else:
            np.testing.assert_array_equal(np.asarray(got_next[n]), want_next[n], err_msg=f"next of layer {n}")
    np.testing.assert_array_equal(np.asarray(got_pools[4].k), pools[4]["k"])  # no entry: unchanged
    jax.block_until_ready(got_pools)


def test_recall_groups_of_one_layer_apply_each_layer_exactly(model, tokens, reference, exact_scout, monkeypatch):
    """With GROUP_LAYERS = 1 every layer's recall is a group of its own (one scatter each); with the
    default one group holds both layers of the tiny model (one scatter for both): the logits equal
    `full` and the pool equals the host store either way, and the scatters counted are the groups."""
    from jhybrid.hybrid.modes import scout as scout_module

    together = Run(model, exact_scout, *tokens)
    logits = together.run(STEPS, before=wait_all)
    np.testing.assert_allclose(logits, reference, atol=TOL, rtol=0)
    counters = together.runtime.counters()
    assert counters["n_recalls"] > counters["n_recall_applies"] > 0  # a warm start moves both layers at once
    assert assert_pool_matches_store(together) > 0

    monkeypatch.setattr(scout_module, "GROUP_LAYERS", 1)
    apart = Run(model, exact_scout, *tokens)
    logits = apart.run(STEPS, before=wait_all)
    np.testing.assert_allclose(logits, reference, atol=TOL, rtol=0)
    counters = apart.runtime.counters()
    assert counters["n_recalls"] == counters["n_recall_applies"] > 0
    assert assert_pool_matches_store(apart) > 0
