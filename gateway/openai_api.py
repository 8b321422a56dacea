"""The OpenAI API as the gateway speaks it: request models (pydantic), what specwire does with each field, the
error JSON and the mapping from gRPC status codes to HTTP statuses. No I/O here."""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict
from typing import Any, Literal

import grpc
from pydantic import BaseModel, ConfigDict, Field

from specwire.client import Result, Stats

# An unset max_tokens on chat: generate until the end-of-sequence token or the target's context length (the
# verifier ends the sequence there with finish reason "length").
UNBOUNDED_MAX_TOKENS = 1 << 30
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class ApiError(Exception):
    """An OpenAI-style error: HTTP status, `type`, message, and the offending parameter when there is one."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


# gRPC status -> (HTTP status, OpenAI error type)
_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
}


def from_grpc(code: grpc.StatusCode, message: str) -> ApiError:
    """The draft service's answer as the HTTP client sees it: its message, under the status its code maps to
    (500 server_error for the rest). 401 from the draft service is the gateway's own credentials' fault: 503."""
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return ApiError(503, f"the gateway's credentials were refused by the draft service: {message}",
                        type="service_unavailable_error")
    status, kind = _STATUS.get(code, (500, "server_error"))
    return ApiError(status, message, type=kind, code=code.name.lower())


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    """Fields both endpoints share. Unknown fields are accepted and ignored (clients send many); fields whose
    non-default value specwire cannot honour are refused in `check_unsupported`."""

    model_config = ConfigDict(extra="allow")

    model: str
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # specwire's extensions (vLLM style: extra top-level fields; extra_body= in the openai package)
    top_k: int = 0
    ignore_eos: bool = False
    num_speculative_tokens: int | None = None
    wire_mode: Literal["sparse", "one-hot", "coupled"] | None = None
    specwire_stats: bool = Field(False, description="add the speculative statistics to the response")

    def check_unsupported(self) -> None:
        if self.n != 1:
            raise invalid(f"n = {self.n} is not supported: specwire returns one choice per request (n = 1)", "n")
        if self.presence_penalty or self.frequency_penalty:
            raise invalid("presence_penalty and frequency_penalty are not supported (they would change the target "
                          "distribution the verifier samples)", "presence_penalty")
        if self.logit_bias:
            raise invalid("logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed with stream = true", "stream_options")

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def generate_kwargs(self, max_tokens: int) -> dict[str, Any]:
        """The SDK's generate() arguments, besides the prompt."""
        kwargs: dict[str, Any] = dict(max_tokens=max_tokens, top_k=self.top_k, stop=self.stop_list(),
                                      ignore_eos=self.ignore_eos, seed=self.seed,
                                      num_speculative_tokens=self.num_speculative_tokens, wire_mode=self.wire_mode)
        kwargs["temperature"] = 1.0 if self.temperature is None else self.temperature
        kwargs["top_p"] = 1.0 if self.top_p is None else self.top_p
        return kwargs

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        for name, value, default in (("echo", self.echo, False), ("logprobs", self.logprobs, None),
                                     ("suffix", self.suffix, None)):
            if value != default:
                raise invalid(f"{name} is not supported", name)
        if self.best_of not in (None, 1):
            raise invalid("best_of > 1 is not supported", "best_of")

    def prompt_kwargs(self) -> dict[str, Any]:
        """One prompt, as text or token ids; a batch of prompts is refused."""
        p = self.prompt
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            return {"prompt": p}
        if isinstance(p, list) and all(isinstance(t, int) for t in p):
            return {"prompt_token_ids": p}
        raise invalid("batched prompts are not supported: send one prompt per request", "prompt")

    def max_new_tokens(self) -> int:
        return COMPLETIONS_DEFAULT_MAX_TOKENS if self.max_tokens is None else _positive(self.max_tokens, "max_tokens")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    response_format: dict | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.logprobs or self.top_logprobs:
            raise invalid("logprobs are not supported", "logprobs")
        if self.tools:
            raise invalid("tools are not supported", "tools")
        if self.response_format and self.response_format.get("type") != "text":
            raise invalid("response_format other than text is not supported", "response_format")

    def max_new_tokens(self) -> int:
        if self.max_completion_tokens is not None:
            return _positive(self.max_completion_tokens, "max_completion_tokens")
        if self.max_tokens is not None:
            return _positive(self.max_tokens, "max_tokens")
        return UNBOUNDED_MAX_TOKENS

    def template_messages(self) -> list[dict[str, str]]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


def _positive(value: int, name: str) -> int:
    if value < 1:
        raise invalid(f"{name} must be at least 1, got {value}", name)
    return value


# -- responses -------------------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(result: Result) -> dict[str, int]:
    s = result.stats
    prompt, completion = (s.num_prompt_tokens, s.num_generated_tokens) if s else (0, len(result.token_ids))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def finish_reason(result: Result) -> str | None:
    reason = result.finish_reason
    return None if reason in (None, "cancelled") else reason


def stats_extension(stats: Stats | None) -> dict | None:
    """The speculative statistics of one request (the `specwire_stats` field), or None."""
    if stats is None:
        return None
    out = asdict(stats)
    out["mean_acceptance_length"] = stats.num_generated_tokens / stats.num_rounds if stats.num_rounds else 0.0
    out["acceptance_rate_per_position"] = [a / d if d else 0.0 for a, d in
                                           zip(stats.accepted_per_position, stats.drafted_per_position, strict=False)]
    return out


def now() -> int:
    return int(time.time())
