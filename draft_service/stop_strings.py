"""Stop strings over streamed text: text that could still become a stop string is held back."""

from __future__ import annotations


class StopStringMatcher:
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
