"""The serving warm-up (jhybrid/serving/warmup.py) on the tiny model (CPU):

  * after the warm-up for prompts of up to L tokens, requests of at most L tokens (one alone, two
    at once so that one decodes while the other prefills: packed calls, more than the slots) run
    no executable for the first time; the same requests on an engine that was not warmed up run
    each of theirs for the first time (their own backend object: executables are shared only by
    engines of one backend object, `_executable_key`, so the two engines share none);
  * afterwards the prefix cache holds none of the warm-up's blocks (a prompt cached before it
    stays) and the engine's counts (EngineStats, /metrics) start from 0;
  * the waves themselves: sizes, max_tokens within max_len, request ids, bad settings one line;
  * `jhybrid serve --warm-up-tokens`: bad values are one-line errors before the model loads, and
    the flag warms the engine up with progress on stderr.
"""

from __future__ import annotations

import threading
import types

import numpy as np
import pytest

from jhybrid.attention.full import FullAttention
from jhybrid.models import create_model
from jhybrid.serving.api import Request
from jhybrid.serving.engine import ServingEngine
from jhybrid.serving.prefix_cache import PrefixCacheConfig
from jhybrid.serving.warmup import (WARM_TOKENS, LeadWave, engine_warm_up_waves, packed_waves, run_warm_up,
                                    warm_up, warm_up_waves)
from tests.hybrid_support import TINY

# 2 slots of 128 tokens, chunks of 16, 32 prompt tokens a step: a 48-token prompt takes two steps,
# so a request decodes while it prefills (packed calls of 1 row)
SLOTS, MAX_LEN, CHUNK, BUDGET, LONGEST = 2, 128, 16, 32, 48
TIMEOUT = 120.0
PREFIX_CACHE = PrefixCacheConfig(device_bytes=1 << 20)  # room for every warm-up block (64 blocks)


@pytest.fixture(scope="module")
def model():
    return create_model(TINY, seed=0)


def new_engine(model) -> ServingEngine:
    """A started engine on a backend object of its own (executables of its own)."""
    engine = ServingEngine(model, FullAttention("jnp"), slots=SLOTS, max_len=MAX_LEN, prefill_chunk=CHUNK,
                           step_token_budget=BUDGET, prefix_cache=PREFIX_CACHE)
    engine.start()
    return engine


def recording(engine) -> list[tuple]:
    """Records (name, input shapes) of every compiled call the engine runs."""
    calls, run = [], engine._run

    def recorded(name, fn, donate, *args):
        calls.append((name, tuple(np.shape(a) for a in args[1:3])))
        return run(name, fn, donate, *args)

    engine._run = recorded
    return calls


def serve_requests(engine, rng) -> None:
    """Prompts of at most LONGEST tokens: one alone, then two at once (the short one decodes while
    the long one prefills), then three at once (one waits for a slot)."""
    for group in ([(40, 6)], [(13, 20), (LONGEST, 4)], [(30, 8), (LONGEST, 3), (5, 5)]):
        handles = [engine.submit(Request(rng.integers(0, TINY.vocab_size, n).tolist(), max_tokens=m))
                   for n, m in group]
        for handle in handles:
            assert len(handle.result(TIMEOUT).tokens) >= 1


def test_after_the_warm_up_no_request_runs_a_step_for_the_first_time(model):
    warmed, cold = new_engine(model), new_engine(model)
    try:
        report = warm_up(warmed, engine_warm_up_waves(warmed, LONGEST))
        assert report.first_runs >= 4 and report.requests == 1 + 2 + 2  # waves of 1, 2 and one packed wave
        calls = recording(warmed)
        serve_requests(warmed, np.random.default_rng(7))
        ran = set(calls)
        assert "packed" in {name for name, _ in ran} and "decode" in {name for name, _ in ran}, ran
        assert warmed.stats().first_runs == 0 and warmed.stats().compiles == 0

        cold_calls = recording(cold)
        serve_requests(cold, np.random.default_rng(7))
        assert set(cold_calls) == ran  # the same shapes, each run for the first time here
        assert cold.stats().first_runs == len(ran) and cold.stats().compiles == len(ran)
    finally:
        warmed.close(drain=False)
        cold.close(drain=False)


@pytest.mark.parametrize("slots, budget, left", [
    (2, 32, []),  # 2 slots: no packed call of 2 rows (one slot decodes), so none compiled either
    (4, 64, []),  # the longest prompt fits one step's budget: the packed wave's lead runs first
    # calls of 2 rows x 8 and 4 x 4 tokens at prompts' tails: the tail waves run them; the packed
    # [4, 4] (3 tails beside a decoding request) is still left
    (4, 16, ["packed [4, 4]"])])
def test_the_warm_up_runs_every_step_shape_it_claims(model, slots, budget, left):
    """`ServingEngine.unrun_steps` names every compiled shape before any request and, after the
    warm-up, the ones it left: none for full attention with whole-chunk calls (2 and 4 slots); under
    a budget below slots x chunk, only the packed call of three tails beside a decoding request.
    Before the lead-first packed wave (`LeadWave`) the 4-slot engine left "packed [1, 16]", before the
    tail waves the third one also "prefill_rows [2, 8]" and "prefill [4, 4]"."""
    engine = ServingEngine(model, FullAttention("jnp"), slots=slots, max_len=MAX_LEN, prefill_chunk=CHUNK,
                           step_token_budget=budget, prefix_cache=PREFIX_CACHE)
    try:
        engine.start()
        engine.compile_steps()
        widths = engine.call_widths()
        assert widths == {rows: max(1, min(CHUNK, budget // rows)) for rows in widths}
        before = engine.unrun_steps()
        assert len(before) == 1 + len(widths) + len(engine.packed_row_counts())  # decode, prefill, packed
        assert all(f"[{rows}, {width}]" in " ".join(before) for rows, width in widths.items())
        report = warm_up(engine, engine_warm_up_waves(engine, LONGEST))
        assert list(report.unrun_steps) == left == engine.unrun_steps()
        assert report.first_runs == len(before) - len(left) and report.compiles == 0
    finally:
        engine.close(drain=False)


def test_the_warm_up_leaves_nothing_in_the_prefix_cache_and_counts_start_over(model):
    engine = new_engine(model)
    try:
        kept = np.random.default_rng(3).integers(0, TINY.vocab_size, 40).tolist()
        engine.submit(Request(kept, max_tokens=2)).result(TIMEOUT)  # cached before the warm-up: stays
        before = engine._prefix.stats()
        assert before.blocks_device == 2
        waves = engine_warm_up_waves(engine, LONGEST)
        report = warm_up(engine, waves)
        assert report.forgotten_blocks == sum(len(p) // 16 for p in {tuple(p) for w in waves for p, _ in w})
        stats = engine.stats()
        assert (stats.prefix_hits, stats.prefix_misses, stats.prefix_hit_tokens) == (0, 0, 0)
        assert stats.prefix_bytes_device == before.bytes_device and stats.prefix_bytes_host == 0
        assert (stats.finished, stats.steps, stats.prefill_tokens, stats.generated_tokens, stats.compiles,
                stats.first_runs) == (0, 0, 0, 0, 0, 0)
        assert engine.step_log() == []
        prefix = engine._prefix.stats()
        assert (prefix.blocks_device, prefix.blocks_host, prefix.inserted, prefix.dropped) == (2, 0, 0, 0)
        out = engine.submit(Request(kept, max_tokens=2)).result(TIMEOUT)  # the kept prompt still hits
        assert out.cached_tokens == 32 and engine.stats().prefix_hits == 1 and engine.stats().finished == 1
    finally:
        engine.close(drain=False)


def test_forget_and_reset_refuse_a_busy_engine(model):
    engine = ServingEngine(model, FullAttention("jnp"), slots=SLOTS, max_len=MAX_LEN, prefill_chunk=CHUNK)
    try:
        engine.submit(Request([1, 2, 3], max_tokens=2))  # waits: the engine is not started
        for call in (lambda: engine.reset_stats(), lambda: engine.forget_prompts([[1, 2, 3]])):
            with pytest.raises(RuntimeError, match=r"^ServingEngine\.\w+ with 0 requests running and 1 waiting; "
                                                   r"expected an idle engine$"):
                call()
    finally:
        engine.close(drain=False)


def test_waves_fit_the_engine_and_name_their_requests(model):
    engine = ServingEngine(model, FullAttention("jnp"), slots=4, max_len=64, prefill_chunk=CHUNK,
                           step_token_budget=BUDGET, prefix_cache=None)
    try:
        waves = engine_warm_up_waves(engine, 60)
        # 1, 2 and 4 prompts of 60 tokens; the tail wave of the 4-row calls (8 tokens a row: 4 prompts
        # of 16 + 8); packed, each led by a one-chunk prompt: 1, 2 (60 tokens) and 3 (3 prefilling
        # rows take the 4-row call: 24 tokens, their tails)
        assert [len(w) for w in waves] == [1, 2, 4, 4, 2, 3, 4]
        assert [len(p) for p, _ in waves[3]] == [CHUNK + 8] * 4 and not isinstance(waves[3], LeadWave)
        assert all(isinstance(w, LeadWave) and len(w[0][0]) == CHUNK for w in waves[4:])
        assert [[len(p) for p, _ in w[1:]] for w in waves[4:]] == [[60], [60, 60], [CHUNK + 8] * 3]
        assert all(len(p) + m <= 64 for w in waves for p, m in w)
        assert [m for _, m in waves[4]] == [min(1 * 4 + 2, 64 - CHUNK - 1), WARM_TOKENS]
        with pytest.raises(ValueError, match=r"^warm-up longest=61; expected 1\.\.60 \(the engine's max_len 64 "
                                             r"less 4 generated tokens\)$"):
            engine_warm_up_waves(engine, 61)
        engine.start()
        submitted = []
        submit = engine.submit
        engine.submit = lambda request, *a: submitted.append(request.request_id) or submit(request, *a)
        report = run_warm_up(engine, waves[:2], TIMEOUT)
        assert submitted == ["warm-0-0", "warm-1-0", "warm-1-1"] and (report.waves, report.requests) == (2, 3)
    finally:
        engine.close(drain=False)
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match=r"^warm-up lengths \[70\]; expected lengths in 1\.\.longest=60$"):
        warm_up_waves(60, [70], 2, CHUNK, WARM_TOKENS, 128, (), rng, 97)
    with pytest.raises(ValueError, match=r"^warm-up slots=0; expected an integer >= 1$"):
        warm_up_waves(60, [], 0, CHUNK, WARM_TOKENS, 128, (), rng, 97)
    # a max_len that leaves less than a chunk after the short prompt: a shorter one, still decoding
    (short, decoding), *_ = packed_waves(10, 2, CHUNK, WARM_TOKENS, 14, [1], rng, 97)[0]
    assert len(short) == 12 and decoding == 1


# ----------------------------------------------------------------------------- jhybrid serve --warm-up-tokens


@pytest.mark.parametrize("argv, message", [
    (["--warm-up-tokens", "-1"], "--warm-up-tokens -1; expected an integer >= 0 (0 = no warm-up)"),
    (["--warm-up-tokens", "61", "--max-len", "64"],
     "--warm-up-tokens 61; expected 1..60 (--max-len 64 less the 4 tokens each warm-up request generates), "
     "or 0 for no warm-up"),
])
def test_serve_rejects_bad_warm_up_tokens_before_loading(argv, message, capsys, monkeypatch):
    from jhybrid import cli

    monkeypatch.setattr(cli, "_load_with_progress", lambda *a: pytest.fail("loaded before checking"))
    assert cli.main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {message}\n"


def test_serve_warm_up_tokens_checks_the_models_context_once_loaded():
    from jhybrid import cli

    cli.check_warm_up_tokens(0, 8)  # off
    cli.check_warm_up_tokens(252, 256)
    with pytest.raises(ValueError, match=r"^--warm-up-tokens 253; expected 1\.\.252 \(--max-len 256 less"):
        cli.check_warm_up_tokens(253, 256)


def test_serve_warm_up_tokens_warms_the_engine_up_before_listening(model, capsys):
    from jhybrid import cli

    parser = cli.build_parser()
    for flag in ([], ["--warm-up-tokens", "40"]):
        args = parser.parse_args(["serve", "--slots", "2", "--prefill-chunk", "16", "--step-token-budget", "32",
                                  *flag])
        engine = cli._serving_engine(model, FullAttention("jnp"), args, max_len=64)
        try:
            report = cli.warm_up_serving_engine(engine, args)
            err = capsys.readouterr().err
            if flag:
                assert report.requests == 5 and report.first_runs > 0 and engine.stats().first_runs == 0
                assert "[warming up (--warm-up-tokens 40): 3 waves" in err
                assert "[warm-up ran 5 requests in " in err and f"first runs: {report.first_runs}" in err
                assert engine.stats().prefix_bytes_device == 0
            else:
                assert report is None and err == "" and engine.stats().steps == 0
        finally:
            engine.close(drain=False)


def test_a_lead_wave_packs_however_late_the_warm_up_thread_runs(model, monkeypatch):
    """A loaded machine: the warm-up's own thread resumes only after the lead request has finished
    (its wait for the lead's first token is held until then). The others were submitted by the
    lead's first token's callback, on the engine thread, so they still prefilled beside the lead's
    decoding: the packed call ran (submitted after the wait, as before, it never did)."""
    from jhybrid.serving import warmup as warmup_module

    engine = new_engine(model)
    try:
        engine.compile_steps()
        calls = recording(engine)
        leads = []
        submit = engine.submit

        def submitted(request, on_token=None, on_finish=None):
            handle = submit(request, on_token=on_token, on_finish=on_finish)
            if request.request_id.endswith("-0"):
                leads.append(handle)
            return handle

        engine.submit = submitted

        class LateEvent(threading.Event):
            def wait(self, timeout=None):
                leads[-1].result(TIMEOUT)  # this thread "descheduled" until the lead is done
                return super().wait(timeout)

        # the warm-up module's Events only (the engine's own stay plain)
        monkeypatch.setattr(warmup_module, "threading", types.SimpleNamespace(Event=LateEvent))
        waves = packed_waves(LONGEST, SLOTS, CHUNK, WARM_TOKENS, MAX_LEN, engine.packed_row_counts(),
                             np.random.default_rng(0), TINY.vocab_size, engine.call_widths())
        assert waves and all(isinstance(wave, LeadWave) for wave in waves)
        report = run_warm_up(engine, waves, TIMEOUT)
        assert report.requests == sum(len(wave) for wave in waves)
        assert any(name == "packed" for name, _ in calls), calls
    finally:
        engine.close(drain=False)
