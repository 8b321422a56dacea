"""The OpenAI gateway through the official `openai` package, unmodified, against real services (specwire.testing's
LocalStack over the tiny Qwen2 pair): completions and chat, streamed and not, equal to the SDK's output; usage
counts; OpenAI-style errors with the right statuses; bearer tokens; a client that disconnects mid-stream frees its
sequence on both services."""

from __future__ import annotations

import http.client
import json
import time
import urllib.request

import grpc
import openai
import pytest
import torch
from transformers import AutoTokenizer

from gateway.api_errors import from_grpc
from specwire.testing import LocalStack, table_model, text_pair

PROMPT = "def fibonacci(n):"
MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "fibonacci, please"}]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    root = tmp_path_factory.mktemp("gateway")
    target, draft = text_pair(root, "qwen2")
    with LocalStack.start(target, draft, log_dir=root / "logs", dtype="float64") as stack:
        yield stack, stack.start_gateway()


@pytest.fixture(scope="module")
def client(gateway):
    _, url = gateway
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _model(client) -> str:
    return client.models.list().data[0].id


def test_models_and_health(gateway, client):
    stack, url = gateway
    models = client.models.list().data
    assert [m.id for m in models] == [stack.target_dir.name]
    assert client.models.retrieve(models[0].id).id == models[0].id
    with urllib.request.urlopen(url + "/health") as reply:
        assert json.load(reply) == {"status": "ok", "draft": "SERVING", "verifier": "CONNECTED"}


@pytest.mark.parametrize("stream", [False, True])
def test_completions_equal_the_sdk(gateway, client, stream):
    stack, _ = gateway
    with stack.client() as sdk:
        expected = sdk.generate(PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True)
    kwargs = dict(model=_model(client), prompt=PROMPT, max_tokens=12, temperature=0.0,
                  extra_body={"ignore_eos": True})
    if stream:
        chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        usage = chunks[-1].usage
        assert not chunks[-1].choices and all(c.usage is None for c in chunks[:-1])
    else:
        out = client.completions.create(**kwargs)
        text, finish, usage = out.choices[0].text, [out.choices[0].finish_reason], out.usage
        assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert text == expected.text
    assert finish == ["length"]
    assert (usage.prompt_tokens, usage.completion_tokens) == (expected.stats.num_prompt_tokens, 12)
    assert usage.total_tokens == usage.prompt_tokens + 12


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_the_sdk_over_the_chat_template(gateway, client, stream):
    stack, _ = gateway
    tokenizer = AutoTokenizer.from_pretrained(stack.target_dir)
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)["input_ids"]
    with stack.client() as sdk:
        expected = sdk.generate(prompt_token_ids=ids, max_tokens=10, temperature=0.0, ignore_eos=True)
    kwargs = dict(model=_model(client), messages=MESSAGES, max_completion_tokens=10, temperature=0.0,
                  extra_body={"ignore_eos": True})
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    else:
        out = client.chat.completions.create(**kwargs)
        assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
        text, usage = out.choices[0].message.content, out.usage
        assert out.choices[0].finish_reason == "length"
    assert text == expected.text
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), 10)


def test_stop_strings_and_seeded_sampling(client):
    model = _model(client)
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0.0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[4:7]
    cut = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0.0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].text == full[:full.index(stop)] and cut.choices[0].finish_reason == "stop"
    seeded = [client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0.9, seed=5,
                                        extra_body={"ignore_eos": True}).choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_speculative_statistics_only_when_asked(client):
    model = _model(client)
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0.0)
    assert "specwire_stats" not in (plain.model_extra or {})
    asked = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0.0,
                                      extra_body={"specwire_stats": True, "ignore_eos": True})
    stats = asked.model_extra["specwire_stats"]
    assert stats["num_generated_tokens"] == 8 and stats["num_rounds"] >= 1
    assert stats["num_accepted_tokens"] <= stats["num_draft_tokens"]
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, stream=True,
                                                 extra_body={"specwire_stats": True, "ignore_eos": True}))
    assert chunks[-1].model_extra["specwire_stats"]["num_generated_tokens"] == 6


@pytest.mark.parametrize("kwargs,error,status,fragment", [
    (dict(model="gpt-4"), openai.NotFoundError, 404, "does not exist"),
    (dict(max_tokens=-1), openai.BadRequestError, 400, "max_tokens"),
    (dict(max_tokens=0), openai.BadRequestError, 400, "max_tokens"),
    (dict(n=2), openai.BadRequestError, 400, "n = 2"),
    (dict(temperature=-1.0), openai.BadRequestError, 400, "temperature"),
    (dict(logprobs=2), openai.BadRequestError, 400, "logprobs"),
    (dict(extra_body={"wire_mode": "dense"}), openai.BadRequestError, 400, "wire_mode"),
    (dict(prompt=["a", "b"]), openai.BadRequestError, 400, "batched prompts"),
    # integers the wire cannot carry (int32, uint64) or the services refuse: 400s, never the wire's own 500
    (dict(seed=-1), openai.BadRequestError, 400, "seed"),
    (dict(seed=2**63), openai.BadRequestError, 400, "seed"),
    (dict(seed=2**64), openai.BadRequestError, 400, "seed"),
    (dict(max_tokens=2**31), openai.BadRequestError, 400, "max_tokens"),
    (dict(extra_body={"top_k": 2**31}), openai.BadRequestError, 400, "top_k"),
    (dict(extra_body={"top_k": -(2**31) - 1}), openai.BadRequestError, 400, "top_k"),
    (dict(extra_body={"num_speculative_tokens": 2**31}), openai.BadRequestError, 400, "num_speculative_tokens"),
    (dict(extra_body={"num_speculative_tokens": -1}), openai.BadRequestError, 400, "num_speculative_tokens"),
    (dict(prompt=[5, 2**31]), openai.BadRequestError, 400, "prompt token ids"),
    (dict(prompt=[[5, -1]]), openai.BadRequestError, 400, "prompt token ids"),
    (dict(temperature=1e39), openai.BadRequestError, 400, "temperature"),
    (dict(extra_body={"cache_salt": "s" * 257}), openai.BadRequestError, 400, "cache_salt"),
    (dict(extra_body={"cache_salt": ""}), openai.BadRequestError, 400, "cache_salt"),
    (dict(extra_body={"cache_salt": 7}), openai.BadRequestError, 400, "cache_salt"),
])
def test_bad_completion_requests_get_openai_errors(client, kwargs, error, status, fragment):
    args = dict(model=_model(client), prompt=PROMPT, max_tokens=4) | kwargs
    with pytest.raises(error) as err:
        client.completions.create(**args)
    assert err.value.status_code == status
    assert fragment in err.value.message, err.value.message
    assert set(err.value.body) == {"message", "type", "param", "code"}  # OpenAI's error object


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "seed"])
def test_out_of_range_chat_integers_are_400s(gateway, client, field):
    _, url = gateway
    value = -1 if field == "seed" else 2**31
    status, body = _raw(url, "/v1/chat/completions", json.dumps({"model": _model(client), "messages": MESSAGES,
                                                                 field: value}).encode())
    assert status == 400, body
    assert body["error"]["param"] == field and body["error"]["type"] == "invalid_request_error", body


def test_a_string_that_is_not_unicode_is_a_400(gateway, client):
    """JSON's \\ud800 escape is a lone surrogate, which no UTF-8 encoder takes: refused before the wire."""
    _, url = gateway
    for path, body in (("/v1/completions", b'{"model": "m", "prompt": "a\\ud800"}'),
                       ("/v1/completions", b'{"model": "m", "prompt": "a", "stop": ["\\udfff"]}'),
                       ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}')):
        status, reply = _raw(url, path, body.replace(b'"m"', json.dumps(_model(client)).encode()))
        assert status == 400 and "not valid Unicode" in reply["error"]["message"], reply


def test_cache_salt_is_accepted_and_keeps_the_output(client):
    model = _model(client)
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True})
    plain = client.completions.create(**kwargs).choices[0].text
    salted = client.completions.create(**{**kwargs, "extra_body": {"ignore_eos": True, "cache_salt": "tenant-a"}})
    assert salted.choices[0].text == plain
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3,
                                          extra_body={"cache_salt": "tenant-b"})
    assert chat.usage.completion_tokens >= 1


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_refused_streamed_request_gets_its_status_not_a_200(client, endpoint):
    """The services' refusal arrives before the first token: the stream has not begun, so it is a plain 400."""
    model = _model(client)
    with pytest.raises(openai.BadRequestError) as err:
        if endpoint == "chat":
            list(client.chat.completions.create(model=model, messages=MESSAGES, stream=True, temperature=-0.5))
        else:
            list(client.completions.create(model=model, prompt=PROMPT, stream=True, top_p=0.0))
    assert err.value.status_code == 400
    assert ("temperature" if endpoint == "chat" else "top_p") in err.value.message


def _raw(url: str, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url + path, data=body, headers={"Content-Type": "application/json",
                                                                      **(headers or {})})
    try:
        with urllib.request.urlopen(request) as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def test_malformed_json_and_an_empty_chat_get_400(gateway, client):
    _, url = gateway
    status, body = _raw(url, "/v1/completions", b'{"model": "x", "prompt": ')
    assert status == 400 and body["error"]["type"] == "invalid_request_error" and "JSON" in body["error"]["message"]
    status, body = _raw(url, "/v1/chat/completions", json.dumps({"model": _model(client), "messages": []}).encode())
    assert status == 400 and "messages" in body["error"]["message"]
    status, body = _raw(url, "/v1/nowhere", b"{}")
    assert status == 404 and body["error"]["type"] == "not_found_error"


def test_grpc_statuses_map_to_http_statuses():
    cases = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400,
             grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
             grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.INTERNAL: 500, grpc.StatusCode.UNKNOWN: 500,
             grpc.StatusCode.UNAUTHENTICATED: 503}  # the gateway's own credentials: not the caller's fault
    for code, status in cases.items():
        err = from_grpc(code, "why")
        assert err.status == status and err.body()["error"]["message"].endswith("why"), code
    assert from_grpc(grpc.StatusCode.RESOURCE_EXHAUSTED, "full").body()["error"]["type"] == "rate_limit_error"


def test_bearer_tokens(gateway, tmp_path):
    stack, _ = gateway
    tokens = tmp_path / "tokens"
    tokens.write_text("first-token\nsecond-token\n")
    url = stack.start_gateway("--auth-token-file", str(tokens))
    for key in ("wrong", "first-toke", "first-token-and-more"):
        with pytest.raises(openai.AuthenticationError) as err:
            openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0).models.list()
        assert err.value.status_code == 401
    status, body = _raw(url, "/v1/completions", b"{}")  # no Authorization header at all
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    for key in ("first-token", "second-token"):
        good = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        model = good.models.list().data[0].id
        assert good.completions.create(model=model, prompt="x", max_tokens=2).usage.completion_tokens >= 1
    with urllib.request.urlopen(url + "/health") as reply:  # health stays open
        assert reply.status == 200
    with pytest.raises(urllib.error.HTTPError) as err:  # metrics need a token: they tell who sends how much
        urllib.request.urlopen(url + "/metrics")
    assert err.value.code == 401 and json.load(err.value)["error"]["code"] == "invalid_api_key"
    request = urllib.request.Request(url + "/metrics", headers={"Authorization": "Bearer second-token"})
    with urllib.request.urlopen(request) as reply:
        assert b"specwire_gateway_requests_total" in reply.read()


def test_a_client_that_disconnects_mid_stream_frees_the_sequence_on_both_services(gateway, client):
    stack, url = gateway
    host, port = url.removeprefix("http://").split(":")
    before = stack.metric("specwire_draft_requests_total", {"outcome": "cancelled"}, draft=True) or 0.0
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": MESSAGES})):
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("POST", path, json.dumps({"model": _model(client), "max_tokens": 400, "stream": True,
                                               "temperature": 0.0, "ignore_eos": True, **body}),
                     {"Content-Type": "application/json"})
        reply = conn.getresponse()
        assert reply.status == 200
        while b'"text"' not in (line := reply.readline()) and b'"content": "' not in line.replace(
                b'"content": ""', b""):
            assert line.startswith((b"data: ", b"\n")), line  # skip the chat's role chunk: wait for tokens
        conn.sock.close()  # the client goes away mid-stream
        conn.close()
    # unstreamed: the client gives up before the answer
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"model": _model(client), "max_tokens": 400, "prompt": PROMPT,
                                                        "temperature": 0.0, "ignore_eos": True}),
                 {"Content-Type": "application/json"})
    deadline = time.monotonic() + 10
    while not stack.metric("specwire_draft_active_generations", draft=True):
        assert time.monotonic() < deadline, "the unstreamed generation never started"
        time.sleep(0.02)
    conn.sock.close()
    conn.close()
    stack.wait_idle()
    deadline = time.monotonic() + 10
    while (stack.metric("specwire_draft_requests_total", {"outcome": "cancelled"}, draft=True) or 0.0) < before + 3:
        assert time.monotonic() < deadline, "the draft service did not see the three generations cancelled"
        time.sleep(0.05)


def test_chat_without_a_chat_template_is_a_clear_400(gateway, tmp_path):
    stack, _ = gateway
    plain = table_model(tmp_path / "no-template", torch.full((8, 8), 1 / 8))  # a word tokenizer: no template
    for tokenizer, fragment in ((None, "--tokenizer"), (plain, "has no chat template")):
        service = stack.stack.start_gateway(stack.draft, tokenizer=tokenizer, args=("--model-name", "m"))
        status, body = _raw(service.address, "/v1/chat/completions",
                            json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode())
        assert status == 400 and fragment in body["error"]["message"], body
        status, _ = _raw(service.address, "/v1/completions", json.dumps({"model": "m", "prompt": "hi",
                                                                          "max_tokens": 2}).encode())
        assert status == 200  # completions need no template
        service.stop()


def test_prometheus_metrics_count_requests_by_endpoint_and_status(gateway, client):
    _, url = gateway
    model = _model(client)
    client.completions.create(model=model, prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    with urllib.request.urlopen(url + "/metrics") as reply:  # open: this gateway has no --auth-token-file
        text = reply.read().decode()
    assert 'specwire_gateway_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert 'specwire_gateway_requests_total{endpoint="/v1/completions",status="404"}' in text
    assert 'specwire_gateway_response_seconds_count{endpoint="/v1/completions"}' in text
