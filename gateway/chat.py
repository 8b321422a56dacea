"""Chat prompts: messages rendered with the model's own chat template into token ids."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from gateway.api_errors import ApiError

# The most characters a conversation's messages may hold (roles and contents together): rendering and tokenizing
# take time in proportion, and no target's context holds more (a 400 above it).
MAX_CHAT_CHARS = 1 << 22


class ChatTemplate:
    """The tokenizer of --tokenizer, loaded once; None of it when the gateway has no tokenizer. Conversations are
    rendered on a thread of their own, one at a time (a tokenizer is not safe to share between threads), never on
    the event loop that serves every request."""

    def __init__(self, tokenizer: Any | None, source: str | None, max_chars: int = MAX_CHAT_CHARS) -> None:
        self.tokenizer = tokenizer
        self.source = source
        self.max_chars = max_chars
        self._thread: ThreadPoolExecutor | None = None

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
            self._thread = None

    @classmethod
    def load(cls, path: str | None) -> ChatTemplate:
        if not path:
            return cls(None, None)
        from common.model_loading import load_tokenizer

        return cls(load_tokenizer(path), str(Path(path)))

    async def render(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of the conversation followed by the assistant's turn. 400 when there is no template or the
        messages hold more than max_chars characters."""
        if self.tokenizer is None:
            raise ApiError(400, "chat needs the model's chat template: start the gateway with --tokenizer PATH (the "
                           "draft's or the target's model directory)", param="messages")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(400, f"the model's tokenizer ({self.source}) has no chat template: use /v1/completions",
                           param="messages")
        num_chars = sum(len(m["role"]) + len(m["content"]) for m in messages)
        if num_chars > self.max_chars:
            raise ApiError(400, f"the messages hold {num_chars} characters; this gateway renders at most "
                           f"{self.max_chars}", param="messages")
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="specwire-chat-template")
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._render, messages)

    def _render(self, messages: list[dict[str, str]]) -> list[int]:
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as err:  # noqa: BLE001 - a template may reject a conversation (say, roles out of order)
            raise ApiError(400, f"the chat template refused these messages: {err}", param="messages") from err
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
