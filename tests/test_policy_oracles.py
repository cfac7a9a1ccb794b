"""The policies against NumPy oracles written from their definitions, not from the product code.

Keep-everything runs cannot see a policy; these run real thresholds and budgets on a one-layer model
whose queries and keys the test computes itself (the layer's own projections of the embeddings) and
simulates, token by token in float64:

  * the eviction schedule: which blocks the host owns at each step (copies started when due, spread
    by sequence phase or when the ring's slack runs out, published `eviction_lag_steps` later);
  * hgca: the moving-average attention weight of every ring token (reset when written, updated with
    the window's probabilities at every step), the salience threshold beta / window at eviction, and
    the re-evaluation after the prompt (the prompt's last queries over every stored token, threshold
    beta / stored tokens): the kept token set of every KV head must match the product's;
  * topk: the blocks selected at each step (Quest bound over the digests of the host-owned blocks,
    top budget / block_size) must match `LayerState.selected`.
Breaking any of these (e.g. the MAW update's alpha, the threshold's denominator, the eviction phase,
the top-k order) fails a test here.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jhybrid.generation import make_step
from jhybrid.hybrid import OffloadConfig, make_backend
from jhybrid.models import create_model
from tests.hybrid_support import TINY

CONFIG = TINY.replace(num_layers=1)
WINDOW = dict(window_tokens=40, block_size=16, sink=8, host_threads=1)
CHUNK, PROMPT, STEPS, MAX_LEN = 16, 40, 70, 128


@pytest.fixture(scope="module")
def model():
    return create_model(CONFIG, seed=2)


def projections(model, tokens: np.ndarray):
    """q [B, N, Hq, D], k [B, N, Hkv, D] float64 of every position, from the layer's projections."""
    b, n = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    layer = model.layers[0]
    x = layer.attention_input(model.embed(jnp.asarray(tokens)))
    q = layer.attention.project_q(x, positions)
    k, _ = layer.attention.project_kv(x, positions)
    return np.asarray(q, np.float64), np.asarray(k, np.float64)


def run(model, config: OffloadConfig, tokens: np.ndarray, observe=None):
    """Prefill PROMPT tokens in chunks, then STEPS decode steps (teacher-forced). observe(step,
    cache) after each decode step's before_step. -> the backend (left open)."""
    b = tokens.shape[0]
    backend = make_backend(config)
    step, params = make_step(model, backend)
    backend.open(model.config, b, MAX_LEN)
    cache = model.init_cache(b, MAX_LEN, backend)
    for s in range(0, PROMPT, CHUNK):
        pos = s + np.arange(CHUNK)[None].repeat(b, 0)
        pos = np.where(pos < PROMPT, pos, -1).astype(np.int32)
        cache = backend.before_step(cache, pos)
        _, cache = step(params, np.where(pos >= 0, tokens[:, np.maximum(pos[0], 0)], 0).astype(np.int32), pos, cache)
    for t in range(STEPS):
        pos = np.full((b, 1), PROMPT + t, np.int32)
        cache = backend.before_step(cache, pos)
        if observe is not None:
            observe(t, cache)
        _, cache = step(params, tokens[:, PROMPT + t:PROMPT + t + 1], pos, cache)
    backend.runtime.evictor.publish_all()
    backend.runtime.evictor.wait_background()
    return backend


class Schedule:
    """The eviction schedule from its definition (jhybrid/hybrid/eviction.py's docstring)."""

    def __init__(self, cfg: OffloadConfig, batch: int):
        self.cfg, self.batch = cfg, batch
        self.started = np.zeros(batch, np.int64)
        self.published = np.zeros(batch, np.int64)
        self.jobs = []  # (publish_step, started after the job)
        self.starts = []  # (step, seq, first block, end block): the copies in start order

    def target(self, n):
        over = n - self.cfg.sink - (self.cfg.window_tokens - self.cfg.sink)
        return np.maximum(0, -(-over // self.cfg.block_size))

    def prefill(self, n_after, step):
        """A prefill chunk on the host path: everything due starts and is published."""
        self._start(self.target(n_after), step, None)
        self.jobs.clear()
        self.published = self.started.copy()

    def decode(self, t, n_after):
        cfg, bs = self.cfg, self.cfg.block_size
        cap = cfg.window_tokens - cfg.sink + cfg.ring_slack_blocks * bs
        while self.jobs and self.jobs[0][0] <= t:
            self.published = np.maximum(self.published, self.jobs.pop(0)[1])
        target = self.target(n_after)
        phase = (t + np.arange(self.batch)) % bs == 0
        soon = n_after + cfg.eviction_lag_steps + 1 - cfg.sink - cap
        urgent = -(-np.maximum(soon, 0) // bs) > self.started
        start = (target > self.started) & (phase | urgent)
        if start.any():
            self._start(np.where(start, target, self.started), t, t + cfg.eviction_lag_steps)
        need = -(-np.maximum(n_after - cfg.sink - cap, 0) // bs)
        if np.any(self.published < need):
            self.published = self.started.copy()
            self.jobs.clear()
        return self.published.copy()

    def _start(self, started, step, publish_step):
        for b in range(self.batch):
            if started[b] > self.started[b]:
                self.starts.append((step, b, int(self.started[b]), int(started[b])))
        self.started = started.copy()
        self.jobs.append((publish_step, started.copy()))


def test_eviction_schedule_matches_its_definition(model):
    """Two sequences of different lengths: the host-owned blocks at every decode step."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 97, (2, PROMPT + STEPS)).astype(np.int32)
    cfg = OffloadConfig(mode="streaming", **WINDOW)
    seen = []
    run(model, cfg, tokens, observe=lambda t, cache: seen.append(np.asarray(cache.meta.offloaded_blocks)))
    oracle = Schedule(cfg.resolved(), 2)
    for s in range(0, PROMPT, CHUNK):
        oracle.prefill(np.full(2, min(PROMPT, s + CHUNK)), 0)
    want = [oracle.decode(t, np.full(2, PROMPT + t + 1)) for t in range(STEPS)]
    np.testing.assert_array_equal(np.stack(seen), np.stack(want))
    assert np.stack(want)[-1].min() >= 3  # the run crossed several evictions
    # the spreading: sequence 1 starts its copies one step before sequence 0 (phase (t + b) % bs)
    firsts = {b: min(step for step, seq, *_ in oracle.starts if seq == b and step > 0) for b in (0, 1)}
    assert firsts[0] != firsts[1]


@pytest.mark.parametrize("keep_after", [0, 3])
def test_hgca_kept_tokens_match_a_float64_simulation(model, keep_after):
    """What hgca keeps over a prefill and decode steps crossing evictions and the turn's re-evaluation,
    with HGCA's rule (keep_after 0) and with spans (each kept token keeps the 3 after it, within the
    group sparsified together), against a float64 simulation of the rule."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 97, (1, PROMPT + STEPS)).astype(np.int32)
    cfg = OffloadConfig(mode="hgca", beta=1.0, alpha=0.3, keep_after=keep_after, **WINDOW).resolved()
    backend = run(model, cfg, tokens)
    store = backend.runtime.store
    got = [set(store.context.kept(0, 0, h)["token_index"].tolist()) for h in range(CONFIG.num_kv_heads)]
    want = simulate_hgca(cfg, *projections(model, tokens))
    assert sum(len(w) for w in want) > 0 and any(len(w) < store.n_tokens(0, 0) for w in want)  # a real threshold
    if keep_after:  # the spans change what is kept (so a broken span extension fails here)
        plain = simulate_hgca(dataclasses.replace(cfg, keep_after=0), *projections(model, tokens))
        assert any(w > p for w, p in zip(want, plain))
    for h in range(CONFIG.num_kv_heads):
        assert got[h] == want[h], f"KV head {h}: product keeps {sorted(got[h] ^ want[h])[:12]} differently"


def test_hgca_cap_keeps_a_subset_of_the_threshold_selection(model):
    """max_keep_share through decode: the MAW (on the GPU) does not depend on what the host keeps, so
    the capped run's kept tokens are a subset of the uncapped run's, fewer, and each head holds at
    most the cap of the tokens re-evaluated plus the cap (rounded up) of each later evicted group."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 97, (1, PROMPT + STEPS)).astype(np.int32)
    kept, stored = {}, 0
    for cap in (None, 0.1):
        cfg = OffloadConfig(mode="hgca", beta=0.2, alpha=0.3, max_keep_share=cap, **WINDOW).resolved()
        store = run(model, cfg, tokens).runtime.store
        kept[cap] = [set(store.context.kept(0, 0, h)["token_index"].tolist()) for h in range(CONFIG.num_kv_heads)]
        stored = store.n_tokens(0, 0)
    assert sum(map(len, kept[0.1])) < sum(map(len, kept[None]))
    bound = int(np.ceil(0.1 * stored)) + STEPS  # re-evaluated tokens + at most one per later group
    for h in range(CONFIG.num_kv_heads):
        assert kept[0.1][h] <= kept[None][h], f"KV head {h}: the cap kept {sorted(kept[0.1][h] - kept[None][h])}"
        assert 0 < len(kept[0.1][h]) <= bound


def simulate_hgca(cfg: OffloadConfig, q, k):
    """hgca's kept token indices per KV head (token_index = position - sink) for one sequence."""
    s, bs, alpha, beta, window = cfg.sink, cfg.block_size, cfg.alpha, cfg.beta, cfg.window_tokens
    hq, hkv = q.shape[2], k.shape[2]
    g = hq // hkv
    scale = CONFIG.attention_scale
    schedule = Schedule(cfg, 1)
    maw = {}  # position -> [Hkv] moving-average weight (ring tokens only)
    kept = [set() for _ in range(hkv)]
    reevaluated = False

    def spans(chosen: set, lo: int, hi: int) -> set:
        """keep_after: each chosen token index also keeps the next ones, inside [lo, hi)."""
        return {min(i + j, hi - 1) for i in chosen for j in range(cfg.keep_after + 1) if i + j < hi} | chosen

    def copy_started(blocks, into_kept=True):
        blocks = list(blocks)
        if not blocks:
            return
        for h in range(hkv):
            chosen = {s + blk * bs + j - s for blk in blocks for j in range(bs)
                      if into_kept and maw[s + blk * bs + j][h] > beta / window}
            kept[h] |= spans(chosen, blocks[0] * bs, (blocks[-1] + 1) * bs)

    def window_probs(query_positions, published):
        """MAW update of one step: per KV head, probabilities over the GPU tokens (sinks + ring from
        the host's end), summed over the group, averaged over the step's queries."""
        n = query_positions[-1] + 1
        first_ring = s + published * bs
        add = {}
        for p in query_positions:
            keys = [j for j in range(min(n, s))] + list(range(first_ring, p + 1))
            for h in range(hkv):
                scores = np.array([[q[0, p, h * g + i] @ k[0, j, h] * scale for j in keys] for i in range(g)])
                probs = np.exp(scores - scores.max(axis=1, keepdims=True))
                probs /= probs.sum(axis=1, keepdims=True)
                for idx, j in enumerate(keys):
                    if j >= s:
                        add.setdefault(j, np.zeros(hkv))[h] += probs[:, idx].sum() / len(query_positions)
        return add

    def update(add, positions_written):
        for p in positions_written:
            if p >= s:
                maw[p] = np.zeros(hkv)  # written: reset
        for j in maw:
            if j >= s + schedule.published[0] * bs or j in add:
                maw[j] = (1 - alpha) * maw[j] + alpha * add.get(j, np.zeros(hkv))

    n = 0
    for c in range(0, PROMPT, CHUNK):  # prefill chunks (host path: published before each chunk)
        positions = list(range(c, min(PROMPT, c + CHUNK)))
        before = schedule.started[0]
        schedule.prefill(np.array([positions[-1] + 1]), 0)
        copy_started(range(before, schedule.started[0]))
        update(window_probs(positions, schedule.published[0]), positions)
        n = positions[-1] + 1
    turn = list(range(PROMPT - cfg.reevaluate_queries, PROMPT))
    for t in range(STEPS):
        p = PROMPT + t
        before = schedule.started[0]
        published = schedule.decode(t, np.array([p + 1]))[0]
        new_blocks = range(before, schedule.started[0])
        copy_started(new_blocks)
        if not reevaluated and published > 0:  # the prompt's queries re-score every stored token
            reevaluated = True
            stored = list(range(s, s + schedule.started[0] * bs))
            for h in range(hkv):
                probs = np.zeros(len(stored))
                for qp in turn:
                    scores = np.array([[q[0, qp, h * g + i] @ k[0, j, h] * scale for j in stored] for i in range(g)])
                    e = np.exp(scores - scores.max(axis=1, keepdims=True))
                    probs += (e / e.sum(axis=1, keepdims=True)).sum(axis=0) / len(turn)
                kept[h] = spans({j - s for j, pr in zip(stored, probs) if pr > beta / len(stored)}, 0, len(stored))
        update(window_probs([p], published), [p])
    return kept


def test_topk_selection_matches_numpy_top_k(model):
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 97, (1, PROMPT + STEPS)).astype(np.int32)
    cfg = OffloadConfig(**{**WINDOW, "mode": "topk", "budget": 32}).resolved()  # 2 of up to 5 blocks
    q, k = projections(model, tokens)
    selected, published = [], []

    def observe(t, cache):
        published.append(int(np.asarray(cache.meta.offloaded_blocks)[0]))

    backend = make_backend(cfg)
    step, params = make_step(model, backend)
    backend.open(model.config, 1, MAX_LEN)
    cache = model.init_cache(1, MAX_LEN, backend)
    for s in range(0, PROMPT, CHUNK):
        pos = (s + np.arange(CHUNK))[None]
        pos = np.where(pos < PROMPT, pos, -1).astype(np.int32)
        cache = backend.before_step(cache, pos)
        _, cache = step(params, np.where(pos >= 0, tokens[:, np.maximum(pos[0], 0)], 0).astype(np.int32), pos, cache)
    for t in range(STEPS):
        pos = np.full((1, 1), PROMPT + t, np.int32)
        cache = backend.before_step(cache, pos)
        observe(t, cache)
        _, cache = step(params, tokens[:, PROMPT + t:PROMPT + t + 1], pos, cache)
        selected.append(np.asarray(cache.layers[0].selected)[0])  # [Hkv, k]
    s, bs, hkv = cfg.sink, cfg.block_size, CONFIG.num_kv_heads
    g = CONFIG.num_heads // hkv
    checked = 0
    for t in range(STEPS):
        e, p = published[t], PROMPT + t
        for h in range(hkv):
            if e == 0:
                assert (selected[t][h] == -1).all()
                continue
            blocks = k[0, s:s + e * bs, h].reshape(e, bs, -1)
            kmin, kmax = blocks.min(axis=1), blocks.max(axis=1)
            scores = sum(np.maximum(q[0, p, h * g + i] * kmin, q[0, p, h * g + i] * kmax).sum(axis=1)
                         for i in range(g))
            want = np.argsort(-scores, kind="stable")[:min(2, e)]
            got = selected[t][h][:len(want)]
            assert list(got) == list(want), f"step {t} head {h}: selected {got} != top-k {want} of {scores.round(3)}"
            checked += 1
    assert checked > 50 and max(published) >= 4


def test_hgca_rescores_a_turn_only_at_a_step_where_its_row_decodes():
    """HgcaHost._reevaluate: of the rows whose new turn awaits its re-scoring and that have offloaded
    blocks, only those with a token in the step are re-scored (a row still prefilling while the
    others decode waits for its own first decode step); each re-scored row once, with its queries."""
    from types import SimpleNamespace

    from jhybrid.hybrid.modes.hgca import HgcaHost

    queued = []
    step_rows = np.array([True, False, True, True])
    ctx = SimpleNamespace(shape=SimpleNamespace(n_layers=2, batch=4, scale=1.0),
                          config=SimpleNamespace(beta=1.0, keep_after=0, max_keep_share=None, reevaluate_queries=4),
                          store=object(), published=lambda: np.array([3, 5, 0, 2]),
                          step_rows=lambda: step_rows.copy(),
                          background=lambda fn, store, layer, seqs, q, *rest: queued.append((layer, seqs, q.shape)),
                          wait_background=lambda: None)
    host = HgcaHost(ctx)
    host.new_turn[:] = [True, True, True, False]
    for layer in range(2):
        for b in range(4):
            host.turn_queries[layer][b] = np.ones((4, 2, 8), np.float32)
    host._reevaluate()
    # row 0: due; row 1: prefilling (no token this step); row 2: nothing offloaded; row 3: no new turn
    assert queued == [(0, [0], (1, 4, 2, 8)), (1, [0], (1, 4, 2, 8))]
    assert host.new_turn.tolist() == [False, True, True, False]
    step_rows[1] = True  # row 1's own first decode step
    host._reevaluate()
    assert queued[2:] == [(0, [1], (1, 4, 2, 8)), (1, [1], (1, 4, 2, 8))]
    assert host.new_turn.tolist() == [False, False, True, False]


def test_a_decode_step_does_not_wait_for_the_copies_of_a_row_it_does_not_carry(model):
    """Row 1 prefills (device path: its chunks attend to device copies of its offloaded prompt) while
    row 0 decodes in steps of its own (the serving engine's schedule). With the eviction thread held,
    row 1's chunks start copies that cannot land; row 0's decode steps must not wait for them (a
    bounded join), and the host owns none of them for row 1 until row 1's own first decode step,
    which owns every block row 1 started (what it would own alone)."""
    import threading

    rng = np.random.default_rng(1)
    tokens = rng.integers(0, CONFIG.vocab_size, (2, 120)).astype(np.int32)
    cfg = OffloadConfig(mode="streaming", **WINDOW, prefill_offloaded="device", eviction_lag_steps=0,
                        eviction_spread=False)
    backend = make_backend(cfg)
    step, params = make_step(model, backend)
    backend.open(model.config, 2, MAX_LEN)
    state = {"cache": model.init_cache(2, MAX_LEN, backend), "n": [0, 0]}

    def run_step(rows_tokens: dict):
        """One step: rows_tokens {row: count}; returns the step's host-owned blocks [2]."""
        width = max(rows_tokens.values())
        pos = np.full((2, width), -1, np.int32)
        for row, count in rows_tokens.items():
            pos[row, :count] = state["n"][row] + np.arange(count)
        cache = backend.before_step(state["cache"], pos)
        owned = np.asarray(cache.meta.offloaded_blocks)
        toks = np.where(pos >= 0, np.take_along_axis(tokens, np.maximum(pos, 0), axis=1), 0).astype(np.int32)
        _, state["cache"] = step(params, toks, pos, cache)
        for row, count in rows_tokens.items():
            state["n"][row] += count
        return owned

    def decode_row_0_bounded():
        done = {}
        worker = threading.Thread(target=lambda: done.setdefault("owned", run_step({0: 1})), daemon=True)
        worker.start()
        worker.join(timeout=120)
        assert not worker.is_alive(), "row 0's decode step waited for row 1's copies"
        return done["owned"]

    evictor = backend.runtime.evictor
    gate = threading.Event()
    try:
        run_step({0: 16})
        run_step({0: 8})  # row 0: a 24-token prompt, inside its window
        for _ in range(3):  # row 1's first chunks: its copies begin as its evicted blocks (no wait for the store)
            run_step({1: CHUNK})
            run_step({0: 1})
        owned_before = int(evictor.published[1])
        assert owned_before == 0 < int(evictor.started[1])  # row 1 has not decoded: the host owns none of its blocks
        evictor._thread.submit(gate.wait, 120)  # every copy started from here waits for the gate
        for _ in range(3):
            run_step({1: CHUNK})  # starts copies of row 1's blocks (their jobs wait behind the gate)
            owned = decode_row_0_bounded()
            assert owned[1] == owned_before  # row 1's new blocks are not the host's yet
        assert int(evictor.started[1]) > owned_before
        gate.set()
        owned = run_step({0: 1, 1: 1})  # row 1's first decode step
        assert owned[1] == int(evictor.started[1])
    finally:
        gate.set()
        backend.close()
