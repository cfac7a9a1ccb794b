"""Packed serving steps with the offloading modes (`HybridAttention.packs_decode`, `PackedRows` with
the batch's `StepMeta`, `HostRuntime.before_step` with decode_positions) on the tiny model (CPU).

A packed step runs some rows' prefill chunks and the other rows' decode tokens in one call. The
oracles: every request's greedy tokens equal running it alone (one slot, no other request), and
equal the same load served with the decode tokens in calls of their own; the host side sees each
group as a call of its own would (checked through what it counts and what it refuses).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from jhybrid.hybrid import make_backend
from jhybrid.models import create_model
from jhybrid.serving.api import Request
from jhybrid.serving.engine import ServingEngine
from tests.hybrid_support import GEMMA3_LIKE, TINY

SLOTS, MAX_LEN, CHUNK = 4, 160, 16
# every due block evicted and published at once: where blocks go then depends on each request's own
# tokens only, so a request's tokens do not depend on the others' (the alone oracle holds)
POLICY = dict(window_tokens=40, block_size=16, sink=8, host_threads=1, eviction_spread=False, eviction_lag_steps=0)
MODES = {
    "scout": dict(mode="scout", budget=32, recall_blocks=2, recall_threshold=0.0, recall_min_interval=1,
                  recall_lag_steps=1, scout_exact_layers=1, prefill_offloaded="device"),
    "topk": dict(mode="topk", budget=32, prefill_offloaded="device"),
    "streaming": dict(mode="streaming", prefill_offloaded="device"),
}


@pytest.fixture(scope="module")
def model():
    return create_model(TINY, seed=0)


def backend_of(name, packs: bool = True, **fields):
    options = {**POLICY, **MODES[name], **fields}
    backend = make_backend(options.pop("mode"), **options)
    if not packs:  # the same backend, its decode tokens in calls of their own
        backend.__class__ = type("UnpackedCalls", (type(backend),), {"packs_decode": False})
    return backend


def recording(engine):
    """Records the name of every call the engine runs, one list per step."""
    steps, run = [[]], engine._run

    def recorded(name, fn, donate, *args):
        steps[-1].append(name)
        return run(name, fn, donate, *args)

    engine._run = recorded
    step = engine.step

    def stepped():
        busy = step()
        steps.append([])
        return busy

    engine.step = stepped
    return steps


def serve(engine, prompts, tokens, every: int = 3):
    """The requests, one arriving every `every` steps (so later prompts prefill while earlier ones
    decode), stepped to the end (bounded) -> their outputs."""
    handles = []
    for step in range(400):
        if step % every == 0 and len(handles) < len(prompts):
            handles.append(engine.submit(Request(prompts[len(handles)], max_tokens=tokens[len(handles)])))
        if not engine.step() and len(handles) == len(prompts):
            break
    return [h.result(0) for h in handles]


def alone(model, name, prompts, tokens):
    """Each request served alone: one slot, nothing else running."""
    engine = ServingEngine(model, backend_of(name), slots=1, max_len=MAX_LEN, prefill_chunk=CHUNK, prefix_cache=None)
    try:
        return [serve(engine, [p], [n])[0].tokens for p, n in zip(prompts, tokens)]
    finally:
        engine.close(drain=False)


# topk on CI (14 s on 2 cores); scout's packed steps are the same calls plus its recalls (88 s there,
# past the suite's 30 minutes; its packed rows are checked on CI by test_serving_hybrid_rows)
@pytest.mark.parametrize("name", [pytest.param("scout", marks=pytest.mark.slow), "topk",
                                  pytest.param("streaming", marks=pytest.mark.slow)])
def test_packed_steps_give_every_request_its_tokens_alone(model, rng, name):
    """Prompts past the window (their chunks attend to device copies) and inside it, arriving while
    others decode: the engine packs the decode tokens into the first prefill call of a step, and
    every request's tokens equal its run alone and the same load's with unpacked calls."""
    prompts = [rng.integers(0, TINY.vocab_size, n).tolist() for n in (100, 37, 70, 23, 120, 57)]
    tokens = [20, 9, 14, 6, 10, 12]
    outs = {}
    for packs in (True, False):
        engine = ServingEngine(model, backend_of(name, packs), slots=SLOTS, max_len=MAX_LEN, prefill_chunk=CHUNK,
                               step_token_budget=2 * CHUNK, prefix_cache=None, prefill_order="arrival")
        calls = recording(engine)
        try:
            outs[packs] = serve(engine, prompts, tokens)
            counters = engine.backend.counters()
        finally:
            engine.close(drain=False)
        if packs:
            packed_steps = [names for names in calls if "packed" in names]
            assert len(packed_steps) >= 4, calls
            assert all(names.count("decode") == 0 and names.index("packed") == 0 for names in packed_steps), calls
            assert counters["n_prefill_device_chunks"] > 0 and counters["n_prefill_window_chunks"] > 0, counters
        else:
            assert not any("packed" in names for names in calls), calls
    want = alone(model, name, prompts, tokens)
    assert [o.tokens for o in outs[False]] == want, "unpacked"
    assert [o.tokens for o in outs[True]] == want, "packed"
    assert all(len(o.tokens) == n for o, n in zip(outs[True], tokens))


@pytest.mark.slow  # 30 s
def test_a_model_with_sliding_layers_packs_its_global_layers(rng):
    """A Gemma-3-like model (sliding-window layers beside the offloaded global ones): its packed
    steps step the global layers' host side and attend the sliding layers' windows, chunk rows then
    decode rows; every request's tokens equal its run alone."""
    gemma = create_model(GEMMA3_LIKE, seed=3)
    prompts = [rng.integers(0, GEMMA3_LIKE.vocab_size, n).tolist() for n in (90, 37, 64)]
    tokens = [14, 8, 6]
    engine = ServingEngine(gemma, backend_of("scout"), slots=SLOTS, max_len=MAX_LEN, prefill_chunk=CHUNK,
                           step_token_budget=CHUNK, prefix_cache=None, prefill_order="arrival")
    calls = recording(engine)
    try:
        outs = serve(engine, prompts, tokens)
    finally:
        engine.close(drain=False)
    assert sum("packed" in names for names in calls) >= 3, calls
    alone_engine = ServingEngine(gemma, backend_of("scout"), slots=1, max_len=MAX_LEN, prefill_chunk=CHUNK,
                                 prefix_cache=None)
    try:
        want = [serve(alone_engine, [p], [n])[0].tokens for p, n in zip(prompts, tokens)]
    finally:
        alone_engine.close(drain=False)
    assert [o.tokens for o in outs] == want


def test_chunks_on_the_host_path_decode_in_a_call_of_their_own(model, rng, caplog):
    """scout with its offloaded prompt attended on the CPU (prefill_offloaded="host"): a chunk with
    an offloaded part cannot carry the decode tokens (can_pack False), so its step decodes in a call
    of its own (logged once), while chunks inside the window still pack; tokens equal alone."""
    prompts = [rng.integers(0, TINY.vocab_size, n).tolist() for n in (90, 30, 75)]
    tokens = [16, 8, 8]
    engine = ServingEngine(model, backend_of("scout", prefill_offloaded="host"), slots=SLOTS, max_len=MAX_LEN,
                           prefill_chunk=CHUNK, step_token_budget=CHUNK, prefix_cache=None, prefill_order="arrival")
    calls = recording(engine)
    try:
        with caplog.at_level(logging.INFO, logger="jhybrid.serving"):
            outs = serve(engine, prompts, tokens)
    finally:
        engine.close(drain=False)
    assert any(names[:2] == ["prefill_rows", "decode"] for names in calls), calls  # host-path chunks
    assert any("packed" in names for names in calls), calls  # chunks inside the window
    assert sum("cannot carry the decode tokens" in r.message for r in caplog.records) == 1
    assert [o.tokens for o in outs] == alone(model, "scout", prompts, tokens)


def test_hgca_never_packs(model):
    """hgca's prefill chunks hand their last queries to the host (its re-evaluation): not packable."""
    backend = backend_of("scout")
    assert backend.packs_decode
    hgca = make_backend("hgca", **POLICY, beta=1.0, alpha=0.3)
    assert not hgca.packs_decode
    recall = make_backend("recall", **POLICY)
    assert not recall.packs_decode


@pytest.fixture
def opened(model):
    backend = backend_of("scout")
    cache = model.init_cache(2, MAX_LEN, backend)
    backend.open(TINY, 2, MAX_LEN)
    yield backend, cache
    backend.close()


def test_a_packed_step_refuses_what_it_cannot_run(opened):
    backend, cache = opened
    chunk = np.full((2, CHUNK), -1, np.int32)
    chunk[0] = np.arange(CHUNK)
    with pytest.raises(ValueError, match=r"rows \[0\] both prefill and decode"):
        backend.before_packed_step(cache, chunk, np.array([0, -1], np.int32))
    with pytest.raises(ValueError, match=r"expected \[B=2, C > 1\]"):
        backend.runtime.before_step(cache, chunk[:, :1], np.array([-1, 0], np.int32))
    with pytest.raises(ValueError, match="positions start at"):
        backend.before_packed_step(cache, chunk, np.array([-1, 3], np.int32))
    hgca = make_backend("hgca", **POLICY, beta=1.0, alpha=0.3)
    assert not hgca.can_pack(chunk)


def test_compile_steps_compiles_every_packed_shape(model, rng):
    """scout, 2 slots, 2 chunks a step and 1 while requests decode: `compile_steps` compiles decode,
    the prefill of 1 and 2 rows over each prefill variant (as it is: the host path; a chunk inside
    the window; copies of each size) and the packed call of 1 row (a step that packs decode tokens
    takes one chunk) over each variant but the host path's (such chunks never pack). A load of
    packed steps from inside the window to near max_len then compiles nothing more."""
    engine = ServingEngine(model, backend_of("scout"), slots=2, max_len=MAX_LEN, prefill_chunk=CHUNK,
                           step_token_budget=2 * CHUNK, decoding_step_token_budget=CHUNK, prefix_cache=None)
    calls = recording(engine)
    try:
        variants = 2 + len(engine.backend.runtime.prefill.sizes())
        assert engine.compile_steps() == 1 + 2 * variants + (variants - 1)
        compiled = engine.stats().compiles
        prompts = [rng.integers(0, TINY.vocab_size, n).tolist() for n in (30, 150, 90)]
        serve(engine, prompts, [12, 4, 6], every=2)
        assert engine.stats().compiles == compiled
    finally:
        engine.close(drain=False)
    assert sum("packed" in names for names in calls) >= 4, calls


class _Prefilling:
    """What `_take` reads of a prefilling request."""

    def __init__(self, left: int, order: int):
        self.prompt, self.prefilled, self.order = np.zeros(left, np.int32), 0, order


@pytest.mark.parametrize("slots, budget, decoding_budget, max_backlog", [
    (4, 4 * CHUNK, CHUNK, None), (4, 4 * CHUNK, 2 * CHUNK, None), (4, 4 * CHUNK, 3 * CHUNK, None),
    (4, 4 * CHUNK, CHUNK // 2, None), (2, 2 * CHUNK, CHUNK, None), (4, 4 * CHUNK, None, None),
    (4, 4 * CHUNK, CHUNK, 1000), (2, 2 * CHUNK, None, None), (3, 3 * CHUNK, None, None), (1, CHUNK, None, None)])
def test_packed_row_counts_are_those_a_decoding_step_can_take(model, slots, budget, decoding_budget, max_backlog):
    """The packed shapes compile_steps compiles (`packed_row_counts`) against the row counts of
    every first call `_take` makes for 1 to slots - 1 prefilling requests (one slot decodes) under
    the budget a step that packs decode tokens has (the decoding budget, strict, when it always
    applies; else the step's): the same set (none with one slot; 2 slots: 1 row only)."""
    engine = ServingEngine(model, backend_of("scout"), slots=slots, max_len=MAX_LEN, prefill_chunk=CHUNK,
                           step_token_budget=budget, decoding_step_token_budget=decoding_budget,
                           decoding_budget_max_backlog=max_backlog, prefix_cache=None)
    try:
        taken = set()
        for n in range(1, slots):
            runs = [_Prefilling(5 * CHUNK, order) for order in range(n)]
            if decoding_budget is not None:  # the budget applies (a backlog of at most max_backlog) ...
                taken.add(engine._take(runs, engine.decoding_step_token_budget, strict=True, first_call=True)[1])
            if decoding_budget is None or max_backlog is not None:  # ... or it does not
                taken.add(engine._take(runs, budget, strict=False, first_call=True)[1])
        assert sorted(taken) == engine.packed_row_counts()
    finally:
        engine.close(drain=False)
