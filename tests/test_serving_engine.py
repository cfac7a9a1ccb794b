"""The continuous-batching engine (jhybrid/serving/engine.py) on the tiny model (CPU):

  * every request's greedy output equals the Generator's run of it alone (prompt lengths 1..100,
    requests arriving while others decode, more requests than slots, stop tokens, max_tokens 1);
  * cancel mid-run and while waiting; close with and without draining;
  * seeded sampling per request: the same tokens whatever its batch mates and slot (and the
    Generator's with that seed);
  * 50 short requests through 2 slots: every row reset, nothing left, counters consistent, no
    recompilation after warm-up;
  * a long prompt is prefilled in budget-sized chunks, one per step, each step also decoding the
    running request (the step log);
  * admission errors (one line, value and limit), constructor errors (an offloading mode's window
    too small for prefill chunks of 2+ tokens among them), a failing step ends every
    request with ERROR (no hang) and later submits raise EngineClosed;
  * (slow) an offloading mode serves the same outputs (with its prefix cache on).
Waits are bounded by timeouts, never by wall-clock asserts.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time

import numpy as np
import pytest

from jhybrid.attention.full import FullAttention, PackedRows
from jhybrid.generation import Generator, SamplingParams
from jhybrid.models import create_model
from jhybrid.serving.api import AdmissionError, EngineClosed, FinishReason, Request
from jhybrid.serving.engine import ServingEngine
from tests.hybrid_support import KEEP_ALL, TINY

SLOTS, MAX_LEN, CHUNK = 2, 128, 16
TIMEOUT = 120.0
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def model():
    return create_model(TINY, seed=0)


class Alone:
    """A request's output generated on its own by the Generator (full attention, same max_len)."""

    def __init__(self, model):
        self.generator = Generator(model, prefill_chunk=CHUNK, max_len=MAX_LEN)
        self.memo: dict = {}

    def __call__(self, prompt, max_tokens, sampling=GREEDY, stop=()) -> tuple[list[int], FinishReason]:
        key = (tuple(prompt), max_tokens, sampling, tuple(stop))
        if key not in self.memo:
            out = self.generator.generate([list(prompt)], max_new_tokens=max_tokens, sampling=sampling,
                                          stop_tokens=stop)
            self.memo[key] = (out.tokens[0], FinishReason(out.finish_reasons[0]))
        return self.memo[key]


@pytest.fixture(scope="module")
def alone(model):
    return Alone(model)


@pytest.fixture(scope="module")
def engine(model):
    """One started engine shared by the tests (each checks differences of its counters)."""
    engine = ServingEngine(model, slots=SLOTS, max_len=MAX_LEN, prefill_chunk=CHUNK, prefix_cache=None)
    engine.start()
    yield engine
    engine.close(drain=False)


def prompts_of(rng, lengths):
    return [rng.integers(0, TINY.vocab_size, n).tolist() for n in lengths]


class Stream:
    """on_token / on_finish callbacks that record what the engine emitted."""

    def __init__(self):
        self.tokens: list[tuple[int, int]] = []
        self.finished = []

    def on_token(self, token, index):
        self.tokens.append((token, index))

    def on_finish(self, output):
        self.finished.append(output)


def wait_idle(engine, timeout=TIMEOUT):
    """Until nothing runs or waits (bounded)."""
    deadline = time.monotonic() + timeout
    while (engine.stats().running, engine.stats().waiting) != (0, 0):
        assert time.monotonic() < deadline, f"the engine did not go idle within {timeout} s: {engine.stats()}"
        time.sleep(0.01)


# ----------------------------------------------------------------------------- greedy = alone


def test_greedy_outputs_equal_running_alone(engine, alone, rng):
    """Ten requests with prompts of 1..100 tokens through 2 slots: the first wave is queued at once,
    the second arrives (from the engine's own callback) while the first decodes."""
    lengths = [1, 7, 16, 17, 33, 100, 5, 48, 64, 2]
    max_tokens = [20, 1, 12, 25, 9, 28, 1, 30, 15, 24]
    prompts = prompts_of(rng, lengths)
    streams = [Stream() for _ in prompts]
    handles = {}
    second_wave = threading.Event()

    def submit(i):
        handles[i] = engine.submit(Request(prompts[i], max_tokens=max_tokens[i], request_id=f"r{i}"),
                                   streams[i].on_token, streams[i].on_finish)

    def first_token(token, index):
        streams[0].on_token(token, index)
        if index == 3:  # request 0 is decoding: the rest arrive now
            for i in range(5, len(prompts)):
                submit(i)
            second_wave.set()

    handles[0] = engine.submit(Request(prompts[0], max_tokens=max_tokens[0], request_id="r0"), first_token,
                               streams[0].on_finish)
    for i in range(1, 5):
        submit(i)
    assert second_wave.wait(TIMEOUT)
    for i, prompt in enumerate(prompts):
        out = handles[i].result(TIMEOUT)
        tokens, reason = alone(prompt, max_tokens[i])
        assert (out.tokens, out.finish_reason) == (tokens, reason), f"request {i}"
        assert out.request_id == f"r{i}" and out.prompt_tokens == len(prompt) and out.error is None
        assert streams[i].tokens == [(t, k) for k, t in enumerate(tokens)]
        assert streams[i].finished == [out] and handles[i].done
        assert len(out.token_times) == len(tokens) and out.ttft == out.token_times[0]
        assert out.token_times == sorted(out.token_times)
    wait_idle(engine)


def test_stop_tokens(engine, alone, rng):
    prompt = prompts_of(rng, [9])[0]
    free, _ = alone(prompt, 30)
    late = next((t for i, t in enumerate(free) if i >= 2 and t not in free[:i]), None)
    if late is None:
        pytest.skip("the free run repeats one token")
    stopped = engine.submit(Request(prompt, max_tokens=30, stop_tokens=(late,))).result(TIMEOUT)
    assert stopped.finish_reason == FinishReason.STOP and stopped.tokens == free[:free.index(late)]
    assert (stopped.tokens, stopped.finish_reason) == alone(prompt, 30, stop=(late,))
    at_once = engine.submit(Request(prompt, max_tokens=30, stop_tokens=(free[0],))).result(TIMEOUT)
    assert at_once.finish_reason == FinishReason.STOP and at_once.tokens == [] and at_once.ttft is None


# ----------------------------------------------------------------------------- cancel


def test_cancel_mid_run_and_while_waiting(engine, alone, rng):
    wait_idle(engine)
    before = engine.stats()
    prompts = prompts_of(rng, [10, 12, 14])
    holder, queued_cancelled, other_cancelled = {}, threading.Event(), threading.Event()

    def cancel_at_5(token, index):
        if index == 5:  # the engine thread waits here until the queued request's cancel is in
            assert queued_cancelled.wait(TIMEOUT)
            holder["running"].cancel()  # from the engine's own thread: ends at the next step

    def hold_at_20(token, index):
        if index == 20:  # it cannot reach max_tokens before the test cancels it
            assert other_cancelled.wait(TIMEOUT)

    holder["running"] = engine.submit(Request(prompts[0], max_tokens=100), cancel_at_5)
    other = engine.submit(Request(prompts[1], max_tokens=100), hold_at_20)
    queued = engine.submit(Request(prompts[2], max_tokens=100))  # both slots are taken: it waits
    queued.cancel()
    queued_cancelled.set()
    out = holder["running"].result(TIMEOUT)
    assert out.finish_reason == FinishReason.CANCELLED and out.tokens == alone(prompts[0], 100)[0][:6]
    waited = queued.result(TIMEOUT)
    assert waited.finish_reason == FinishReason.CANCELLED and waited.tokens == []
    other.cancel()
    other_cancelled.set()
    assert other.result(TIMEOUT).finish_reason == FinishReason.CANCELLED
    other.cancel()  # no-op once finished
    wait_idle(engine)
    after = engine.stats()
    assert after.cancelled - before.cancelled == 3 and after.finished == before.finished


# ----------------------------------------------------------------------------- sampling


def test_seeded_sampling_is_independent_of_batch_mates(engine, alone, rng):
    prompt = prompts_of(rng, [11])[0]
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=7)
    by_itself = engine.submit(Request(prompt, max_tokens=16, sampling=params)).result(TIMEOUT).tokens
    mates = [engine.submit(Request(p, max_tokens=24, sampling=SamplingParams(temperature=0.8, seed=s)))
             for s, p in enumerate(prompts_of(rng, [30, 5]))]
    greedy_mate = engine.submit(Request(prompts_of(rng, [3])[0], max_tokens=10))
    with_mates = engine.submit(Request(prompt, max_tokens=16, sampling=params)).result(TIMEOUT).tokens
    for handle in mates + [greedy_mate]:
        handle.result(TIMEOUT)
    assert by_itself == with_mates == alone(prompt, 16, sampling=params)[0]
    other_seed = engine.submit(Request(prompt, max_tokens=16, sampling=dataclasses.replace(params, seed=8)))
    assert other_seed.result(TIMEOUT).tokens != by_itself


# ----------------------------------------------------------------------------- slots are reused


def test_slots_reused_by_50_requests_leak_nothing(engine, alone, rng):
    # prefill of one row and of both rows (full prefills only the rows taking part) and decode
    # compiled: the 3-token prompt, admitted while the 100-token one takes 7 steps of 16, shares the
    # last of them with it
    for handle in [engine.submit(Request(p, max_tokens=2)) for p in ([1] * 100, [1, 2, 3])]:
        handle.result(TIMEOUT)
    engine.compile_steps()  # whichever shapes the timing of those two left out (run alone, this test
    wait_idle(engine)       # compiled a step shape under the 50 requests that the rest of the file had compiled)
    before = engine.stats()
    requests = [Request(prompts_of(rng, [int(rng.integers(1, 9))])[0], max_tokens=int(rng.integers(1, 5)))
                for _ in range(50)]
    handles = [engine.submit(r) for r in requests]
    outputs = [h.result(TIMEOUT) for h in handles]
    for request, out in zip(requests, outputs):
        assert (out.tokens, out.finish_reason) == alone(request.prompt, request.max_tokens)
    wait_idle(engine)
    after = engine.stats()
    assert (after.running, after.waiting) == (0, 0)
    assert after.finished - before.finished == 50
    assert after.generated_tokens - before.generated_tokens == sum(len(o.tokens) for o in outputs)
    assert after.prefill_tokens - before.prefill_tokens == sum(len(r.prompt) for r in requests)
    assert after.compiles == before.compiles  # prefill and decode were compiled before: nothing since
    assert (engine.slot_lengths() == 0).all()  # every row was reset when its request left


# ----------------------------------------------------------------------------- chunked prefill


def test_long_prompt_is_prefilled_in_chunks_between_decode_steps(engine, alone, rng):
    """While a 100-token prompt is prefilled (7 chunks of at most the 16-token budget), the running
    request gets a decode step in every one of those steps."""
    wait_idle(engine)
    short, long = prompts_of(rng, [6, 100])
    handles = {}

    def submit_long(token, index):
        if index == 0:  # the short request decodes from now on
            handles["long"] = engine.submit(Request(long, max_tokens=5, request_id="long"))

    handles["short"] = engine.submit(Request(short, max_tokens=40, request_id="short"), submit_long)
    assert handles["short"].result(TIMEOUT).tokens == alone(short, 40)[0]
    assert handles["long"].result(TIMEOUT).tokens == alone(long, 5)[0]
    log = engine.step_log()
    chunks = [(record.step, dict(record.prefill)["long"], record.decode) for record in log
              if "long" in dict(record.prefill)]
    assert [n for _, n, _ in chunks] == [16] * 6 + [4]
    steps = [step for step, _, _ in chunks]
    assert steps == list(range(steps[0], steps[0] + 7))  # one chunk per step, no step without one
    assert all("short" in decode for _, _, decode in chunks)  # and a decode step of the other in each


@pytest.mark.parametrize("order", ["arrival", "shortest"])
def test_prefill_order_decides_who_takes_the_step_budget(model, alone, rng, order):
    """A 100-token prompt is being prefilled when a 10-token one arrives: in arrival order the long
    one keeps the 16-token budget until it is done; shortest-first gives the short one its 10
    tokens in the next step (the long one the 6 left). Outputs equal running alone either way."""
    engine = ServingEngine(model, slots=SLOTS, max_len=MAX_LEN, prefill_chunk=CHUNK, prefix_cache=None,
                           prefill_order=order)
    try:
        long, short = prompts_of(rng, [100, 10])
        handles = [engine.submit(Request(long, max_tokens=3, request_id="long"))]
        engine.step()
        handles.append(engine.submit(Request(short, max_tokens=3, request_id="short")))
        for _ in range(40):  # bounded: 7 prefill steps + 3 decode steps at most
            if not engine.step():
                break
        assert [h.result(0).tokens for h in handles] == [alone(long, 3)[0], alone(short, 3)[0]]
        second = engine.step_log()[1].prefill
        assert second == ((("short", 10), ("long", 6)) if order == "shortest" else (("long", 16),))
    finally:
        engine.close(drain=False)
    with pytest.raises(ValueError, match="prefill_order='random'; expected one of"):
        ServingEngine(model, slots=2, max_len=64, prefill_order="random")


class ShapeRecording(FullAttention):
    """`full` with its chunks on the range kernel (interpreted: the GPU's path), recording the
    (rows, tokens per row) of every prefill call it traces, and those of calls packed with decode tokens."""

    def __init__(self):
        super().__init__(prefill_backend="interpret")
        self.calls = set()
        self.packed = set()

    def attend(self, layer_idx, q, k, v, positions, lengths, layer_cache, context):
        if isinstance(context.meta, PackedRows):
            rows = context.meta.rows.shape[0]
            shape = (rows, (q.shape[1] - context.meta.decode_lengths.shape[0]) // rows)
            self.calls.add(shape)
            self.packed.add(shape)
        elif q.shape[1] > 1:
            self.calls.add(q.shape[:2])
        return super().attend(layer_idx, q, k, v, positions, lengths, layer_cache, context)

    def __eq__(self, other):
        return other is self

    def __hash__(self):
        return id(self)


def test_prefill_calls_are_sized_by_the_prefilling_rows(model, alone, rng):
    """4 slots, 48 prompt tokens per step in calls of R rows x min(16, 48 / R) tokens: a prompt alone
    takes 1-row calls of 16; short prompts arriving behind it (shortest first) share a 4-row call
    of 12 (an idle row as padding when 3 take part) and 2-row calls of 16; decode tokens ride in
    the prefill calls. Through the range kernel's row map every output equals running alone."""
    backend = ShapeRecording()
    engine = ServingEngine(model, backend, slots=4, max_len=MAX_LEN, prefill_chunk=CHUNK, step_token_budget=48,
                           prefix_cache=None, prefill_order="shortest")
    try:
        prompts = prompts_of(rng, [100, 5, 6, 30])
        handles = [engine.submit(Request(prompts[0], max_tokens=4, request_id="a"))]
        engine.step()  # "a" alone: 3 one-row calls of 16
        handles += [engine.submit(Request(p, max_tokens=4, request_id=r)) for p, r in zip(prompts[1:], "bcd")]
        for _ in range(40):  # bounded
            if not engine.step():
                break
        assert [h.result(0).tokens for h in handles] == [alone(p, 4)[0] for p in prompts]
        # step 2: b 5, c 6, d 12, a 12 in one [4, 12] call (b, the shortest, gets all it needs at any
        # R; 4 rows give the call the most), then d 13 alone (the budget's rest); step 3: d 5 + a 16
        # ([2, 16], with b's and c's decode tokens), a 16, a 8
        assert [r.prefill for r in engine.step_log()[:3]] == [
            (("a", 48),), (("b", 5), ("c", 6), ("d", 25), ("a", 12)), (("d", 5), ("a", 40))]
        assert {rows for rows, _ in backend.calls} == {1, 2, 4}, backend.calls
        assert all(width == min(CHUNK, 48 // rows) for rows, width in backend.calls), backend.calls
        assert backend.packed, "no request decoded while another prefilled"
        assert (engine.slot_lengths() == 0).all()  # every row reset after its request
    finally:
        engine.close(drain=False)


class WholeRowCalls(FullAttention):
    """`full` as a backend that cannot prefill some rows alone (the offloading backends): its
    prefill calls are [slots, prefill_chunk] over every row, its decode tokens a call of their own."""

    prefills_rows = False
    packs_decode = False


@pytest.mark.parametrize("budget, first_step", [
    (16, (("a", 16), ("b", 16), ("c", 16))),   # below one call's 4 x 16 positions: one call a step
    (100, (("a", 32), ("b", 32), ("c", 20))),  # ceil(100 / 64) = 2 calls a step
])
def test_whole_row_calls_carry_a_chunk_of_every_prefilling_request(model, alone, rng, budget, first_step):
    """A [slots, chunk] call computes every row whether it carries tokens or not, so each call takes
    a chunk of every prefilling request and spends slots x chunk of the step's budget (a call
    carrying one prompt at a time prefilled at 1/slots of a fixed batch's rate). Outputs equal
    running alone."""
    engine = ServingEngine(model, WholeRowCalls("jnp"), slots=4, max_len=MAX_LEN, prefill_chunk=CHUNK,
                           step_token_budget=budget, prefix_cache=None, prefill_order="arrival")
    try:
        prompts = prompts_of(rng, [40, 40, 20])
        handles = [engine.submit(Request(p, max_tokens=3, request_id=r)) for p, r in zip(prompts, "abc")]
        for _ in range(20):  # bounded
            if not engine.step():
                break
        assert [h.result(0).tokens for h in handles] == [alone(p, 3)[0] for p in prompts]
        log = engine.step_log()
        assert log[0].prefill == first_step
        assert sum(t for r in log for _, t in r.prefill) == 100
        for record in log:  # a step's calls: one per chunk of its most prefilled request, one decode
            prefill_calls = -(-max((t for _, t in record.prefill), default=0) // CHUNK)
            assert prefill_calls <= -(-budget // (4 * CHUNK))
            assert record.times.calls == prefill_calls + bool(record.decode), record
            assert record.times.host_seconds + record.times.call_seconds <= record.seconds
    finally:
        engine.close(drain=False)


def test_compile_steps_compiles_every_step_shape_up_front(model, alone, rng):
    """4 slots: decode, and prefill of 1, 2 and 4 rows alone and packed with decode tokens = 7
    executables, compiled without running (2 at once); a second call compiles nothing; a load of requests
    arriving while others decode then compiles nothing more (no request waits for a compile).
    No step holds a conditional: the token draw's `lax.cond` runs in a program of its own (on a GPU a
    step with a conditional would wait on the host for its predicate, its dispatch for the device)."""
    from jhybrid.serving import engine as engine_module

    engine = ServingEngine(model, FullAttention("jnp"), slots=4, max_len=MAX_LEN, prefill_chunk=CHUNK,
                           step_token_budget=48, prefix_cache=None, prefill_order="shortest")
    try:
        with pytest.raises(ValueError, match=r"workers=0; expected an int >= 1"):
            engine.compile_steps(workers=0)
        assert engine.compile_steps(workers=2) == 7  # (compiles side by side, traced one by one)
        assert engine.compile_steps() == 0
        steps = [executable.as_text() for backend, executable in engine_module._executables.values()
                 if backend is engine.backend]
        assert len(steps) == 7 and not any(re.search(r"\bconditional\(", text) for text in steps)
        compiled = engine.stats().compiles
        prompts = prompts_of(rng, [100, 5, 6, 30, 60, 3])
        handles = [engine.submit(Request(p, max_tokens=6)) for p in prompts[:4]]
        for _ in range(80):  # bounded
            if len(handles) < len(prompts) and handles[0].done:
                handles += [engine.submit(Request(p, max_tokens=6)) for p in prompts[4:]]
            if not engine.step() and len(handles) == len(prompts):
                break
        assert [h.result(0).tokens for h in handles] == [alone(p, 6)[0] for p in prompts]
        assert engine.stats().compiles == compiled
        # compiling ran nothing: each executable the load ran had its first run there, counted once
        # (in the step that made it) and never again (a last short request reuses two of them)
        ran = engine.stats().first_runs
        assert 2 <= ran <= 7 and sum(r.times.first_runs for r in engine.step_log()) == ran
        last = engine.submit(Request(prompts[1], max_tokens=2))
        for _ in range(20):  # bounded
            if not engine.step():
                break
        assert last.result(0).tokens == alone(prompts[1], 2)[0] and engine.stats().first_runs == ran
    finally:
        engine.close(drain=False)


def test_compile_steps_keeps_every_shape_of_its_engine_however_many(model, monkeypatch):
    """The shared executables keep the latest SHARED_EXECUTABLES beyond the most shapes one engine's
    compile_steps compiled: with room for 2 shared ones, the 7 shapes of a 4-slot engine all stay
    (a second compile_steps compiles none, where a cap of 2 recompiled 5); a second engine's 7 then
    stay too, beside 2 of the first's."""
    from jhybrid.serving import engine as engine_module

    monkeypatch.setattr(engine_module, "SHARED_EXECUTABLES", 2)
    monkeypatch.setattr(engine_module, "_kept_executables", 2)
    monkeypatch.setattr(engine_module, "_executables", engine_module.collections.OrderedDict())
    engines = [ServingEngine(model, FullAttention("jnp"), slots=4, max_len=MAX_LEN, prefill_chunk=CHUNK,
                             step_token_budget=48, prefix_cache=None) for _ in range(2)]
    try:
        assert engines[0].compile_steps() == 7
        assert engine_module._kept_executables == 9
        assert engines[0].compile_steps() == 0
        assert engines[1].compile_steps() == 7  # another backend object: its own executables ...
        assert engines[1].compile_steps() == 0  # ... kept, with 2 of the first engine's
        assert len(engine_module._executables) == 9
    finally:
        for engine in engines:
            engine.close(drain=False)


@pytest.mark.parametrize("max_backlog", [None, 100])
def test_a_step_that_begins_with_requests_decoding_prefills_its_smaller_budget(model, alone, rng, max_backlog):
    """4 slots, 48 prompt tokens a step, 12 while a request decodes (the test tracks, before each
    step, whether a request had its first token and was not done); with max_backlog 100, the 12
    only while the prompt tokens left (submitted minus the step log's prefilled, counted by the
    test) are at most 100, else 48. Calls keep their compiled shapes (compile_steps' 7, none
    compiled by the load); outputs equal running alone."""
    engine = ServingEngine(model, FullAttention("jnp"), slots=4, max_len=MAX_LEN, prefill_chunk=CHUNK,
                           step_token_budget=48, decoding_step_token_budget=12, prefix_cache=None,
                           decoding_budget_max_backlog=max_backlog)
    try:
        assert engine.compile_steps() == 7
        prompts = prompts_of(rng, [20, 90, 60, 33])
        handles = [engine.submit(Request(prompts[0], max_tokens=30))]
        taken = []  # (a request was decoding when the step began, prompt backlog then, tokens the step took)
        for _ in range(120):  # bounded
            decoding = any(h.tokens and not h.done for h in handles)
            backlog = sum(len(p) for p in prompts[:len(handles)]) - sum(
                n for record in engine.step_log() for _, n in record.prefill)
            before = engine.stats().steps
            if not engine.step() and len(handles) == len(prompts):
                break
            if engine.stats().steps > before:
                record = engine.step_log()[-1]
                taken.append((decoding, backlog, sum(n for _, n in record.prefill)))
                assert record.budget == (12 if decoding and (max_backlog is None or backlog <= max_backlog)
                                         else 48), taken
            if len(handles) < len(prompts) and handles[0].tokens:  # the rest arrive while "a" decodes
                handles += [engine.submit(Request(p, max_tokens=5)) for p in prompts[1:]]
        assert [h.result(0).tokens for h in handles] == [alone(p, n)[0] for p, n in zip(prompts, (30, 5, 5, 5))]
        assert taken[0] == (False, 20, 20)
        small = [n for decoding, backlog, n in taken
                 if decoding and (max_backlog is None or backlog <= max_backlog)]
        assert small and all(n <= 12 for n in small), taken
        if max_backlog is not None:  # behind: the full budget although a request decodes
            assert any(n > 12 for decoding, backlog, n in taken if decoding and backlog > max_backlog), taken
        assert sum(n for _, _, n in taken) == sum(map(len, prompts))
        assert engine.stats().compiles == 7
    finally:
        engine.close(drain=False)


# ----------------------------------------------------------------------------- errors


def test_admission_errors_name_the_value_and_the_limit(engine):
    before = engine.stats().rejected
    cases = [
        (Request([1] * 100, max_tokens=29), "prompt 100 + max_tokens 29 = 129 tokens; expected at most a slot's 128"),
        (Request([1, 2, 97], max_tokens=3), "prompt token 2 is id 97; expected ids in [0, 97)"),
        (Request([-1], max_tokens=3), "prompt token 0 is id -1; expected ids in [0, 97)"),
        (Request([], max_tokens=3), "the prompt is empty"),
        (Request([1.5, 2.0], max_tokens=3),
         "the prompt is float64 of shape (2,); expected a list of integer token ids"),
        (Request([1], max_tokens=0), "max_tokens=0; expected an integer >= 1"),
    ]
    for request, message in cases:
        with pytest.raises(AdmissionError, match="^" + re.escape(message)) as info:
            engine.submit(request)
        assert "\n" not in str(info.value)
    assert engine.stats().rejected - before == len(cases)
    assert engine.submit(Request([1] * 100, max_tokens=28)).result(TIMEOUT).finish_reason == FinishReason.LENGTH


def test_constructor_errors(model):
    class NoRows(FullAttention):
        name = "rowless"
        reuses_rows = False

    with pytest.raises(ValueError, match="^mode 'rowless' cannot serve: its backend cannot reset single rows"):
        ServingEngine(model, NoRows(), slots=2, max_len=64)
    with pytest.raises(ValueError, match="max_len 300 is longer than the model's context of 256 tokens"):
        ServingEngine(model, slots=2, max_len=300)
    with pytest.raises(ValueError, match="slots=0; expected an integer >= 1"):
        ServingEngine(model, slots=0)
    with pytest.raises(ValueError, match="decoding_step_token_budget=0; expected an integer >= 1"):
        ServingEngine(model, slots=2, decoding_step_token_budget=0)
    with pytest.raises(ValueError, match="decoding_budget_max_backlog=-1; expected an integer >= 0"):
        ServingEngine(model, slots=2, decoding_step_token_budget=8, decoding_budget_max_backlog=-1)
    with pytest.raises(ValueError, match="decoding_budget_max_backlog=64 needs decoding_step_token_budget"):
        ServingEngine(model, slots=2, decoding_budget_max_backlog=64)
    with pytest.raises(ValueError, match=r"compiler_options=\{'xla_no_such_option': ''\}: XLA refused them "
                                         r"\(.*No such compile option: 'xla_no_such_option'"):
        ServingEngine(model, slots=2, compiler_options={"xla_no_such_option": ""})
    with pytest.raises(ValueError, match="compiler_options=.*expected a dict of XLA option names"):
        ServingEngine(model, slots=2, compiler_options=["xla_gpu_enable_command_buffer"])


def test_compiler_options_reach_every_step_compile(model, alone, rng, monkeypatch):
    """The engine's compiler_options go to each step program's compile (and key its executables: an
    engine without them compiles its own); outputs still equal each request run alone."""
    import jax

    seen = []
    compile_lowered = jax.stages.Lowered.compile

    def recording(self, compiler_options=None, **kwargs):
        seen.append(compiler_options)
        return compile_lowered(self, compiler_options=compiler_options, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", recording)
    options = {"xla_gpu_enable_command_buffer": ""}
    prompts = prompts_of(rng, [9, 21])
    for compiler_options in (None, options):
        engine = ServingEngine(model, FullAttention("jnp"), slots=SLOTS, max_len=MAX_LEN, prefill_chunk=CHUNK,
                               prefix_cache=None, compiler_options=compiler_options)
        try:
            seen.clear()
            assert engine.compile_steps() > 0
            assert seen and all(o == compiler_options for o in seen)  # (None: XLA's defaults)
            handles = [engine.submit(Request(p, max_tokens=5)) for p in prompts]
            while engine.step():
                pass
            assert [h.result(0).tokens for h in handles] == [alone(p, 5)[0] for p in prompts]
        finally:
            engine.close(drain=False)


class FailingAttention(FullAttention):
    """Full attention whose host hook raises at its `fail_at`-th call (an injected step failure)."""

    def __init__(self, fail_at: int):
        self.fail_at, self.calls = fail_at, 0

    def before_step(self, cache, positions):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected failure")
        return cache

    def close(self):
        self.closed = True


def test_a_failing_step_ends_every_request_with_error(model, rng):
    """The third model call raises (after two prefill calls: [2, 8] of both prompts, then the 9-token
    one's last token; at the first decode): both running requests and the waiting one end ERROR with
    the message; the engine refuses new requests; close returns."""
    backend = FailingAttention(fail_at=3)
    engine = ServingEngine(model, backend, slots=2, max_len=MAX_LEN, prefill_chunk=CHUNK, prefix_cache=None)
    engine.start()
    streams = [Stream() for _ in range(3)]
    handles = [engine.submit(Request(p, max_tokens=10), s.on_token, s.on_finish)
               for p, s in zip(prompts_of(rng, [5, 9, 3]), streams)]
    outputs = [h.result(TIMEOUT) for h in handles]
    assert [o.finish_reason for o in outputs] == [FinishReason.ERROR] * 3
    assert all(o.error == "RuntimeError: injected failure" for o in outputs)
    assert [len(o.tokens) for o in outputs] == [1, 1, 0]  # the first tokens came from the prefill
    assert all(s.finished == [o] for s, o in zip(streams, outputs))
    with pytest.raises(EngineClosed, match="stopped after an error: RuntimeError: injected failure"):
        engine.submit(Request([1, 2], max_tokens=2))
    stats = engine.stats()
    assert (stats.errors, stats.running, stats.waiting) == (3, 0, 0)
    engine.close()
    assert backend.closed and engine.closed


def test_close_without_draining_cancels_and_with_draining_finishes(model, alone, rng):
    """Stepped on the caller's thread (no start()): close(drain=False) cancels what runs and waits,
    a closed engine refuses requests and steps no more; close(drain=True) steps until all is done."""
    first, second, third = prompts_of(rng, [20, 4, 6])
    engine = ServingEngine(model, slots=SLOTS, max_len=MAX_LEN, prefill_chunk=CHUNK, prefix_cache=None)
    running = [engine.submit(Request(p, max_tokens=50)) for p in (first, second)]
    waiting = engine.submit(Request(third, max_tokens=50))
    # 16 prompt tokens of the first; its last 4 and the second's 4 (each samples its first token);
    # a decode step of both (a request decodes from the step after its prefill ends)
    assert engine.step() and engine.step() and engine.step()
    engine.close(drain=False)
    outputs = [h.result(0) for h in running + [waiting]]
    assert [o.finish_reason for o in outputs] == [FinishReason.CANCELLED] * 3
    assert [o.tokens for o in outputs] == [alone(first, 50)[0][:2], alone(second, 50)[0][:2], []]
    assert engine.stats().cancelled == 3 and not engine.step()
    with pytest.raises(EngineClosed, match="closed"):
        engine.submit(Request(second, max_tokens=2))

    engine = ServingEngine(model, slots=SLOTS, max_len=MAX_LEN, prefill_chunk=CHUNK, prefix_cache=None)
    handles = [engine.submit(Request(p, max_tokens=8)) for p in (first, second, third)]
    engine.close(drain=True, timeout=TIMEOUT)
    assert [(h.result(0).tokens, h.result(0).finish_reason) for h in handles] == [
        alone(p, 8) for p in (first, second, third)]


# ----------------------------------------------------------------------------- an offloading mode


def test_compile_steps_compiles_the_prefill_over_every_copy_size(model, alone, rng):
    """An offloading mode whose prefill attends to its offloaded prompt on the device (prefill
    copies, whose token count P is part of the step's shapes): `compile_steps` compiles the prefill
    of each row count over the cache as it is, with a chunk inside the window, and with copies of
    every size `PrefillCopies.sizes` gives (each ~15 s on the H100, which a request would otherwise
    wait for). Prompts from inside the window to near max_len then compile no step, and their
    outputs equal running each alone (hgca keeping every token: exact)."""
    from jhybrid.hybrid import make_backend

    engine = ServingEngine(model, make_backend("hgca", **KEEP_ALL, prefill_offloaded="device"), slots=2,
                           max_len=MAX_LEN, prefill_chunk=CHUNK, prefix_cache=None)
    with engine:
        sizes = engine.backend.runtime.prefill.sizes()
        assert sizes == [16, 32, 64, 128]  # max_len 128 = 8 blocks of 16: from an eighth up
        variants = 2 + len(sizes)  # as it is, a chunk inside the window, each copy size
        assert engine.compile_steps() == 1 + variants * 2  # decode; prefill of 1 and 2 rows each
        compiled = engine.stats().compiles
        lengths, max_tokens = [20, 100, 60, 110], [4, 4, 8, 4]
        prompts = prompts_of(rng, lengths)
        engine.start()
        handles = [engine.submit(Request(p, max_tokens=m)) for p, m in zip(prompts, max_tokens)]
        for handle, prompt, m in zip(handles, prompts, max_tokens):
            out = handle.result(TIMEOUT * 2)
            assert (out.tokens, out.finish_reason) == alone(prompt, m)
        assert engine.backend.counters()["n_prefill_device_chunks"] > 0
        assert engine.stats().compiles == compiled


def test_a_window_too_small_for_a_prefill_chunk_is_a_constructor_error(model):
    """An offloading mode's window of sink + one block: its prefill chunks (the ring less one block)
    hold one token, and the engine's calls over some rows (packed ones too) need 2+: a one-line
    ValueError naming window_tokens and the least window at construction, not "got T = 1" in
    compile_steps; so is prefill_chunk=1. The window one block larger, the least that serves,
    builds and compiles every step; in one slot (every call over the whole batch, none packed)
    hgca and scout take one-token chunks and build."""
    from jhybrid.hybrid import make_backend

    def scout(window):
        return make_backend("scout", window_tokens=window, sink=16, block_size=16, host_threads=1,
                            scout_exact_layers=1)

    least = r"; expected window_tokens >= 48 \(sink \+ 2 blocks\)$"
    for slots in (2, 3):
        with pytest.raises(ValueError, match=r"^offload window_tokens=32 is too small to serve with mode 'scout': "
                                             r"beside the 16-token sink it leaves a ring of 16 tokens, .*at most 1 "
                                             rf"token.*prefill_chunk=16\){least}") as info:
            ServingEngine(model, scout(32), slots=slots, max_len=MAX_LEN, prefill_chunk=16, prefix_cache=None)
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"^ServingEngine prefill_chunk=1; expected >= 2: mode 'scout'"):
        ServingEngine(model, scout(48), slots=2, max_len=MAX_LEN, prefill_chunk=1, prefix_cache=None)
    hgca = make_backend("hgca", window_tokens=32, sink=16, block_size=16, host_threads=1)
    for backend in (hgca, scout(32)):
        ServingEngine(model, backend, slots=1, max_len=MAX_LEN, prefill_chunk=16, prefix_cache=None).close()
    with ServingEngine(model, scout(48), slots=2, max_len=MAX_LEN, prefill_chunk=16, prefix_cache=None) as engine:
        assert engine.prefill_chunk == 16
        assert engine.compile_steps() > 0


@pytest.mark.slow
@pytest.mark.parametrize("prefill_offloaded", ["host", "device"])
def test_an_offloading_mode_serves_the_same_outputs(model, alone, rng, caplog, prefill_offloaded):
    """hgca keeping every token (exact) through 2 slots with rows reset and reused: every output
    equals full attention's alone; the prefix cache is used (its first tier on the host: nothing
    logged; tests/test_serving_prefix_offload.py checks its hits) and these prompts share no prefix.
    Prefill chunks attend to the offloaded prompt on the host, or on the device through copies that
    survive the decode call between two steps' chunks (each prompt copied from the store once)."""
    from jhybrid.hybrid import make_backend

    lengths, max_tokens = [5, 60, 17, 90, 3, 41], [30, 20, 25, 30, 12, 40]
    prompts = prompts_of(rng, lengths)
    with caplog.at_level(logging.INFO, logger="jhybrid.serving"):
        engine = ServingEngine(model, make_backend("hgca", **KEEP_ALL, prefill_offloaded=prefill_offloaded),
                               slots=2, max_len=MAX_LEN, prefill_chunk=CHUNK)
    assert [r.message for r in caplog.records if "prefix cache not used" in r.message] == []
    with engine:
        engine.start()
        handles = [engine.submit(Request(p, max_tokens=m)) for p, m in zip(prompts, max_tokens)]
        for handle, prompt, m in zip(handles, prompts, max_tokens):
            out = handle.result(TIMEOUT * 2)
            assert (out.tokens, out.finish_reason) == alone(prompt, m)
        stats = engine.stats()
        assert (stats.prefix_hits, stats.prefix_misses, stats.running) == (0, len(prompts), 0)
        assert (engine.slot_lengths() == 0).all()
        counters = engine.backend.counters()
        if prefill_offloaded == "device":  # the 60-, 90- and 41-token prompts offload: 8 such chunks
            assert counters["n_prefill_host_chunks"] == 0 and counters["n_prefill_device_chunks"] >= 6
            # each offloaded prompt's first chunk past the window takes its copies from its evicted
            # blocks; later chunks extend them: nothing is copied from the store
            assert counters["n_prefill_rows_from_evicted"] == 3 and counters["n_prefill_row_uploads"] == 0
        else:
            assert counters["n_prefill_device_chunks"] == 0
    assert engine.closed


def test_garbage_collections_count_in_the_thread_that_ran_them():
    """thread_gc_seconds (StepTimes.gc_seconds): a collection's time counts in the thread that ran it."""
    import gc
    import threading

    from jhybrid.serving.engine import thread_gc_seconds

    junk = [[i] for i in range(200_000)]  # something for the collection to walk
    seen = {}

    def collect():
        before = thread_gc_seconds()
        gc.collect()
        seen["other"] = thread_gc_seconds() - before

    gc.disable()  # no automatic collection in this thread meanwhile
    try:
        mine = thread_gc_seconds()
        thread = threading.Thread(target=collect)
        thread.start()
        thread.join(60)
        assert not thread.is_alive()
        assert seen["other"] > 0
        assert thread_gc_seconds() == mine  # none of it here
    finally:
        gc.enable()
    before = thread_gc_seconds()
    gc.collect()
    assert thread_gc_seconds() > before
    del junk
