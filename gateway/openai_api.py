"""The OpenAI API's requests as the gateway takes them: the request models (pydantic) and what specwire does with
each field (its errors: gateway.api_errors; its answers' shapes: gateway.answers). No I/O here."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from common.sampling import MAX_SEED
from gateway.api_errors import invalid
from specwire.v1.wire import MAX_CACHE_SALT_CHARS

# An unset max_tokens on chat: generate until the end-of-sequence token or the target's context length (the
# verifier ends the sequence there with finish reason "length").
UNBOUNDED_MAX_TOKENS = 1 << 30
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# The wire's integer types (protos/specwire/v1): max_tokens, top_k, num_speculative_tokens and token ids are
# int32, the seed uint64 (of which the services accept [0, 2^63 - 1]); temperature and top_p are float32.
INT32_MAX = (1 << 31) - 1
FLOAT32_MAX = 3.4028234663852886e38


class StreamOptions(BaseModel):
    include_usage: bool = False


def _has_lone_surrogate(value: Any) -> bool:
    """Whether any string in a parsed JSON value (keys included) is not valid Unicode. Iterative: a deeply
    nested body must not exhaust the stack."""
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            todo.extend(item.keys())
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)
    return False


def _check_int(value: int | None, name: str, low: int, high: int, bounds: str) -> None:
    if value is not None and not low <= value <= high:
        raise invalid(f"{name} must be an integer in {bounds}, got {value}", name)


def _check_float32(value: float | None, name: str) -> None:
    """Only what the wire's float32 cannot carry; the services judge the value itself (NaN, negative, ...)."""
    if value is not None and math.isfinite(value) and abs(value) > FLOAT32_MAX:
        raise invalid(f"{name} {value:g} is beyond the range of a 32-bit float", name)


class _Request(BaseModel):
    """Fields both endpoints share. Unknown fields are accepted and ignored (clients send many); `check` refuses
    out-of-range numbers (400, never the wire's own exception: a 500) and the fields whose non-default value
    specwire cannot honour."""

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
    # vLLM's per-request prefix-cache salt: requests share cached KV only with requests of the same salt
    cache_salt: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        # NOTE: JSON's \ud800 escapes parse into lone surrogates, which no UTF-8 encoder (protobuf's, the
        # tokenizer's, the JSON answer's) takes: refused here, before any field is read.
        if _has_lone_surrogate(data):
            raise PydanticCustomError("invalid_unicode", "the body holds a string that is not valid Unicode (a "
                                      "lone surrogate escape such as \\ud800)")
        return data

    def check(self) -> None:
        """400 for what the services could not be sent or cannot honour."""
        self.check_ranges()
        self.check_unsupported()

    def check_ranges(self) -> None:
        _check_int(self.seed, "seed", 0, MAX_SEED, "[0, 2^63 - 1]")
        _check_int(self.top_k, "top_k", 0, INT32_MAX, "[0, 2^31 - 1] (0 disables it)")
        _check_int(self.num_speculative_tokens, "num_speculative_tokens", 0, INT32_MAX, "[0, 2^31 - 1]")
        _check_float32(self.temperature, "temperature")
        _check_float32(self.top_p, "top_p")
        if self.cache_salt is not None and not 1 <= len(self.cache_salt) <= MAX_CACHE_SALT_CHARS:
            raise invalid(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters, "
                          f"got {len(self.cache_salt)}", "cache_salt")

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
        if self.cache_salt is not None:
            kwargs["cache_salt"] = self.cache_salt
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

    def check_ranges(self) -> None:
        super().check_ranges()
        prompts = self.prompt if isinstance(self.prompt, list) else []
        ids = (t for p in prompts for t in (p if isinstance(p, list) else [p]) if isinstance(t, int))
        bad = next((t for t in ids if not 0 <= t <= INT32_MAX), None)
        if bad is not None:  # the wire's int32; the draft service judges the vocabulary
            raise invalid(f"prompt token ids must be integers in [0, 2^31 - 1], got {bad}", "prompt")
        if self.max_tokens is not None:
            _positive(self.max_tokens, "max_tokens")

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

    def check_ranges(self) -> None:
        super().check_ranges()
        for name in ("max_tokens", "max_completion_tokens"):
            if getattr(self, name) is not None:
                _positive(getattr(self, name), name)

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
    """A token count: at least 1 and within the wire's int32."""
    if value < 1:
        raise invalid(f"{name} must be at least 1, got {value}", name)
    _check_int(value, name, 1, INT32_MAX, "[1, 2^31 - 1]")
    return value
