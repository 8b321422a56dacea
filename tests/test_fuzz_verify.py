"""Hypothesis-driven message sequences on the Verify stream of a live verifier: random but mostly plausible
opens, proposals (with random legal and illegal q) and closes. Whatever arrives, the verifier answers with valid
messages or a status, never crashes or hangs, serves a well-formed sequence right after, and leaks no block.
200 sequences in the default run; `-m slow` runs 10,000."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_bad_input import GOOD, _open, _propose, _run_case

from specwire.v1 import verifier_pb2

VOCAB = 320  # the text stacks' tokenizer
token = st.one_of(st.integers(0, VOCAB - 1), st.integers(-5, VOCAB + 5))
seq_ids = st.integers(3, 6)  # GOOD (2) is kept for the control sequence
prob = st.one_of(st.floats(0.0, 1.0), st.floats(allow_nan=True, allow_infinity=True))


@st.composite
def q_for(draw, drafts):
    """Often the right q for the drafts (support containing the draft, normalised), sometimes anything."""
    out = []
    for x in drafts:
        if draw(st.booleans()):
            others = draw(st.lists(st.integers(0, VOCAB - 1), max_size=4, unique=True))
            ids = [x, *[o for o in others if o != x]]
            weights = [draw(st.floats(0.05, 1.0)) for _ in ids]
            out.append((tuple(ids), tuple(w / sum(weights) for w in weights)))
        else:
            ids = draw(st.lists(token, max_size=4))
            out.append((tuple(ids), tuple(draw(st.lists(prob, min_size=len(ids), max_size=len(ids) + 1)))))
    return out


@st.composite
def message(draw):
    kind = draw(st.sampled_from(["open", "open", "propose", "propose", "propose", "close", "empty"]))
    seq_id = draw(seq_ids)
    if kind == "open":
        prompt = draw(st.lists(token, min_size=0, max_size=12))
        temperature = draw(st.sampled_from([0.0, 0.7, 1.0, 1e-30, -1.0]))
        return _open(seq_id, prompt, temperature=temperature, max_tokens=draw(st.integers(-1, 6)),
                     top_k=draw(st.sampled_from([0, 3, -1])), top_p=draw(st.sampled_from([1.0, 0.9, 0.0])))
    if kind == "propose":
        drafts = draw(st.lists(token, max_size=10))
        q = draw(st.one_of(st.none(), q_for(drafts)))
        return _propose(seq_id, draw(st.integers(0, 20)), drafts, q)
    if kind == "close":
        return verifier_pb2.DraftMessage(close=verifier_pb2.CloseSequence(seq_id=seq_id))
    return verifier_pb2.DraftMessage()




def _fuzz(text_stack, messages):
    replies = _run_case(text_stack.verifier, messages)
    assert replies[0].WhichOneof("kind") == "welcome"
    for reply in replies[1:]:
        kind = reply.WhichOneof("kind")
        assert kind in ("verdict", "error", "dropped"), reply
        if kind == "error":  # a client's mistake, never the verifier's own failure
            assert reply.error.message and reply.error.code in {c.value[0] for c in grpc.StatusCode}
            assert reply.error.code != grpc.StatusCode.INTERNAL.value[0], reply.error.message
        if kind == "verdict":
            assert all(0 <= t < VOCAB for t in reply.verdict.token_ids)
    assert replies[-1].WhichOneof("kind") == "verdict" and replies[-1].verdict.seq_id == GOOD


@st.composite
def episode(draw):
    """A valid open followed by proposals at the right positions, with random tokens (now and then one out of
    range) and a random q that is usually legal: this reaches the forward pass and the rejection sampler."""
    seq_id = draw(seq_ids)
    prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12))
    out = [_open(seq_id, prompt, temperature=draw(st.sampled_from([0.0, 0.7, 1.0])), max_tokens=8,
                 top_k=draw(st.sampled_from([0, 3])), top_p=draw(st.sampled_from([1.0, 0.9])))]
    for _ in range(draw(st.integers(1, 2))):
        drafts = draw(st.lists(st.one_of(st.integers(0, VOCAB - 1), token), max_size=6))
        out.append(_propose(seq_id, len(prompt), drafts, draw(st.one_of(st.none(), q_for(drafts)))))
    return out


ONE_FAMILY = pytest.mark.parametrize("text_stack", ["qwen2"], indirect=True)
MESSAGES = st.lists(st.one_of(message().map(lambda m: [m]), episode()), min_size=1, max_size=6).map(
    lambda groups: [m for group in groups for m in group])


@ONE_FAMILY
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(messages=MESSAGES)
def test_fuzzed_verify_streams(text_stack, messages):
    _fuzz(text_stack, messages)


@pytest.mark.slow
@ONE_FAMILY
@settings(max_examples=10_000, deadline=None, suppress_health_check=list(HealthCheck))
@given(messages=MESSAGES)
def test_fuzzed_verify_streams_long(text_stack, messages):
    _fuzz(text_stack, messages)


@ONE_FAMILY
def test_fuzzing_left_no_block_behind(text_stack):
    text_stack.wait_for_metric("specwire_kv_blocks_used", 0)
