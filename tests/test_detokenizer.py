"""The incremental detokenizer against the full decode it replaces: the same deltas, call by call."""

from __future__ import annotations

from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common import tokenizer as tokenizer_module
from common.tokenizer import IncrementalDetokenizer

from tiny_models import byte_bpe_tokenizer, word_tokenizer

BYTE_BPE = byte_bpe_tokenizer()
WORDS = word_tokenizer(40)


class FullDecodeReference:
    """The detokenizer as it was: decode every token on every call."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.text = ""

    def add(self, token_ids: list[int], *, final: bool = False) -> str:
        self.token_ids.extend(token_ids)
        full = self._tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if not final:
            while full.endswith("\ufffd"):
                full = full[:-1]
        if not full.startswith(self.text):
            full = self.text + full[len(self.text):]
        delta = full[len(self.text):]
        self.text = full
        return delta


def calls(tokenizer, *, id_slack: int = 4):
    """Lists of (token ids, final) calls: random ids (some past the tokenizer's vocabulary, as a target's padded
    vocabulary may emit) or the ids of random text, cut into random rounds; final on the last call."""
    vocab = len(tokenizer)
    random_ids = st.lists(st.integers(0, vocab - 1 + id_slack), max_size=60)
    text_ids = st.text(max_size=30).map(lambda s: tokenizer.encode(s, add_special_tokens=False))

    @st.composite
    def split(draw):
        ids = draw(st.one_of(random_ids, text_ids))
        cuts = sorted(draw(st.lists(st.integers(0, len(ids)), max_size=12)))
        bounds = [0, *cuts, len(ids)]
        rounds = [ids[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
        return [(r, i == len(rounds) - 1) for i, r in enumerate(rounds)]

    return split()


def run_both(tokenizer, rounds):
    fast, reference = IncrementalDetokenizer(tokenizer), FullDecodeReference(tokenizer)
    for ids, final in rounds:
        assert fast.add(list(ids), final=final) == reference.add(list(ids), final=final), (rounds, ids)
        assert fast.text == reference.text
    return fast


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls(BYTE_BPE))
def test_byte_bpe_stream_gives_the_full_decodes_deltas(rounds):
    with mock.patch.object(tokenizer_module, "MAX_PENDING_TOKENS", 1 << 30):
        fast = IncrementalDetokenizer(BYTE_BPE)
        assert fast.incremental
        for ids, final in rounds[:-1]:
            fast.add(list(ids), final=final)
        # byte-level BPE never leaves the stream before the final flush, but for a long unfinished run
        assert fast.incremental
        run_both(BYTE_BPE, rounds)
    run_both(BYTE_BPE, rounds)  # the cap on that run on: random ids often pass it


@settings(max_examples=200, deadline=None)
@given(calls(BYTE_BPE), st.lists(st.booleans(), max_size=13))
def test_any_final_pattern_matches_the_full_decode(rounds, finals):
    """final=True in the middle too (the full decode's splicing of what was sent)."""
    run_both(BYTE_BPE, [(ids, final if i >= len(finals) else finals[i]) for i, (ids, final) in enumerate(rounds)])


@settings(max_examples=100, deadline=None)
@given(calls(WORDS))
def test_word_decoder_stream_gives_the_full_decodes_deltas(rounds):
    run_both(WORDS, rounds)


def test_multi_byte_characters_split_across_tokens_and_flushed_at_the_end():
    tok = BYTE_BPE
    ids = tok.encode("Ça va, 日本語 ✓", add_special_tokens=False)
    run_both(tok, [([i], False) for i in ids] + [([], True)])
    byte_ids = [tok.convert_tokens_to_ids(_BYTE_CHARS[b]) for b in "€".encode()]  # byte-level alphabet ids
    a = tok.encode("a", add_special_tokens=False)
    # the character arrives a byte at a time after text; then an unfinished one is flushed by final
    run_both(tok, [(a + byte_ids[:1], False), (byte_ids[1:2], False), (byte_ids[2:], False),
                   (byte_ids[:2], False), ([], True)])


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map: the byte-level alphabet."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


_BYTE_CHARS = _bytes_to_unicode()


def test_a_fast_tokenizer_never_decodes_the_whole_output(monkeypatch):
    """The stream decodes the tokens since its last chunk (in the backend), never all of them again."""
    tok = byte_bpe_tokenizer()
    calls_seen = []
    monkeypatch.setattr(tok, "decode", lambda ids, **kw: calls_seen.append(len(ids)) or "")
    detok = IncrementalDetokenizer(tok)
    ids = BYTE_BPE.encode("日本語のテキスト。 " * 20, add_special_tokens=False)
    text = "".join(detok.add([i]) for i in ids)
    assert text == BYTE_BPE.decode(ids).rstrip("\ufffd")
    assert calls_seen == []


class SlowTokenizer:
    """A tokenizer without a fast backend: full decodes."""

    def decode(self, ids, skip_special_tokens=True):
        return BYTE_BPE.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("final_every", [0, 3])
def test_slow_tokenizers_fall_back_to_full_decodes(final_every):
    ids = BYTE_BPE.encode("Le cœur a ses raisons 日本語", add_special_tokens=False)
    rounds = [([i], bool(final_every) and n % final_every == 0) for n, i in enumerate(ids)] + [([], True)]
    detok = run_both(SlowTokenizer(), rounds)
    assert not detok.incremental


def test_a_long_run_of_unfinished_characters_costs_bounded_stream_decodes(monkeypatch):
    """Stray UTF-8 lead bytes never complete a character, so the stream withholds them all: it decodes at most
    MAX_PENDING_TOKENS of them (plus its context) per call, then full decodes take over, with the same text."""
    windows = []
    decode = tokenizer_module._StreamDecode._decode
    monkeypatch.setattr(tokenizer_module._StreamDecode, "_decode",
                        lambda self, ids: windows.append(len(ids)) or decode(self, ids))
    lead = BYTE_BPE.convert_tokens_to_ids(_BYTE_CHARS[0xE2])
    text_ids = BYTE_BPE.encode("a b", add_special_tokens=False)
    rounds = [(text_ids, False)] + [([lead], False)] * 200 + [(text_ids, False), ([], True)]
    detok = run_both(BYTE_BPE, rounds)
    assert not detok.incremental
    assert windows and max(windows) <= tokenizer_module.MAX_PENDING_TOKENS + len(text_ids), max(windows)
