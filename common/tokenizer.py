"""Tokenizer identity, prompt encoding off the event loop, and streaming detokenization."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from common.errors import invalid_argument

T = TypeVar("T")


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



# Prompts up to this many characters are encoded on the event loop: a fraction of a millisecond, less than the hop
# to a thread, and they never queue behind a long prompt being encoded.
INLINE_PROMPT_CHARS = 4096
# Token-id prompts up to this many ids are converted and checked on the event loop, for the same reason.
INLINE_PROMPT_IDS = 4096
ENCODE_THREADS = 2


class PromptEncoder:
    """Prompt text -> token ids. A long prompt is encoded on a small pool of its own, so neither the event loop
    (every stream, the health checks) nor the default executor waits for it; `max_prompt_bytes` bounds how long
    one encode can hold a thread (gRPC's message limit alone lets a 60 MB prompt through)."""

    def __init__(self, tokenizer: Any, max_prompt_bytes: int, num_threads: int = ENCODE_THREADS) -> None:
        self._tokenizer = tokenizer
        self.max_prompt_bytes = max_prompt_bytes
        self._num_threads = num_threads
        self._pool: ThreadPoolExecutor | None = None
        if tokenizer is not None:
            # NOTE: transformers sets the fast backend's truncation and padding before each encode, a mutation that
            # raises "Already borrowed" while another thread encodes; it mutates only when they differ from what
            # the call wants, so one encode now, on one thread, leaves every later call nothing to change.
            tokenizer.encode("", add_special_tokens=False)

    async def encode(self, text: str) -> list[int]:
        if len(text) > self.max_prompt_bytes:  # every character is at least one byte: refused without counting
            raise self._too_long(f"at least {len(text)}")
        if len(text) <= INLINE_PROMPT_CHARS:
            return self._encode(text)
        return await self.call(self._encode, text)

    async def call(self, fn: Callable[..., T], *args: Any, inline: bool = False) -> T:
        """fn(*args) on the encode pool (say, a long token-id prompt converted and checked); inline: here."""
        if inline:
            return fn(*args)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._num_threads, thread_name_prefix="specwire-tokenize")
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _encode(self, text: str) -> list[int]:
        if len(text) * 4 > self.max_prompt_bytes:  # UTF-8 takes at most 4 bytes a character: count only here
            num_bytes = len(text.encode("utf-8", "surrogatepass"))
            if num_bytes > self.max_prompt_bytes:
                raise self._too_long(str(num_bytes))
        # NOTE: a fast tokenizer's encode goes through the Rust encode_batch, which releases the GIL
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def _too_long(self, num_bytes: str):
        return invalid_argument(f"prompt text is {num_bytes} bytes; this draft service takes at most "
                                f"{self.max_prompt_bytes} (--max-prompt-bytes)")


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into text deltas.

    Bytes of a multi-byte character may arrive in different tokens; text that ends in U+FFFD is held back
    until the character completes (or the generation ends). The text is what `full_decode_delta` makes of the
    decode of all the tokens so far. A fast tokenizer gets that decode incrementally from tokenizers'
    DecodeStream (only the tokens since its last complete chunk are decoded), so a long output costs O(n) on
    the event loop, not O(n^2); slow tokenizers decode everything on every call."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.token_ids: list[int] = []
        self._pieces: list[str] = []  # the deltas returned: the text is their concatenation
        self._stream = _StreamDecode.start(tokenizer)
        self._held = ""  # while streaming: the text returned beyond the stream's complete chunks

    @property
    def text(self) -> str:
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def incremental(self) -> bool:
        """Whether the text still comes from the stream (False: from full decodes)."""
        return self._stream is not None

    def add(self, token_ids: list[int], *, final: bool = False) -> str:
        """Append tokens; return the new text that is now certain."""
        self.token_ids.extend(token_ids)
        step = self._stream.feed(token_ids) if self._stream is not None and not final else None
        if step is not None:
            decoded, complete = step
            delta, sent = full_decode_delta(self._held, decoded, final=False)
            if complete and sent != decoded:  # the text left the stream's: full decodes from the next call
                self._stream = None
            self._held = "" if complete else sent
        else:
            # NOTE: full decodes from here on: after the final flush, or where the decoder is not local (a later
            # token changes how earlier ones decode). The text so far is the full decodes' text, so switching at
            # any call keeps it exact.
            self._stream = None
            delta, _ = full_decode_delta(self.text, self._tokenizer.decode(self.token_ids, skip_special_tokens=True),
                                         final=final)
        self._pieces.append(delta)
        return delta


def full_decode_delta(sent: str, full: str, *, final: bool) -> tuple[str, str]:
    """(the new text, all the text sent) once the tokens decode to `full`, `sent` having been sent."""
    if not final:
        full = full.rstrip("\ufffd")
    if not full.startswith(sent):
        # A later token changed how earlier bytes decode; keep what was sent and continue after it.
        full = sent + full[len(sent):]
    return full[len(sent):], full


# Tokens the stream may hold back without a complete chunk before full decodes take over (see _StreamDecode.feed).
MAX_PENDING_TOKENS = 16


class _StreamDecode:
    """The decode of the tokens given since DecodeStream's last complete chunk, and whether it now is one.

    NOTE: DecodeStream keeps the tokens of its last chunk as context (a decoder that strips a leading space
    needs it) and says nothing while the text ends in U+FFFD. While it withholds text the tokens since are
    decoded here, in the same context (`_context_ids`, mirrored). Exact while decoding is local: decode(a + b) ==
    decode(a) + decode(c + b) - decode(c) when a ends in c at a complete character; true of byte-level BPE, byte
    fallback and metaspace decoders, and DecodeStream raises where it sees otherwise."""

    def __init__(self, backend: Any, stream: Any) -> None:
        self._backend = backend
        self._stream = stream
        self._context_ids: list[int] = []  # the tokens of its last chunk
        self._context_text: str | None = ""  # their decode, once needed
        self._pending_ids: list[int] = []  # the tokens given since

    @classmethod
    def start(cls, tokenizer: Any) -> _StreamDecode | None:
        """None where the tokenizer's decode is more than its fast backend's (slow tokenizers, a subclass's own
        decode, clean-up of tokenization spaces) or DecodeStream is missing."""
        try:
            from tokenizers import Tokenizer
            from tokenizers.decoders import DecodeStream
            from transformers.tokenization_utils_base import PreTrainedTokenizerBase
            from transformers.tokenization_utils_tokenizers import TokenizersBackend
        except ImportError:
            return None
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if not isinstance(tokenizer, TokenizersBackend) or not isinstance(backend, Tokenizer):
            return None
        kind = type(tokenizer)
        if kind.decode is not PreTrainedTokenizerBase.decode or kind._decode is not TokenizersBackend._decode:
            return None
        # TokenizersBackend._decode cleans up spaces when asked to, except for BPE models (unless forced)
        if getattr(tokenizer, "clean_up_tokenization_spaces", False) and (
                type(backend.model).__name__ != "BPE"
                or getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
                           False)):
            return None
        return cls(backend, DecodeStream(skip_special_tokens=True))

    def feed(self, token_ids: list[int]) -> tuple[str, bool] | None:
        """(the decode of the tokens since the last complete chunk, whether it is a complete chunk now), or None
        where it cannot be told exactly."""
        if token_ids:
            try:
                chunk = self._stream.step(self._backend, list(token_ids))
            except Exception:  # noqa: BLE001 - its prefix check failed: the decoder is not local
                return None
            if chunk is not None:
                self._context_ids = [*self._pending_ids, *token_ids]
                self._context_text = None
                self._pending_ids = []
                return chunk, True
            self._pending_ids.extend(token_ids)
        if not self._pending_ids:
            return "", False
        if len(self._pending_ids) > MAX_PENDING_TOKENS:
            # NOTE: a long run of tokens that never completes a character (say, stray UTF-8 lead bytes) would cost
            # a decode of all of them per token here, and in DecodeStream, which keeps them too: O(n^2). Past the
            # cap the text comes from full decodes, which give the same text (the caller switches exactly).
            return None
        if self._context_text is None:
            self._context_text = self._decode(self._context_ids)
        window = self._decode([*self._context_ids, *self._pending_ids])
        if not window.startswith(self._context_text):
            return None
        return window[len(self._context_text):], False

    def _decode(self, token_ids: list[int]) -> str:
        return self._backend.decode(token_ids, skip_special_tokens=True)
