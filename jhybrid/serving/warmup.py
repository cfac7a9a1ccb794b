"""Warm-up: requests of random tokens that RUN every step shape of a `ServingEngine` once before
real requests arrive.

`ServingEngine.compile_steps` compiles every step shape but runs none; on a GPU an XLA executable's
first run in a process is slow again (its module loaded, its CUDA graphs instantiated: a 50 ms step
took 200-475 ms on the H200), a cost the first real requests would otherwise pay
(`EngineStats.first_runs` counts those runs). The warm-up submits waves of requests (each wave once
the previous one finished):

  1. R prompts of the longest length together, for each power of two R up to the slots (their
     prefill calls over R rows, from the first chunk to the last: an offloading mode compiles one
     per size of the offloaded prompt's device copies), then their decode steps;
  2. one prompt of each other length asked for, all together (none: no such wave);
  3. with `call_widths` (a backend whose calls over R rows split the step's budget, R x W tokens
     with W < prefill_chunk: full attention), for each such row count R, R prompts of
     prefill_chunk + W tokens: each first prefills a whole chunk alone, and the first one's last W
     tokens go in an [R, W] call beside the others' first (`ServingEngine._take` gives a row count
     the first request's most tokens, then the call's);
  4. for each row count C a packed call can have (`ServingEngine.packed_row_counts`; none: the
     engine does not pack), a one-chunk prompt whose request runs alone until its first token
     (`LeadWave`; its first token's callback submits the others, so they join before its next step
     however late the warm-up's own thread runs), then decodes while R = min(C, slots - 1) prompts
     prefill beside it (R rows take
     the call of C rows, the row counts being powers of two and slots): the longest length (the
     packed calls over every size of an offloading mode's copies), or prefill_chunk + W for a
     width W < prefill_chunk of C rows (their tails' [C, W] calls).

`warm_up_waves` builds them from plain numbers (the serving benchmark adds waves of its own between
2 and 3 from the same generator: `shape_waves`, `tail_waves` and `packed_waves` are the parts), and
`engine_warm_up_waves` from an engine's settings; `run_warm_up` submits and waits for them;
`warm_up` runs them and then leaves no trace of them in what the engine reports
(`ServingEngine.forget_prompts`, `ServingEngine.reset_stats`), as `jhybrid serve --warm-up-tokens`
does before it listens.

`WarmUpReport.unrun_steps` names the step shapes a warm-up left unrun (`ServingEngine.unrun_steps`);
`EngineStats.first_runs` after it tells whether a load met one. Limits (measured on the CPU,
tests/test_serving_warmup.py): full attention with whole-chunk calls is left with none; under a
budget below slots x prefill_chunk, the packed call of three tails beside a decoding request is left;
an offloading mode is left with its host-path variant (out of reach while its prefill copies are on
the device) and, at a budget of several chunks a step, packed calls over copy sizes that no step's
first call reaches.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from jhybrid.serving.api import FinishReason, Request

if TYPE_CHECKING:
    from jhybrid.serving.engine import ServingEngine

WARM_TOKENS = 4  # tokens each warm-up request generates, but the decoding one of a packed wave
WARM_SEED = 1  # the random prompts' generator seed (the serving benchmark's: its load's seed + 1)
WARM_TIMEOUT_S = 3600.0  # the longest wait for one warm-up request (an engine that stopped raises sooner)

# One wave: (prompt int32 [P], max_tokens) per request, submitted together.
Wave = list[tuple[np.ndarray, int]]


class LeadWave(list):
    """A wave (`Wave`) whose first request is submitted alone and the others once it has its first
    token: it then decodes while they prefill, however many of their tokens one step's budget
    holds (submitted together, a prompt within one step's budget would end its prefill in the
    step the first one's did, and nothing would pack)."""


@dataclasses.dataclass(frozen=True)
class WarmUpReport:
    """What a warm-up ran: waves, requests, seconds (wall, submit of the first to the end of the
    last), and of the engine's counts over it: compiles (executables compiled: 0 after
    `compile_steps`) and first_runs (executables run for the first time in the process);
    unrun_steps (`ServingEngine.unrun_steps` afterwards: the step shapes no request has run yet,
    whose first run a later request pays); with `warm_up`, forgotten_blocks (the prefix-cache
    blocks of its prompts dropped afterwards)."""

    waves: int
    requests: int
    seconds: float
    compiles: int
    first_runs: int
    unrun_steps: tuple[str, ...] = ()
    forgotten_blocks: int = 0


def random_tokens(rng: np.random.Generator, vocab: int, length: int) -> np.ndarray:
    """int32 [length] token ids drawn uniformly from [0, vocab)."""
    return rng.integers(0, vocab, length).astype(np.int32)


def shape_waves(longest: int, lengths: Sequence[int], slots: int, warm_tokens: int, rng: np.random.Generator,
                vocab: int) -> list[Wave]:
    """Waves 1 and 2 of the module docstring: R prompts of `longest` tokens for each power of two
    R <= slots, then one prompt of each of `lengths` (no wave when empty); every request generates
    `warm_tokens` tokens."""
    waves = [[(random_tokens(rng, vocab, longest), warm_tokens) for _ in range(1 << k)]
             for k in range(slots.bit_length()) if (1 << k) <= slots]
    if len(lengths):
        waves.append([(random_tokens(rng, vocab, length), warm_tokens) for length in lengths])
    return waves


def tail_waves(longest: int, prefill_chunk: int, warm_tokens: int, call_widths: Mapping[int, int],
               rng: np.random.Generator, vocab: int) -> list[Wave]:
    """Wave 3 of the module docstring: for each row count R whose calls are W = call_widths[R] <
    prefill_chunk tokens a row, R prompts (each its own) of min(prefill_chunk + W, longest) tokens generating
    `warm_tokens` (R <= the slots: call_widths holds the engine's row counts)."""
    return [[(random_tokens(rng, vocab, min(prefill_chunk + width, longest)), warm_tokens) for _ in range(rows)]
            for rows, width in sorted(call_widths.items()) if rows > 1 and width < prefill_chunk]


def packed_waves(longest: int, slots: int, prefill_chunk: int, warm_tokens: int, max_len: int,
                 packed_row_counts: Sequence[int], rng: np.random.Generator, vocab: int,
                 call_widths: Mapping[int, int] | None = None) -> list[Wave]:
    """Wave 4 of the module docstring, one `LeadWave` per distinct R = min(C, slots - 1) over the
    packed calls' row counts C, smallest first: first a prompt of prefill_chunk tokens (fewer when
    max_len leaves no room to decode after it) whose request decodes min(R x ceil(P /
    prefill_chunk) + 2, max_len - its prompt - 1) tokens (through the whole prefill of the others),
    then R prompts of P tokens (each its own) generating `warm_tokens`: P = `longest`, or
    min(prefill_chunk + W, longest) where call_widths gives the C-row calls W < prefill_chunk
    tokens a row. (Session o's o3 met a first run in the 4-row packed call of 3 prefilling prompts
    beside a decoding one, 4 slots, when these waves went only up to R = 2.)"""
    waves: list[Wave] = []
    if max_len < 3:  # no room for a prompt and a token decoded beside the others' prefill
        return waves
    short = min(prefill_chunk, max_len - 2)
    lengths: dict[int, int] = {}  # prefilling rows R -> their prompts' length
    for count in sorted(packed_row_counts):
        rows = min(count, slots - 1)
        width = (call_widths or {}).get(count, prefill_chunk)
        if rows >= 1 and rows not in lengths:
            lengths[rows] = longest if width >= prefill_chunk else min(prefill_chunk + width, longest)
    for rows, length in lengths.items():
        # decoding through the whole prefill of the rows: at least one chunk of theirs a step
        decoding = min(rows * -(-length // prefill_chunk) + 2, max_len - short - 1)
        waves.append(LeadWave([(random_tokens(rng, vocab, short), decoding)]
                              + [(random_tokens(rng, vocab, length), warm_tokens) for _ in range(rows)]))
    return waves


def warm_up_waves(longest: int, lengths: Sequence[int], slots: int, prefill_chunk: int, warm_tokens: int,
                  max_len: int, packed_row_counts: Sequence[int], rng: np.random.Generator,
                  vocab: int, call_widths: Mapping[int, int] | None = None) -> list[Wave]:
    """Every wave of the module docstring (`shape_waves`, `tail_waves` with call_widths (row count
    -> tokens a row of its calls), then `packed_waves`, drawn from `rng` in that order): prompts of
    at most `longest` tokens, each request within max_len (longest + warm_tokens <= max_len:
    ValueError otherwise)."""
    for name, value in (("longest", longest), ("slots", slots), ("prefill_chunk", prefill_chunk),
                        ("warm_tokens", warm_tokens)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"warm-up {name}={value!r}; expected an integer >= 1")
    if longest + warm_tokens > max_len:
        raise ValueError(f"warm-up longest={longest} + warm_tokens={warm_tokens} tokens; expected at most "
                         f"max_len={max_len}")
    bad = [length for length in lengths if not 1 <= length <= longest]
    if bad:
        raise ValueError(f"warm-up lengths {bad}; expected lengths in 1..longest={longest}")
    return (shape_waves(longest, lengths, slots, warm_tokens, rng, vocab)
            + tail_waves(longest, prefill_chunk, warm_tokens, call_widths or {}, rng, vocab)
            + packed_waves(longest, slots, prefill_chunk, warm_tokens, max_len, packed_row_counts, rng, vocab,
                           call_widths))


def run_warm_up(engine: "ServingEngine", waves: Sequence[Wave], timeout_s: float = WARM_TIMEOUT_S) -> WarmUpReport:
    """Submits each wave to the started `engine` (request ids "warm-{wave}-{i}") and waits for all of
    its requests (each at most timeout_s: TimeoutError) before the next. A request that ends with
    an error is a RuntimeError naming it. Returns what ran (`WarmUpReport`)."""
    before = engine.stats()
    start = time.perf_counter()
    requests = 0
    for w, wave in enumerate(waves):
        requests_of = [Request(prompt=prompt.tolist(), max_tokens=max_tokens, request_id=f"warm-{w}-{i}")
                       for i, (prompt, max_tokens) in enumerate(wave)]
        if isinstance(wave, LeadWave) and len(requests_of) > 1:
            handles = _lead_then_rest(engine, requests_of, timeout_s)
        else:
            handles = [engine.submit(request) for request in requests_of]
        for handle in handles:
            output = handle.result(timeout_s)
            if output.finish_reason is FinishReason.ERROR:
                raise RuntimeError(f"warm-up request {output.request_id!r} failed: {output.error}")
        requests += len(handles)
    seconds = time.perf_counter() - start
    after = engine.stats()
    return WarmUpReport(waves=len(waves), requests=requests, seconds=seconds,
                        compiles=after.compiles - before.compiles, first_runs=after.first_runs - before.first_runs,
                        unrun_steps=tuple(engine.unrun_steps()))


def _lead_then_rest(engine: "ServingEngine", requests: list[Request], timeout_s: float) -> list:
    """A `LeadWave`'s handles: requests[0] submitted, the rest submitted by its first token's callback
    (on the engine thread, before its next step: they prefill while the lead decodes whatever this
    thread's own timing; submitted from here, after the wait, a loaded machine's lead could finish
    its few tokens first and the packed calls never run). The rest is submitted here instead when
    the lead ends without a token."""
    rest: list = []
    failures: list[BaseException] = []
    submitted = threading.Event()

    def submit_rest(*_) -> None:
        if submitted.is_set():
            return
        try:
            rest.extend(engine.submit(request) for request in requests[1:])
        except BaseException as error:  # raised on the warm-up's thread below (the engine ignores it)
            failures.append(error)
        finally:
            submitted.set()

    lead = engine.submit(requests[0], on_token=submit_rest)
    if not submitted.wait(timeout_s) and not lead.done:
        raise TimeoutError(f"warm-up request {requests[0].request_id!r} had no token in {timeout_s} s")
    if failures:
        raise failures[0]
    if not submitted.is_set():  # the lead ended without a token (an error, reported with its result)
        rest = [engine.submit(request) for request in requests[1:]]
    return [lead, *rest]


def engine_warm_up_waves(engine: "ServingEngine", longest: int, warm_tokens: int = WARM_TOKENS,
                         seed: int = WARM_SEED) -> list[Wave]:
    """`warm_up_waves` for prompts of up to `longest` tokens from the engine's own slots,
    prefill_chunk, max_len, packed row counts and vocabulary (no other lengths), random prompts from
    `seed`. ValueError when longest + warm_tokens passes the engine's max_len."""
    if not isinstance(longest, (int, np.integer)) or not 1 <= longest <= engine.max_len - warm_tokens:
        raise ValueError(f"warm-up longest={longest!r}; expected 1..{engine.max_len - warm_tokens} "
                         f"(the engine's max_len {engine.max_len} less {warm_tokens} generated tokens)")
    return warm_up_waves(int(longest), (), engine.slots, engine.prefill_chunk, warm_tokens, engine.max_len,
                         engine.packed_row_counts(), np.random.default_rng(seed),
                         engine.config.vocab_size, engine.call_widths())


def warm_up(engine: "ServingEngine", waves: Sequence[Wave], timeout_s: float = WARM_TIMEOUT_S) -> WarmUpReport:
    """A server's warm-up: `waves` run on the started, idle engine (`run_warm_up`), then no trace of
    them in what it reports: their prompts' blocks dropped from the prefix cache
    (`ServingEngine.forget_prompts`: a prompt another cached one continues stays) and the engine's
    counts started over (`ServingEngine.reset_stats`), so that stats() and /metrics count the
    requests served after it."""
    report = run_warm_up(engine, waves, timeout_s)
    forgotten = engine.forget_prompts([prompt for wave in waves for prompt, _ in wave])
    engine.reset_stats()
    return dataclasses.replace(report, forgotten_blocks=forgotten)


__all__ = ["WARM_TOKENS", "WARM_SEED", "WARM_TIMEOUT_S", "Wave", "LeadWave", "WarmUpReport", "random_tokens",
           "shape_waves", "tail_waves", "packed_waves", "warm_up_waves", "engine_warm_up_waves", "run_warm_up",
           "warm_up"]
