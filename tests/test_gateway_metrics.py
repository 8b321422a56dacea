"""The gateway's queue gauges, which routers read (specwire:num_requests_waiting and specwire:num_requests_running),
in process over a scripted fake draft service: a request waits until its first token, runs until its answer ends,
and both gauges come back to 0 after a finished stream, a client that leaves mid-stream (both ways a server tells
the app: an http.disconnect message under ASGI 2.3, as uvicorn does, or an OSError from send under 2.4), a 400, a
500 and an error event mid-stream. Also what outside benchmark clients (guidellm, aiperf: bench/external_clients.sh)
need of a stream's error that the openai package did not: an `event: error` message."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from test_gateway_fuzz import FakeDraft, InProcessGateway

from gateway.app import create_app
from gateway.chat import ChatTemplate
from gateway.config import GatewayConfig
from specwire.client import Chunk, Result
from specwire.errors import SpecwireError
from specwire.testing.models import byte_bpe_tokenizer

MODEL = "metrics-model"
WAIT_S = 10.0  # how long a gauge may take to reach a value before the test fails (never a hang)


class ScriptedDraft(FakeDraft):
    """FakeDraft whose prompt scripts the answer: "hold-first" waits for `release` before its first token, "hold"
    after it; "refuse" is INVALID_ARGUMENT before any token, "drop" UNAVAILABLE after the first, "bug" a
    RuntimeError after the first. `ended` counts generations whose generator finished (ran out, failed, or was
    closed or cancelled: what frees the sequence on the real services)."""

    def __init__(self, config: GatewayConfig) -> None:
        super().__init__(config)
        self.release = asyncio.Event()
        self.ended = 0

    async def stream(self, prompt: str | None = None, *, result: Result | None = None, **kwargs) -> AsyncIterator[Chunk]:
        result = result if result is not None else Result()
        self._check(prompt, kwargs)
        try:
            if prompt == "refuse":
                raise SpecwireError("temperature must be >= 0", code=grpc.StatusCode.INVALID_ARGUMENT)
            if prompt == "hold-first":
                await self.release.wait()
            result.token_ids.append(5)
            result.text += "he"
            yield Chunk([5], "he")
            if prompt == "hold":
                await self.release.wait()
            if prompt == "drop":
                raise SpecwireError("the verifier went away", code=grpc.StatusCode.UNAVAILABLE)
            if prompt == "bug":
                raise RuntimeError("a bug after the first token")
            result.token_ids.append(9)
            result.text += "llo"
            yield Chunk([9], "llo")
        finally:
            self.ended += 1


@pytest.fixture
def gateway():
    fakes: list[ScriptedDraft] = []

    def connect(config: GatewayConfig) -> ScriptedDraft:
        fakes.append(ScriptedDraft(config))
        return fakes[-1]

    app = create_app(GatewayConfig(model_name=MODEL), chat=ChatTemplate(byte_bpe_tokenizer(), "byte-bpe"),
                     connect_client=connect)
    gw = InProcessGateway(app)
    gw.fake = fakes[0]
    yield gw
    gw.loop.call_soon_threadsafe(gw.fake.release.set)  # a failed test must not leave a generation waiting
    gw.close()


def gauges(gateway: InProcessGateway) -> tuple[float, float]:
    """(waiting, running) as /metrics serves them."""
    status, _, raw = gateway.request("/metrics", b"", method="GET")
    assert status == 200, raw
    text = raw.decode()
    values = []
    for name in ("specwire:num_requests_waiting", "specwire:num_requests_running"):
        assert f"# TYPE {name} gauge" in text, text
        values.append(float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.M).group(1)))
    return values[0], values[1]


def wait_gauges(gateway: InProcessGateway, expected: tuple[float, float]) -> None:
    """Until the gauges read `expected`; fails after WAIT_S with what they read."""
    deadline = time.monotonic() + WAIT_S
    while (seen := gauges(gateway)) != expected:
        assert time.monotonic() < deadline, f"gauges (waiting, running) read {seen}, expected {expected}"
        time.sleep(0.01)


def body(prompt: str, stream: bool) -> bytes:
    return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": stream}).encode()


async def leaving_client(app, raw: bytes, gone: asyncio.Event, spec_version: str) -> list[bytes]:
    """A streamed POST whose client goes away once `gone` is set: under ASGI 2.3 receive() then answers
    http.disconnect (Starlette listens for it); under 2.4 the next send raises OSError, as a closed socket does."""
    sent: list[bytes] = []
    delivered = False

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if gone.is_set() and message["type"] == "http.response.body":
            raise OSError("the client closed the connection")
        if message["type"] == "http.response.body":
            sent.append(message.get("body", b""))

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000)}
    try:
        await app(scope, receive, send)
    except Exception:  # noqa: BLE001 - Starlette's ClientDisconnect under 2.4: what a server swallows
        pass
    return sent


def test_a_request_waits_until_its_first_token_then_runs_until_its_stream_ends(gateway):
    fake = gateway.fake
    assert gauges(gateway) == (0, 0)
    answer = asyncio.run_coroutine_threadsafe(
        gateway._call("POST", "/v1/completions", body("hold-first", True), {"content-type": "application/json"}),
        gateway.loop)
    wait_gauges(gateway, (1, 0))  # accepted, no token yet
    gateway.loop.call_soon_threadsafe(fake.release.set)
    status, _, raw = answer.result(WAIT_S)
    assert status == 200 and raw.endswith(b"data: [DONE]\n\n"), raw
    wait_gauges(gateway, (0, 0))
    fake.release.clear()
    answer = asyncio.run_coroutine_threadsafe(
        gateway._call("POST", "/v1/completions", body("hold", True), {"content-type": "application/json"}),
        gateway.loop)
    wait_gauges(gateway, (0, 1))  # streaming: its first token came
    gateway.loop.call_soon_threadsafe(fake.release.set)
    assert answer.result(WAIT_S)[0] == 200
    wait_gauges(gateway, (0, 0))
    assert fake.ended == 2


@pytest.mark.parametrize("stream", [False, True])
def test_an_unstreamed_or_streamed_answer_counts_its_request_once(gateway, stream):
    for _ in range(3):
        status, _, raw = gateway.request("/v1/completions", body("plain", stream))
        assert status == 200, raw
    wait_gauges(gateway, (0, 0))


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
def test_a_client_that_leaves_mid_stream_is_no_longer_running(gateway, spec_version):
    fake = gateway.fake
    gone = asyncio.Event()
    client = asyncio.run_coroutine_threadsafe(
        leaving_client(gateway.app, body("hold", True), gone, spec_version), gateway.loop)
    wait_gauges(gateway, (0, 1))
    gateway.loop.call_soon_threadsafe(gone.set)
    if spec_version == "2.4":  # only a send notices: the generation goes on to its next token
        gateway.loop.call_soon_threadsafe(fake.release.set)
    sent = client.result(WAIT_S)
    assert any(b'"he"' in part for part in sent), sent  # it left mid-stream, after its first token
    assert not any(b"[DONE]" in part for part in sent), sent
    wait_gauges(gateway, (0, 0))
    assert fake.ended == 1  # the generation was closed, not left to the garbage collector


@pytest.mark.parametrize("prompt,stream,status", [
    ("refuse", False, 400),  # refused before the first token: it was waiting
    ("refuse", True, 400),
    ("bug", False, 500),  # a failure after the first token: it was running
    ("drop", False, 503),
    ("drop", True, 200),  # the stream had begun: an error event, then [DONE]
    ("bug", True, 500),  # the stream had begun: the app raises, the server aborts the connection
])
def test_the_gauges_return_to_zero_after_an_error(gateway, prompt, stream, status):
    got, _, raw = gateway.request("/v1/completions", body(prompt, stream))
    assert got == status, raw
    if prompt == "drop" and stream:
        assert b'"error"' in raw and raw.endswith(b"data: [DONE]\n\n"), raw
    wait_gauges(gateway, (0, 0))


def test_a_chat_refused_before_the_draft_service_is_no_longer_waiting():
    """The template renders after the request is accepted (it counts as waiting): a refusal there ends it."""
    app = create_app(GatewayConfig(model_name=MODEL), chat=ChatTemplate(None, None), connect_client=ScriptedDraft)
    gw = InProcessGateway(app)
    try:
        raw = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        status, _, reply = gw.request("/v1/chat/completions", raw.encode())
        assert status == 400 and b"--tokenizer" in reply, reply
        wait_gauges(gw, (0, 0))
    finally:
        gw.close()


def test_chat_streams_are_counted_like_completions(gateway):
    raw = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                      "stream": True})
    status, _, reply = gateway.request("/v1/chat/completions", raw.encode())
    assert status == 200 and reply.endswith(b"data: [DONE]\n\n"), reply
    wait_gauges(gateway, (0, 0))


def test_an_error_mid_stream_is_an_sse_error_event_every_client_reads():
    """aiperf counts a request as failed only from an SSE message with `event: error` (its reason from the comment
    line); guidellm and the openai package raise on a `data` line holding an `error` object. Before the event line,
    aiperf counted a stream the verifier broke off as a success with fewer tokens."""
    from openai._streaming import SSEDecoder

    app = create_app(GatewayConfig(model_name=MODEL), chat=ChatTemplate(None, None), connect_client=ScriptedDraft)
    gw = InProcessGateway(app)
    try:
        status, _, raw = gw.request("/v1/completions", body("drop", True))
    finally:
        gw.close()
    assert status == 200, raw
    messages = [m for m in raw.decode().split("\n\n") if m]
    assert messages[-1] == "data: [DONE]", messages
    error = messages[-2].splitlines()
    assert error[0] == "event: error" and error[1] == ": the verifier went away", error  # aiperf
    payload = json.loads(error[2].removeprefix("data: "))
    assert payload["error"]["code"] == "unavailable" and payload["error"]["type"] == "service_unavailable_error"
    decoder = SSEDecoder()  # the openai package's reading of the same bytes
    events = [e for e in (decoder.decode(line) for line in raw.decode().splitlines()) if e is not None]
    assert events[-2].event == "error" and events[-2].json()["error"]["message"] == "the verifier went away"
    assert all(e.event is None for e in events[:-2])  # the tokens stay plain data messages
