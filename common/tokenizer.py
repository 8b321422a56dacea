"""Tokenizer identity and streaming detokenization."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of the tokenizer's canonical definition: vocabulary, merges, normaliser, pre-tokeniser and
    added tokens, without runtime settings (padding, truncation). Two tokenizers with the same fingerprint
    map text to the same ids, which is what drafting for another model's verifier needs."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        spec.pop("truncation", None)
        spec.pop("padding", None)
    else:  # slow tokenizers: the vocabulary and the special tokens
        spec = {"vocab": sorted(tokenizer.get_vocab().items()), "special": sorted(map(str, tokenizer.all_special_tokens))}
    canonical = json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into text deltas.

    Bytes of a multi-byte character may arrive in different tokens; text that ends in U+FFFD is held back
    until the character completes (or the generation ends)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.text = ""

    def add(self, token_ids: list[int], *, final: bool = False) -> str:
        """Append tokens; return the new text that is now certain."""
        self.token_ids.extend(token_ids)
        full = self._tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if not final:
            while full.endswith("\ufffd"):
                full = full[:-1]
        if not full.startswith(self.text):
            # A later token changed how earlier bytes decode; keep what was sent and continue after it.
            full = self.text + full[len(self.text):]
        delta = full[len(self.text):]
        self.text = full
        return delta
