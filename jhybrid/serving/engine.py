"""The continuous-batching engine: `ServingEngine`, the `jhybrid.serving.api.Engine` of jhybrid.

One KV cache of `slots` rows of `max_len` tokens is opened once (`backend.open` + `init_cache`);
each request runs in one row (slot) from admission to its end, then the row is emptied with
`backend.reset_rows` and the next waiting request (FIFO) takes it. One engine step:

  1. requests cancelled since the last step end (CANCELLED); their rows are reset;
  2. waiting requests take the free slots, in arrival order; with the prefix cache, a request
     whose prompt starts with cached blocks gets their KV copied into its row and starts its
     prefill after them (at least its last prompt token is always prefilled: it gives the logits);
  3. prefill: up to `step_token_budget` prompt tokens of the prefilling requests (while any request
     decodes, `decoding_step_token_budget` when set: see below) (oldest first, or
     with prefill_order="shortest" fewest prompt tokens left first: a prefix-cache hit's short
     suffix then does not wait behind long prompts), in calls of [R, W] tokens over the R rows
     taking part (R a power of two or slots, padded with idle rows; a call of every row runs over
     the whole batch; W = min(prefill_chunk, step_token_budget / R), or prefill_chunk for a backend
     whose rows depend on where chunks end (`chunk_dependent`: the offloading modes; every row then
     gets whole chunks, as alone, and a step's last call may pass the budget); R chosen to give the
     first request the most tokens, then the call the most) when the backend `prefills_rows` (`full`,
     the offloading modes on one device), else of [slots, prefill_chunk] (positions -1 for the rows
     not taking part), each taking a chunk of every prefilling request and spending slots x
     prefill_chunk of the budget (it computes every row: a step makes ceil(budget / (slots x
     prefill_chunk)) of them, at least one); a request whose
     prompt is done samples its first token (the tokens a call draws are read only once the step's
     last prefill call is dispatched: the host work of its later calls overlaps it on the device),
     and its prompt's blocks enter the prefix cache (full
     attention: PREFIX_INSERT_BLOCKS_PER_STEP a step from this one, copied from its row, and all
     that are left when the request ends; an offloading backend: each call's whole blocks after the
     call, read from the device window as they are prefilled);
  4. decode: one token for every request past its prefill (each row sampled with its own request's
     parameters: `jhybrid.serving.sampling`). When the backend `packs_decode` (`full`; scout, topk
     and streaming on one device, whenever the chunks `can_pack`: their offloaded prompt attended
     on the device) and the step prefills, the decode tokens of the requests that were decoding when the step began ride in its
     first prefill call (`PackedRows`: one read of the weights for both; a request whose prefill
     ends in this step decodes from the next); otherwise one [slots, 1] call after the prefill
     (dispatched before the prefill instead, so that the host's work for the prefill would overlap
     it, scout measured no faster on the H100 and its decode-only steps slower: BENCHMARKS.md);
  5. finished requests (stop token, max_tokens) leave; their rows are reset.

A long prompt is thus prefilled over several steps, each followed by a decode step of the running
requests: it never stalls them for more than one budget of prefill. While requests decode, the
step's budget is `decoding_step_token_budget` when set (Sarathi-Serve's stall-free batching: a
smaller budget keeps the running requests' token gaps near a decode step's time, at the cost of the
prompts' time to first token), and it is strict for a `chunk_dependent` backend: its calls then
take whole chunks within the budget (at least one chunk a step), where otherwise a call of R rows
takes a chunk of each. With `decoding_budget_max_backlog` the smaller budget follows the load: it
applies only while the prompt tokens left to prefill (admitted and waiting) are at most that many,
so a saturated engine prefills at full rate and a lone long prompt does not stall the running
requests. Shapes are fixed (prefill [R, W] for each row count R, alone or packed with
[slots] decode tokens, or [slots, chunk]; decode [slots, 1]; the prefix copies run in pieces of one
block count), each compiled once ahead of time (like `Generator._run`; `compile_steps` compiles
every step shape up front, an offloading mode's prefill over each size of its prefill copies and its
host side's own compiles too): the steady state never recompiles.

The prefix cache holds every layer's true K, V of whole prompt blocks, with either kind of backend:
  * one that keeps every token on the device and says how a row's tokens lie (`backend.row_kv()`:
    full attention, quest): its first tier is a device array (`kv_blocks.KVBlockPool`); a hit is
    copied into the row (quest: pages and digests, as its prefill writes them), a finished
    prefill's blocks are copied out of it;
  * an offloading backend (`HybridAttention`, any mode): its first tier is a host array
    (`kv_blocks.HostKVBlockPool`, reported as the "device" tier); a hit is placed into the row
    where a plain chunked prefill would have left it (GPU window, host store, digests, counts:
    `jhybrid.hybrid.ingest.place_history`), and `ingest.reusable_prefix` bounds it so that the
    result is exactly a plain prefill's (hgca: the prompt's own prefill evicts every placed ring
    token, covers its last reevaluate_queries tokens and starts on a chunk boundary). The K, V of
    the prompt blocks a request may add to the cache are read from the device window after each
    prefill call that wrote them (`ingest.start_read_rows`, one read of every row of the call: the
    window holds a call's tokens until the next step evicts; the read and its copy to the host are
    dispatched behind the call) and,
    after the next call's dispatch, handed to the store worker thread, which waits for them and
    inserts a call's whole blocks at a time into the cache (`_store_job`, `_store_staged`) while
    the engine thread goes on; a step leaves at most STORE_BACKLOG jobs running when it ends (the
    rest overlap the next step's calls), and waits for all of them before a prefix lookup
    (admission) and when the engine runs out of work.
Other backends (the tensor-parallel offloading ones) run without it (logged once, every request a miss).

Memory: the backend is opened for `slots` rows of `max_len` tokens at construction, so the device
cache (and an offloading backend's host side) is allocated, and checked by the backend, before the
first request; a request is admitted when prompt + max_tokens fits `max_len`, so whatever is
admitted fits memory. The prefix cache's first tier is one more preallocated array (its bytes; on
the host for an offloading backend, whose prefilling rows also stage the K, V of their prompt's
new blocks on the host until their prefill ends: at most the prompt's whole blocks, every layer).
Its spills to a host tier are asynchronous: their gathered copies, up to half the device tier's
bytes, are transient device memory (`PrefixCache` max_spill_blocks).

Threading: `submit`, `cancel`, `stats` from any thread; the steps run on the engine's thread
(`start`) or the caller's (`step`), one at a time. Callbacks run on the stepping thread. An
offloading backend's prefix-cache stores run on one store worker thread, from their submission
until the stepping thread joins them (`_join_stores`): before it admits a request, when it runs out
of work, at close (the prefix cache is not thread-safe: the stepping thread touches it, and reads
its stats, only while no store job runs). A step that raises ends every request with
FinishReason.ERROR and the message; the engine then refuses new requests (EngineClosed with that
message).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import enum
import gc
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jhybrid.attention.base import AttentionBackend
from jhybrid.attention.full import FullAttention, PackedRows, pack_rows
from jhybrid.generation import SamplingParams
from jhybrid.models.decoder import CausalLM, KVCache
from jhybrid.serving.api import (AdmissionError, Engine, EngineClosed, EngineStats, FinishCallback,
                                 FinishReason, Request, RequestHandle, RequestOutput, TokenCallback)
from jhybrid.serving.kv_blocks import HostKVBlockPool, KVBlockPool, block_bytes_of
from jhybrid.serving.prefix_cache import PrefixCache, PrefixCacheConfig
from jhybrid.serving.sampling import RowSampling, sample_rows

log = logging.getLogger("jhybrid.serving")

# The prefix cache's device tier when its config leaves device_bytes None: the KV of one slot's
# max_len tokens (one full-length shared prefix), at most this much.
DEFAULT_PREFIX_DEVICE_BYTES = 1 << 30
# close() waits this long for the engine thread's last step before giving up on it.
JOIN_SECONDS = 60.0
# Compiled steps shared by engines of one model structure and one backend object (a server restarting
# its engine, tests, benchmarks): the latest this many beyond the most step shapes one engine's
# `compile_steps` compiled (`_kept_executables`), keyed by everything the compiled code depends on. (A
# fixed 32 dropped scout's decode step on the H200: 34 shapes with its packed calls, and the first
# decode-only step of the load recompiled for 9 s.)
SHARED_EXECUTABLES = 32
COMPILE_WORKERS = 4  # XLA compiles compile_steps runs at once (each also autotunes on the device)
STEP_SUMMARY = 64  # steps per INFO summary line of step times
# A finished prompt's blocks enter the prefix cache (full attention) this many per step, from the
# step its prefill ends: inserting a 32K prompt's 2,048 blocks at once (the cache's bookkeeping, the
# spill of as many, the copies out of the row) put 6-30 ms of Python into one step on the CPU
# machine (`PrefixCache.insert` timed alone), a step the running requests' next token waits for.
PREFIX_INSERT_BLOCKS_PER_STEP = 256
SLOW_STEP_S = 1.0  # a step this long gets an INFO line of its own
STORE_THREAD_NAME = "jhybrid-prefix-store"  # the thread that stores an offloading backend's captures
STORE_BACKLOG = 2  # store jobs a step may leave running when it ends (each holds a step's captured K, V)
_executables: collections.OrderedDict = collections.OrderedDict()
_executables_lock = threading.Lock()
_kept_executables = SHARED_EXECUTABLES  # grown by compile_steps to hold every shape of its engine
_executables_run: "weakref.WeakSet" = weakref.WeakSet()  # executables that have run in this process
# Each distinct model structure (graphdef) and parameter signature as a small int, found once per
# engine: hashing a graphdef walks the whole module tree, too slow for every step's lookup.
_structure_ids: dict = {}
# The backend of engines given none (full attention has no state of its own: one object serves all).
_FULL = FullAttention()
_DEFAULT_PREFIX_CACHE = PrefixCacheConfig()


class _State(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


def _checked_compiler_options(options) -> dict[str, str | bool | int]:
    """options ({name: value} XLA compile options, or None) checked by compiling a trivial program
    with them: an unknown name or a bad value is a ValueError now, not an error in a request's step."""
    if options is None:
        return {}
    if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
        raise ValueError(f"ServingEngine compiler_options={options!r}; expected a dict of XLA option names "
                         "to values, e.g. {'xla_gpu_enable_command_buffer': ''}")
    try:
        jax.jit(lambda x: x + 1).lower(np.zeros(1, np.float32)).compile(compiler_options=dict(options) or None)
    except Exception as exc:  # noqa: BLE001 - XLA's error, first line, named
        raise ValueError(f"ServingEngine compiler_options={options!r}: XLA refused them "
                         f"({str(exc).splitlines()[0]})") from None
    return dict(options)


def _offload_chunk_problem(backend: AttentionBackend, prefill_chunk: int, slots: int) -> str | None:
    """Why an offloading backend cannot serve with these prefill chunks (None: it can). Its prefill
    calls over some rows of the batch (slots > 1; packed calls with decode tokens are such calls)
    must carry chunks of 2+ tokens (`HybridAttention.attend`: a one-token chunk is a decode step,
    "got T = 1"), and the engine's chunk is prefill_chunk cut to the window's `max_prefill_chunk`
    (its ring less one block): a window of sink + one block leaves chunks of one token. One slot
    prefills the whole batch in every call (and never packs: `packed_row_counts`), which one-token
    chunks may be."""
    from jhybrid.hybrid.backend import HybridAttention

    if not isinstance(backend, HybridAttention) or not backend.prefills_rows or slots == 1:
        return None
    config, least = backend.config, 2
    serving = f"serving {slots} slots needs prefill chunks of >= {least} tokens"
    if config.max_prefill_chunk < least:
        block, ring = config.block_size, config.ring_tokens
        window = config.sink + block * -(-(block + least) // block)  # a ring of one block + a chunk, whole blocks
        return (f"offload window_tokens={config.window_tokens} is too small to serve with mode {config.mode!r}: "
                f"beside the {config.sink}-token sink it leaves a ring of {ring} tokens, whose prefill chunks (the "
                f"ring less one block of block_size={block}) hold at most {config.max_prefill_chunk} token, and "
                f"{serving} (prefill_chunk={prefill_chunk}); expected window_tokens >= {window} "
                f"(sink + {(window - config.sink) // block} blocks)")
    if prefill_chunk < least:
        return f"ServingEngine prefill_chunk={prefill_chunk}; expected >= {least}: mode {config.mode!r} {serving}"
    return None


def _last_logits(model, hidden, positions) -> jax.Array:
    """Each row's logits at its last valid position: hidden [R, T, d], positions [R, T] -> [R, V] float32."""
    last = jnp.argmax(positions, axis=1)
    last_hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    return model.logits(last_hidden).astype(jnp.float32)


# The tokens are drawn in a program of their own, after the step's: `sample_rows` decides on the
# device whether any row samples (a `lax.cond`), and a GPU program with a conditional waits on the
# host for its predicate, so a step sampling inside it would return from its dispatch only when the
# device had run the whole model (the host work before the next call no longer overlapping it).
# A prefill call that ends no prompt draws nothing.
_sample = jax.jit(sample_rows)


@dataclasses.dataclass
class StepTimes:
    """One step's model calls and where its time went:
    host_seconds: in the backend's `before_step` (an offloading backend's host work before a call:
        evictions published, prefill copies, a mode's recalls or re-scoring); host_cpu_seconds: the
        engine thread's CPU time in it (`time.thread_time`; the rest the thread waited, for the GIL
        or the device);
    overlap_seconds: in the backend's `after_dispatch` (host work right after a call's launch, meant
        for the device's shadow: scout's finished recalls applied);
    call_seconds: in each compiled call's launch and, for a call whose tokens are read (a decode
        call, a prefill call that ends a prompt), the wait for them (the device work and the host
        attention before them; a prefill call that ends no prompt is not waited for: the next
        call's host work overlaps it); launch_seconds: of it, inside the launches
        (`executable(*args)` until it returns; an asynchronous launch returns before the device is
        done);
    capture_seconds: dispatching reads of prefilled K, V from the device window for the prefix
        cache (offloading backends; the store worker waits for them);
    calls: how many; first_runs: of them, calls of an executable that had never run in this process
        (XLA loads a GPU executable's module at its first run, which can take a step's time again);
    reset_seconds: emptying the rows of the requests that ended in the step, after their tokens
        (`backend.reset_rows`: an offloading backend first waits for the exchange and the evictions
        in flight, a delay the running requests' next token gap carries);
    gc_seconds: in the interpreter's garbage collections that ran in the stepping thread, anywhere
        in the step (a collection of the older generations can take a step's time again)."""

    host_seconds: float = 0.0
    host_cpu_seconds: float = 0.0
    overlap_seconds: float = 0.0
    launch_seconds: float = 0.0
    gc_seconds: float = 0.0
    call_seconds: float = 0.0
    capture_seconds: float = 0.0
    calls: int = 0
    reset_seconds: float = 0.0
    first_runs: int = 0


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What one engine step ran: prefill ((request_id, prompt tokens prefilled), ...) in the order
    they took the step's budget (prefill_order) and decode (request_ids that got a decode step) in
    slot order; seconds: its wall time (admission, model calls, sampling; not the wait for work), of
    which prefix_seconds in the prefix cache (hits copied into rows, finished prompts inserted, and
    the spills' waits those caused; an offloading backend's: the wait for the store worker's jobs);
    started: its start (time.perf_counter); admitted: requests it took into slots; times: where the
    rest went (`StepTimes`); backend_seconds: the backend's time counters (`backend.counters()`,
    the keys ending in _s) that grew during the step, by how much (name, seconds), largest first;
    budget: the prompt tokens the step could prefill (step_token_budget, or decoding_step_token_budget
    where it applied)."""

    step: int
    prefill: tuple[tuple[str, int], ...]
    decode: tuple[str, ...]
    seconds: float = 0.0
    prefix_seconds: float = 0.0
    started: float = 0.0
    admitted: int = 0
    times: StepTimes = dataclasses.field(default_factory=StepTimes)
    backend_seconds: tuple[tuple[str, float], ...] = ()
    budget: int = 0


class _GcClock(threading.local):
    """Seconds of the interpreter's garbage collections run in this thread (`thread_gc_seconds`)."""

    started: float = 0.0
    total: float = 0.0


_gc_clock = _GcClock()


def _on_gc(phase: str, info: dict) -> None:
    """(gc.callbacks) A collection runs in the thread whose allocation triggered it: its time is that
    thread's."""
    if phase == "start":
        _gc_clock.started = time.perf_counter()
    else:
        _gc_clock.total += time.perf_counter() - _gc_clock.started


gc.callbacks.append(_on_gc)


def thread_gc_seconds() -> float:
    """The seconds this thread has spent in garbage collections since this module loaded."""
    return _gc_clock.total


def _time_counters(backend: AttentionBackend) -> dict[str, float]:
    """The backend's cumulative time counters (keys ending in _s)."""
    return {name: float(value) for name, value in backend.counters().items() if name.endswith("_s")}


def _grown(before: dict[str, float], after: dict[str, float]) -> tuple[tuple[str, float], ...]:
    """The counters that grew from `before` to `after`, by how much, largest first."""
    grown = [(name, value - before.get(name, 0.0)) for name, value in after.items()]
    return tuple(sorted([(name, round(d, 6)) for name, d in grown if d > 0], key=lambda g: -g[1]))


@dataclasses.dataclass
class _Counters:
    """The engine's cumulative counts (guarded by its lock); `EngineStats` fields of the same names.
    prefix_unusable: requests admitted while the backend's KV could not use the prefix cache (misses)."""

    finished: int = 0
    cancelled: int = 0
    errors: int = 0
    rejected: int = 0
    steps: int = 0
    decode_steps: int = 0
    prefill_calls: int = 0
    prefill_tokens: int = 0
    generated_tokens: int = 0
    compiles: int = 0
    first_runs: int = 0
    prefix_unusable: int = 0


@dataclasses.dataclass
class _Draws:
    """The tokens one prefill call drew, still on the device: read (`ServingEngine._accept_draws`)
    only once the step's last prefill call is dispatched, so the host work and dispatch of the
    step's later calls overlap this one on the device instead of waiting for it.

    decoded: int32 [slots] device array, the decode tokens that rode in the call (None: none did);
    decoding: the requests those belong to (row = slot);
    first: int32 [R] device array, the tokens drawn at the call's rows (None: no prompt ended);
    prompts_done: (request, its row in the call) for each prompt the call ended."""

    decoded: jax.Array | None = None
    decoding: list[_Run] = dataclasses.field(default_factory=list)
    first: jax.Array | None = None
    prompts_done: list[tuple[_Run, int]] = dataclasses.field(default_factory=list)


class _Run(RequestHandle):
    """A submitted request: its handle and its engine-side state (touched by the stepping thread;
    `cancel_requested` and the output by any thread under the engine's lock)."""

    def __init__(self, engine: "ServingEngine", request: Request, prompt: np.ndarray, request_id: str,
                 on_token: TokenCallback | None, on_finish: FinishCallback | None):
        self.request_id = request_id
        self.request = request
        self.prompt = prompt  # [P] int32
        self.stop = frozenset(int(t) for t in request.stop_tokens)
        self.on_token, self.on_finish = on_token, on_finish
        self.submitted = time.perf_counter()
        self.state = _State.WAITING
        self.slot = -1
        self.order = -1  # admission order: prefill goes oldest first
        self.prefilled = 0  # prompt tokens in the row (cached ones included)
        self.cached_tokens = 0
        self.queued: float | None = None  # submit -> admission (s)
        # offloading backend + prefix cache: prompt tokens [capture_from, capture_to) are read from the
        # window as they are prefilled and their whole blocks stored in the prefix cache after each
        # prefill call; captured: the reads dispatched since the last store job (the engine thread's);
        # staged: the tokens from staged_from not stored yet ([L, 2, T, Hkv, D] host arrays; the store
        # worker's, like staged_from; capture_to is set to 0 by it when it stops storing the request)
        self.capture_from = self.capture_to = self.staged_from = 0
        self.captured: list = []  # `ingest.PendingTokens`, one per prefill call since the last store job
        self.staged: list[np.ndarray] = []
        # full attention + prefix cache: the prompt's whole blocks inserted so far (None: none pending)
        self.prefix_blocks_stored: int | None = None
        self.tokens: list[int] = []
        self.token_times: list[float] = []
        self.cancel_requested = False
        self._engine = engine
        self._event = threading.Event()
        self._output: RequestOutput | None = None

    def cancel(self) -> None:
        self._engine._request_cancel(self)

    def result(self, timeout: float | None = None) -> RequestOutput:
        if not self._event.wait(timeout):
            raise TimeoutError(f"request {self.request_id!r} did not finish within {timeout} s")
        return self._output

    @property
    def done(self) -> bool:
        return self._event.is_set()


class ServingEngine(Engine):
    """Continuous batching over one model and one attention backend (module docstring).

    model: a CausalLM. backend: any AttentionBackend with `reuses_rows` (default: FullAttention);
        the engine opens it for `slots` x `max_len` and closes it at close().
    slots: requests decoded together (rows of the batch).
    max_len: tokens per slot, prompt + max_tokens of a request at most (default: the model's
        context; more only for a backend that handles long context).
    prefill_chunk: the most tokens of one row in one prefill call (bounded by the backend's
        max_prefill_chunk); a backend that `prefills_rows` runs R rows in calls of
        min(prefill_chunk, step_token_budget // R) tokens each (prefill_chunk when it is
        `chunk_dependent`), any other [slots, prefill_chunk]. An offloading mode's calls over
        some rows need chunks of 2+ tokens: a window (or prefill_chunk) that leaves one is a
        ValueError here (`_offload_chunk_problem`), not in a step.
    step_token_budget: prompt tokens prefilled per engine step over all rows (default: prefill_chunk);
        with a backend that does not `prefills_rows`, the token positions its calls compute: each
        [slots, prefill_chunk] call counts whole, carrying a chunk of every prefilling request.
    decoding_step_token_budget: the budget of a step that begins with requests decoding (at most
        step_token_budget; default None: step_token_budget, by its rules). Calls keep their shapes
        (a `prefills_rows` backend's width comes from step_token_budget): only how many tokens a
        step takes changes; a `chunk_dependent` backend takes whole chunks within it, at least one
        a step.
    decoding_budget_max_backlog: with decoding_step_token_budget, a budget that follows the load:
        the smaller budget applies only while the prompt backlog (the prompt tokens the admitted
        requests have left to prefill plus the waiting requests' prompts) is at most this many
        tokens; above it the engine is behind and a step takes step_token_budget even while
        requests decode (throughput first). Default None: the smaller budget whenever requests
        decode.
    prefix_cache: a PrefixCacheConfig, or None for no prefix cache. Used with a backend that says
        how a row's tokens lie (`backend.row_kv()`: full, quest) and with a single-device
        offloading backend (HybridAttention: its first tier lives on the host, module docstring); with any other
        backend it is not used: logged once, and every request counts a miss. device_bytes None =
        the KV of max_len tokens (one slot's), at most DEFAULT_PREFIX_DEVICE_BYTES.
    prefix_cache_bytes: shorthand for the device tier's bytes (`jhybrid serve --prefix-cache-mb`):
        replaces prefix_cache's device_bytes; 0 turns the prefix cache off.
    step_log: how many StepRecords `step_log()` keeps (the latest).
    prefill_order: which prefilling requests take each step's budget first: "arrival" (admission
        order) or "shortest" (fewest prompt tokens left to prefill, then admission order; lowers
        the time to first token of short prompts and prefix-cache hits, as SGLang's
        longest-prefix-match policy does, at the cost of long prompts under a sustained load).
    compiler_options: XLA compile options of the step programs ({name: value}, as in
        `jax.stages.Lowered.compile`), e.g. {"xla_gpu_enable_command_buffer": ""}: a GPU step launches
        its kernels one by one instead of through CUDA graphs (slower on the H200 for the 32-layer
        model: BENCHMARKS.md, "CUDA graphs or not"). Checked here: an option XLA does not know is a
        ValueError. May be replaced later (`benchmarks/probe_serving_steps.py --compare`): later
        steps compile with the new options.
    """

    PREFILL_ORDERS = ("arrival", "shortest")

    def __init__(self, model: CausalLM, backend: AttentionBackend | None = None, slots: int = 4,
                 max_len: int | None = None, prefill_chunk: int = 256, step_token_budget: int | None = None,
                 prefix_cache: PrefixCacheConfig | None = _DEFAULT_PREFIX_CACHE,
                 prefix_cache_bytes: int | None = None, step_log: int = 1024, prefill_order: str = "arrival",
                 decoding_step_token_budget: int | None = None, decoding_budget_max_backlog: int | None = None,
                 compiler_options: dict[str, str | bool | int] | None = None):
        backend = _FULL if backend is None else backend
        asked_for_prefix_cache = prefix_cache is not _DEFAULT_PREFIX_CACHE or prefix_cache_bytes is not None
        config = model.config
        context = config.max_position_embeddings
        max_len = context if max_len is None else max_len
        step_token_budget = prefill_chunk if step_token_budget is None else step_token_budget
        for name, value in (("slots", slots), ("max_len", max_len), ("prefill_chunk", prefill_chunk),
                            ("step_token_budget", step_token_budget),
                            ("decoding_step_token_budget", decoding_step_token_budget)):
            if name == "decoding_step_token_budget" and value is None:
                continue
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ServingEngine {name}={value!r}; expected an integer >= 1")
        if decoding_budget_max_backlog is not None:
            if not isinstance(decoding_budget_max_backlog, int) or decoding_budget_max_backlog < 0:
                raise ValueError(f"ServingEngine decoding_budget_max_backlog={decoding_budget_max_backlog!r}; "
                                 "expected an integer >= 0")
            if decoding_step_token_budget is None:
                raise ValueError(f"ServingEngine decoding_budget_max_backlog={decoding_budget_max_backlog} "
                                 "needs decoding_step_token_budget (the budget it switches on and off)")
        if prefill_order not in self.PREFILL_ORDERS:
            raise ValueError(f"ServingEngine prefill_order={prefill_order!r}; expected one of {self.PREFILL_ORDERS}")
        if not backend.reuses_rows:
            raise ValueError(f"mode {backend.name!r} cannot serve: its backend cannot reset single rows "
                             "(reuses_rows is False), which continuous batching needs")
        if max_len > context and not backend.handles_long_context:
            raise ValueError(f"max_len {max_len} is longer than the model's context of {context} tokens "
                             f"(backend {backend.name!r} keeps all KV on the device)")
        chunk_problem = _offload_chunk_problem(backend, prefill_chunk, slots)
        if chunk_problem is not None:
            raise ValueError(chunk_problem)
        if prefix_cache_bytes is not None:
            if prefix_cache_bytes < 0:
                raise ValueError(f"prefix_cache_bytes={prefix_cache_bytes}; expected >= 0")
            prefix_cache = (None if prefix_cache_bytes == 0 else
                            dataclasses.replace(prefix_cache or PrefixCacheConfig(), device_bytes=prefix_cache_bytes))
        if prefix_cache is not None and prefix_cache.device_bytes == 0:
            prefix_cache = None

        self.config = config
        self.backend = backend
        self.slots = slots
        self.max_len = max_len
        self.prefill_chunk = min(prefill_chunk, backend.max_prefill_chunk or prefill_chunk)
        self.step_token_budget = step_token_budget
        self.decoding_step_token_budget = (None if decoding_step_token_budget is None
                                           else min(decoding_step_token_budget, step_token_budget))
        self.decoding_budget_max_backlog = decoding_budget_max_backlog
        self.prefill_order = prefill_order
        self.compiler_options = compiler_options  # (the property: checked, and the executables' key part)
        self.graphdef, self.params = nnx.split(model)
        params_signature = tuple((x.shape, str(x.dtype), getattr(x, "sharding", None))
                                 for x in jax.tree_util.tree_leaves(self.params))
        with _executables_lock:
            self._structure_id = _structure_ids.setdefault((self.graphdef, params_signature), len(_structure_ids))
        self.compile_seconds = 0.0

        backend.open(config, slots, max_len)
        self._overlaps = backend.overlap_dispatch()  # host work in each call's shadow (`_after_dispatch`)
        self._hybrid = False  # the prefix cache places hits with jhybrid.hybrid.ingest
        self._logged_unpacked = False
        try:
            self._cache: KVCache = model.init_cache(slots, max_len, backend)
            self._prefix, self._pool = self._open_prefix_cache(prefix_cache, asked_for_prefix_cache)
        except BaseException:
            backend.close()
            raise
        self._prefix_unusable = prefix_cache is not None and self._prefix is None
        self._prefix_stats = self._prefix.stats() if self._prefix else None

        self._sampling = RowSampling.empty(slots)
        self._cond = threading.Condition()  # guards the queue, the slots' occupants and the counters
        self._step_lock = threading.Lock()  # one step at a time
        self._waiting: collections.deque[_Run] = collections.deque()
        self._rows: list[_Run | None] = [None] * slots
        self._to_reset: list[int] = []
        self._thread: threading.Thread | None = None
        self._stop = False
        self._closing = False
        self._closed = False
        self._error: str | None = None
        self._ids = itertools.count()
        self._admissions = itertools.count()
        self._log: collections.deque[StepRecord] = collections.deque(maxlen=step_log)
        self._step_window: list[tuple[float, int, int]] = []  # (seconds, prompt, decode tokens) since the last summary
        self._prefix_seconds = 0.0  # the current step's time in the prefix cache (StepRecord.prefix_seconds)
        self._times = StepTimes()  # the current step's calls (StepRecord.times)
        self._step_budget = self.step_token_budget  # the current step's (StepRecord.budget)
        self._inserting: list[_Run] = []  # finished prompts whose blocks enter the prefix cache (full)
        self._unstored: list[_Run] = []  # requests whose captured reads await a store job (`_submit_stores`)
        # The store worker (an offloading backend's prefix cache): it runs the store jobs submitted
        # during the steps; the engine thread touches the prefix cache only after joining them all
        # (`_join_stores`), so never while a job may (the cache is not thread-safe).
        self._store_worker: concurrent.futures.ThreadPoolExecutor | None = None
        self._stores: list[concurrent.futures.Future] = []
        self.store_seconds = 0.0  # the store worker's time in jobs (waits for reads, inserts)
        self._counts = _Counters()

    @property
    def compiler_options(self) -> dict[str, str | bool | int]:
        """The XLA compile options of the step programs (constructor docstring)."""
        return dict(self._compiler_options)

    @compiler_options.setter
    def compiler_options(self, options: dict[str, str | bool | int] | None) -> None:
        self._compiler_options = _checked_compiler_options(options)
        self._options_key = tuple(sorted(self._compiler_options.items()))  # made once, not per dispatch

    def _open_prefix_cache(self, config: PrefixCacheConfig | None, asked_for: bool):
        """(PrefixCache, its first tier's pool), or (None, None) when off or the backend keeps KV the
        prefix cache cannot place (logged: a warning when the caller asked for a prefix cache, else
        the default's note)."""
        if config is None:
            return None, None
        row_kv = self.backend.row_kv()  # blocks copied in and out of rows on the device (full, quest)
        full = row_kv is not None
        problem = None if full else self._hybrid_problem()
        if problem is not None:
            log.log(logging.WARNING if asked_for else logging.INFO,
                    "prefix cache not used with backend %r: %s (every request counts a prefix-cache miss)",
                    self.backend.name, problem)
            return None, None
        dtype = jax.tree_util.tree_leaves(self._cache.layers)[0].dtype if full else None
        block_bytes = block_bytes_of(self.config, config.block_size, dtype)
        device_bytes = config.device_bytes
        if device_bytes is None:
            slot_bytes = block_bytes * -(-self.max_len // config.block_size)
            device_bytes = min(slot_bytes, DEFAULT_PREFIX_DEVICE_BYTES)
        if device_bytes < block_bytes:
            raise ValueError(f"prefix cache device_bytes {device_bytes} holds no block of {block_bytes} bytes "
                             f"({config.block_size} tokens of every layer's K and V); expected >= {block_bytes}")
        c = self.config
        if full:
            pool = KVBlockPool(device_bytes // block_bytes, c.num_layers, config.block_size, c.num_kv_heads,
                               c.head_dim, dtype, row_kv)
        else:
            pool = HostKVBlockPool(device_bytes // block_bytes, c.num_layers, config.block_size, c.num_kv_heads,
                                   c.head_dim, c.dtype)
            from jhybrid.hybrid import ingest  # imported when used: full attention needs none of it

            self._hybrid, self._ingest = True, ingest
        from jhybrid.hcache.storage import config_hash, weights_fingerprint  # what a saved disk tier's KV needs

        fingerprint = (f"config {config_hash(c)} weights {weights_fingerprint(nnx.merge(self.graphdef, self.params))}"
                       f" kv {pool.dtype.name}" if config.disk_dir is not None and config.disk_bytes > 0 else None)
        return PrefixCache(config, pool, fingerprint=fingerprint), pool

    def _hybrid_problem(self) -> str | None:
        """Why the prefix cache cannot place hits into this backend's rows (None: it can)."""
        from jhybrid.hybrid.backend import HybridAttention

        if not isinstance(self.backend, HybridAttention) or self.backend.runtime is None:
            return ("its KV cache is neither rows of device KV (backend.row_kv()) nor a single-device offloading "
                    "backend's (GPU window + host store)")
        c = self.config
        if len(c.global_layers) < c.num_layers and self.prefill_chunk > min(c.sliding_window, self.max_len):
            return (f"a prefill chunk of {self.prefill_chunk} tokens is longer than the sliding window of "
                    f"{c.sliding_window}, whose ring then does not hold a chunk's K, V for the prefix cache to read")
        return None

    @property
    def _chunk_period(self) -> int:
        """A request prefilling alone has its prefill calls end at multiples of this many tokens
        (chunks of prefill_chunk, as many as each step's budget takes, the last one cut by it; a
        backend that does not `prefills_rows`: chunks of prefill_chunk, `_take`)."""
        chunk, budget = self.prefill_chunk, self.step_token_budget
        whole_chunks = budget % chunk == 0 or not self.backend.prefills_rows or self.backend.chunk_dependent
        return chunk if whole_chunks else budget

    # ---- the caller's side ---------------------------------------------------------------------------

    def submit(self, request: Request, on_token: TokenCallback | None = None,
               on_finish: FinishCallback | None = None) -> RequestHandle:
        self._refuse_if_closed()
        try:
            prompt = self._admissible(request)
        except AdmissionError:
            with self._cond:
                self._counts.rejected += 1
            raise
        with self._cond:
            self._refuse_if_closed()
            run = _Run(self, request, prompt, request.request_id or f"req-{next(self._ids)}", on_token, on_finish)
            self._waiting.append(run)
            self._cond.notify_all()
        return run

    def _refuse_if_closed(self) -> None:
        if self._error is not None:
            raise EngineClosed(f"the engine stopped after an error: {self._error}")
        if self._closing:
            raise EngineClosed("the engine is closed (or draining): it takes no new requests")

    def _admissible(self, request: Request) -> np.ndarray:
        """The prompt as int32 [P] if the request can ever run here; AdmissionError naming the value
        and the limit otherwise."""
        if not isinstance(request, Request):
            raise AdmissionError(f"expected a jhybrid.serving.api.Request, got {type(request).__name__}")
        if not isinstance(request.sampling, SamplingParams):
            raise AdmissionError(f"sampling is a {type(request.sampling).__name__}; expected SamplingParams")
        ids = np.asarray(request.prompt)
        if ids.size == 0:
            raise AdmissionError("the prompt is empty; a request needs at least one token")
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise AdmissionError(f"the prompt is {ids.dtype} of shape {ids.shape}; "
                                 "expected a list of integer token ids")
        vocab = self.config.vocab_size
        bad = (ids < 0) | (ids >= vocab)
        if bad.any():
            at = int(np.argmax(bad))
            raise AdmissionError(f"prompt token {at} is id {int(ids[at])}; expected ids in [0, {vocab}) "
                                 "(the model's vocabulary)")
        if not isinstance(request.max_tokens, int) or request.max_tokens < 1:
            raise AdmissionError(f"max_tokens={request.max_tokens!r}; expected an integer >= 1")
        if not all(isinstance(t, (int, np.integer)) for t in request.stop_tokens):
            raise AdmissionError(f"stop_tokens={request.stop_tokens!r}; expected integer token ids")
        total = len(ids) + request.max_tokens
        if total > self.max_len:
            raise AdmissionError(f"prompt {len(ids)} + max_tokens {request.max_tokens} = {total} tokens; "
                                 f"expected at most a slot's {self.max_len}")
        return ids.astype(np.int32)

    def _request_cancel(self, run: _Run) -> None:
        with self._cond:
            if run.state is not _State.DONE:
                run.cancel_requested = True
                self._cond.notify_all()

    def stats(self) -> EngineStats:
        with self._cond:
            c = self._counts
            prefix = self._prefix_stats
            return EngineStats(
                slots=self.slots, running=sum(r is not None for r in self._rows), waiting=len(self._waiting),
                finished=c.finished, cancelled=c.cancelled, rejected=c.rejected, decode_steps=c.decode_steps,
                prefill_tokens=c.prefill_tokens, generated_tokens=c.generated_tokens,
                prefix_hits=prefix.hits if prefix else 0,
                prefix_misses=(prefix.misses if prefix else 0) + c.prefix_unusable,
                prefix_hit_tokens=prefix.hit_tokens if prefix else 0,
                prefix_bytes_device=prefix.bytes_device if prefix else 0,
                prefix_bytes_host=prefix.bytes_host if prefix else 0,
                prefix_bytes_disk=prefix.bytes_disk if prefix else 0,
                errors=c.errors, steps=c.steps, prefill_calls=c.prefill_calls, compiles=c.compiles,
                first_runs=c.first_runs,
                prefix_hit_tokens_host=prefix.hit_tokens_host if prefix else 0,
                prefix_hit_tokens_disk=prefix.hit_tokens_disk if prefix else 0,
                prefix_spill_wait_seconds=prefix.spill_wait_seconds if prefix else 0.0,
                prefix_disk_read_errors=prefix.disk_read_errors if prefix else 0)

    def forget_prompts(self, prompts: Sequence[Sequence[int]]) -> int:
        """Drops the prefix-cache blocks of `prompts` that no other cached prompt continues
        (`PrefixCache.forget`: a shared prefix stays), e.g. a warm-up's random prompts
        (jhybrid.serving.warmup); returns how many (0 without a prefix cache). The engine must be
        idle: nothing running or waiting (RuntimeError otherwise)."""
        with self._step_lock:
            self._refuse_unless_idle("forget_prompts")
            if self._prefix is None:
                return 0
            self._join_stores()  # (done at the last step's end: the cache is the caller's alone now)
            forgotten = sum(self._prefix.forget(prompt) for prompt in prompts)
            with self._cond:
                self._prefix_stats = self._prefix.stats()
            return forgotten

    def reset_stats(self) -> None:
        """Starts the engine's counts over, e.g. after a warm-up (jhybrid.serving.warmup), so that
        `stats()` (and the server's /metrics) counts what came after: every EngineStats counter (the
        prefix cache's lookups too: `PrefixCache.reset_counts`, its disk_read_errors kept) back to 0,
        and the step log emptied (its step numbers start over). The gauges (running, waiting, the
        prefix cache's bytes) and compile_seconds / store_seconds stay. The engine must be idle:
        nothing running or waiting (RuntimeError otherwise)."""
        with self._step_lock:
            self._refuse_unless_idle("reset_stats")
            self._join_stores()
            with self._cond:
                self._counts = _Counters()
                self._log.clear()
                self._step_window.clear()
                if self._prefix is not None:
                    self._prefix.reset_counts()
                    self._prefix_stats = self._prefix.stats()

    def _refuse_unless_idle(self, what: str) -> None:
        """RuntimeError naming `what` while a request runs or waits."""
        with self._cond:
            running, waiting = sum(r is not None for r in self._rows), len(self._waiting)
        if running or waiting:
            raise RuntimeError(f"ServingEngine.{what} with {running} requests running and {waiting} waiting; "
                               "expected an idle engine")

    def step_log(self) -> list[StepRecord]:
        """The latest steps' records, oldest first."""
        with self._cond:
            return list(self._log)

    def slot_lengths(self) -> np.ndarray:
        """[slots] int: the tokens each row of the cache holds (0 once a row is reset: a leak check)."""
        with self._step_lock:
            return np.asarray(self._cache.lengths).copy()

    @property
    def closed(self) -> bool:
        return self._closed

    # ---- the loop --------------------------------------------------------------------------------

    def start(self) -> None:
        with self._cond:
            self._refuse_if_closed()
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._loop, name="jhybrid-serving-engine", daemon=True)
            self._thread.start()

    def _busy(self) -> bool:
        """Work for a step (under the lock): a waiting request or an occupied slot."""
        return bool(self._waiting) or any(r is not None for r in self._rows)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._busy():
                    self._cond.wait()
                if self._stop:
                    return
            try:
                self.step()
            except Exception:  # step() has ended every request with the error and logged it
                return

    def step(self) -> bool:
        with self._step_lock:
            if self._error is not None or self._closed:
                return False
            try:
                return self._step()
            except Exception as error:
                self._fail(error)
                raise

    def _step(self) -> bool:
        with self._cond:
            cancelled = [r for r in self._waiting if r.cancel_requested]
            cancelled += [r for r in self._rows if r is not None and r.cancel_requested]
        for run in cancelled:
            self._finish(run, FinishReason.CANCELLED)
        self._reset_released_rows()
        start, collected = time.perf_counter(), thread_gc_seconds()
        self._prefix_seconds, self._times = 0.0, StepTimes()
        counted = _time_counters(self.backend)
        admitted = self._admit()
        prefilled, decoded = self._prefill_and_decode()
        self._insert_pending()
        with self._timed("reset_seconds"):
            self._reset_released_rows()
        if not any(r is not None for r in self._rows):  # out of work: nothing to overlap the stores with
            self._submit_stores()
            self._join_stores()
        else:  # the rest overlap the next step's calls
            self._join_stores(keep=STORE_BACKLOG)
        seconds = time.perf_counter() - start
        self._times.gc_seconds = thread_gc_seconds() - collected
        with self._cond:
            if prefilled or decoded:
                self._counts.steps += 1
                self._log.append(StepRecord(self._counts.steps, tuple(prefilled), tuple(decoded), seconds,
                                            self._prefix_seconds, start, len(admitted), self._times,
                                            _grown(counted, _time_counters(self.backend)),
                                            self._step_budget))
                self._log_steps(seconds, sum(n for _, n in prefilled), len(decoded))
            if self._prefix is not None and not self._stores:
                self._prefix_stats = self._prefix.stats()
            self._cond.notify_all()
        return bool(cancelled or admitted or prefilled or decoded)

    def _log_steps(self, seconds: float, prefill_tokens: int, decode_tokens: int) -> None:
        """Every STEP_SUMMARY steps, one INFO line: their median and longest time and their tokens;
        and one for a step of SLOW_STEP_S or more, with its prefix-cache share."""
        if seconds >= SLOW_STEP_S:
            log.info("step %d took %.2f s (%.2f s in the prefix cache); %d prompt and %d decode tokens",
                     self._counts.steps, seconds, self._prefix_seconds, prefill_tokens, decode_tokens)
        window = self._step_window
        window.append((seconds, prefill_tokens, decode_tokens))
        if len(window) == STEP_SUMMARY:
            times = sorted(w[0] for w in window)
            log.info("steps %d-%d: median %.1f ms, longest %.1f ms; %d prompt and %d decode tokens",
                     self._counts.steps - len(window) + 1, self._counts.steps, 1e3 * times[len(times) // 2],
                     1e3 * times[-1], sum(w[1] for w in window), sum(w[2] for w in window))
            window.clear()

    def _admit(self) -> list[_Run]:
        """Waiting requests into free slots (FIFO), each with its prefix-cache hit copied into its row."""
        admitted = []
        with self._cond:
            free = [slot for slot, run in enumerate(self._rows) if run is None]
            while free and self._waiting:
                run = self._waiting.popleft()
                run.slot, run.state, run.order = free.pop(0), _State.PREFILL, next(self._admissions)
                run.queued = time.perf_counter() - run.submitted
                self._rows[run.slot] = run
                admitted.append(run)
        if admitted:  # the lookups see every block prefilled so far
            self._submit_stores()
            self._join_stores()
        for run in admitted:
            self._sampling.set_row(run.slot, run.request.sampling)
            self._use_prefix_cache(run)
        return admitted

    @contextlib.contextmanager
    def _in_prefix_cache(self):
        """Times its body into the step's prefix_seconds (StepRecord)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._prefix_seconds += time.perf_counter() - start

    @contextlib.contextmanager
    def _timed(self, field: str):
        """Adds its body's seconds to the step's `field` (StepTimes)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            setattr(self._times, field, getattr(self._times, field) + time.perf_counter() - start)

    def _before_step(self, positions: np.ndarray, decode_positions: np.ndarray | None = None) -> None:
        """The backend's host work before a call (`AttentionBackend.before_step`; with decode_positions
        a packed call's, `before_packed_step`), timed; counts the call."""
        self._times.calls += 1
        cpu = time.thread_time()
        with self._timed("host_seconds"):
            if decode_positions is None:
                self._cache = self.backend.before_step(self._cache, positions)
            else:
                self._cache = self.backend.before_packed_step(self._cache, positions, decode_positions)
        self._times.host_cpu_seconds += time.thread_time() - cpu

    def _after_dispatch(self) -> None:
        """The backend's host work in the shadow of the call just dispatched (`overlap_dispatch`),
        timed."""
        if self._overlaps:
            with self._timed("overlap_seconds"):
                self._cache = self.backend.after_dispatch(self._cache)

    def _use_prefix_cache(self, run: _Run) -> None:
        with self._in_prefix_cache():
            self._place_cached_prefix(run)

    def _place_cached_prefix(self, run: _Run) -> None:
        """The longest cached prefix of the run's prompt copied into its row (prefill starts after it)."""
        if self._prefix is None:
            if self._prefix_unusable:
                with self._cond:
                    self._counts.prefix_unusable += 1
            return
        bs = self._prefix.block_size
        usable = (len(run.prompt) - 1) // bs * bs
        if self._hybrid:  # only what a placement + the prefill of the rest reproduce exactly
            usable = self._ingest.reusable_prefix(self.backend, len(run.prompt), usable, self._chunk_period, bs)
        slots = self._prefix.acquire(run.prompt[:usable])
        if slots.size:
            if self._hybrid:
                self._cache = self._ingest.place_history(self.backend, self.config, self._cache, run.slot,
                                                         self._pool.history(slots))
            else:
                self._cache = self._pool.into_row(self._cache, run.slot, slots)
            run.prefilled = run.cached_tokens = int(slots.size) * bs
        if self._hybrid:  # the whole blocks the cache could take: read as they are prefilled
            run.capture_from = run.staged_from = run.prefilled
            run.capture_to = min(len(run.prompt) // bs, self._pool.capacity) * bs

    def _prefill_and_decode(self) -> tuple[list[tuple[str, int]], list[str]]:
        """Up to step_token_budget prompt tokens of the prefilling requests (in prefill_order;
        decoding_step_token_budget when the step begins with requests decoding), in calls of [R, W]
        (`_take`; see the module docstring), and one token for every request past its prefill:
        packed into the first prefill call when the backend `packs_decode`, else one [slots, 1]
        call after the prefill.
        decoding_budget_max_backlog, when set, keeps the smaller budget to steps whose prompt backlog is
        within it.
        Returns ((request_id, prompt tokens) per request that prefilled, decoded request_ids)."""
        decoding_now = self._decoding()
        # the running requests wait for this step: keep it within its budget
        strict = self._decoding_budget_applies(decoding_now)
        budget = self.decoding_step_token_budget if strict else self.step_token_budget
        self._step_budget = budget
        done, first_call, draws = collections.Counter(), True, []
        packs = self.backend.packs_decode
        decoding = decoding_now if packs else []  # decided before the prefill: they ride in it
        packed, unpacked = decoding, False
        if self.prefill_order == "shortest":
            def first(run):
                return len(run.prompt) - run.prefilled, run.order
        else:
            def first(run):
                return run.order
        while budget > 0:
            runs = sorted((r for r in self._rows if r is not None and r.state is _State.PREFILL
                           and not r.cancel_requested), key=first)
            if not runs:
                break
            taken, size = self._take(runs, budget, strict, first_call)
            if not taken:  # a strict budget's rest is less than a chunk
                break
            first_call = False
            budget -= self._call_cost(taken)
            rode, call_draws = self._prefill_call(taken, size, done, packed)
            draws.append(call_draws)
            unpacked = not rode and bool(packed)
            packed = []  # the decode tokens ride with the first call only
        for call_draws in draws:  # read once every prefill call is dispatched (`_Draws`)
            self._accept_draws(call_draws)
        if not packs:  # a request whose prefill just ended decodes in this step too
            decoding = self._decoding()
        if decoding and (not (packs and done) or unpacked):  # (packs: they rode in the first call)
            self._decode_call(decoding)
        return list(done.items()), [run.request_id for run in decoding]

    def _decoding_budget_applies(self, decoding_now: list[_Run]) -> bool:
        """Whether this step takes decoding_step_token_budget: it is set, the step begins with
        requests decoding, and (decoding_budget_max_backlog set) the prompt backlog is within it."""
        if self.decoding_step_token_budget is None or not decoding_now:
            return False
        return (self.decoding_budget_max_backlog is None
                or self._prompt_backlog() <= self.decoding_budget_max_backlog)

    def _prompt_backlog(self) -> int:
        """Prompt tokens not yet prefilled: the admitted requests' rest and the waiting requests'
        whole prompts (a prefix-cache hit, found at admission, is not subtracted)."""
        with self._cond:
            waiting = sum(len(run.prompt) for run in self._waiting if not run.cancel_requested)
        return waiting + sum(len(r.prompt) - r.prefilled for r in self._rows
                             if r is not None and r.state is _State.PREFILL and not r.cancel_requested)

    def _call_cost(self, taken: list[tuple[_Run, int]]) -> int:
        """What a prefill call of `taken` spends of the step's budget: its prompt tokens when the
        backend `prefills_rows`; else the [slots, prefill_chunk] positions it computes whichever rows
        carry tokens (a step of such a backend makes ceil(budget / (slots x prefill_chunk)) calls)."""
        if self.backend.prefills_rows:
            return sum(n for _, n in taken)
        return self.slots * self.prefill_chunk

    def _call_width(self, rows: int) -> int:
        """Tokens per row of a prefill call over `rows` rows (a backend that `prefills_rows`): the
        step's budget split over them, at most prefill_chunk ([1, budget] alone, [4, budget / 4]...);
        prefill_chunk whatever the rows for a `chunk_dependent` backend."""
        if self.backend.chunk_dependent:
            return self.prefill_chunk
        return max(1, min(self.prefill_chunk, self.step_token_budget // rows))

    def _take(self, runs: list[_Run], budget: int, strict: bool = False,
              first_call: bool = True) -> tuple[list[tuple[_Run, int]], int]:
        """The next prefill call from `runs` (in prefill order) within `budget` tokens: ((request,
        prompt tokens) each, the call's row count R). A backend that `prefills_rows` gets the row
        count R (a power of two) that gives the first request the most tokens, then the call the most
        (one shape per R: [R, _call_width(R)]; a `chunk_dependent` backend's requests each take a
        whole chunk, the budget cutting none, unless `strict`: then whole chunks within the budget,
        one at least in a step's first call, none when less than a chunk is left in a later one);
        any other backend [slots, prefill_chunk] calls, each
        taking up to prefill_chunk tokens of every prefilling request: such a call computes all its
        rows whether they carry tokens or not (`_call_cost`), so a row left empty saves nothing (a
        [4, 256] call carrying two rows prefilled at half a fixed batch's rate)."""
        def greedy(width, rows, left):
            taken = []
            for run in runs[:rows]:
                n = min(width, len(run.prompt) - run.prefilled, left)
                if n <= 0:
                    break
                left -= n
                taken.append((run, n))
            return taken

        if not self.backend.prefills_rows:
            return greedy(self.prefill_chunk, self.slots, self.slots * self.prefill_chunk), self.slots
        best = None
        for rows in self._row_counts():
            width = self._call_width(rows)
            if not self.backend.chunk_dependent:
                taken = greedy(width, rows, budget)
            else:  # whole chunks: each row taking part gets one (or its prompt's last tokens)
                carrying = min(rows, max(budget // width, int(first_call))) if strict else rows
                taken = greedy(width, carrying, carrying * width)
            if not taken:
                continue
            score = (taken[0][1], sum(n for _, n in taken))
            if best is None or score > best[0]:
                best = (score, taken, rows)
        return ([], 0) if best is None else (best[1], best[2])

    def _row_counts(self) -> list[int]:
        """The row counts of prefill calls (backends that `prefills_rows`): powers of two below
        slots, and slots."""
        return sorted({self._call_rows(n) for n in range(1, self.slots + 1)})

    def _call_rows(self, prefilling: int) -> int:
        """The row count of a prefill call over `prefilling` (>= 1) requests: the next power of two,
        at most slots."""
        return min(self.slots, 1 << (prefilling - 1).bit_length())

    def call_widths(self) -> dict[int, int]:
        """{row count R: tokens per row} of this engine's prefill calls over R rows ([R, W] each,
        `_call_width`); {} for a backend that does not `prefills_rows` (its [slots, prefill_chunk]
        calls are one shape)."""
        if not self.backend.prefills_rows:
            return {}
        return {rows: self._call_width(rows) for rows in self._row_counts()}

    def packed_row_counts(self) -> list[int]:
        """The row counts a packed call (prefill chunks and decode tokens in one call) can have; []
        when the backend does not pack. Decode tokens ride only in a step that begins with
        requests decoding; with decoding_step_token_budget always applying then (no
        decoding_budget_max_backlog) a `chunk_dependent` backend's packed call carries whole chunks
        within that budget (`_take`, strict): max(budget // prefill_chunk, 1) requests, in the
        fewest rows that hold them. Else any row count a call of at most slots - 1 prefilling
        requests (one slot decodes) can have: none with one slot, 1 and 2 with 3 slots (not 3: two
        prefilling rows take the 2-row call)."""
        if not self.backend.packs_decode:
            return []
        beside = self.slots - 1  # the most requests prefilling beside a decoding one
        counts = [rows for rows in self._row_counts() if beside >= 1 and rows <= self._call_rows(beside)]
        if (not counts or self.decoding_step_token_budget is None or self.decoding_budget_max_backlog is not None
                or not self.backend.chunk_dependent):
            return counts
        carrying = max(self.decoding_step_token_budget // self.prefill_chunk, 1)
        fewest = min((r for r in counts if r >= min(carrying, self.slots)), default=counts[-1])
        return [rows for rows in counts if rows <= fewest]

    def _decoding(self) -> list[_Run]:
        """The requests past their prefill, in slot order: each gets one token this step."""
        return [r for r in self._rows if r is not None and r.state is _State.DECODE and not r.cancel_requested]

    def _prefill_call(self, taken: list[tuple[_Run, int]], size: int, done: collections.Counter,
                      packed: list[_Run]) -> tuple[bool, _Draws]:
        """One prefill call of `taken` ((request, prompt tokens) each) over `size` rows (`_take`), with
        the decode tokens of `packed` (the backend packs_decode) in the same call when the backend
        `can_pack` these chunks (an offloading mode whose chunk attends to its offloaded prompt on
        the host cannot: the step then decodes in a call of its own, logged once); their tokens
        sampled (drawn on the device, read and accepted by the caller once the step's last prefill call
        is dispatched: `_accept_draws`). Returns (whether the decode tokens rode in the call, its draws)."""
        whole = size == self.slots and not packed  # a call of every row runs over the whole batch
        if self.backend.prefills_rows and not whole:  # only the rows taking part (+ idle ones as padding)
            width = self._call_width(size)
            busy = {run.slot for run, _ in taken}
            idle = [slot for slot in range(self.slots) if slot not in busy]
            rows = np.array([run.slot for run, _ in taken] + idle[:size - len(taken)], np.int32)
        else:
            width = self._call_width(size) if self.backend.prefills_rows else self.prefill_chunk
            rows = np.arange(self.slots, dtype=np.int32)
        index = {int(slot): i for i, slot in enumerate(rows)}
        batch_positions = np.full((self.slots, width), -1, np.int32)  # before_step's contract
        tokens = np.zeros((len(rows), width), np.int32)
        for run, n in taken:
            tokens[index[run.slot], :n] = run.prompt[run.prefilled:run.prefilled + n]
            batch_positions[run.slot, :n] = np.arange(run.prefilled, run.prefilled + n)
        positions = batch_positions[rows]
        if packed and not self.backend.can_pack(batch_positions):
            if not self._logged_unpacked:
                self._logged_unpacked = True
                log.info("a step's prefill chunks cannot carry the decode tokens (backend %s: its chunks "
                         "attend to their offloaded prompt on the host); such steps decode in a call of "
                         "their own", self.backend.name)
            packed = []
        decode_tokens, decode_positions = self._decode_inputs(packed)
        self._before_step(batch_positions, decode_positions if packed else None)
        with self._timed("call_seconds"):
            if packed:
                (logits, decode_logits), self._cache = self._run(
                    "packed", self._packed_fn, (6,), self.params, tokens, positions, rows, decode_tokens,
                    decode_positions, self._cache)
            elif not whole:
                logits, self._cache = self._run("prefill_rows", self._prefill_rows_fn, (4,), self.params, tokens,
                                                positions, rows, self._cache)
            else:
                logits, self._cache = self._run("prefill", self._prefill_fn, (3,), self.params, tokens,
                                                positions, self._cache)
        self._after_dispatch()
        self._submit_stores()  # the earlier calls' captures, while this call runs
        # A chunk's token is drawn only when it ends its prompt: other calls are not waited for, so
        # the next call's host work (its before_step) overlaps this one on the device. The draws come
        # before any token of this call is accepted (`_row_sampling`: each row at its next token).
        draws = _Draws()
        with self._timed("call_seconds"):
            if packed:
                draws.decoded, draws.decoding = _sample(decode_logits, self._row_sampling()), packed
            if any(run.prefilled + n == len(run.prompt) for run, n in taken):
                chunk_sampling = jax.tree_util.tree_map(lambda x: x[rows], self._row_sampling())
                draws.first = _sample(logits, chunk_sampling)
        with self._cond:
            self._counts.prefill_calls += 1
            self._counts.prefill_tokens += sum(n for _, n in taken)
            self._counts.decode_steps += bool(packed)
        if self._hybrid:
            self._capture_call(taken)  # from each run's prefilled, before it advances
        for run, n in taken:
            run.prefilled += n
            done[run.request_id] += n
            if run.prefilled == len(run.prompt):
                self._store_prefix(run)
                run.state = _State.DECODE
                draws.prompts_done.append((run, index[run.slot]))
        return bool(packed), draws

    def _accept_draws(self, draws: _Draws) -> None:
        """A prefill call's drawn tokens read (waiting for the call) and accepted: the decode tokens
        that rode in it, then the first token of each prompt it ended."""
        with self._timed("call_seconds"):
            decoded = None if draws.decoded is None else np.asarray(draws.decoded)
            first = None if draws.first is None else np.asarray(draws.first)
        for run in draws.decoding:
            self._accept(run, int(decoded[run.slot]))
        for run, row in draws.prompts_done:
            self._accept(run, int(first[row]))

    def _decode_inputs(self, runs: list[_Run]) -> tuple[np.ndarray, np.ndarray]:
        """Each slot's decode token and position ([slots] int32; position -1 for a slot not in `runs`)."""
        tokens = np.zeros(self.slots, np.int32)
        positions = np.full(self.slots, -1, np.int32)
        for run in runs:
            tokens[run.slot] = run.tokens[-1]
            positions[run.slot] = len(run.prompt) + len(run.tokens) - 1
        return tokens, positions

    def _decode_call(self, runs: list[_Run]) -> None:
        """One token for each of `runs` (one [slots, 1] call)."""
        tokens, positions = self._decode_inputs(runs)
        self._before_step(positions[:, None])
        with self._timed("call_seconds"):
            logits, self._cache = self._run("decode", self._decode_fn, (3,), self.params, tokens, positions,
                                            self._cache)
        self._after_dispatch()
        self._submit_stores()
        with self._timed("call_seconds"):
            sampled = np.asarray(_sample(logits, self._row_sampling()))
        with self._cond:
            self._counts.decode_steps += 1
        for run in runs:
            self._accept(run, int(sampled[run.slot]))

    def _row_sampling(self) -> RowSampling:
        """The rows' sampling parameters, each row at its request's next token index."""
        index = np.array([len(r.tokens) if r is not None else 0 for r in self._rows], np.int32)
        return self._sampling.replace(index=index)

    def _capture_call(self, taken: list[tuple[_Run, int]]) -> None:
        """Stages the K, V of the prompt tokens the last prefill call wrote ((request, n tokens from
        its run.prefilled) each, before prefilled advances) that the prefix cache may take, read from
        the device windows in ONE dispatch for the whole call (`ingest.start_read_rows`: a launch per
        request and call queued behind the device work cost ~0.9 s of a 14 s load on the H200). Every
        run is stored after the next call's dispatch (`_submit_stores`)."""
        captures = []  # (run, lo, hi): the positions [lo, hi) of its row to read
        for run, n in taken:
            lo, hi = max(run.prefilled, run.capture_from), min(run.prefilled + n, run.capture_to)
            if hi > lo:
                captures.append((run, lo, hi))
            self._unstored.append(run)
        if not captures:
            return
        with self._timed("capture_seconds"):
            reads = self._ingest.start_read_rows(self.backend, self._cache, [run.slot for run, _, _ in captures],
                                                 [lo for _, lo, _ in captures],
                                                 [hi - lo for _, lo, hi in captures], self.prefill_chunk)
        for (run, _, _), read in zip(captures, reads):
            run.captured.append(read)

    def _precompile_captures(self) -> None:
        """The capture reads (`_capture_call`) of each padded row count a call can use (1, 2, 4, ...
        up to slots; `ingest.read_rows_padded`) compiled on the current cache (a read changes
        nothing; its result is dropped), so that no timed request compiles one."""
        if not self._hybrid:
            return
        padded = sorted({self._ingest.read_rows_padded(n, self.slots) for n in range(1, self.slots + 1)})
        for rows in padded:
            self._ingest.start_read_rows(self.backend, self._cache, list(range(rows)), [0] * rows, [1] * rows,
                                         self.prefill_chunk)

    def _submit_stores(self) -> None:
        """The captures of the prefill calls so far, handed to the store worker (`_store_job`):
        called after a call's dispatch (the device runs it meanwhile, and the worker's copies overlap
        the engine thread's next host work), before a request is admitted (then joined: its prefix
        lookup sees every block prefilled before it) and when the engine runs out of work."""
        unstored, self._unstored = self._unstored, []
        jobs = []
        for run in dict.fromkeys(unstored):  # each once, in order
            jobs.append((run, run.captured))
            run.captured = []
        if not jobs:
            return
        if self._store_worker is None:
            self._store_worker = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                                       thread_name_prefix=STORE_THREAD_NAME)
        self._stores.append(self._store_worker.submit(self._store_job, jobs))

    def _store_job(self, jobs: list[tuple[_Run, list]]) -> None:
        """On the store worker: each request's reads waited for and their whole blocks stored."""
        start = time.perf_counter()
        try:
            for run, reads in jobs:
                if run.capture_to == 0:  # storing it stopped (`_store_staged`)
                    continue
                run.staged.extend(read() for read in reads)
                self._store_staged(run)
        finally:
            self.store_seconds += time.perf_counter() - start

    def _join_stores(self, keep: int = 0) -> None:
        """Waits for the store jobs submitted so far, oldest first, until at most `keep` are still
        running (timed into the step's prefix_seconds): with keep=0, for every one (then the engine
        thread may touch the prefix cache). The first finished job's error is raised here, on the
        stepping thread (the step fails with it)."""
        running = [future for future in self._stores if not future.done()]
        if len(running) > keep:
            with self._in_prefix_cache():
                concurrent.futures.wait(running[:len(running) - keep])
        done = [future.done() for future in self._stores]  # read once: a job may end meanwhile
        finished = [future for future, d in zip(self._stores, done) if d]
        self._stores = [future for future, d in zip(self._stores, done) if not d]
        for future in finished:
            future.result()

    def _store_staged(self, run: _Run) -> None:
        """The whole blocks staged so far into the prefix cache (an offloading backend, after each
        prefill call): a prompt's KV enters the cache a call's tokens at a time, not all at once when
        its prefill ends (a 16K prompt of the 32-layer Llama-3-8B shape is 2 GiB: one 2 s step).
        Stops capturing the request when the cache no longer holds every block before the staged
        ones (evicted meanwhile) or did not take all of them (a full tier, a hash collision): the
        blocks after a gap could never be matched."""
        if self._prefix is None or not run.staged:
            return
        bs = self._prefix.block_size
        kv = run.staged[0] if len(run.staged) == 1 else np.concatenate(run.staged, axis=2)
        whole, first = kv.shape[2] // bs, run.staged_from // bs
        if whole == 0:
            run.staged = [kv]
            return
        upto = run.staged_from + whole * bs
        if len(self._prefix.match(run.prompt[:run.staged_from])) < first:
            stored = False
        else:
            def write(numbers: np.ndarray, slots: np.ndarray) -> None:
                if numbers.min(initial=first) < first:  # the match above rules it out
                    raise RuntimeError(f"prefix cache: block {numbers.min()} asked of a request whose "
                                       f"staged KV starts at block {first}")
                self._pool.write_history(slots, kv, numbers - first)

            self._prefix.insert(run.prompt[:upto], write)
            stored = len(self._prefix.match(run.prompt[:upto])) == upto // bs
        if not stored:
            run.staged, run.capture_to = [], 0
            return
        run.staged = [kv[:, :, whole * bs:]] if kv.shape[2] > whole * bs else []
        run.staged_from = upto

    def _store_prefix(self, run: _Run) -> None:
        """A finished prefill's prompt blocks into the prefix cache: full attention, copied from its
        row over the next steps; an offloading backend stored them as they were prefilled
        (`_store_staged`)."""
        if self._prefix is None or self._hybrid:
            return
        run.prefix_blocks_stored = 0  # inserted over the next steps (_insert_pending)
        self._inserting.append(run)

    def _insert_pending(self, run: _Run | None = None) -> None:
        """Finished prompts' blocks into the prefix cache (full attention): PREFIX_INSERT_BLOCKS_PER_STEP
        of them, oldest prompt first, copied from their rows (whose prompt KV stays as it is while the
        request decodes); with `run`, all of that request's that are left (its row is about to be reset)."""
        if self._prefix is None:
            return
        budget = PREFIX_INSERT_BLOCKS_PER_STEP
        bs = self._prefix.block_size
        for pending in ([run] if run is not None else list(self._inserting)):
            if pending.prefix_blocks_stored is None or (run is None and budget <= 0):
                continue
            whole = len(pending.prompt) // bs
            upto = whole if run is not None else min(whole, pending.prefix_blocks_stored + budget)
            budget -= upto - pending.prefix_blocks_stored

            def copy(block_numbers: np.ndarray, slots: np.ndarray, slot=pending.slot) -> None:
                self._pool.from_row(self._cache, slot, block_numbers, slots)

            with self._in_prefix_cache():
                self._prefix.insert(pending.prompt[:upto * bs], copy)
            pending.prefix_blocks_stored = upto
            if upto == whole:
                pending.prefix_blocks_stored = None
                self._inserting.remove(pending)

    def _accept(self, run: _Run, token: int) -> None:
        """A sampled token of a request: stop, or emit (and end at max_tokens)."""
        if token in run.stop:
            self._finish(run, FinishReason.STOP)
            return
        run.tokens.append(token)
        run.token_times.append(time.perf_counter() - run.submitted)
        with self._cond:
            self._counts.generated_tokens += 1
        if run.on_token is not None:
            try:
                run.on_token(token, len(run.tokens) - 1)
            except Exception:
                log.exception("on_token of request %r raised (ignored)", run.request_id)
        if len(run.tokens) >= run.request.max_tokens:
            self._finish(run, FinishReason.LENGTH)

    def _finish(self, run: _Run, reason: FinishReason, error: str | None = None) -> None:
        """Ends a request: its slot is released (reset at the step's end), its output set, on_finish called.
        Its prompt's blocks not yet in the prefix cache go in first (unless it ended with an error)."""
        flush = False
        with self._cond:
            if run.state is _State.DONE:
                return
            if run.state is _State.WAITING:
                self._waiting.remove(run)
            elif run.slot >= 0:
                self._rows[run.slot] = None
                self._to_reset.append(run.slot)
                flush = run.prefix_blocks_stored is not None and reason is not FinishReason.ERROR
            run.state = _State.DONE
            if run.prefix_blocks_stored is not None and not flush:
                run.prefix_blocks_stored = None
                self._inserting.remove(run)
            if reason is FinishReason.CANCELLED:
                self._counts.cancelled += 1
            elif reason is FinishReason.ERROR:
                self._counts.errors += 1
            else:
                self._counts.finished += 1
            run._output = RequestOutput(
                request_id=run.request_id, tokens=list(run.tokens), finish_reason=reason,
                prompt_tokens=len(run.prompt), cached_tokens=run.cached_tokens,
                ttft=run.token_times[0] if run.token_times else None, token_times=list(run.token_times),
                error=error, queued=run.queued)
            self._cond.notify_all()
        if flush:  # before the output is visible: a request sent after it hits the whole prompt
            try:
                self._insert_pending(run)
            except Exception:  # the request's output stands; only its prompt is not cached
                log.exception("inserting the prompt of request %r into the prefix cache failed; not cached",
                              run.request_id)
                if run.prefix_blocks_stored is not None:  # never read from its row once it is reused
                    run.prefix_blocks_stored = None
                    self._inserting.remove(run)
        try:
            if run.on_finish is not None:
                run.on_finish(run._output)
        except Exception:
            log.exception("on_finish of request %r raised (ignored)", run.request_id)
        finally:
            run._event.set()

    def _reset_released_rows(self) -> None:
        with self._cond:
            rows, self._to_reset = sorted(self._to_reset), []
        if rows:
            self._cache = self.backend.reset_rows(self._cache, np.asarray(rows, np.int64))

    def _fail(self, error: BaseException) -> None:
        """A step raised: every request ends with ERROR and the message; no new requests."""
        message = f"{type(error).__name__}: {error}"
        log.error("serving engine step failed; ending every request: %s", message, exc_info=error)
        with self._cond:
            self._error = message
            runs = [r for r in self._rows if r is not None] + list(self._waiting)
        for run in runs:
            self._finish(run, FinishReason.ERROR, message)

    # ---- compiled pieces (pure functions of params, tokens and cache) -------------------------------

    def _prefill_fn(self, params, tokens, positions, cache):
        """[slots, C] prompt tokens -> (each row's logits at its last valid position [slots, V] float32, cache)."""
        model = nnx.merge(self.graphdef, params)
        hidden, cache, _ = model.hidden_states(tokens, positions, cache, self.backend)
        return _last_logits(model, hidden, positions), cache

    def _prefill_rows_fn(self, params, tokens, positions, rows, cache):
        """[R, C] prompt tokens of batch rows `rows` [R] (distinct) -> (each one's logits at its last
        valid position [R, V] float32, cache): the other rows' KV and lengths are untouched."""
        model = nnx.merge(self.graphdef, params)
        selected = KVCache(layers=cache.layers, lengths=cache.lengths[rows], meta=self.backend.rows_meta(cache.meta, rows))
        hidden, selected, _ = model.hidden_states(tokens, positions, selected, self.backend)
        cache = KVCache(layers=selected.layers, lengths=cache.lengths.at[rows].set(selected.lengths), meta=cache.meta)
        return _last_logits(model, hidden, positions), cache

    def _packed_fn(self, params, tokens, positions, rows, decode_tokens, decode_positions, cache):
        """_prefill_rows_fn's [R, C] chunks of batch rows `rows` and _decode_fn's [slots] decode
        tokens in one call (PackedRows: the weights are read once for both) -> ((the chunks' rows'
        logits at their last valid positions [R, V], the decode logits [slots, V], float32), cache)."""
        model = nnx.merge(self.graphdef, params)
        prefill_lengths = jnp.maximum(cache.lengths[rows], jnp.max(positions, axis=1) + 1)
        # every row's length after the step (a chunk's row, at -1 among the decode tokens, with its chunk)
        decode_lengths = jnp.maximum(cache.lengths.at[rows].max(prefill_lengths), decode_positions + 1)
        meta = PackedRows(rows=rows, prefill_lengths=prefill_lengths, decode_lengths=decode_lengths, step=cache.meta)
        packed = KVCache(layers=cache.layers, lengths=cache.lengths[:1], meta=meta)  # lengths: not read
        hidden, packed, _ = model.hidden_states(pack_rows(tokens, decode_tokens), pack_rows(positions, decode_positions),
                                                packed, self.backend)
        hidden_chunks, hidden_decode = meta.split(hidden)
        lengths = decode_lengths
        decode_logits = model.logits(hidden_decode[:, 0]).astype(jnp.float32)
        return (_last_logits(model, hidden_chunks, positions), decode_logits), \
            KVCache(layers=packed.layers, lengths=lengths, meta=cache.meta)

    def _decode_fn(self, params, tokens, positions, cache):
        """tokens, positions [slots] -> (next-token logits [slots, V] float32, cache)."""
        model = nnx.merge(self.graphdef, params)
        logits, cache = model(tokens[:, None], positions[:, None], cache, self.backend)
        return logits[:, 0].astype(jnp.float32), cache

    def _run(self, name: str, fn, donate: tuple, *args: Any):
        """fn compiled ahead of time once per shapes (`_executable`) and run on args (a first run of
        the executable in this process counted: `StepTimes.first_runs`)."""
        executable = self._executable(name, fn, donate, *args)
        with _executables_lock:
            first = executable not in _executables_run
            if first:
                _executables_run.add(executable)
        if first:
            self._times.first_runs += 1
            with self._cond:
                self._counts.first_runs += 1
        start = time.perf_counter()
        try:
            return executable(*args)
        finally:
            self._times.launch_seconds += time.perf_counter() - start

    def _executable(self, name: str, fn, donate: tuple, *args: Any):
        """fn compiled ahead of time for these arguments' shapes (`Generator._run`), shared with other
        engines of the same model structure and parameter shapes on the same backend object (the
        compiled code's inputs besides the arguments: fn merges self.graphdef and calls self.backend).
        The object, not an equal one: an offloading backend's compiled host calls reach its own runtime."""
        key = self._executable_key(name, args)
        executable = self._kept_executable(key)
        if executable is None:
            executable = self._compiled(name, key, args, self._lowered(fn, donate, args))
        return executable

    def _executable_key(self, name: str, args: tuple) -> tuple:
        """What a compiled step depends on besides the parameters: its name, the model structure, the
        backend object, the compile options and the other arguments' tree, shapes and dtypes."""
        varying = [a for a in args if a is not self.params]
        leaves, treedef = jax.tree_util.tree_flatten(varying)
        # (the dtype objects themselves: str() of 500 dtypes took ~3 ms of every 32-layer call's dispatch)
        return ((name, self._structure_id, id(self.backend), self._options_key, treedef)
                + tuple([(a.shape, a.dtype) for a in leaves]))

    def _kept_executable(self, key: tuple):
        """The shared executable of `key` (marked the latest used), or None."""
        with _executables_lock:
            backend, executable = _executables.get(key, (None, None))
            if backend is not self.backend:  # an id reused by a newer object
                return None
            _executables.move_to_end(key)
        return executable

    @staticmethod
    def _lowered(fn, donate: tuple, args: tuple) -> tuple[jax.stages.Lowered, float]:
        """fn traced and lowered for args (Python: holds the GIL) -> (lowered, seconds it took)."""
        start = time.perf_counter()
        lowered = jax.jit(fn, donate_argnums=donate).lower(*args)
        return lowered, time.perf_counter() - start

    def _compiled(self, name: str, key: tuple, args: tuple, lowering: tuple[jax.stages.Lowered, float]):
        """`lowering` (`_lowered`) compiled by XLA (which releases the GIL: compile_steps runs several at
        once) and kept under `key`. The log line gives the tracing and the compile apart: JAX's
        persistent compilation cache saves the compile only."""
        lowered, lowered_seconds = lowering
        start = time.perf_counter()
        executable = lowered.compile(compiler_options=self._compiler_options or None)
        seconds = time.perf_counter() - start
        log.info("compiled the %s step in %.1f s, after %.1f s tracing it (its 4-D inputs: %s)", name, seconds,
                 lowered_seconds,
                 sorted({tuple(a.shape) for a in jax.tree_util.tree_leaves([a for a in args if a is not self.params])
                         if getattr(a, "ndim", 0) == 4}))
        with self._cond:
            self._counts.compiles += 1
            self.compile_seconds += seconds
        with _executables_lock:
            _executables[key] = (self.backend, executable)  # the backend kept alive: its id stays its own
            while len(_executables) > _kept_executables:
                _executables.popitem(last=False)
        return executable

    def _step_shapes(self) -> list[tuple]:
        """Every step this engine can run, as `_executable`'s arguments (name, fn, donate, *args)."""
        chunk = self.prefill_chunk  # [slots, chunk] prefill
        decode = (np.zeros(self.slots, np.int32), np.full(self.slots, -1, np.int32))
        shapes = [("decode", self._decode_fn, (3,), self.params, *decode, self._cache)]
        packed_rows = self.packed_row_counts()
        for cache in self.backend.prefill_variants(self._cache):  # e.g. each size of prefill copies
            if not self.backend.prefills_rows:
                prefill = (np.zeros((self.slots, chunk), np.int32), np.full((self.slots, chunk), -1, np.int32))
                shapes.append(("prefill", self._prefill_fn, (3,), self.params, *prefill, cache))
                continue
            for size in self._row_counts():
                width = self._call_width(size)
                prefill = (np.zeros((size, width), np.int32), np.full((size, width), -1, np.int32),
                           np.arange(size, dtype=np.int32))
                if size == self.slots:  # a call of every row: the whole batch (`_prefill_call`)
                    shapes.append(("prefill", self._prefill_fn, (3,), self.params, *prefill[:2], cache))
                else:
                    shapes.append(("prefill_rows", self._prefill_rows_fn, (4,), self.params, *prefill, cache))
                packed = self.backend.packed_variant(cache) if size in packed_rows else None
                if packed is not None:
                    shapes.append(("packed", self._packed_fn, (6,), self.params, *prefill, *decode, packed))
        return shapes

    def unrun_steps(self) -> list[str]:
        """The step shapes this engine can run (`compile_steps`'s) whose executable has not run in
        this process, each as "name [R, W]" (its tokens' shape) with the shapes of the device copies
        its cache carries beyond the open batch's ("+ [B, Hkv, P, D]", an offloading mode's prefill
        copies); [] when every one has run. After a warm-up (jhybrid.serving.warmup) these are the
        steps whose first run a request may still pay: on a GPU a first run loads the module and
        instantiates its CUDA graphs (`StepTimes.first_runs`). Some may be out of any request's
        reach (an offloading mode's host-path variant while its prefill copies are on the device, a
        copy size longer than max_len's prompts take): the list is of compiled shapes, not of
        reachable ones. Two variants without copies (the host path, a chunk inside the window)
        read alike."""
        with self._step_lock:
            shapes = self._step_shapes()
            base = {tuple(a.shape) for a in jax.tree_util.tree_leaves(self._cache) if getattr(a, "ndim", 0) == 4}
        unrun = []
        for name, _fn, _donate, *args in shapes:
            executable = self._kept_executable(self._executable_key(name, args))
            with _executables_lock:
                ran = executable is not None and executable in _executables_run
            if not ran:
                copies = sorted({tuple(a.shape) for a in jax.tree_util.tree_leaves(args[-1])
                                 if getattr(a, "ndim", 0) == 4} - base)
                unrun.append(f"{name} {list(np.shape(args[1]))}" + "".join(f" + {list(c)}" for c in copies))
        return unrun

    def compile_steps(self, workers: int | None = None) -> int:
        """Compiles every step shape this engine can run (decode; prefill of each row count, alone and
        packed with decode tokens, over each of the backend's `prefill_variants`, e.g. an offloading
        mode's prefill copies of each size), the token draw of each and the backend's host-side
        compiles (`precompile_host`), and with an offloading backend's prefix cache its capture reads
        (`_precompile_captures`), without running the steps, so that no request waits for a compile.
        The prefix cache's other copies compile on their first use. Returns how many steps were
        compiled now.

        workers: XLA compiles run at once (default: COMPILE_WORKERS, at most the host's cores, on an
        accelerator; 1 on the CPU backend, whose compiles already fill the cores: 2 workers took as
        long as 1 on the 2-core CI machine). Each shape is traced on this thread (Python) while the
        shapes traced before it compile on the workers (XLA releases the GIL): on a fresh H200,
        scout's 32-layer packed steps compiled for 30-40 s each one after the other; 4 at once, its
        24 shapes took 160-165 s (BENCHMARKS.md, row m3)."""
        global _kept_executables
        if workers is None:
            on_cpu = jax.default_backend() == "cpu"
            workers = 1 if on_cpu else max(1, min(COMPILE_WORKERS, os.cpu_count() or 1))
        elif not isinstance(workers, int) or workers < 1:
            raise ValueError(f"compile_steps workers={workers!r}; expected an int >= 1")
        with self._step_lock:
            before = self._counts.compiles
            shapes = self._step_shapes()
            with _executables_lock:  # every shape stays compiled, whatever other engines compile
                _kept_executables = max(_kept_executables, len(shapes) + SHARED_EXECUTABLES)
            with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="jhybrid-compile") as pool:
                compiles = []
                for name, fn, donate, *args in shapes:
                    key = self._executable_key(name, args)
                    if self._kept_executable(key) is None:
                        compiles.append(pool.submit(self._compiled, name, key, args,
                                                    self._lowered(fn, donate, args)))
                for compile_ in compiles:  # XLA's errors raised here; the pool waits for the rest
                    compile_.result()
            self.backend.precompile_host(self._cache)  # e.g. scout's recall scatters
            self._precompile_captures()
            sampling = self._row_sampling()
            for size in sorted(set(self._row_counts()) | {self.slots}):  # logits as a step leaves them
                logits = jax.device_put(np.zeros((size, self.config.vocab_size), np.float32),
                                        self._cache.lengths.sharding)
                _sample(logits, jax.tree_util.tree_map(lambda x: x[:size], sampling))
            return self._counts.compiles - before

    # ---- shutdown --------------------------------------------------------------------------------

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        if self._thread is not None and threading.current_thread() is self._thread:
            raise RuntimeError("close() from the engine's own thread (a callback) would wait for itself; "
                               "call it from another thread")
        with self._cond:
            if self._closed or self._closing:
                return
            self._closing = True
            self._cond.notify_all()
        deadline = None if timeout is None else time.monotonic() + timeout
        if drain:
            self._drain(deadline)
        with self._cond:
            self._stop = True
            for run in [r for r in self._rows if r is not None] + list(self._waiting):
                run.cancel_requested = True
            self._cond.notify_all()
        thread = self._thread
        if thread is not None:
            thread.join(JOIN_SECONDS)
            if thread.is_alive():
                log.error("the serving engine's thread did not end within %.0f s of close()", JOIN_SECONDS)
        locked = self._step_lock.acquire(timeout=JOIN_SECONDS)
        try:
            with self._cond:
                left = [r for r in self._rows if r is not None] + list(self._waiting)
            for run in left:
                self._finish(run, FinishReason.CANCELLED)
            self._closed = True
            self._stop_store_worker()
            if self._prefix is not None:
                self._prefix.close()
                self._prefix_stats = self._prefix.stats()
            self.backend.close()
        finally:
            if locked:
                self._step_lock.release()

    def _stop_store_worker(self) -> None:
        """Waits for the store jobs left by a failed step (their errors logged) and ends the worker."""
        stores, self._stores = self._stores, []
        for future in stores:
            try:
                future.result()
            except Exception:
                log.exception("a prefix-cache store job failed (its blocks are not cached)")
        if self._store_worker is not None:
            self._store_worker.shutdown(wait=True)
            self._store_worker = None

    def _drain(self, deadline: float | None) -> None:
        """Lets running and waiting requests finish (until the deadline): on the engine's thread
        when started, else by stepping here."""
        def remaining() -> float | None:
            return None if deadline is None else deadline - time.monotonic()

        if self._thread is not None:
            with self._cond:
                while self._busy() and self._error is None and self._thread.is_alive():
                    left = remaining()
                    if left is not None and left <= 0:
                        return
                    self._cond.wait(left)
            return
        while self._error is None and self._busy():
            left = remaining()
            if left is not None and left <= 0:
                return
            try:
                self.step()
            except Exception:
                return


__all__ = ["ServingEngine", "StepRecord", "StepTimes"]
