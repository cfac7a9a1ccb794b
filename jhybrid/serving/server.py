"""An OpenAI-compatible HTTP server over a serving `Engine` (Starlette on uvicorn).

Endpoints: POST /v1/completions and /v1/chat/completions (JSON, or `stream: true` as server-sent
events in OpenAI's chunk format ending with `data: [DONE]`), GET /v1/models, /health and /metrics
(Prometheus text format: the engine's `EngineStats` and the server's request counters).

Text goes in and out through the model's tokenizer (`ServedModel`): prompts are encoded (chat
messages through the model's chat template first) and emitted tokens are detokenized incrementally,
never emitting half a multi-byte character. `stop` strings are checked on the detokenized text: the
output is cut before the first one, the engine request cancelled and the finish reason is "stop".

Errors are OpenAI's JSON shape `{"error": {"message", "type", "param", "code"}}`: 400 for bad JSON,
bad or unsupported parameters (naming the parameter) and prompts that do not fit (the engine's
`AdmissionError`), 404 for an unknown model, 503 while shutting down. A client that goes away (the
ASGI `http.disconnect`) cancels its engine request, streamed or not.

Threading: the engine calls `on_token` / `on_finish` on its own thread; they only hand the event to
the request's asyncio queue (`loop.call_soon_threadsafe`), everything else runs on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import random
import socket
import threading
import time
import uuid
from typing import Any, AsyncIterator, Callable, Sequence

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from jhybrid.generation import SamplingParams
from jhybrid.serving.api import (AdmissionError, Engine, EngineClosed, FinishReason, Request,
                                 RequestOutput)

log = logging.getLogger("jhybrid.serving")

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
MAX_STOP_STRINGS = 4            # as OpenAI


# ----------------------------------------------------------------------------- the model's text side


@dataclasses.dataclass
class ServedModel:
    """What the server needs of a model besides the engine: its name, text <-> token ids, the
    chat template and the stop tokens.

    encode(text) -> ids (with BOS where the model expects it); decode(ids) -> text (special tokens
    skipped); chat_prompt(messages) -> prompt text, or None when the model has no chat template;
    context: the model's context in tokens (the engine's slot capacity may be smaller)."""

    name: str
    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]
    vocab_size: int
    stop_token_ids: tuple[int, ...] = ()
    chat_prompt: Callable[[Sequence[dict]], str] | None = None
    context: int | None = None

    @classmethod
    def from_pretrained(cls, pretrained, name: str) -> "ServedModel":
        """A `jhybrid.loading.pretrained.Pretrained` (model + tokenizer + chat format)."""
        from jhybrid.loading import chat

        tokenizer = pretrained.tokenizer
        if tokenizer is None:
            raise ValueError(f"{pretrained.source} has no tokenizer; the server needs one")
        chat_prompt = None
        if pretrained.chat_format == "chatml":
            def chat_prompt(messages, default_system=pretrained.default_system):
                return chat.format_chatml(messages, default_system=default_system)
        config = pretrained.model.config
        return cls(name=name, encode=pretrained.encode,
                   decode=lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True),
                   vocab_size=config.vocab_size, stop_token_ids=tuple(pretrained.stop_token_ids),
                   chat_prompt=chat_prompt, context=config.max_position_embeddings)


class IncrementalDetokenizer:
    """Token ids in, text deltas out, never a partial character: each delta is the new text of a
    short decoded window (the previous delta's tokens as context + the new ones), held back while
    that window ends in U+FFFD (the rest of a multi-byte character is still to come). The deltas
    concatenate to decode(all tokens); `flush()` releases what is held at the end."""

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self.decode = decode
        self.tokens: list[int] = []
        self.prefix_offset = 0  # tokens[prefix_offset:read_offset] were emitted last (context)
        self.read_offset = 0    # tokens before this are emitted

    def add(self, token: int) -> str:
        self.tokens.append(int(token))
        return self._delta(final=False)

    def flush(self) -> str:
        return self._delta(final=True) if self.read_offset < len(self.tokens) else ""

    def _delta(self, final: bool) -> str:
        prefix = self.decode(self.tokens[self.prefix_offset:self.read_offset])
        text = self.decode(self.tokens[self.prefix_offset:])
        if len(text) <= len(prefix) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return text[len(prefix):]


class StopStrings:
    """Cuts streamed text before the first stop string. `feed(delta)` -> (text safe to emit, hit):
    text that could be the start of a stop string is held back until it is known not to be."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text = ""
        self.sent = 0
        self.hit = False

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.hit:
            return "", True
        self.text += delta
        if not self.stops:
            return self._emit(len(self.text)), False
        begin = max(0, self.sent - self.longest + 1)
        found = [p for p in (self.text.find(s, begin) for s in self.stops) if p >= 0]
        if found:
            cut = min(found)
            self.text = self.text[:cut]
            self.hit = True
            return self._emit(cut), True
        held = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.text) - self.sent), held, -1):
                if self.text.endswith(stop[:k]):
                    held = k
                    break
        return self._emit(len(self.text) - held), False

    def flush(self) -> str:
        return "" if self.hit else self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        out = self.text[self.sent:upto]
        self.sent = max(self.sent, upto)
        return out


# ----------------------------------------------------------------------------- errors and parameters


class APIError(Exception):
    """An error response in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code=code)


_MISSING = object()


def _int(body: dict, name: str, default, least: int | None = None, most: int | None = None):
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"{value!r} is not an integer", "invalid_type")
    if least is not None and value < least:
        raise _bad(name, f"{value} is less than the minimum of {least}")
    if most is not None and value > most:
        raise _bad(name, f"{value} is greater than the maximum of {most}")
    return value


def _number(body: dict, name: str, default: float, least: float, most: float, open_low: bool = False) -> float:
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(name, f"{value!r} is not a finite number", "invalid_type")
    if value < least or (open_low and value == least) or value > most:
        low = "(" if open_low else "["
        raise _bad(name, f"{value} is outside {low}{least:g}, {most:g}]")
    return float(value)


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(name, f"{value!r} is not a boolean", "invalid_type")
    return value


def _unsupported(body: dict, name: str, allowed: Callable[[Any], bool], what: str) -> None:
    """A parameter we do not implement: accepted only at its neutral value."""
    if name in body and body[name] is not None and not allowed(body[name]):
        raise APIError(400, f"{name}: not supported by this server ({what})", param=name,
                       code="unsupported_parameter")


# Parameters each endpoint reads; anything else is refused by name, as OpenAI does.
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
           "n", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "user"}
_COMPLETION_KEYS = _COMMON | {"prompt", "echo", "best_of", "suffix"}
_CHAT_KEYS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "functions",
                        "function_call", "parallel_tool_calls", "response_format", "metadata", "store"}


@dataclasses.dataclass
class _Params:
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool


def _common_params(body: dict, keys: set[str]) -> dict:
    unknown = sorted(set(body) - keys)
    if unknown:
        raise APIError(400, f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0],
                       code="unknown_parameter")
    _int(body, "n", 1, 1)
    _unsupported(body, "n", lambda v: v == 1, "only n=1")
    _number(body, "presence_penalty", 0.0, -2.0, 2.0)
    _unsupported(body, "presence_penalty", lambda v: v == 0, "only 0")
    _number(body, "frequency_penalty", 0.0, -2.0, 2.0)
    _unsupported(body, "frequency_penalty", lambda v: v == 0, "only 0")
    _unsupported(body, "logit_bias", lambda v: v == {}, "no logit bias")
    if "user" in body and body["user"] is not None and not isinstance(body["user"], str):
        raise _bad("user", f"{body['user']!r} is not a string", "invalid_type")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, open_low=True)
    top_k = _int(body, "top_k", 0, -1)
    seed = _int(body, "seed", None)
    if seed is None:
        seed = random.getrandbits(31)  # unseeded sampling differs between requests, as OpenAI's does
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise _bad("stop", f"{stop!r} is not a string or a list of strings", "invalid_type")
    if len(stop) > MAX_STOP_STRINGS:
        raise _bad("stop", f"{len(stop)} stop strings; at most {MAX_STOP_STRINGS}")
    if any(s == "" for s in stop):
        raise _bad("stop", "empty stop string")
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise _bad("stream_options", "only allowed with stream: true")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise _bad("stream_options", f"{options!r}; expected {{\"include_usage\": bool}}")
        include_usage = _bool(options, "include_usage", False)
    try:
        sampling = SamplingParams(temperature=temperature, top_k=max(top_k, 0), top_p=top_p, seed=seed % 2**31)
    except ValueError as error:  # pragma: no cover - the ranges above are stricter
        raise _bad("temperature", str(error))
    return dict(sampling=sampling, stop=stop, stream=stream, include_usage=include_usage)


def _completion_prompt(body: dict, model: ServedModel) -> list[int]:
    if "prompt" not in body or body["prompt"] is None:
        raise APIError(400, "prompt: required", param="prompt", code="missing_required_parameter")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        ids = model.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < model.vocab_size]
        if bad:
            raise _bad("prompt", f"token id {bad[0]} is outside the vocabulary [0, {model.vocab_size})")
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise _bad("prompt", f"a batch of {len(prompt)} prompts; this server takes one prompt per request")
    else:
        raise _bad("prompt", "expected a string, a list of token ids, or a list of one of those", "invalid_type")
    if not ids:
        raise _bad("prompt", "the prompt is empty")
    return ids


def _chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if messages is None:
        raise APIError(400, "messages: required", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "expected a non-empty list of messages", "invalid_type")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad(where, f"{message!r} is not an object", "invalid_type")
        role, content = message.get("role"), message.get("content")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant"):
            raise _bad(f"{where}.role", f"{role!r}; expected system, developer, user or assistant")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise _bad(f"{where}.content[{j}]", "only text content parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise _bad(f"{where}.content", f"{content!r} is not a string", "invalid_type")
        out.append({"role": role, "content": content})
    return out


# ----------------------------------------------------------------------------- one request


class _Run:
    """One engine request as the event loop sees it: tokens arrive on an asyncio queue, come out
    as (text delta, finish reason or None) pairs after detokenization and the stop-string check."""

    def __init__(self, server: "_ServerState", params: _Params, request_id: str, chat: bool):
        self.server, self.params, self.request_id, self.chat = server, params, request_id, chat
        self.queue: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.handle = None
        self.finished = False
        self.cancel_requested = False
        self.completion_tokens = 0
        self.cached_tokens: int | None = None
        self.finish_reason: str | None = None
        self.client_gone = False

    def _post(self, item) -> None:  # engine thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    async def submit(self) -> None:
        request = Request(prompt=self.params.prompt, max_tokens=self.params.max_tokens, sampling=self.params.sampling,
                          stop_tokens=self.server.model.stop_token_ids, request_id=self.request_id)
        engine = self.server.engine
        try:
            self.handle = await run_in_threadpool(
                engine.submit, request, lambda token, index: self._post(("token", token)),
                lambda output: self._post(("finish", output)))
        except AdmissionError as error:
            self.server.count("rejected")
            raise APIError(400, str(error), param="messages" if self.chat else "prompt",
                           code="context_length_exceeded") from None
        except EngineClosed as error:
            raise APIError(503, f"the engine takes no new requests: {error}", code="engine_closed") from None
        self.server.count("submitted")
        with self.server.lock:
            self.server.runs.add(self)
        if self.cancel_requested:
            self.handle.cancel()

    def cancel(self, client: bool = False) -> None:
        """Ends the engine request (no-op once finished)."""
        if self.finished:
            return
        if client and not self.client_gone:
            self.client_gone = True
            self.server.count("client_disconnects")
        self.cancel_requested = True
        if self.handle is not None:
            self.handle.cancel()

    async def events(self) -> AsyncIterator[tuple[str, str | None]]:
        detok = IncrementalDetokenizer(self.server.model.decode)
        stops = StopStrings(self.params.stop)
        try:
            while True:
                kind, value = await self.queue.get()
                if kind == "token":
                    self.completion_tokens += 1
                    text, hit = stops.feed(detok.add(value))
                    if hit:
                        self._finish("stop")
                        self.handle.cancel()  # the engine ends it at its next step
                        yield text, "stop"
                        return
                    if text:
                        yield text, None
                    continue
                output: RequestOutput = value
                self.cached_tokens = output.cached_tokens
                reason = output.finish_reason
                if reason == FinishReason.ERROR:
                    self._finish("error")
                    raise APIError(500, f"the engine failed while running the request: {output.error}",
                                   code="engine_error")
                text, hit = stops.feed(detok.flush())
                text += stops.flush()
                self._finish("stop" if hit or reason == FinishReason.STOP else
                             "length" if reason == FinishReason.LENGTH else "cancelled")
                yield text, self.finish_reason
                return
        finally:
            self.close()  # the consumer went away early (client disconnect, shutdown): cancel

    def close(self) -> None:
        """Cancels the engine request unless it finished; forgets the run."""
        self.cancel()
        with self.server.lock:
            self.server.runs.discard(self)

    def _finish(self, reason: str) -> None:
        self.finished, self.finish_reason = True, reason
        self.server.count(f"finish_{reason}")
        self.server.count_tokens(len(self.params.prompt), self.completion_tokens)

    def usage(self) -> dict:
        prompt = len(self.params.prompt)
        usage = {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                 "total_tokens": prompt + self.completion_tokens}
        if self.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage


async def _watch_disconnect(receive, run: _Run) -> None:
    """Cancels the run's engine request when the client goes away (ASGI http.disconnect)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            run.cancel(client=True)
            return


class _EventStream(StreamingResponse):
    """Server-sent events from an async iterator of `data:` payloads; a disconnect cancels the run."""

    def __init__(self, run: _Run, payloads: AsyncIterator[str]):
        super().__init__(payloads, media_type="text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        self.run, self.payloads = run, payloads

    async def __call__(self, scope, receive, send) -> None:
        watcher = asyncio.ensure_future(_watch_disconnect(receive, self.run))
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for payload in self.payloads:
                if self.run.client_gone:
                    break
                await send({"type": "http.response.body", "body": f"data: {payload}\n\n".encode(),
                            "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away while we were sending (ASGI >= 2.4 servers)
            self.run.cancel(client=True)
        finally:
            watcher.cancel()
            self.run.close()
            await self.payloads.aclose()


# ----------------------------------------------------------------------------- the application


class _ServerState:
    def __init__(self, engine: Engine, model: ServedModel, max_len: int | None, drain_timeout: float):
        self.engine, self.model, self.max_len = engine, model, max_len
        self.drain_timeout = drain_timeout
        self.draining = False
        self.engine_closed = False
        self.created = int(time.time())
        self.lock = threading.Lock()
        self.counters: dict[str, int] = {}
        self.http: dict[tuple[str, int], int] = {}
        self.in_flight = 0
        self.runs: set[_Run] = set()
        self.drain_timer: threading.Timer | None = None

    def begin_drain(self) -> None:
        """New requests get 503 from now on; running ones get drain_timeout seconds to finish, then
        their engine requests are cancelled (their streams end with finish_reason "cancelled")."""
        with self.lock:
            if self.draining:
                return
            self.draining = True
            self.drain_timer = threading.Timer(self.drain_timeout, self.cancel_all)
            self.drain_timer.daemon = True
            self.drain_timer.start()

    def cancel_all(self) -> None:
        with self.lock:
            runs = list(self.runs)
        for run in runs:
            if run.handle is not None and not run.finished:
                run.handle.cancel()  # thread-safe (Engine API); the run ends through on_finish

    def count(self, name: str, amount: int = 1) -> None:
        with self.lock:
            self.counters[name] = self.counters.get(name, 0) + amount

    def count_tokens(self, prompt: int, completion: int) -> None:
        self.count("prompt_tokens", prompt)
        self.count("completion_tokens", completion)

    def close_engine(self, drain: bool = True) -> None:
        """Stops accepting, lets running requests finish for at most drain_timeout s (drain=False:
        not at all), then cancels the rest and releases the backend (once)."""
        self.begin_drain()
        with self.lock:
            if self.engine_closed:
                return
            self.engine_closed = True
        try:
            self.engine.close(drain=drain, timeout=self.drain_timeout if drain else 0.0)
        finally:
            if self.drain_timer is not None:
                self.drain_timer.cancel()


def _now() -> int:
    return int(time.time())


class ServingApp:
    """The ASGI application (Starlette) around one engine and one model; `app.state` is this."""

    def __init__(self, engine: Engine, model: ServedModel, max_len: int | None = None,
                 drain_timeout: float = 30.0, start_engine: bool = True):
        self.state = _ServerState(engine, model, max_len or model.context, drain_timeout)
        self.start_engine = start_engine
        routes = [Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
                  Route("/health", self.health, methods=["GET"]),
                  Route("/metrics", self.metrics, methods=["GET"])]
        self.paths = {route.path for route in routes}
        self.starlette = Starlette(routes=routes, lifespan=self._lifespan,
                                   exception_handlers={404: self._not_found, 405: self._not_allowed,
                                                       Exception: self._failed})

    @property
    def draining(self) -> bool:
        return self.state.draining

    def begin_drain(self) -> None:
        """From now on new requests get 503; running ones get drain_timeout seconds, then are cancelled."""
        self.state.begin_drain()

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        if self.start_engine:
            self.state.engine.start()
        try:
            yield
        finally:
            await run_in_threadpool(self.state.close_engine)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.starlette(scope, receive, send)
        path = scope.get("path", "")
        label = path if path in self.paths else "/v1/models/{id}" if path.startswith("/v1/models/") else "other"
        status = [500]

        async def send_status(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        state = self.state
        with state.lock:
            state.in_flight += 1
        try:
            if state.draining and label in ("/v1/completions", "/v1/chat/completions", "/health"):
                await APIError(503, "the server is shutting down", code="shutting_down").response()(
                    scope, receive, send_status)
            else:
                await self.starlette(scope, receive, send_status)
        finally:
            with state.lock:
                state.in_flight -= 1
                state.http[(label, status[0])] = state.http.get((label, status[0]), 0) + 1

    async def _not_found(self, request, exc) -> Response:
        return APIError(404, f"no such endpoint: {request.method} {request.url.path}", code="not_found").response()

    async def _not_allowed(self, request, exc) -> Response:
        return APIError(405, f"method {request.method} is not allowed on {request.url.path}",
                        code="method_not_allowed").response()

    async def _failed(self, request, exc) -> Response:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error").response()

    # -- endpoints --

    async def models(self, request: HTTPRequest) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: HTTPRequest) -> Response:
        model_id = request.path_params["model_id"]
        if model_id != self.state.model.name:
            return self._unknown_model(model_id).response()
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict:
        return {"id": self.state.model.name, "object": "model", "created": self.state.created,
                "owned_by": "jhybrid", "max_model_len": self.state.max_len}

    def _unknown_model(self, name) -> APIError:
        return APIError(404, f"The model `{name}` does not exist (this server serves `{self.state.model.name}`).",
                        param="model", code="model_not_found")

    async def health(self, request: HTTPRequest) -> Response:
        stats = self.state.engine.stats()
        return JSONResponse({"status": "ok", "model": self.state.model.name, "running": stats.running,
                             "waiting": stats.waiting, "slots": stats.slots})

    async def metrics(self, request: HTTPRequest) -> Response:
        return PlainTextResponse(self.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def metrics_text(self) -> str:
        """Prometheus text exposition: the engine's stats (jhybrid_engine_*) and the server's counters."""
        stats = dataclasses.asdict(self.state.engine.stats())
        gauges = {"slots", "running", "waiting", "prefix_bytes_device", "prefix_bytes_host", "prefix_bytes_disk"}
        lines = []
        for name, value in stats.items():
            metric = f"jhybrid_engine_{name}" + ("" if name in gauges else "_total")
            lines += [f"# HELP {metric} EngineStats.{name}",
                      f"# TYPE {metric} {'gauge' if name in gauges else 'counter'}", f"{metric} {value}"]
        state = self.state
        with state.lock:
            counters, http, in_flight = dict(state.counters), dict(state.http), state.in_flight
        lines += ["# HELP jhybrid_http_requests_total HTTP requests answered, by path and status",
                  "# TYPE jhybrid_http_requests_total counter"]
        lines += [f'jhybrid_http_requests_total{{path="{path}",status="{status}"}} {n}'
                  for (path, status), n in sorted(http.items())]
        lines += ["# HELP jhybrid_http_requests_in_flight HTTP requests being answered",
                  "# TYPE jhybrid_http_requests_in_flight gauge", f"jhybrid_http_requests_in_flight {in_flight}"]
        lines += ["# HELP jhybrid_requests_finished_total generation requests ended, by finish reason",
                  "# TYPE jhybrid_requests_finished_total counter"]
        lines += [f'jhybrid_requests_finished_total{{reason="{reason}"}} {counters.get("finish_" + reason, 0)}'
                  for reason in ("stop", "length", "cancelled", "error")]
        for name, text in (("submitted", "generation requests handed to the engine"),
                           ("rejected", "generation requests the engine refused (AdmissionError)"),
                           ("client_disconnects", "requests whose client went away before the end"),
                           ("prompt_tokens", "prompt tokens of finished requests"),
                           ("completion_tokens", "tokens generated for finished requests")):
            metric = f"jhybrid_{name}_total"
            lines += [f"# HELP {metric} {text}", f"# TYPE {metric} counter", f"{metric} {counters.get(name, 0)}"]
        lines.append(f"jhybrid_draining {int(state.draining)}")
        lines.insert(len(lines) - 1, "# TYPE jhybrid_draining gauge")
        return "\n".join(lines) + "\n"

    async def completions(self, request: HTTPRequest) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: HTTPRequest) -> Response:
        return await self._generate(request, chat=True)

    # -- generation --

    async def _body(self, request: HTTPRequest) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as error:
            raise APIError(400, f"We could not parse the JSON body of your request ({error}).",
                           code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        return body

    def _params(self, body: dict, chat: bool) -> _Params:
        """Checks every parameter (APIError naming it) and builds the prompt's token ids."""
        state = self.state
        model = body.get("model")
        if not isinstance(model, str):
            if model is None:
                raise APIError(400, "model: required", param="model", code="missing_required_parameter")
            raise _bad("model", f"{model!r} is not a string", "invalid_type")
        if model != state.model.name:
            raise self._unknown_model(model)
        common = _common_params(body, _CHAT_KEYS if chat else _COMPLETION_KEYS)
        if chat:
            _unsupported(body, "logprobs", lambda v: v is False, "no log probabilities")
            _unsupported(body, "top_logprobs", lambda v: False, "no log probabilities")
            for name in ("tools", "functions"):
                _unsupported(body, name, lambda v: v == [], "no tool calls")
            for name in ("tool_choice", "function_call"):
                _unsupported(body, name, lambda v: v == "none", "no tool calls")
            _unsupported(body, "response_format", lambda v: v == {"type": "text"}, "text only")
            messages = _chat_messages(body)
            if state.model.chat_prompt is None:
                raise APIError(400, f"model `{state.model.name}` has no chat template; use /v1/completions",
                               param="messages", code="no_chat_template")
            prompt = state.model.encode(state.model.chat_prompt(messages))
            max_tokens = _int(body, "max_completion_tokens", None, 1)
            max_tokens = _int(body, "max_tokens", max_tokens, 1)
        else:
            _unsupported(body, "echo", lambda v: v is False, "echo false only")
            _unsupported(body, "logprobs", lambda v: False, "no log probabilities")
            _unsupported(body, "best_of", lambda v: v == 1, "best_of 1 only")
            _unsupported(body, "suffix", lambda v: v == "", "no suffix")
            prompt = _completion_prompt(body, state.model)
            max_tokens = _int(body, "max_tokens", DEFAULT_COMPLETION_TOKENS, 1)
        param = "messages" if chat else "prompt"
        if state.max_len is not None:
            if max_tokens is None:  # chat without a limit: up to the slot's capacity
                max_tokens = state.max_len - len(prompt)
            if len(prompt) + max(max_tokens, 1) > state.max_len:
                asked = f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the {param}, {max_tokens} for the " \
                    "completion)" if max_tokens >= 1 else f"{len(prompt)} tokens in the {param} and at least one more"
                raise APIError(400, f"This model's maximum context length is {state.max_len} tokens. However, you "
                                    f"requested {asked}. Please reduce the length of the {param} or the completion.",
                               param=param, code="context_length_exceeded")
        elif max_tokens is None:
            max_tokens = DEFAULT_COMPLETION_TOKENS
        return _Params(prompt=prompt, max_tokens=max_tokens, **common)

    async def _generate(self, request: HTTPRequest, chat: bool) -> Response:
        try:
            body = await self._body(request)
            params = await run_in_threadpool(self._params, body, chat)  # tokenizing may take a while
            prefix = "chatcmpl" if chat else "cmpl"
            run = _Run(self.state, params, f"{prefix}-{uuid.uuid4().hex}", chat)
            await run.submit()
        except APIError as error:
            return error.response()
        if params.stream:
            return _EventStream(run, self._chunks(run, chat))
        watcher = asyncio.ensure_future(_watch_disconnect(request.receive, run))
        try:
            texts = []
            async for text, _ in run.events():
                texts.append(text)
        except APIError as error:
            return error.response()
        finally:
            watcher.cancel()
            run.close()
        return JSONResponse(self._full_response(run, "".join(texts), chat))

    def _full_response(self, run: _Run, text: str, chat: bool) -> dict:
        reason = run.finish_reason
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                      "logprobs": None, "finish_reason": reason}
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            kind = "text_completion"
        return {"id": run.request_id, "object": kind, "created": _now(), "model": self.state.model.name,
                "system_fingerprint": None, "choices": [choice], "usage": run.usage()}

    async def _chunks(self, run: _Run, chat: bool) -> AsyncIterator[str]:
        """The `data:` payloads of a streamed response, `[DONE]` last."""
        created, name = _now(), self.state.model.name
        kind = "chat.completion.chunk" if chat else "text_completion"
        usage_field = {"usage": None} if run.params.include_usage else {}

        def chunk(text: str | None, reason: str | None, first: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else {} if text is None else {"content": text}
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
            return json.dumps({"id": run.request_id, "object": kind, "created": created, "model": name,
                               "system_fingerprint": None, "choices": [choice], **usage_field})

        if chat:
            yield chunk(None, None, first=True)
        events = run.events()
        try:
            async for text, reason in events:
                if reason is None:
                    yield chunk(text, None)
                    continue
                if text:
                    yield chunk(text, None)
                yield chunk(None, reason)
        except APIError as error:
            yield json.dumps(error.body())
        finally:
            await events.aclose()
        if run.params.include_usage and run.finished:
            yield json.dumps({"id": run.request_id, "object": kind, "created": created, "model": name,
                              "system_fingerprint": None, "choices": [], "usage": run.usage()})
        yield "[DONE]"


def create_app(engine: Engine, model: ServedModel, max_len: int | None = None, drain_timeout: float = 30.0,
               start_engine: bool = True) -> ServingApp:
    """The ASGI app: starts the engine at startup (unless start_engine=False), closes it at
    shutdown (drain for at most drain_timeout seconds, then cancel). max_len: tokens per request
    (prompt + completion) the engine's slots hold (default: the model's context)."""
    return ServingApp(engine, model, max_len=max_len, drain_timeout=drain_timeout, start_engine=start_engine)


# ----------------------------------------------------------------------------- running it


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: a free one); OSError naming --host / --port when it cannot."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise OSError(f"--host {host}: not an address of this machine ({error.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as error:
        sock.close()
        raise OSError(f"--host {host} --port {port}: cannot listen there ({error.strerror})") from None
    sock.setblocking(False)
    return sock


class HTTPServer:
    """uvicorn serving a `ServingApp`: `run()` on the main thread, or `start()` / `stop()` on a
    background thread (tests). SIGINT / SIGTERM (or stop()) start uvicorn's graceful shutdown: new
    connections are refused and new requests on open ones get 503, running requests get
    drain_timeout seconds to finish and are then cancelled (a stream ends with finish_reason
    "cancelled"), then the engine closes. A second SIGINT stops at once (requests cancelled).
    `signals` lists the signals received (the caller picks its exit status from them).

    The listening socket is `sock`, or bound at construction (port 0 = a free one; `port` tells which)."""

    def __init__(self, app: ServingApp, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning",
                 access_log: bool = False, on_ready: Callable[["HTTPServer"], None] | None = None,
                 on_signal: Callable[[int], None] | None = None, sock: socket.socket | None = None):
        import uvicorn

        self.app = app
        self.sock = sock if sock is not None else bind_socket(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        self.signals: list[int] = []
        config = uvicorn.Config(app, log_level=log_level, access_log=access_log, lifespan="on",
                                timeout_graceful_shutdown=app.state.drain_timeout + 10.0, http="h11")
        outer = self

        class _Server(uvicorn.Server):
            def handle_exit(self, sig, frame):
                outer.signals.append(sig)
                app.begin_drain()
                if on_signal is not None and not self.should_exit:
                    on_signal(sig)
                super().handle_exit(sig, frame)

            async def startup(self, sockets=None):
                await super().startup(sockets)
                if self.started and on_ready is not None:
                    on_ready(outer)

            @contextlib.contextmanager
            def capture_signals(self):
                # As uvicorn's, without raising the signal again once shut down: the caller decides
                # the exit (jhybrid serve: 130 after Ctrl-C).
                import signal

                if threading.current_thread() is not threading.main_thread():
                    yield
                    return
                signals = [signal.SIGINT, signal.SIGTERM]
                original = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
                try:
                    yield
                finally:
                    for sig, handler in original.items():
                        signal.signal(sig, handler)

        self.server = _Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def run(self) -> None:
        """Serves until a signal (or stop()); returns after the engine is closed."""
        try:
            self.server.run(sockets=[self.sock])
        finally:
            self.sock.close()
            self.app.state.close_engine(drain=not self.server.force_exit)  # a second Ctrl-C: cancel

    def start(self, timeout: float = 60.0) -> "HTTPServer":
        self._thread = threading.Thread(target=self.run, name="jhybrid-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """Graceful shutdown, as after SIGTERM."""
        self.app.begin_drain()
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError(f"the HTTP server did not stop within {timeout} s")
