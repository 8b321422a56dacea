"""The gateway's chat rendering, in process over a fake draft service: the chat template runs off the event loop
(other requests are served while one renders), and a conversation above the size cap is a 400 in OpenAI's error
shape, refused before any rendering."""

from __future__ import annotations

import asyncio
import json
import threading

from test_gateway_fuzz import FakeDraft, InProcessGateway

from gateway.app import create_app
from gateway.chat import ChatTemplate
from gateway.config import GatewayConfig

MODEL = "chat-model"


class BlockingTemplate:
    """A tokenizer whose chat template waits until `release` is set (at most 30 s, so a render on the event loop
    fails the test instead of hanging it)."""

    chat_template = "{{ messages }}"

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.released_in_time: bool | None = None
        self.calls = 0

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        self.calls += 1
        self.started.set()
        self.released_in_time = self.release.wait(timeout=30)
        return [1, 2, 3]


def _gateway(template: BlockingTemplate, **chat) -> InProcessGateway:
    return InProcessGateway(create_app(GatewayConfig(model_name=MODEL), chat=ChatTemplate(template, "t", **chat),
                                       connect_client=FakeDraft))


def _chat_body(content: str) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2}).encode()


def test_a_chat_template_renders_off_the_event_loop():
    template = BlockingTemplate()
    gateway = _gateway(template)
    try:
        chat = asyncio.run_coroutine_threadsafe(
            gateway._call("POST", "/v1/chat/completions", _chat_body("hi"), {"content-type": "application/json"}),
            gateway.loop)
        assert template.started.wait(30)
        # the loop answers while the template renders
        status, _, body = gateway.request("/v1/completions", json.dumps({"model": MODEL, "prompt": "x",
                                                                         "max_tokens": 2}).encode())
        assert status == 200, body
        template.release.set()
        status, _, body = chat.result(30)
        assert status == 200, body
        assert template.released_in_time
    finally:
        template.release.set()
        gateway.close()


def test_a_conversation_above_the_size_cap_is_a_400_before_rendering():
    template = BlockingTemplate()
    template.release.set()
    gateway = _gateway(template, max_chars=100)
    try:
        status, _, body = gateway.request("/v1/chat/completions", _chat_body("x" * 97))  # "user" + 97 = 101
        error = json.loads(body)["error"]
        assert status == 400 and error["param"] == "messages" and error["type"] == "invalid_request_error", error
        assert "101 characters" in error["message"] and "at most 100" in error["message"]
        assert template.calls == 0
        status, _, body = gateway.request("/v1/chat/completions", _chat_body("x" * 96))  # exactly 100
        assert status == 200, body
    finally:
        gateway.close()
