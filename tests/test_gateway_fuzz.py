"""Hypothesis over OpenAI request bodies, sent to the real gateway app in-process (its ASGI app on an event loop of
its own, lifespan entered): random but mostly plausible completions and chat bodies, with out-of-range numbers,
wrong types, lone surrogates, unknown fields and broken JSON. Whatever arrives, the answer is a 200 or an OpenAI
error (400/404) with OpenAI's error shape, never a 500 and never a hang, and a well-formed request is served right
after. The bulk runs over a fake draft service (the SDK's own request builder and the draft service's own request
checks, answering at once): 200 examples in the default run, 10,000 with `-m slow` (hypothesis profiles
"gateway-fuzz" and "gateway-fuzz-slow"). A subset runs over the real tiny stack: each wire field's edges, then 40
random bodies (1,000 with `-m slow`)."""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
from collections.abc import AsyncIterator

import grpc
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from common.errors import ErrorCode, ServiceError
from draft_service.servicer import request_from_proto
from gateway.app import create_app
from gateway.chat import ChatTemplate
from gateway.config import GatewayConfig
from specwire.client import Chunk, Result, Stats, build_request
from specwire.errors import SpecwireError
from specwire.testing.models import byte_bpe_tokenizer
from specwire.v1 import draft_pb2

settings.register_profile("gateway-fuzz", max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
settings.register_profile("gateway-fuzz-slow", settings.get_profile("gateway-fuzz"), max_examples=10_000)
FUZZ = settings.get_profile("gateway-fuzz")
FUZZ_SLOW = settings.get_profile("gateway-fuzz-slow")
# The real stack answers in tens of milliseconds per request: a subset of the examples goes there.
STACK = settings(FUZZ, max_examples=40)
STACK_SLOW = settings(FUZZ, max_examples=1_000)

VOCAB = 320  # the text stacks' tokenizer
MAX_DRAFT_TOKENS = 8  # the text stacks' verifier (tests/stacks.py)
FAKE_MODEL = "fuzz-model"
STACK_MODEL = "qwen2-target"  # the gateway's model id: the target directory's name (specwire.testing.text_pair)
REQUEST_TIMEOUT_S = 60.0  # "never a hang": a request that takes longer fails the test
ONE_FAMILY = pytest.mark.parametrize("text_stack", ["qwen2"], indirect=True)


# -- the gateway in-process ------------------------------------------------------------------------------------

class InProcessGateway:
    """The gateway's ASGI app served on an event loop in a thread of its own (the SDK's grpc.aio channel belongs
    to that loop), its lifespan entered once; `request` calls the app directly and waits at most a time limit."""

    def __init__(self, app) -> None:
        self.app = app
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self._lifespan = app.router.lifespan_context(app)
        self._run(self._lifespan.__aenter__())

    def _run(self, coro, timeout_s: float = REQUEST_TIMEOUT_S):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def request(self, path: str, body: bytes, headers: dict[str, str] | None = None,
                method: str = "POST") -> tuple[int, dict[str, str], bytes]:
        """(status, headers, body); 500 when the app raised. TimeoutError when no answer came in time."""
        return self._run(self._call(method, path, body, {"content-type": "application/json", **(headers or {})}))

    async def _call(self, method: str, path: str, body: bytes, headers: dict[str, str]):
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                 "headers": [(k.encode(), v.encode("latin-1")) for k, v in headers.items()],
                 "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000)}
        finished = asyncio.Event()
        delivered = False
        status, reply_headers, chunks = 500, {}, []

        async def receive():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await finished.wait()  # the client stays until the whole answer is read
            return {"type": "http.disconnect"}

        async def send(message):
            nonlocal status, reply_headers
            if message["type"] == "http.response.start":
                status = message["status"]
                reply_headers = {k.decode().lower(): v.decode("latin-1") for k, v in message.get("headers", [])}
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    finished.set()

        try:
            await self.app(scope, receive, send)
        except Exception:  # noqa: BLE001 - an exception out of the app is what a 500 is
            status = 500
        finally:
            finished.set()
        return status, reply_headers, b"".join(chunks)

    def close(self) -> None:
        self._run(self._lifespan.__aexit__(None, None, None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class FakeDraft:
    """specwire.AsyncClient as the gateway uses it, without a draft service: the SDK's own request builder, the
    draft service's own request checks (so an SDK-side exception or a service's INVALID_ARGUMENT arrives as it
    would), then a canned two-chunk answer."""

    def __init__(self, _config: GatewayConfig) -> None:
        self.closed = False
        self.calls: list[dict] = []  # the keyword arguments of each generation

    async def health(self, service: str = "", *, timeout: float = 5.0) -> str:
        return "SERVING"

    async def close(self) -> None:
        self.closed = True

    async def stream(self, prompt: str | None = None, *, result: Result | None = None, **kwargs) -> AsyncIterator[Chunk]:
        result = result if result is not None else Result()
        self.calls.append({"prompt": prompt, **kwargs})
        self._check(prompt, kwargs)
        for chunk in (Chunk([5], "he"), Chunk([9], "llo")):
            result.token_ids.extend(chunk.token_ids)
            result.text += chunk.text
            yield chunk
        result.stats = Stats("length", 3, 2, 1, 2, 1, [1, 0], [1, 1], 0.01, 0.005, 0.001, 0.002, 2)

    async def generate(self, prompt: str | None = None, **kwargs) -> Result:
        result = Result()
        async for _ in self.stream(prompt, result=result, **kwargs):
            pass
        return result

    @staticmethod
    def _check(prompt: str | None, kwargs: dict) -> None:
        accepted = inspect.signature(build_request).parameters
        unknown = set(kwargs) - set(accepted)
        if unknown:  # as the real SDK would: an unknown keyword argument
            raise TypeError(f"unexpected keyword arguments {sorted(unknown)}")
        req = build_request(prompt=prompt, **{**dict.fromkeys(("prompt_token_ids", "seed", "stop",
                                                               "num_speculative_tokens")),
                                              "temperature": 1.0, "top_k": 0, "top_p": 1.0, "ignore_eos": False,
                                              **kwargs})
        req = draft_pb2.GenerateRequest.FromString(req.SerializeToString())  # what travels
        try:
            parsed = request_from_proto(req)
            ids = parsed.prompt_token_ids
            if ids is not None and (not ids or any(not 0 <= t < VOCAB for t in ids)):
                raise ServiceError(ErrorCode.INVALID_ARGUMENT, "prompt token outside the vocabulary")
            k = parsed.num_speculative_tokens
            if k is not None and not 0 <= k <= MAX_DRAFT_TOKENS:
                raise ServiceError(ErrorCode.INVALID_ARGUMENT, f"num_speculative_tokens {k} out of range")
        except ServiceError as err:
            raise SpecwireError(err.message, code=grpc.StatusCode[err.code.name]) from None


# -- request bodies --------------------------------------------------------------------------------------------

INT_EDGES = [0, 1, -1, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**32, 2**63 - 1, 2**63, -(2**63), 2**64, 10**30]
FLOAT_EDGES = [0.0, -0.0, 0.5, 1.0, 2.0, -1.0, 1e-40, 1e-300, 3.4e38, 3.5e38, 1e39, 1e308]
# Mostly ordinary text; now and then a lone surrogate (JSON's \ud800 escape), NUL or a line separator.
text = st.one_of(st.text(max_size=12), st.text(max_size=12), st.text(max_size=12),
                 st.text(st.one_of(st.characters(), st.sampled_from(["\ud800", "\udfff", "\x00", "\u2028"])),
                         max_size=12))
number = st.one_of(st.sampled_from(INT_EDGES), st.integers(-3, 12), st.integers(),
                   st.sampled_from(FLOAT_EDGES), st.floats(allow_nan=True, allow_infinity=True))
junk = st.one_of(st.none(), st.booleans(), text, st.lists(st.integers(-3, 3), max_size=3),
                 st.dictionaries(text, st.integers(-3, 3), max_size=2))
anything = st.one_of(number, number, junk)  # numbers weigh double: most fields are numbers

token_ids = st.lists(st.one_of(st.integers(0, VOCAB - 1), st.integers(0, VOCAB - 1), st.sampled_from(INT_EDGES)),
                     max_size=6)
# each field with a plausible value; a body then gets a few of them replaced by anything at all
COMMON = {
    "temperature": st.sampled_from([0.0, 0.7, 1.0]),
    "top_p": st.sampled_from([1.0, 0.9]),
    "top_k": st.sampled_from([0, 3]),
    "seed": st.integers(0, 2**63 - 1),
    "max_tokens": st.integers(1, 6),
    "stop": st.one_of(text, st.lists(text, max_size=3)),
    "n": st.just(1),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "presence_penalty": st.just(0.0),
    "frequency_penalty": st.just(0.0),
    "logit_bias": st.just({}),
    "user": text,
    "ignore_eos": st.booleans(),
    "num_speculative_tokens": st.integers(0, MAX_DRAFT_TOKENS),
    "wire_mode": st.sampled_from(["sparse", "one-hot", "coupled"]),
    "specwire_stats": st.booleans(),
    "cache_salt": st.text(min_size=1, max_size=260),
    "some_unknown_field": anything,
}
COMPLETION = {**COMMON, "echo": st.just(False), "logprobs": st.none(), "best_of": st.just(1), "suffix": st.none()}
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
     "content": st.one_of(text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}),
                                         max_size=2))},
    optional={"name": text})
CHAT = {**COMMON, "max_completion_tokens": st.integers(1, 6), "logprobs": st.just(False), "top_logprobs": st.none(),
        "tools": st.none(), "response_format": st.just({"type": "text"})}
ENDPOINTS = {
    "/v1/completions": ("prompt", st.one_of(text, token_ids, st.lists(text, max_size=2),
                                            st.lists(token_ids, max_size=2)), COMPLETION),
    "/v1/chat/completions": ("messages", st.lists(message, min_size=1, max_size=3), CHAT),
}


@st.composite
def json_body(draw, model: str) -> tuple[str, bytes]:
    """A plausible body for either endpoint with up to three fields (required ones included) replaced by any
    value or removed, and now and then one of its messages given a wrong role or part."""
    path = draw(st.sampled_from(sorted(ENDPOINTS)))
    key, prompt, fields = ENDPOINTS[path]
    body = {"model": model, key: draw(prompt), **draw(st.fixed_dictionaries({}, optional=fields))}
    if "stream_options" in body:
        body["stream"] = True  # plausible: the options of a stream
    # NOTE: hypothesis starts from the simplest choices (0, the first item): those keep the body as it is
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2, 3]))):
        name = draw(st.sampled_from(["model", key, *sorted(fields)]))
        if draw(st.integers(0, 9)) == 9:
            body.pop(name, None)
        else:
            body[name] = draw(anything)
    if key == "messages" and isinstance(body.get(key), list) and body[key] and draw(st.integers(0, 4)) == 4:
        body[key][0] = {**body[key][0], draw(st.sampled_from(["role", "content", "name"])): draw(anything)}
    return path, json.dumps(body).encode()


def bodies(model: str) -> st.SearchStrategy:
    """(path, raw body): mostly a JSON object, now and then bytes that are not one (or not JSON at all)."""
    raw = st.tuples(st.sampled_from(sorted(ENDPOINTS)),
                    st.one_of(st.binary(max_size=40), anything.map(lambda v: json.dumps(v).encode()),
                              st.just(b'{"model": "x", "prompt": "\xff\xfe"}'), st.just(b"[" * 5000)))
    return st.one_of(*[json_body(model)] * 9, raw)


def small(pair: tuple[str, bytes]) -> tuple[str, bytes]:
    """A body for the real stack: a valid max_tokens kept small (an unbounded chat would run to the context)."""
    path, raw = pair
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return pair
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            value = body.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool) and 6 < value < 2**31:
                body[key] = 6
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = 4
    return path, json.dumps(body).encode()


# -- the checks ------------------------------------------------------------------------------------------------

def check_answer(status: int, headers: dict[str, str], raw: bytes) -> None:
    assert status in (200, 400, 404), (status, raw[:500])
    if status != 200:
        error = json.loads(raw)["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), error
        return
    if headers.get("content-type", "").startswith("text/event-stream"):
        events = [line.removeprefix(b"data: ") for line in raw.split(b"\n\n") if line]
        assert events[-1] == b"[DONE]", raw[-200:]
        for item in events[:-1]:
            payload = json.loads(item)
            assert "error" not in payload, payload
    else:
        assert json.loads(raw)["choices"], raw[:500]


def check_control(gateway: InProcessGateway, model: str) -> None:
    """A well-formed request right after is served."""
    for path, body in (("/v1/completions", {"prompt": "def f(x):"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        status, _, raw = gateway.request(path, json.dumps({"model": model, "max_tokens": 2, "temperature": 0.0,
                                                           "ignore_eos": True, **body}).encode())
        assert status == 200, raw
        assert json.loads(raw)["usage"]["completion_tokens"] == 2


def fuzz_one(gateway: InProcessGateway, model: str, pair: tuple[str, bytes]) -> None:
    path, raw = pair
    status, headers, reply = gateway.request(path, raw)
    event(f"status {status}")  # --hypothesis-show-statistics: how many reached the draft service
    check_answer(status, headers, reply)
    check_control(gateway, model)


# -- over the fake draft service -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fake_gateway():
    config = GatewayConfig(model_name=FAKE_MODEL)
    fakes: list[FakeDraft] = []

    def connect(config: GatewayConfig) -> FakeDraft:
        fakes.append(FakeDraft(config))
        return fakes[-1]

    app = create_app(config, chat=ChatTemplate(byte_bpe_tokenizer(), "byte-bpe"), connect_client=connect)
    gateway = InProcessGateway(app)
    gateway.fake = fakes[0]
    yield gateway
    gateway.close()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "x"}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})])
def test_cache_salt_reaches_the_sdk_call(fake_gateway, path, body, stream):
    salt = "tenant-é" + "s" * 248  # 256 characters: the longest allowed
    status, _, raw = fake_gateway.request(path, json.dumps({"model": FAKE_MODEL, "cache_salt": salt,
                                                            "stream": stream, **body}).encode())
    assert status == 200, raw
    assert fake_gateway.fake.calls[-1]["cache_salt"] == salt
    status, _, raw = fake_gateway.request(path, json.dumps({"model": FAKE_MODEL, **body}).encode())
    assert status == 200 and "cache_salt" not in fake_gateway.fake.calls[-1]  # unset: the SDK's default


@pytest.mark.parametrize("field,value", [("seed", -1), ("seed", 2**64), ("max_tokens", 2**31), ("top_k", 2**31),
                                         ("top_k", -1), ("num_speculative_tokens", 2**31), ("temperature", 1e39),
                                         ("top_p", -1e39), ("cache_salt", "s" * 257), ("cache_salt", "")])
def test_out_of_range_numbers_are_openai_400s(fake_gateway, field, value):
    """In-process, no stack: each field the wire carries is range-checked before the SDK call."""
    for path, body in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        status, _, raw = fake_gateway.request(path, json.dumps({"model": FAKE_MODEL, field: value, **body}).encode())
        assert status == 400, raw
        error = json.loads(raw)["error"]
        assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", field, None), error
        assert field in error["message"], error


@FUZZ
@given(pair=bodies(FAKE_MODEL))
def test_fuzzed_requests(fake_gateway, pair):
    fuzz_one(fake_gateway, FAKE_MODEL, pair)


@pytest.mark.slow
@FUZZ_SLOW
@given(pair=bodies(FAKE_MODEL))
def test_fuzzed_requests_long(fake_gateway, pair):
    fuzz_one(fake_gateway, FAKE_MODEL, pair)


# -- over the real tiny stack ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stack_gateway(text_stack):
    config = GatewayConfig(server=text_stack.draft, tokenizer=str(text_stack.target_dir))
    assert text_stack.target_dir.name == STACK_MODEL
    gateway = InProcessGateway(create_app(config))
    yield gateway
    gateway.close()


def edge(path: str, **fields) -> tuple[str, bytes]:
    key, value = ("prompt", "def f(x):") if path == "/v1/completions" else (
        "messages", [{"role": "user", "content": "hi"}])
    return path, json.dumps({"model": STACK_MODEL, key: value, "max_tokens": 3, **fields}).encode()


# the edges of each field the wire carries, always tried on the real stack (the fuzz may or may not reach them)
EDGES = [edge("/v1/completions", seed=-1), edge("/v1/completions", seed=2**64), edge("/v1/completions", seed=2**63 - 1),
         edge("/v1/completions", max_tokens=2**31), edge("/v1/chat/completions", max_completion_tokens=2**31),
         edge("/v1/completions", top_k=2**31), edge("/v1/completions", top_k=2**31 - 1),
         edge("/v1/chat/completions", num_speculative_tokens=2**31), edge("/v1/completions", temperature=1e39),
         edge("/v1/completions", prompt=[5, 2**31]), edge("/v1/completions", prompt=[5, -1]),
         edge("/v1/completions", stop=["\ud800"]), edge("/v1/completions", prompt="\udfff", stream=True),
         edge("/v1/chat/completions", messages=[{"role": "user", "content": "\ud800"}]),
         edge("/v1/completions", cache_salt="s" * 256), edge("/v1/completions", cache_salt="s" * 257)]


def with_edges(test):
    for pair in EDGES:
        test = example(pair=pair)(test)
    return test


@ONE_FAMILY
@STACK
@with_edges
@given(pair=bodies(STACK_MODEL).map(small))
def test_fuzzed_requests_on_the_real_stack(stack_gateway, pair):
    fuzz_one(stack_gateway, STACK_MODEL, pair)


@pytest.mark.slow
@ONE_FAMILY
@STACK_SLOW
@given(pair=bodies(STACK_MODEL).map(small))
def test_fuzzed_requests_on_the_real_stack_long(stack_gateway, pair):
    fuzz_one(stack_gateway, STACK_MODEL, pair)


@ONE_FAMILY
def test_fuzzing_left_the_stack_idle(text_stack, stack_gateway):
    text_stack.wait_for_metric("specwire_draft_active_generations", 0, draft=True)
    text_stack.wait_for_metric("specwire_kv_blocks_used", 0)
