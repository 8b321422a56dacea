"""A generation's text (draft_service.text_output): stop strings hold back and cut, the detokenizer holds back
incomplete characters."""

from __future__ import annotations

from common.tokenizer import IncrementalDetokenizer
from draft_service.text_output import StopStringMatcher

from tiny_models import byte_bpe_tokenizer


def test_stop_strings_hold_back_and_cut():
    m = StopStringMatcher(("END", "\n\n"))
    out = []
    for delta in ["Hello E", "N", "D more"]:
        text, stopped = m.feed(delta)
        out.append(text)
        if stopped:
            break
    assert "".join(out) == "Hello " and stopped


def test_stop_strings_flush_on_final():
    m = StopStringMatcher(("STOP",))
    assert m.feed("abcST") == ("ab", False)
    assert m.feed("", final=True) == ("cST", False)


def test_detokenizer_holds_incomplete_characters():
    tok = byte_bpe_tokenizer()
    ids = tok.encode("Ça va, 日本語", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add([i]) for i in ids]
    assert "".join(pieces) == "Ça va, 日本語"
    assert all("\ufffd" not in p for p in pieces)
