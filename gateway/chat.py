"""Chat prompts: messages rendered with the model's own chat template into token ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gateway.openai_api import ApiError


class ChatTemplate:
    """The tokenizer of --tokenizer, loaded once; None of it when the gateway has no tokenizer."""

    def __init__(self, tokenizer: Any | None, source: str | None) -> None:
        self.tokenizer = tokenizer
        self.source = source

    @classmethod
    def load(cls, path: str | None) -> ChatTemplate:
        if not path:
            return cls(None, None)
        from common.model_loading import load_tokenizer

        return cls(load_tokenizer(path), str(Path(path)))

    def render(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of the conversation followed by the assistant's turn. 400 when there is no template."""
        if self.tokenizer is None:
            raise ApiError(400, "chat needs the model's chat template: start the gateway with --tokenizer PATH (the "
                           "draft's or the target's model directory)", param="messages")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(400, f"the model's tokenizer ({self.source}) has no chat template: use /v1/completions",
                           param="messages")
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as err:  # noqa: BLE001 - a template may reject a conversation (say, roles out of order)
            raise ApiError(400, f"the chat template refused these messages: {err}", param="messages") from err
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
