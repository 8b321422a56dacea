"""A generation's text: verified tokens are detokenized incrementally, and text that could still become a stop
string is held back until it cannot (or ends the generation when it does)."""

from __future__ import annotations

from typing import Any

from common.errors import invalid_argument
from common.tokenizer import IncrementalDetokenizer

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024


def check_stop_strings(stop: tuple[str, ...]) -> None:
    """Stop strings are matched against every streamed character: a bounded number of bounded, non-empty ones."""
    if len(stop) > MAX_STOP_STRINGS:
        raise invalid_argument(f"{len(stop)} stop strings; at most {MAX_STOP_STRINGS} are allowed")
    for s in stop:
        if not s:
            raise invalid_argument("stop strings must be non-empty")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise invalid_argument(f"a stop string of {len(s)} characters; at most {MAX_STOP_STRING_CHARS} are "
                                   "allowed")


class StopStringMatcher:
    """Stop strings over streamed text."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._text = ""
        self._emitted = 0

    def feed(self, delta: str, *, final: bool = False) -> tuple[str, bool]:
        """Add new text; return (text safe to emit now, whether a stop string was found)."""
        self._text += delta
        search_from = max(0, self._emitted - self._hold)
        hits = [i for i in (self._text.find(s, search_from) for s in self._stops) if i >= 0]
        if hits:
            cut = min(hits)
            out = self._text[self._emitted:cut]
            self._emitted = max(self._emitted, cut)
            return out, True
        limit = len(self._text) if final else len(self._text) - self._hold
        if limit <= self._emitted:
            return "", False
        out = self._text[self._emitted:limit]
        self._emitted = limit
        return out, False


class TextOutput:
    """Verified tokens -> text deltas, held back while they could still be the start of a stop string."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...]) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._stops = StopStringMatcher(stop)
        self._has_stops = any(stop)

    def feed(self, token_ids: tuple[int, ...], *, final: bool) -> tuple[tuple[int, ...], str, bool]:
        """(the tokens to emit, their text, whether a stop string was found). At a stop string the tokens end
        with the one that completed it, whatever the round's size, so token ids, text and counts agree for
        every k; the text ends before the stop string."""
        if not self._has_stops:
            text, _ = self._stops.feed(self._detokenizer.add(list(token_ids), final=final), final=final)
            return token_ids, text, False
        text = ""
        for i, token in enumerate(token_ids):
            last = final and i == len(token_ids) - 1
            delta, stopped = self._stops.feed(self._detokenizer.add([token], final=last), final=last)
            text += delta
            if stopped:
                return token_ids[:i + 1], text, True
        return token_ids, text, False
