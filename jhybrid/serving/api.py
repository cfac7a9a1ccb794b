"""What the serving engine offers its callers (the HTTP server, tests, users' own loops).

One request = one prompt of token ids, how to sample it, when to stop. The engine runs requests in
a fixed number of slots (rows of one batch): a request joins when a slot frees and leaves when done.
Everything a caller sees of a running request goes through its `RequestHandle`; the engine's own
bookkeeping (slots, prefix cache, the step loop) lives in `jhybrid.serving.engine`.

Threading: `Engine.submit`, `RequestHandle.cancel` and `Engine.stats` may be called from any thread;
the step loop runs on the engine's own thread (`Engine.start`) or the caller's (`Engine.step`).
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from typing import Callable, Sequence

from jhybrid.generation import SamplingParams


class FinishReason(str, enum.Enum):
    """Why a request ended (the OpenAI `finish_reason` values, plus ours)."""

    STOP = "stop"            # a stop token was produced (not emitted)
    LENGTH = "length"        # max_tokens emitted, or the slot's capacity reached
    CANCELLED = "cancelled"  # RequestHandle.cancel() (a client that went away)
    ERROR = "error"          # the engine failed while running it (`RequestOutput.error` says why)


@dataclasses.dataclass(frozen=True)
class Request:
    """prompt: token ids (each in [0, vocab)); max_tokens >= 1 tokens are emitted at most;
    stop_tokens end the request without being emitted; request_id is the caller's name for it."""

    prompt: Sequence[int]
    max_tokens: int = 64
    sampling: SamplingParams = SamplingParams()
    stop_tokens: tuple[int, ...] = ()
    request_id: str = ""


@dataclasses.dataclass
class RequestOutput:
    """A finished request: the emitted tokens, why it ended, and its timings (seconds).

    cached_tokens: prompt tokens taken from the prefix cache (their prefill was skipped).
    ttft: submit -> first token; token_times: time of each emitted token since submit.
    queued: submit -> admission into a slot (None if it never got one).
    """

    request_id: str
    tokens: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int = 0
    ttft: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)
    error: str | None = None
    queued: float | None = None


class AdmissionError(ValueError):
    """The request can never run on this engine (prompt + max_tokens beyond a slot's capacity,
    more host or device memory than the engine has); the message names the value and the limit."""


class EngineClosed(RuntimeError):
    """submit() after close() (or while draining)."""


class RequestHandle(abc.ABC):
    """A submitted request as its caller sees it."""

    request_id: str

    @abc.abstractmethod
    def cancel(self) -> None:
        """Ends the request at the next step (finish reason CANCELLED); no-op once finished."""

    @abc.abstractmethod
    def result(self, timeout: float | None = None) -> RequestOutput:
        """Blocks until the request ends (TimeoutError after `timeout` seconds)."""

    @property
    @abc.abstractmethod
    def done(self) -> bool: ...


# on_token(token, index) is called from the engine thread for each emitted token (index 0, 1, ...);
# on_finish(output) once when the request ends. Both must return quickly (queue the work).
TokenCallback = Callable[[int, int], None]
FinishCallback = Callable[[RequestOutput], None]


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine (for /metrics and the serving benchmark)."""

    slots: int
    running: int
    waiting: int
    finished: int
    cancelled: int
    rejected: int
    decode_steps: int
    prefill_tokens: int
    generated_tokens: int
    prefix_hits: int
    prefix_misses: int
    prefix_hit_tokens: int
    prefix_bytes_device: int
    prefix_bytes_host: int
    prefix_bytes_disk: int
    # Added by the engine (defaults keep other Engines' constructors valid): requests ended with
    # ERROR (`finished` counts those that ended STOP / LENGTH), engine steps that ran a model call,
    # prefill calls, executables compiled (flat in the steady state) and executables run for the
    # first time in this process (flat once every shape has run: a first run loads its GPU module).
    errors: int = 0
    steps: int = 0
    prefix_hit_tokens_host: int = 0  # of prefix_hit_tokens, found in the host / disk tier
    prefix_hit_tokens_disk: int = 0
    prefill_calls: int = 0
    compiles: int = 0
    first_runs: int = 0
    prefix_spill_wait_seconds: float = 0.0  # steps' time waiting for the prefix cache's spills to the host
    prefix_disk_read_errors: int = 0  # disk-tier blocks that failed their checksum (dropped as misses)


class Engine(abc.ABC):
    """A running batch of `slots` sequences that requests join and leave."""

    @abc.abstractmethod
    def submit(self, request: Request, on_token: TokenCallback | None = None,
               on_finish: FinishCallback | None = None) -> RequestHandle:
        """Queues a request (AdmissionError if it can never fit; EngineClosed after close)."""

    @abc.abstractmethod
    def step(self) -> bool:
        """One iteration on the caller's thread: admit waiting requests into free slots, run one
        prefill chunk budget and one decode step; False when there was nothing to do."""

    @abc.abstractmethod
    def start(self) -> None:
        """Runs the step loop on a background thread until close()."""

    @abc.abstractmethod
    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stops accepting requests; drain=True lets running and queued requests finish (waiting
        at most `timeout` seconds), drain=False cancels them. Then releases the backend."""

    @abc.abstractmethod
    def stats(self) -> EngineStats: ...

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close(drain=exc_info[0] is None)
