"""Prefill calls over some rows with the offloading modes (jhybrid/serving/engine.py's row calls +
`HybridAttention.rows_meta`, jhybrid/hybrid/rows.py's `part_of_rows`) on the tiny model (CPU).

The oracle is the whole-row call, the offloading modes' only prefill call before: the same engine
schedule run with a backend that prefills every row in every call (positions -1 for the rows not
taking part). With a step budget of one chunk both engines give every prefilling request the same
chunk in every step, so after each step their device caches (every layer-state array and the
lengths) and their tokens must be equal, while the row engine's calls carry 1, 2 or all 4 rows
and the rows not in a call decode in between. hgca's prompts attend to their offloaded part on
the host (the host side numbers rows of the whole batch: the queries go over spread to 4 rows) and
hand their last queries to its re-evaluation; scout's attend to device copies of it.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jhybrid.hybrid import make_backend
from jhybrid.models import create_model
from jhybrid.serving.api import Request
from jhybrid.serving.engine import ServingEngine
from tests.hybrid_support import TINY

SLOTS, MAX_LEN, CHUNK = 4, 160, 16
POLICY = dict(window_tokens=40, block_size=16, sink=8, host_threads=1, eviction_spread=False, eviction_lag_steps=0)
MODES = {
    "hgca": dict(mode="hgca", beta=1.0, alpha=0.3, prefill_offloaded="host"),
    "scout": dict(mode="scout", budget=32, recall_blocks=2, recall_threshold=0.0, recall_min_interval=1,
                  recall_lag_steps=1, scout_exact_layers=1, prefill_offloaded="device"),
}


@pytest.fixture(scope="module")
def model():
    return create_model(TINY, seed=0)


def backend_of(name, whole_rows: bool, packs: bool = True):
    options = {**POLICY, **MODES[name]}
    backend = make_backend(options.pop("mode"), **options)
    if whole_rows:  # the same backend, its prefill calls over every row
        backend.__class__ = type("WholeRowCalls", (type(backend),), {"prefills_rows": False})
    elif not packs:  # the same backend, its decode tokens in calls of their own
        backend.__class__ = type("UnpackedCalls", (type(backend),), {"packs_decode": False})
    return backend


def recording(engine):
    """Records (name, token rows) of every call the engine runs."""
    calls, run = [], engine._run

    def recorded(name, fn, donate, *args):
        calls.append((name, np.shape(args[1])[0]))
        return run(name, fn, donate, *args)

    engine._run = recorded
    return calls


def cache_arrays(engine):
    """Every layer-state array (this step's device copies left out) and the lengths, as NumPy."""
    cache = engine._cache
    leaves = [np.asarray(x, np.float64) for state in cache.layers
              for x in jax.tree_util.tree_leaves(state.replace(offloaded=None))]
    return leaves + [np.asarray(cache.lengths)]


@pytest.mark.parametrize("name", ["scout", "hgca"])
def test_prefill_calls_over_some_rows_equal_whole_row_calls(model, rng, name):
    prompts = [rng.integers(0, TINY.vocab_size, n).tolist() for n in (100, 41, 70, 23, 57, 90)]
    engines = [ServingEngine(model, backend_of(name, whole, packs=False), slots=SLOTS, max_len=MAX_LEN, prefill_chunk=CHUNK,
                             step_token_budget=CHUNK, prefix_cache=None, prefill_order="arrival")
               for whole in (False, True)]
    rows_engine, whole_engine = engines
    calls = recording(rows_engine)
    try:
        handles = [[], []]
        for step in range(200):  # bounded; a request arrives every 2 steps
            if step % 2 == 0 and step // 2 < len(prompts):
                for engine, mine in zip(engines, handles):
                    mine.append(engine.submit(Request(prompts[step // 2], max_tokens=12)))
            busy = [engine.step() for engine in engines]
            assert busy[0] == busy[1]
            if not busy[0] and len(handles[0]) == len(prompts):
                break
            for got, want in zip(cache_arrays(rows_engine), cache_arrays(whole_engine)):
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"step {step}")
        outs = [[h.result(0) for h in mine] for mine in handles]
        assert [o.tokens for o in outs[0]] == [o.tokens for o in outs[1]]
        assert all(len(o.tokens) == 12 for o in outs[0])
        logs = [[(r.prefill, r.decode) for r in engine.step_log()] for engine in engines]
        assert logs[0] == logs[1]
    finally:
        for engine in engines:
            engine.close(drain=False)
    prefill_rows = {rows for kind, rows in calls if kind == "prefill_rows"}
    assert prefill_rows == {1, 2}, calls  # calls of some rows while others decode ...
    assert ("prefill", SLOTS) in calls  # ... and of every row (the whole batch) when 3 or 4 prefill


@pytest.mark.parametrize("name", ["scout", pytest.param("hgca", marks=pytest.mark.slow)])  # hgca: 14 s more
def test_a_step_that_begins_with_requests_decoding_prefills_whole_chunks_within_its_budget(model, rng, name):
    """4 chunks a step, one while a request decodes (`decoding_step_token_budget`): the offloading
    modes' rows depend on where chunks end, so such a step takes one whole chunk where a call of R
    rows would take one of each; the steps without a decoding request take a chunk of each of up
    to 4 rows. Every request's tokens equal running it alone (its chunks end where they end alone)."""
    prompts = [rng.integers(0, TINY.vocab_size, n).tolist() for n in (30, 100, 41, 70)]
    tokens = [24, 6, 6, 6]
    engine = ServingEngine(model, backend_of(name, False), slots=SLOTS, max_len=MAX_LEN, prefill_chunk=CHUNK,
                           step_token_budget=4 * CHUNK, decoding_step_token_budget=CHUNK, prefix_cache=None,
                           prefill_order="arrival")
    taken = []  # (a request was decoding when the step began, prompt tokens the step took per request)
    try:
        handles = [engine.submit(Request(prompts[0], max_tokens=tokens[0]))]
        for _ in range(200):  # bounded
            decoding = any(h.tokens and not h.done for h in handles)
            before = engine.stats().steps
            if not engine.step() and len(handles) == len(prompts):
                break
            if engine.stats().steps > before:
                taken.append((decoding, engine.step_log()[-1].prefill))
            if len(handles) < len(prompts) and handles[0].tokens:  # the rest arrive while the first decodes
                handles += [engine.submit(Request(p, max_tokens=n)) for p, n in zip(prompts[1:], tokens[1:])]
        outs = [h.result(0) for h in handles]
    finally:
        engine.close(drain=False)
    alone_engine = ServingEngine(model, backend_of(name, False), slots=SLOTS, max_len=MAX_LEN, prefill_chunk=CHUNK,
                                 prefix_cache=None)
    try:
        for prompt, n, out in zip(prompts, tokens, outs):
            handle = alone_engine.submit(Request(prompt, max_tokens=n))
            while alone_engine.step():
                pass
            assert out.tokens == handle.result(0).tokens
    finally:
        alone_engine.close(drain=False)
    assert taken[0] == (False, ((outs[0].request_id, 30),))  # 16 + 14 in one step, nothing decoding yet
    decoding_steps = [prefill for decoding, prefill in taken if decoding and prefill]
    assert decoding_steps and all(sum(n for _, n in p) <= CHUNK for p in decoding_steps), taken
    left = {out.request_id: len(p) for out, p in zip(outs, prompts)}
    for _, prefill in taken:  # whole chunks: only a prompt's last one is shorter
        for request_id, n in prefill:
            left[request_id] -= n
            assert n % CHUNK == 0 or left[request_id] == 0, taken
    assert not any(left.values())


def test_scout_recalls_applied_in_the_calls_shadow_keep_every_token(model, rng):
    """scout at keep-all (exact query; every block selected, so any pool content is exact) with
    recall_after_dispatch: the engine applies every recall right
    after a call's dispatch (`overlap_dispatch`), none at a step start, and every request's greedy
    tokens equal the `full` engine's."""
    prompts = [rng.integers(0, TINY.vocab_size, n).tolist() for n in (100, 70, 41)]
    keep_all = {**POLICY, "budget": MAX_LEN, "recall_blocks": 2, "recall_threshold": 0.0, "recall_min_interval": 1,
                "predict_query": False, "prefill_offloaded": "device", "recall_after_dispatch": True}
    outs = {}
    for name, backend in (("scout", make_backend("scout", **keep_all)), ("full", make_backend("full"))):
        engine = ServingEngine(model, backend, slots=2, max_len=MAX_LEN, prefill_chunk=CHUNK,
                               step_token_budget=CHUNK, prefix_cache=None, prefill_order="arrival")
        try:
            handles = [engine.submit(Request(p, max_tokens=16)) for p in prompts]
            for _ in range(400):  # bounded
                if not engine.step():
                    break
            outs[name] = [h.result(0).tokens for h in handles]
            counters = engine.backend.counters()
        finally:
            engine.close(drain=False)
        if name == "scout":
            assert counters["n_recalls"] > 0 and counters["n_recalls_after_dispatch"] == counters["n_recalls"]
            overlap = sum(r.times.overlap_seconds for r in engine.step_log())
            assert overlap > 0
    assert outs["scout"] == outs["full"]
    assert all(len(tokens) == 16 for tokens in outs["full"])
