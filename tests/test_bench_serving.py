"""The serving benchmark (`benchmark.task: serving`, jhybrid.bench.serving) end to end on the tiny
random model through run_sweep: its rows' fields, every request completed, the shared-prefix load's
prefix hits, the fixed-batch comparison; bad serving settings are one-line ConfigErrors."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from jhybrid.bench import runner
from jhybrid.bench.serving import make_load
from jhybrid.config import load_config
from jhybrid.config.schema import ConfigError

CONFIG = """
name: tiny-serving
model: {name: tiny}
benchmark: {task: serving, decode_tokens: 4, prefill_chunk: 32, serving_requests: 6, serving_rate: 1000.0,
            serving_contexts: [64, 96], serving_shared_prefix: 48, serving_shared_share: 1.0, serving_slots: 2,
            serving_decoding_step_tokens: 16, serving_decoding_max_backlog: 200}
sweep:
  - {offload.mode: full}
"""

FIELDS = {"mode", "slots", "requests", "rate", "ttft_p50_s", "ttft_p99_s", "tbt_p50_ms", "tbt_p99_ms",
          "request_throughput", "decode_tok_s", "goodput", "slo_met", "prefix_hits", "prefix_misses",
          "ttft_hit_over_miss", "ttft_hit_over_shared_miss", "served_over_fixed", "served_over_fixed_e2e", "fixed_decode_tok_s",
          "tbt_p99_over_p50", "decoding_step_tokens", "completed", "lost", "compiles_timed", "first_runs_timed", "saturated_tok_s", "saturated_over_fixed"}


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serving")
    path = folder / "serving.yaml"
    path.write_text(CONFIG)
    outcome = runner.run_sweep(load_config(str(path)), output_dir=str(folder / "results"), argv=[],
                               show_progress=False)
    assert outcome.errors == 0 and outcome.ran == 1
    assert (folder / "results" / "tiny-serving-serving.png").stat().st_size > 1000  # the sweep's plot
    return outcome.rows


def test_serving_rows_have_every_field_and_every_request_completes(rows):
    (row,) = rows
    assert "error" not in row and "skipped" not in row, row
    assert FIELDS <= set(row), FIELDS - set(row)
    assert row["task"] == "serving" and row["mode"] == "full" and row["slots"] == 2
    assert row["requests"] == 6 and row["completed"] == 6 and row["lost"] == 0
    assert (row["step_tokens"], row["decoding_step_tokens"], row["decoding_max_backlog"]) == (32, 16, 200)
    prefill = row["load_steps"]["prefill"]
    assert set(prefill["budgets"]) <= {"16", "32"} and sum(prefill["budgets"].values()) == prefill["steps"]
    assert row["ttft_p99_s"] >= row["ttft_p50_s"] > 0
    assert row["tbt_p99_ms"] >= row["tbt_p50_ms"] > 0
    assert row["request_throughput"] > 0 and row["decode_tok_s"] > 0
    assert row["served_over_fixed"] > 0 and row["fixed_decode_tok_s"] > 0
    assert row["saturated_tok_s"] > 0 and row["saturated_over_fixed"] > 0
    assert 0 <= row["slo_met"] <= 6
    assert "device_memory" in row  # (None on the CPU: no allocator statistics)
    assert row["compiles_timed"] == 0  # the warm-up compiled every shape of the load ...
    assert row["first_runs_timed"] == 0  # ... and ran each (a GPU executable loads at its first run)
    for phase in ("load_jit_compiles", "saturated_jit_compiles"):  # every XLA compile in the phase
        compiles = row[phase]
        assert compiles["count"] >= sum(n for _, n, _ in compiles["by_name"]) >= 0 and compiles["seconds"] >= 0
    # where the steps' time went: every uncached prompt token prefilled in the load's steps, and the
    # timed parts of a step within its wall time
    load = row["load_steps"]["prefill"]
    assert load["prompt_tokens"] == sum(r["prompt"] - r["cached"] for r in row["per_request"])
    for phase in ("load_steps", "saturated_steps"):
        for kind in ("prefill", "decode"):
            steps = row[phase][kind]
            if steps is None:
                continue
            assert steps["calls"] >= steps["steps"] > 0
            assert steps["first_runs"] == 0 == steps["longest_first_runs"]  # the warm-up ran every shape of both
            parts = steps["host_s"] + steps["call_s"] + steps["capture_s"] + steps["reset_s"] + steps["prefix_s"]
            assert 0 < parts <= steps["seconds"] + 1e-3, (phase, kind, steps)
            assert 0 <= steps["host_cpu_s"] <= steps["host_s"] + 1e-3  # thread CPU time within the wall time
            # the launches are part of the calls (rounded to the ms: a phase of a few tiny CPU launches,
            # or of launches returning before their inputs are computed, can round to 0) ...
            assert 0 <= steps["launch_s"] <= steps["call_s"] + 1e-3
            assert 0 <= steps["gc_s"] <= steps["seconds"] + 1e-3
            assert steps["median_ms"] <= steps["p90_ms"] <= steps["max_ms"]
    # ... and they are timed: the phases' launches add up to some time
    assert sum(row[phase][kind]["launch_s"] for phase in ("load_steps", "saturated_steps")
               for kind in ("prefill", "decode") if row[phase][kind] is not None) > 0


def test_shared_prefix_load_hits_the_prefix_cache(rows):
    (row,) = rows
    # every request carries the prefix; two slots: the first two miss, the later ones are admitted
    # after a prefill stored it and hit
    assert row["prefix_hits"] >= 1 and row["prefix_misses"] >= 1
    assert row["prefix_hits"] + row["prefix_misses"] == 6
    assert row["ttft_hit_over_miss"] is not None and row["ttft_hit_over_miss"] > 0


def test_load_is_deterministic_and_shares_the_prefix():
    bench = load_config_text(CONFIG).benchmark
    a, b = make_load(bench, 97), make_load(bench, 97)
    assert all((x == y).all() for x, y in zip(a.prompts, b.prompts)) and (a.arrivals == b.arrivals).all()
    assert a.shared.all() and all((p[:48] == a.prompts[0][:48]).all() for p in a.prompts)
    mixed = make_load(dataclasses.replace(bench, serving_contexts=(32, 64, 96), serving_shared_share=0.5,
                                          serving_requests=40), 97)
    assert 0 < mixed.shared.sum() < 40 and all(len(p) > 48 for p, s in zip(mixed.prompts, mixed.shared) if s)
    assert {len(p) for p in a.prompts} <= {64, 96} and (a.arrivals[1:] >= a.arrivals[:-1]).all()


@pytest.mark.parametrize("slots, counts", [(2, []), (2, [1, 2]), (4, [1]), (4, [1, 2]), (4, [1, 2, 4]),
                                           (8, [1, 2, 4, 8])])
def test_warmup_runs_a_packed_wave_per_packed_row_count(slots, counts):
    """After the waves that compile (prompts of the longest length by powers of two, one per length,
    the prefix carriers), one wave per distinct R = min(C, slots - 1) over the packed calls' row
    counts C: a one-chunk request first, decoding through the prefill of the R longest prompts
    submitted with it (at least one chunk of theirs a step), so the packed calls over every copy
    size run before the load. R prompts take the call of C rows: with 4 slots the 4-row call is
    3 prompts beside the decoding one (session o's o3 met it unwarmed)."""
    from jhybrid.bench.serving import WARM_TOKENS, warmup_waves

    bench = dataclasses.replace(load_config_text(CONFIG).benchmark, serving_slots=slots)
    max_len, chunk, longest = 200, bench.prefill_chunk, max(bench.serving_contexts)
    plain = warmup_waves(bench, 97, max_len)
    waves = warmup_waves(bench, 97, max_len, counts)
    assert [[(len(p), m) for p, m in w] for w in waves[:len(plain)]] == [[(len(p), m) for p, m in w] for w in plain]
    assert all(m == min(WARM_TOKENS, bench.decode_tokens) for w in plain for _, m in w)
    packed = waves[len(plain):]
    want = {(2, 2): [1], (4, 1): [1], (4, 2): [1, 2], (4, 4): [1, 2, 3], (8, 8): [1, 2, 4, 7]}.get(
        (slots, max(counts, default=0)), [])
    assert [len(w) - 1 for w in packed] == want
    # each packed row count that a call beside a decoding request can have is some wave's call
    call_rows = {min(slots, 1 << (rows - 1).bit_length()) for rows in want}
    assert call_rows == {c for c in counts if c <= min(slots, 1 << (slots - 2).bit_length())}
    for rows, wave in zip(want, packed):
        (short, decoding), *long = wave
        assert len(short) == chunk and [len(p) for p, _ in long] == [longest] * rows
        assert decoding == min(rows * -(-longest // chunk) + 2, max_len - chunk - 1)
        assert len(short) + decoding < max_len


def test_a_shared_suffix_makes_every_sharing_prompt_prefix_plus_suffix():
    """serving_shared_suffix: the sharing requests are the prefix + that many tokens (even past the
    longest context: the slots' max_len grows to hold them); the others draw from the contexts."""
    from jhybrid.bench.serving import serving_max_len

    bench = dataclasses.replace(load_config_text(CONFIG).benchmark, serving_shared_share=0.5, serving_requests=40,
                                serving_shared_prefix=90, serving_shared_suffix=20)
    load = make_load(bench, 97)
    assert 0 < load.shared.sum() < 40
    assert all(len(p) == 110 and (p[:90] == load.prompts[np.argmax(load.shared)][:90]).all()
               for p, s in zip(load.prompts, load.shared) if s)
    assert {len(p) for p, s in zip(load.prompts, load.shared) if not s} <= {64, 96}
    assert serving_max_len(bench) == 128  # 110 + 4 decode tokens + 1, rounded up to 64


def load_config_text(text: str):
    import os
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(text)
    try:
        return load_config(f.name)
    finally:
        os.remove(f.name)


@pytest.mark.parametrize("setting, words", [
    ("serving_shared_share: 1.5", ["serving_shared_share", "[0, 1]"]),
    ("serving_shared_share: 0.5, serving_shared_prefix: 0", ["serving_shared_prefix", "> 0"]),
    ("serving_shared_prefix: 128, serving_contexts: [64, 128]", ["serving_shared_prefix", "longest prompt (128"]),
    ("serving_contexts: []", ["serving_contexts", "non-empty list of positive ints"]),
    ("serving_contexts: [64, 0]", ["serving_contexts", "non-empty list of positive ints"]),
    ("serving_rate: 0", ["serving_rate", "positive"]),
    ("serving_slots: 0", ["serving_slots", "positive"]),
    ("serving_decoding_step_tokens: 0", ["serving_decoding_step_tokens", "positive"]),
    ("serving_requests: -1", ["serving_requests", "positive"]),
    ("serving_prefix_cache_mb: -1", ["serving_prefix_cache_mb", ">= 0"]),
    ("serving_rate: fast", ["serving_rate", "float"]),
    ("serving_shared_suffix: 0, serving_shared_prefix: 16", ["serving_shared_suffix", ">= 1"]),
    ("serving_shared_suffix: 8", ["serving_shared_suffix", "serving_shared_prefix' = 0"]),
    ("serving_prefill_order: fastest", ["serving_prefill_order", "shortest"]),
    ("serving_switch_intervals_ms: []", ["serving_switch_intervals_ms", "non-empty list", "> 0"]),
    ("serving_switch_intervals_ms: [5, 0]", ["serving_switch_intervals_ms", "[5, 0]", "> 0"]),
    ("serving_switch_intervals_ms: [fast]", ["serving_switch_intervals_ms", "> 0"]),
])
def test_bad_serving_settings_are_one_line_config_errors(setting, words):
    text = f"name: x\nmodel: {{name: tiny}}\nbenchmark: {{task: serving, {setting}}}\n"
    with pytest.raises(ConfigError) as error:
        load_config_text(text)
    message = str(error.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


def test_prefill_gaps_are_the_gaps_ended_by_steps_that_also_prefilled_another_request():
    """_gaps_during_prefill / _longest_gaps against a hand-built step log: request "a" decodes in
    steps 2-4; "b" prefills in steps 3 and 4 (step 4 also admits one, starts 20 ms after step 3 ended and is the long one). Only a's
    gaps ended by steps 3 and 4 count, the longest first, each with its step's record."""
    from jhybrid.bench.serving import _gaps_during_prefill, _longest_gaps
    from jhybrid.serving.api import FinishReason, RequestOutput
    from jhybrid.serving.engine import StepRecord, StepTimes

    a = RequestOutput("a", [1, 2, 3, 4], FinishReason.LENGTH, 8, token_times=[1.0, 1.02, 1.05, 1.15])
    c = RequestOutput("c", [7, 8], FinishReason.LENGTH, 8, token_times=[1.06, 1.15])
    b = RequestOutput("b", [5], FinishReason.LENGTH, 64, token_times=[1.3])
    records = [StepRecord(1, (("a", 8),), (), 0.01, 0.0, 0.99, 1),
               StepRecord(2, (), ("a",), 0.02, 0.0, 1.0),
               StepRecord(3, (("b", 32),), ("a",), 0.03, 0.0, 1.02, 0, StepTimes(reset_seconds=0.012)),
               StepRecord(4, (("b", 32),), ("a", "c"), 0.08, 0.05, 1.07, 1,
                          StepTimes(host_seconds=0.01, host_cpu_seconds=0.004, call_seconds=0.015,
                                    capture_seconds=0.002, calls=2, first_runs=1),
                          (("recall_s", 0.004), ("evict_s", 0.001)))]
    gaps = _gaps_during_prefill([a, b], records)
    assert [round(g.seconds, 6) for g in gaps] == [0.03, 0.1]
    assert [g.step.step for g in gaps] == [3, 4] and [g.previous.step for g in gaps] == [2, 3]
    step_4 = {"gap_ms": 100.0, "step": 4, "step_ms": 80.0, "prefix_ms": 50.0, "host_ms": 10.0, "host_cpu_ms": 4.0,
              "overlap_ms": 0.0, "launch_ms": 0.0, "gc_ms": 0.0, "call_ms": 15.0,
              "capture_ms": 2.0, "calls": 2, "first_runs": 1, "between_ms": 20.0, "previous_step_ms": 30.0,
              "previous_reset_ms": 12.0,
              "prefill_tokens": 32, "decode_rows": 2,
              "admitted": 1, "backend_ms": {"recall_s": 4.0, "evict_s": 1.0}}
    assert _longest_gaps(gaps, n=1) == [step_4]
    # c's gap (90 ms, its first) also ended in step 4: one row per step, the step's longest gap
    with_c = _gaps_during_prefill([a, b, c], records)
    assert sorted(round(g.seconds, 6) for g in with_c) == [0.03, 0.09, 0.1]
    assert [row["step"] for row in _longest_gaps(with_c, n=3)] == [4, 3]


def run_two_requests_config(extra: str) -> str:
    """CONFIG with 2 requests and `extra` (benchmark keys, YAML flow syntax)."""
    text = CONFIG.replace("serving_decoding_step_tokens: 16, serving_decoding_max_backlog: 200}",
                          f"serving_requests: 2, {extra}}}")
    assert text != CONFIG
    return text.replace("serving_requests: 6, ", "")


def run_two_requests(tmp_path, extra: str) -> list[dict]:
    """CONFIG's sweep with 2 requests and `extra` -> its rows."""
    path = tmp_path / "serving.yaml"
    path.write_text(run_two_requests_config(extra))
    return runner.run_sweep(load_config(str(path)), output_dir=str(tmp_path / "results"), argv=[],
                            show_progress=False).rows


def test_saturation_phase_can_be_left_out(tmp_path):
    (row,) = run_two_requests(tmp_path, "serving_saturation: false")
    assert row["completed"] == 2 and row["saturated_tok_s"] is None and row["saturated_over_fixed"] is None
    assert row["fixed_decode_tok_s"] > 0  # the fixed batches still ran


def test_repeats_report_the_median_of_each_phase(tmp_path):
    """serving_repeats: 3 runs the saturation phase and the fixed batches 3 times each; the row's
    saturated_tok_s and fixed_tok_s are the medians of the repeats listed beside them, and the ratio
    is theirs."""
    (row,) = run_two_requests(tmp_path, "serving_repeats: 3")
    saturated, fixed = row["saturated_tok_s_repeats"], row["fixed_tok_s_repeats"]
    assert len(saturated) == 3 and len(fixed) == 3 and min(saturated) > 0 and min(fixed) > 0
    assert row["saturated_tok_s"] == pytest.approx(sorted(saturated)[1], abs=0.01)
    assert row["fixed_tok_s"] == pytest.approx(sorted(fixed)[1], abs=0.01)
    assert row["saturated_over_fixed"] == pytest.approx(row["saturated_tok_s"] / row["fixed_tok_s"], rel=1e-3)


def test_each_switch_interval_is_a_pass_of_the_load_on_the_warm_engine(tmp_path, monkeypatch):
    """serving_switch_intervals_ms: [2, 0.5] runs the load twice on one engine, the first pass at
    2 ms and the second (the row's own fields, saturation and the fixed batches) at 0.5 ms; the
    second pass starts with the first's prompts out of the prefix cache;
    the interpreter's interval is back afterwards."""
    import sys

    from jhybrid.bench import serving

    seen, run_load = [], serving._run_load

    def recording(*args, **kwargs):
        seen.append(sys.getswitchinterval())
        return run_load(*args, **kwargs)

    monkeypatch.setattr(serving, "_run_load", recording)
    interval = sys.getswitchinterval()
    (row,) = run_two_requests(tmp_path, "serving_switch_intervals_ms: [2, 0.5]")
    assert sys.getswitchinterval() == interval
    assert seen == [pytest.approx(2e-3), pytest.approx(5e-4)]
    assert row["switch_interval_ms"] == 0.5 and row["completed"] == 2 and row["lost"] == 0
    first, second = row["load_passes"]
    for load_pass in (first, second):
        assert load_pass["tbt_p50_ms"] > 0 and load_pass["load_steps"]["prefill"]["steps"] > 0
    assert second["tbt_p50_ms"] == row["tbt_p50_ms"] and second["ttft_p50_s"] == row["ttft_p50_s"]
    # the second pass starts as cold as the first: its first request finds nothing cached (hits
    # between the pass's own requests depend on their timing)
    assert row["per_request"][0]["cached"] == 0 and second["prefix_hits"] == row["prefix_hits"] <= 1
    assert row["saturated_tok_s"] > 0 and row["fixed_decode_tok_s"] > 0


def test_the_switch_interval_is_set_for_its_body_and_restored_after_an_error():
    import sys

    from jhybrid.serving.gil import switch_interval

    interval = sys.getswitchinterval()
    with pytest.raises(KeyError):
        with switch_interval(1e-4) as now:
            assert now == pytest.approx(1e-4) and sys.getswitchinterval() == pytest.approx(1e-4)
            raise KeyError("body")
    assert sys.getswitchinterval() == interval
    with switch_interval(None) as now:
        assert now == interval
    for bad in (0, -1.0, float("nan"), "1", True):
        with pytest.raises(ValueError, match="switch interval"):
            with switch_interval(bad):
                pass
    assert sys.getswitchinterval() == interval


def test_the_compile_recorder_counts_the_compiles_inside_its_block():
    """CompileRecorder against jit's own cache misses: a new shape compiles once inside, a repeated
    one not at all, and nothing outside the block is counted."""
    import jax
    import jax.numpy as jnp

    from jhybrid.bench.serving import CompileRecorder

    def double(x):
        return x * 2

    fn = jax.jit(double)
    three, five, seven = jnp.ones(3), jnp.ones(5), jnp.ones(7)  # made outside: they compile too
    fn(three)  # compiled before the block
    enabled = jax.config.jax_enable_compilation_cache  # the suite's persistent cache (conftest) would
    jax.config.update("jax_enable_compilation_cache", False)  # load a former run's compile instead
    try:
        with CompileRecorder() as recorder:
            fn(three)      # cached
            fn(five)       # a new shape: one compile
            fn(five)
        fn(seven)          # after the block
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
    summary = recorder.summary()
    assert summary["count"] == 1 and summary["by_name"][0][:2] == ["jit(double)", 1], summary


@pytest.mark.parametrize("second", ["running", "after the failure"])
def test_an_engine_failure_in_the_load_is_the_points_error(tmp_path, monkeypatch, second):
    """A step that fails while the load runs ends every request with the error (the engine); the
    point then fails with that error named, not with a statistic of requests that have no tokens.
    So does a request arriving after the engine stopped (its submit refused: EngineClosed), the
    order the 2-request load met by chance on a fast machine (CI of 91aa1fa), here forced."""
    from jhybrid.serving import ServingEngine

    original, submit = ServingEngine._decode_call, ServingEngine.submit

    def failing(self, runs):
        if any(run.request_id.startswith("r-") for run in runs):  # the load's requests, not the warm-up's
            raise RuntimeError("injected device fault")
        return original(self, runs)

    def submit_after_the_failure(self, request, *args, **kwargs):
        if request.request_id == "r-1":
            for _ in range(600):  # bounded: until the engine stopped on the fault
                if self._error is not None:
                    break
                time.sleep(0.1)
            assert self._error is not None
        return submit(self, request, *args, **kwargs)

    monkeypatch.setattr(ServingEngine, "_decode_call", failing)
    if second == "after the failure":
        monkeypatch.setattr(ServingEngine, "submit", submit_after_the_failure)
    path = tmp_path / "serving.yaml"
    path.write_text(run_two_requests_config("serving_saturation: false"))
    outcome = runner.run_sweep(load_config(str(path)), output_dir=str(tmp_path / "results"), argv=[],
                               show_progress=False)
    assert outcome.errors == 1
    (row,) = outcome.rows
    assert "serving engine failed 2 of 2 requests" in row["error"] and "injected device fault" in row["error"], row
