"""The OpenAI-compatible HTTP server (jhybrid/serving/server.py), used as users use it: a live
uvicorn server on a free localhost port and the official `openai` client (httpx for malformed
requests). Most tests run on a deterministic fake engine (a thread that emits a known token
sequence per prompt: any lost or mixed-up token shows); the real-engine tests check every request's
greedy output against running it alone with the Generator, and `jhybrid serve` runs SmolLM2 as a
subprocess. Every wait is bounded by a timeout; nothing asserts on wall-clock speed."""

from __future__ import annotations

import concurrent.futures
import json
import re
import signal
import subprocess
import sys
import threading
import time
import zlib

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from jhybrid.serving.api import (AdmissionError, Engine, EngineClosed, EngineStats, FinishReason,  # noqa: E402
                                 RequestHandle, RequestOutput)
from jhybrid.serving.server import (HTTPServer, IncrementalDetokenizer, ServedModel, StopStrings,  # noqa: E402
                                    create_app)

TIMEOUT = 60.0  # bound of every wait on the server

# ----------------------------------------------------------------------------- a tiny text model

# ids 0..93: ASCII 32..125; 94, 95: the two UTF-8 bytes of "é"; 96: end of text (the stop token).
VOCAB, STOP = 97, 96


def tiny_decode(ids) -> str:
    raw = b"".join(bytes([32 + i]) if i < 94 else b"\xc3" if i == 94 else b"\xa9" if i == 95 else b"" for i in ids)
    return raw.decode("utf-8", errors="replace")


def tiny_encode(text: str) -> list[int]:
    ids = []
    for byte in text.encode("utf-8"):
        ids.append(byte - 32 if 32 <= byte < 126 else 94 if byte == 0xC3 else 95 if byte == 0xA9 else 31)
    return ids


def tiny_chat(messages) -> str:
    return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def tiny_model(context: int = 256) -> ServedModel:
    return ServedModel(name="tiny", encode=tiny_encode, decode=tiny_decode, vocab_size=VOCAB,
                       stop_token_ids=(STOP,), chat_prompt=tiny_chat, context=context)


# ----------------------------------------------------------------------------- a fake engine


def fake_tokens(prompt, max_tokens: int) -> tuple[list[int], FinishReason]:
    """What the fake engine emits for a prompt: a sequence determined by the prompt's ids, ending
    with the stop token for a third of the prompts."""
    h = zlib.crc32(bytes(str(list(prompt)), "ascii"))
    stop_at = (h >> 4) % 24 + 2 if (h >> 8) % 3 == 0 else None
    out = []
    for i in range(max_tokens):
        if i == stop_at:
            return out, FinishReason.STOP
        out.append((h + 7 * i * i + 3 * i) % 94)
    return out, FinishReason.LENGTH


class _FakeHandle(RequestHandle):
    def __init__(self, request, on_token, on_finish):
        self.request, self.request_id = request, request.request_id
        self.on_token, self.on_finish = on_token, on_finish
        self.expected, self.reason = fake_tokens(request.prompt, request.max_tokens)
        self.emitted: list[int] = []
        self.cancelled = False
        self.output: RequestOutput | None = None
        self.event = threading.Event()

    def cancel(self) -> None:
        self.cancelled = True

    def result(self, timeout=None) -> RequestOutput:
        if not self.event.wait(timeout):
            raise TimeoutError(self.request_id)
        return self.output

    @property
    def done(self) -> bool:
        return self.event.is_set()


class FakeEngine(Engine):
    """`slots` requests at a time, one token each per step of `step_seconds`; requests wait for a
    free slot; close(drain) as the interface says."""

    def __init__(self, slots: int = 4, max_len: int = 256, step_seconds: float = 0.003):
        self.slots, self.max_len, self.step_seconds = slots, max_len, step_seconds
        self.lock = threading.Lock()
        self.waiting: list[_FakeHandle] = []
        self.running: list[_FakeHandle] = []
        self.closed = False
        self.stop_loop = threading.Event()
        self.thread = None
        self.counts = dict(finished=0, cancelled=0, rejected=0, steps=0, generated=0, prefill=0)
        self.seen_running = 0  # most requests running at once

    def submit(self, request, on_token=None, on_finish=None):
        if self.closed:
            raise EngineClosed("closed")
        if len(request.prompt) + request.max_tokens > self.max_len:
            with self.lock:
                self.counts["rejected"] += 1
            raise AdmissionError(f"prompt {len(request.prompt)} + max_tokens {request.max_tokens} tokens; "
                                 f"expected at most a slot's {self.max_len}")
        handle = _FakeHandle(request, on_token, on_finish)
        with self.lock:
            self.waiting.append(handle)
        return handle

    def _end(self, handle, reason):
        output = RequestOutput(handle.request_id, list(handle.emitted), reason, len(handle.request.prompt))
        handle.output = output
        self.counts["cancelled" if reason == FinishReason.CANCELLED else "finished"] += 1
        if handle.on_finish:
            handle.on_finish(output)
        handle.event.set()

    def step(self) -> bool:
        with self.lock:
            while self.waiting and len(self.running) < self.slots:
                handle = self.waiting.pop(0)
                self.counts["prefill"] += len(handle.request.prompt)
                self.running.append(handle)
            for handle in [h for h in self.waiting if h.cancelled]:
                self.waiting.remove(handle)
                self._end(handle, FinishReason.CANCELLED)
            self.seen_running = max(self.seen_running, len(self.running))
            if not self.running:
                return False
            self.counts["steps"] += 1
            for handle in list(self.running):
                if handle.cancelled:
                    self.running.remove(handle)
                    self._end(handle, FinishReason.CANCELLED)
                    continue
                i = len(handle.emitted)
                if i == len(handle.expected):
                    self.running.remove(handle)
                    self._end(handle, handle.reason)
                    continue
                handle.emitted.append(handle.expected[i])
                self.counts["generated"] += 1
                if handle.on_token:
                    handle.on_token(handle.expected[i], i)
                if len(handle.emitted) == handle.request.max_tokens:
                    self.running.remove(handle)
                    self._end(handle, FinishReason.LENGTH)
        return True

    def start(self) -> None:
        def loop():
            while not self.stop_loop.is_set():
                if not self.step():
                    time.sleep(self.step_seconds)
                else:
                    time.sleep(self.step_seconds)

        self.thread = threading.Thread(target=loop, daemon=True)
        self.thread.start()

    def close(self, drain=True, timeout=None):
        self.closed = True
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while drain and (self.running or self.waiting) and time.monotonic() < deadline:
            time.sleep(0.005)
        with self.lock:
            for handle in self.running + self.waiting:
                handle.cancelled = True
        self.stop_loop.set()
        if self.thread is not None:
            self.thread.join(10)
        self.step()  # ends what was cancelled

    def stats(self) -> EngineStats:
        c = self.counts
        return EngineStats(slots=self.slots, running=len(self.running), waiting=len(self.waiting),
                           finished=c["finished"], cancelled=c["cancelled"], rejected=c["rejected"],
                           decode_steps=c["steps"], prefill_tokens=c["prefill"], generated_tokens=c["generated"],
                           prefix_hits=0, prefix_misses=0, prefix_hit_tokens=0, prefix_bytes_device=0,
                           prefix_bytes_host=0, prefix_bytes_disk=0)


def fake_text(prompt_ids, max_tokens) -> tuple[str, str]:
    tokens, reason = fake_tokens(prompt_ids, max_tokens)
    return tiny_decode(tokens), reason.value


def long_prompt(tag: str, max_tokens: int = 200) -> str:
    """A prompt the fake engine answers with max_tokens tokens (no stop token)."""
    return next(p for p in (f"{tag} {i}" for i in range(1000)) if fake_text(tiny_encode(p), max_tokens)[1] == "length")


def wait_for(condition, timeout=TIMEOUT, what="condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def fake_server():
    engine = FakeEngine(slots=4, max_len=256)
    server = HTTPServer(create_app(engine, tiny_model(), max_len=256, drain_timeout=5.0), port=0).start()
    yield server, engine
    server.stop()


@pytest.fixture
def client(fake_server):
    server, _ = fake_server
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT) as c:
        yield c


# ----------------------------------------------------------------------------- pieces


def test_incremental_detokenizer_never_splits_a_character():
    ids = tiny_encode("a é b ") + [94, 95, 94] + tiny_encode("x")  # "é" then a lone 0xC3 byte
    detok = IncrementalDetokenizer(tiny_decode)
    deltas = [detok.add(t) for t in ids] + [detok.flush()]
    assert all("\ufffd" not in d for d in deltas[:4])
    assert "".join(deltas) == tiny_decode(ids)
    assert deltas[2] == "" and deltas[3] == "é"  # the first byte of é waits for the second


def test_incremental_detokenizer_on_smollm2_text(smollm2):
    tokenizer = smollm2.tokenizer
    text = "Héllo wörld — naïve café 日本語 🙂 emoji, 12345 and\nnew lines."
    ids = tokenizer.encode(text).ids
    detok = IncrementalDetokenizer(lambda t: tokenizer.decode(list(t)))
    deltas = [detok.add(t) for t in ids] + [detok.flush()]
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
    assert sum(1 for d in deltas if d == "") > 0  # multi-byte characters were held back


def test_stop_strings_cut_the_text_and_hold_back_partial_matches():
    stops = StopStrings(["END", "\n\n"])
    out = []
    for delta in ["hello E", "N", "x world\n", "\nmore"]:
        text, hit = stops.feed(delta)
        out.append(text)
        if hit:
            break
    assert out == ["hello ", "", "ENx world", ""] and hit
    assert "".join(out) == "hello ENx world"
    nothing = StopStrings([])
    assert nothing.feed("abc") == ("abc", False) and nothing.flush() == ""
    tail = StopStrings(["xyz"])
    assert tail.feed("abx") == ("ab", False) and tail.flush() == "x"


# ----------------------------------------------------------------------------- endpoints (fake engine)


def test_completion_not_streamed(client):
    prompt = "Once upon a time"
    expected, reason = fake_text(tiny_encode(prompt), 40)
    response = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0)
    choice = response.choices[0]
    assert choice.text == expected and choice.finish_reason == reason
    assert response.object == "text_completion" and response.model == "tiny"
    assert response.usage.prompt_tokens == len(tiny_encode(prompt))
    assert response.usage.completion_tokens == len(fake_tokens(tiny_encode(prompt), 40)[0])
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_completion_streamed_with_usage(client):
    prompt = [5, 6, 7, 8]  # token ids
    expected, reason = fake_text(prompt, 30)
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == 4
    assert chunks[-1].usage.completion_tokens == len(fake_tokens(prompt, 30)[0])


def test_length_finish_and_one_prompt_lists(client):
    for prompt in ([[9, 9, 9, 1]], ["abcd"]):
        ids = prompt[0] if isinstance(prompt[0], list) else tiny_encode(prompt[0])
        response = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0)
        expected, reason = fake_text(ids, 1)
        assert response.choices[0].text == expected and response.choices[0].finish_reason == reason


def test_chat_not_streamed_and_streamed(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hi there"}]
    ids = tiny_encode(tiny_chat(messages))
    expected, reason = fake_text(ids, 48)
    response = client.chat.completions.create(model="tiny", messages=messages, max_tokens=48, temperature=0)
    assert response.object == "chat.completion"
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected and response.choices[0].finish_reason == reason
    assert response.usage.prompt_tokens == len(ids)

    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=48, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == reason
    assert len({c.id for c in chunks}) == 1


def test_chat_without_max_tokens_fills_the_slot(client):
    messages = [{"role": "user", "content": [{"type": "text", "text": "parts "}, {"type": "text", "text": "join"}]}]
    ids = tiny_encode(tiny_chat([{"role": "user", "content": "parts join"}]))
    response = client.chat.completions.create(model="tiny", messages=messages, temperature=0)
    assert response.choices[0].message.content == fake_text(ids, 256 - len(ids))[0]


def test_raw_sse_format(fake_server):
    server, _ = fake_server
    body = {"model": "tiny", "prompt": "raw", "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = "".join(response.iter_text())
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events[:-1])
    payloads = [json.loads(e[6:]) for e in events[:-2]]
    assert {p["id"] for p in payloads} == {payloads[0]["id"]} and payloads[0]["id"].startswith("cmpl-")
    assert "".join(p["choices"][0]["text"] for p in payloads) == fake_text(tiny_encode("raw"), 5)[0]


def test_stop_strings_end_the_request(client, fake_server):
    _, engine = fake_server
    prompt = long_prompt("stop string", 60)
    full, _ = fake_text(tiny_encode(prompt), 60)
    stop = full[10:13]  # a string the output contains
    cut = full[:full.find(stop)]
    before = engine.stats().cancelled
    response = client.completions.create(model="tiny", prompt=prompt, max_tokens=60, temperature=0, stop=stop)
    assert response.choices[0].text == cut and response.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=60, temperature=0,
                                         stop=[stop, "never"], stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    wait_for(lambda: engine.stats().cancelled >= before + 2, what="the engine to cancel both requests")


def test_models_health_metrics(client, fake_server):
    server, _ = fake_server
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    health = httpx.get(server.url + "/health", timeout=TIMEOUT)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    client.completions.create(model="tiny", prompt="count me", max_tokens=3, temperature=0)
    metrics = httpx.get(server.url + "/metrics", timeout=TIMEOUT)
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    values = {}
    for line in metrics.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    assert values["jhybrid_engine_slots"] == 4
    assert values["jhybrid_engine_finished_total"] >= 1
    assert values['jhybrid_http_requests_total{path="/v1/completions",status="200"}'] >= 1
    assert values["jhybrid_submitted_total"] >= 1 and values["jhybrid_completion_tokens_total"] >= 3


def _error(response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize("body, status, param", [
    ({"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ({"model": "tiny", "prompt": "x", "n": 2}, 400, "n"),
    ({"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": "tiny", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"model": "tiny", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 2.5}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "echo": True}, 400, "echo"),
    ({"model": "tiny", "prompt": "x", "logprobs": 2}, 400, "logprobs"),
    ({"model": "tiny", "prompt": "x", "stop": 3}, 400, "stop"),
    ({"model": "tiny", "prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"model": "tiny", "prompt": "x", "best_of": 3}, 400, "best_of"),
    ({"model": "tiny", "prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    ({"model": "tiny", "prompt": ["a", "b"]}, 400, "prompt"),
    ({"model": "tiny", "prompt": [1, 2, 500]}, 400, "prompt"),
    ({"model": "tiny", "prompt": ""}, 400, "prompt"),
    ({"model": "tiny"}, 400, "prompt"),
    ({"prompt": "x"}, 400, "model"),
    ({"model": "tiny", "prompt": "x" * 250, "max_tokens": 10}, 400, "prompt"),
])
def test_bad_completion_requests(fake_server, body, status, param):
    server, _ = fake_server
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT)
    assert response.status_code == status, response.text
    error = _error(response)
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param in error["message"] or status == 404 or error["code"] == "context_length_exceeded"


@pytest.mark.parametrize("body, param", [
    ({"model": "tiny", "messages": []}, "messages"),
    ({"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"model": "tiny", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x" * 300}]}, "messages"),
])
def test_bad_chat_requests(fake_server, body, param):
    server, _ = fake_server
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert response.status_code == 400, response.text
    assert _error(response)["param"] == param


def test_errors_through_the_openai_client(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt="x")
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", n=2)
    assert info.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="y" * 200, max_tokens=100)
    assert info.value.body["code"] == "context_length_exceeded"
    assert "maximum context length is 256 tokens" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], temperature=3)


def test_admission_error_from_the_engine_is_a_400(fake_server):
    # The server only knows the model's context (256 here); the engine's slots are smaller.
    engine = FakeEngine(max_len=32)
    server = HTTPServer(create_app(engine, tiny_model()), port=0).start()
    try:
        response = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x" * 30,
                                                                    "max_tokens": 10}, timeout=TIMEOUT)
        assert response.status_code == 400
        error = _error(response)
        assert error["code"] == "context_length_exceeded" and "at most a slot's 32" in error["message"]
        assert engine.stats().rejected == 1
    finally:
        server.stop()


def test_bad_json_and_unknown_paths(fake_server):
    server, _ = fake_server
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        response = httpx.post(server.url + "/v1/completions", content=raw,
                              headers={"content-type": "application/json"}, timeout=TIMEOUT)
        assert response.status_code == 400 and _error(response)["code"] == "invalid_json"
    assert httpx.get(server.url + "/v1/nothing", timeout=TIMEOUT).status_code == 404
    assert httpx.get(server.url + "/v1/completions", timeout=TIMEOUT).status_code == 405


def test_closing_the_stream_cancels_the_engine_request(client, fake_server):
    _, engine = fake_server
    before = engine.stats().cancelled
    stream = client.completions.create(model="tiny", prompt=long_prompt("a long one"), max_tokens=200, temperature=0,
                                       stream=True)
    received = 0
    for chunk in stream:
        received += len(chunk.choices[0].text)
        if received >= 5:
            break
    stream.close()
    wait_for(lambda: engine.stats().cancelled == before + 1 and engine.stats().running == 0,
             what="the engine request to end CANCELLED")
    assert engine.stats().generated_tokens < 10_000


def test_disconnect_while_waiting_cancels_a_non_streamed_request(fake_server):
    _, engine = fake_server
    before = engine.stats().cancelled
    server, _ = fake_server
    body = {"model": "tiny", "prompt": long_prompt("not streamed, abandoned"), "max_tokens": 200, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.15)
    wait_for(lambda: engine.stats().cancelled == before + 1, what="the abandoned request to be cancelled")


def test_concurrent_clients(fake_server):
    server, engine = fake_server
    prompts = [f"client {i} says {'x' * (i % 5)}" for i in range(12)]

    def ask(i):
        with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT) as c:
            if i % 2:
                chunks = c.completions.create(model="tiny", prompt=prompts[i], max_tokens=25, temperature=0,
                                              stream=True)
                return "".join(ch.choices[0].text for ch in chunks)
            return c.completions.create(model="tiny", prompt=prompts[i], max_tokens=25, temperature=0).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(ask, range(len(prompts)), timeout=TIMEOUT))
    assert texts == [fake_text(tiny_encode(p), 25)[0] for p in prompts]
    assert engine.seen_running > 1


def test_draining_refuses_new_requests_and_finishes_running_ones():
    engine = FakeEngine(step_seconds=0.01)
    app = create_app(engine, tiny_model(), max_len=256, drain_timeout=30.0)
    server = HTTPServer(app, port=0).start()
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT) as c:
        prompt = long_prompt("before shutdown", 60)
        stream = c.completions.create(model="tiny", prompt=prompt, max_tokens=60, temperature=0, stream=True)
        first = next(iter(stream))
        app.begin_drain()
        with pytest.raises(openai.APIStatusError) as info:
            c.completions.create(model="tiny", prompt="late", max_tokens=3)
        assert info.value.status_code == 503 and info.value.body["code"] == "shutting_down"
        assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 503
        stopper = threading.Thread(target=server.stop)
        stopper.start()
        rest = "".join(ch.choices[0].text for ch in stream)
        stopper.join(TIMEOUT)
    assert not stopper.is_alive()
    assert first.choices[0].text + rest == fake_text(tiny_encode(prompt), 60)[0]
    assert engine.closed and engine.stats().cancelled == 0


def test_shutdown_cancels_what_outlives_the_drain_timeout():
    engine = FakeEngine(step_seconds=0.02)
    server = HTTPServer(create_app(engine, tiny_model(), drain_timeout=0.3), port=0).start()
    chunks = []

    def slow():
        with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT) as c:
            chunks.extend(c.completions.create(model="tiny", prompt=long_prompt("too long to drain"),
                                               max_tokens=200, temperature=0, stream=True))

    client_thread = threading.Thread(target=slow)
    client_thread.start()
    wait_for(lambda: engine.stats().running == 1, what="the request to start")
    server.stop()
    client_thread.join(TIMEOUT)
    assert engine.closed and engine.stats().cancelled == 1 and engine.stats().running == 0
    assert 0 < len(chunks) < 200 and chunks[-1].choices[0].finish_reason == "cancelled"  # a clean end


# ----------------------------------------------------------------------------- jhybrid serve: argument errors


@pytest.mark.parametrize("argv, message", [
    (["--slots", "0"], "--slots 0; expected an integer >= 1"),
    (["--max-len", "-3"], "--max-len -3; expected an integer >= 1"),
    (["--step-token-budget", "0"], "--step-token-budget 0"),
    (["--decoding-step-token-budget", "-4"], "--decoding-step-token-budget -4; expected an integer >= 1"),
    (["--decoding-step-token-budget", "8", "--decoding-max-backlog", "-1"],
     "--decoding-max-backlog -1; expected an integer >= 0"),
    (["--decoding-max-backlog", "64"], "--decoding-max-backlog 64 needs --decoding-step-token-budget"),
    (["--prefix-cache-mb", "-1"], "--prefix-cache-mb -1.0; expected a number >= 0"),
    (["--prefix-cache-host-mb", "-2"], "--prefix-cache-host-mb -2.0; expected a number >= 0"),
    (["--prefix-cache-disk-dir", "/tmp/x"], "--prefix-cache-disk-dir /tmp/x needs --prefix-cache-disk-mb > 0"),
    (["--prefix-cache-mb", "0", "--prefix-cache-host-mb", "8"], "--prefix-cache-mb 0 turns the prefix cache off"),
    (["--port", "70000"], "--port 70000; expected 0..65535"),
    (["--switch-interval-ms", "0"], "--switch-interval-ms 0.0; expected a number of ms > 0"),
    (["--switch-interval-ms", "nan"], "--switch-interval-ms nan; expected a number of ms > 0"),
    (["--served-model-name", " "], "--served-model-name is empty"),
    (["--dtype", "float7"], "float7"),
    (["--mode", "full", "--beta", "0.5"], "--beta does not apply to --mode full"),
])
def test_serve_rejects_bad_values_before_loading(argv, message, capsys, monkeypatch):
    from jhybrid import cli

    monkeypatch.setattr(cli, "_load_with_progress", lambda *a: pytest.fail("loaded before checking"))
    assert cli.main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_serve_prefix_cache_tiers_reach_the_engine(tmp_path):
    from jhybrid import cli
    from jhybrid.models import create_model
    from tests.hybrid_support import TINY

    parser = cli.build_parser()
    args = parser.parse_args(["serve", "--slots", "2", "--prefix-cache-mb", "1", "--prefix-cache-host-mb", "2",
                              "--prefix-cache-disk-mb", "3", "--prefix-cache-disk-dir", str(tmp_path / "tier")])
    engine = cli._serving_engine(create_model(TINY, seed=0), None, args, max_len=64)
    try:
        config = engine._prefix.config
        assert (config.device_bytes, config.host_bytes, config.disk_bytes) == (2**20, 2 * 2**20, 3 * 2**20)
        assert config.disk_dir == str(tmp_path / "tier") and engine._prefix.disk_dir == str(tmp_path / "tier")
    finally:
        engine.close(drain=False)


def test_serve_compile_steps_compiles_before_listening(capsys):
    """`jhybrid serve --compile-steps` compiles every step shape of its engine before the server
    starts (none left to compile afterwards, progress on stderr); without it nothing is compiled."""
    from jhybrid import cli
    from jhybrid.models import create_model
    from tests.hybrid_support import TINY

    parser = cli.build_parser()
    model = create_model(TINY, seed=0)
    for flag in ([], ["--compile-steps"]):
        args = parser.parse_args(["serve", "--slots", "2", "--prefill-chunk", "16", *flag])
        engine = cli._serving_engine(model, None, args, max_len=64)
        try:
            compiled = cli.compile_serving_steps(engine, args)
            if flag:
                assert compiled > 0 and engine.compile_steps() == 0
                assert f"compiled {compiled} step programs" in capsys.readouterr().err
            else:
                assert compiled == 0 and engine.stats().compiles == 0 and capsys.readouterr().err == ""
        finally:
            engine.close(drain=False)


def test_serve_reports_a_port_in_use_before_loading(capsys, monkeypatch):
    from jhybrid import cli
    from jhybrid.serving.server import bind_socket

    monkeypatch.setattr(cli, "_load_with_progress", lambda *a: pytest.fail("loaded before checking"))
    taken = bind_socket("127.0.0.1", 0)
    try:
        port = taken.getsockname()[1]
        assert cli.main(["serve", "--port", str(port)]) == 2
        err = capsys.readouterr().err
        assert f"error: --host 127.0.0.1 --port {port}: cannot listen there" in err and err.count("\n") == 1
    finally:
        taken.close()


# ----------------------------------------------------------------------------- the real engine (tiny model)

REAL_SLOTS, REAL_MAX_LEN, REAL_CHUNK = 4, 128, 16


def _engine_class():
    try:
        from jhybrid.serving import engine as module
    except ImportError as error:
        pytest.skip(f"jhybrid.serving.engine is not available yet: {error}")
    return module.ServingEngine


class Alone:
    """Each prompt's greedy output when generated on its own (the Generator, same backend settings)."""

    def __init__(self, model, backend_factory):
        from jhybrid.generation import Generator

        self.generator = Generator(model, backend_factory(), prefill_chunk=REAL_CHUNK, max_len=REAL_MAX_LEN)
        self.cache: dict = {}
        self.lock = threading.Lock()

    def __call__(self, prompt_ids, max_tokens) -> tuple[str, str, list[int]]:
        from jhybrid.generation import SamplingParams

        key = (tuple(prompt_ids), max_tokens)
        with self.lock:
            if key not in self.cache:
                out = self.generator.generate([list(prompt_ids)], max_new_tokens=max_tokens,
                                              sampling=SamplingParams(temperature=0.0), stop_tokens=(STOP,))
                reason = {"context": "length"}.get(out.finish_reasons[0], out.finish_reasons[0])
                self.cache[key] = (tiny_decode(out.tokens[0]), reason, out.tokens[0])
        return self.cache[key]


def _full_backend():
    from jhybrid.attention.full import FullAttention

    return FullAttention()


@pytest.fixture(scope="module")
def real_server():
    engine_class = _engine_class()
    from jhybrid.models import create_model
    from tests.hybrid_support import TINY

    model = create_model(TINY, seed=0)
    engine = engine_class(model, backend=_full_backend(), slots=REAL_SLOTS, max_len=REAL_MAX_LEN,
                          prefill_chunk=REAL_CHUNK)
    server = HTTPServer(create_app(engine, tiny_model(TINY.max_position_embeddings), max_len=REAL_MAX_LEN,
                                   drain_timeout=10.0), port=0).start()
    alone = Alone(model, _full_backend)
    yield server, engine, alone
    server.stop()
    alone.generator.close()


def _client(server) -> "openai.OpenAI":
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def test_real_engine_completions_and_chat_equal_running_alone(real_server):
    server, engine, alone = real_server
    with _client(server) as c:
        prompt = "The tiny model says"
        text, reason, _ = alone(tiny_encode(prompt), 20)
        response = c.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
        assert (response.choices[0].text, response.choices[0].finish_reason) == (text, reason)
        chunks = list(c.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0, stream=True))
        assert "".join(ch.choices[0].text for ch in chunks) == text
        assert chunks[-1].choices[0].finish_reason == reason

        messages = [{"role": "user", "content": "hello, tiny"}]
        text, reason, tokens = alone(tiny_encode(tiny_chat(messages)), 24)
        response = c.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0)
        assert response.choices[0].message.content == text and response.choices[0].finish_reason == reason
        assert response.usage.completion_tokens == len(tokens)
        chunks = list(c.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0,
                                                stream=True))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == text


def test_real_engine_concurrent_clients_and_a_shared_prefix(real_server):
    server, engine, alone = real_server
    shared = "A long shared system prompt that every request starts with, "  # 61 tokens: 3 prefill chunks
    prompts = [shared + f"question {i}?" for i in range(8)] + [f"unrelated {i}" for i in range(4)]

    def ask(i):
        with _client(server) as c:
            if i % 2:
                chunks = c.completions.create(model="tiny", prompt=prompts[i], max_tokens=16, temperature=0,
                                              stream=True)
                return "".join(ch.choices[0].text for ch in chunks)
            return c.completions.create(model="tiny", prompt=prompts[i], max_tokens=16, temperature=0).choices[0].text

    before = engine.stats()
    with _client(server) as c:  # the first one stores the shared prefix, the second finds it
        for _ in range(2):
            response = c.completions.create(model="tiny", prompt=prompts[0], max_tokens=16, temperature=0)
            assert response.choices[0].text == alone(tiny_encode(prompts[0]), 16)[0]
    assert response.usage.prompt_tokens_details.cached_tokens >= 48  # 3 blocks of 16
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        texts = list(pool.map(ask, range(len(prompts)), timeout=TIMEOUT * 2))
    assert texts == [alone(tiny_encode(p), 16)[0] for p in prompts]
    after = engine.stats()
    assert after.prefix_hits - before.prefix_hits >= 9 and after.prefix_hit_tokens - before.prefix_hit_tokens >= 9 * 48


def test_real_engine_cancel_mid_stream(real_server):
    server, engine, alone = real_server
    before = engine.stats().cancelled
    with _client(server) as c:
        stream = c.completions.create(model="tiny", prompt="cancel me", max_tokens=100, temperature=0, stream=True)
        for _ in zip(range(3), stream):
            pass
        stream.close()
    wait_for(lambda: engine.stats().cancelled == before + 1 and engine.stats().running == 0,
             what="the engine request to end CANCELLED")


def test_real_engine_load_with_random_arrivals(real_server, rng):
    """8 concurrent clients, 40 requests arriving at random times with random prompts and lengths,
    half streamed: every answer equals its prompt's output generated alone (none lost or mixed up)."""
    server, engine, alone = real_server
    requests = []
    for i in range(40):
        length = int(rng.integers(1, 60))
        prompt = [int(t) for t in rng.integers(0, 94, length)]
        requests.append((float(rng.uniform(0, 3.0)), prompt, int(rng.integers(1, 40)), bool(i % 2)))
    before = engine.stats()
    start = time.monotonic()

    def ask(request):
        at, prompt, max_tokens, stream = request
        time.sleep(max(0.0, at - (time.monotonic() - start)))
        with _client(server) as c:
            if stream:
                chunks = list(c.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                                   temperature=0, stream=True))
                return "".join(ch.choices[0].text for ch in chunks), chunks[-1].choices[0].finish_reason
            choice = c.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0).choices[0]
            return choice.text, choice.finish_reason

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, requests, timeout=TIMEOUT * 4))
    for (_, prompt, max_tokens, _), answer in zip(requests, answers):
        text, reason, _ = alone(prompt, max_tokens)
        assert answer == (text, reason), (prompt, max_tokens)
    after = engine.stats()
    assert after.finished - before.finished == 40 and after.running == 0 and after.waiting == 0


@pytest.mark.slow  # ~30 s on the 2-core machine (hgca's compiles), past this file's budget
def test_real_engine_in_an_offloading_mode(rng):
    """hgca keeping every offloaded token (tests/hybrid_support.py KEEP_ALL): concurrent requests, each
    equal to its prompt generated alone with the same backend settings."""
    engine_class = _engine_class()
    from jhybrid.hybrid import make_backend
    from jhybrid.models import create_model
    from tests.hybrid_support import KEEP_ALL, TINY

    model = create_model(TINY, seed=1)

    def backend():
        return make_backend("hgca", **KEEP_ALL)

    engine = engine_class(model, backend=backend(), slots=3, max_len=REAL_MAX_LEN, prefill_chunk=REAL_CHUNK)
    server = HTTPServer(create_app(engine, tiny_model(TINY.max_position_embeddings), max_len=REAL_MAX_LEN),
                        port=0).start()
    alone = Alone(model, backend)
    try:
        prompts = [[int(t) for t in rng.integers(0, 94, int(n))] for n in rng.integers(5, 70, 6)]

        def ask(prompt):
            with _client(server) as c:
                chunks = c.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True)
                return "".join(ch.choices[0].text for ch in chunks)

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            texts = list(pool.map(ask, prompts, timeout=TIMEOUT * 2))
        assert texts == [alone(p, 24)[0] for p in prompts]
    finally:
        server.stop()
        alone.generator.close()
    assert engine.closed


# ----------------------------------------------------------------------------- jhybrid serve with SmolLM2


def test_jhybrid_serve_smollm2_with_the_openai_client(smollm2, tmp_path):
    """`jhybrid serve` as a subprocess: chat streamed and not, equal to the Generator's greedy output
    of the same prompt; Ctrl-C exits 130 with nothing after the stopping line."""
    _engine_class()
    from jhybrid.generation import Generator, SamplingParams
    from jhybrid.loading import chat

    log = tmp_path / "serve.err"
    with open(log, "w") as err:
        process = subprocess.Popen([sys.executable, "-m", "jhybrid.cli", "serve", "--port", "0", "--slots", "2",
                                    "--max-len", "512", "--prefill-chunk", "64"],
                                   stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        messages = [{"role": "user", "content": "What is the capital of France?"}]  # alone, while it loads
        ids = smollm2.encode(chat.format_chatml(messages, default_system=smollm2.default_system))
        expected = Generator(smollm2.model, prefill_chunk=64, max_len=512).generate(
            [ids], max_new_tokens=16, sampling=SamplingParams(temperature=0.0), stop_tokens=smollm2.stop_token_ids)
        expected_text = smollm2.tokenizer.decode(expected.tokens[0])
        deadline = time.monotonic() + 300
        url = None
        while url is None:
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "jhybrid serve did not start: " + log.read_text()
            found = re.search(r"serving model 'smollm2' at (http://\S+/v1):", log.read_text())
            url = found and found.group(1)
            time.sleep(0.2)
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300) as c:
            assert [m.id for m in c.models.list().data] == ["smollm2"]
            response = c.chat.completions.create(model="smollm2", messages=messages, max_tokens=16, temperature=0)
            assert response.choices[0].message.content == expected_text and "Paris" in expected_text
            assert response.usage.prompt_tokens == len(ids)
            chunks = list(c.chat.completions.create(model="smollm2", messages=messages, max_tokens=16,
                                                    temperature=0, stream=True))
            assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == expected_text
            assert chunks[-1].choices[0].finish_reason == expected.finish_reasons[0]
        process.send_signal(signal.SIGINT)
        assert process.wait(120) == 130
        err = log.read_text()
        assert "Traceback" not in err and err.rstrip().splitlines()[-1].startswith("[stopping:")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)
