"""Bad input on the Verify stream, case by case, through a live verifier: each gets its status and a message a
draft's author can act on, the stream goes on serving a well-formed sequence beside it, and no KV block leaks."""

from __future__ import annotations

import math
import queue
import threading

import grpc
import pytest

from specwire.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

INVALID, NOT_FOUND, ABORTED = (grpc.StatusCode.INVALID_ARGUMENT.value[0], grpc.StatusCode.NOT_FOUND.value[0],
                               grpc.StatusCode.ABORTED.value[0])
BAD, GOOD = 1, 2  # seq ids: the case's sequence and the well-formed one beside it


def _open(seq_id=BAD, prompt=(5, 6, 7), num_output_tokens=0, coupled=False, **sampling):
    sampling = {"temperature": 0.8, "seed": 3, "max_tokens": 3, **sampling}
    return verifier_pb2.DraftMessage(open=verifier_pb2.OpenSequence(
        seq_id=seq_id, prompt_token_ids=list(prompt), sampling=common_pb2.SamplingParams(**sampling),
        num_output_tokens=num_output_tokens, coupled=coupled))


def _propose(seq_id=BAD, start=3, drafts=(9,), q=(((9,), (1.0,)),), assumed=()):
    """q: one (token ids, probs) pair per draft distribution, or None for one-hot."""
    msg = verifier_pb2.Proposal(seq_id=seq_id, start_position=start, draft_token_ids=list(drafts),
                                assumed_token_ids=list(assumed))
    for t, p in q or ():
        msg.draft_probs.append(verifier_pb2.SparseDistribution(token_ids=list(t), probs=list(p)))
    return verifier_pb2.DraftMessage(propose=msg)


HELLO = object()  # placeholder for a second hello

# (case id, messages after hello for the bad sequence, expected code, message fragment)
CASES = [
    ("empty prompt", [_open(prompt=())], INVALID, "prompt is empty"),
    ("out-of-vocabulary prompt", [_open(prompt=(5, 10_000))], INVALID, "outside the vocabulary"),
    ("negative prompt id", [_open(prompt=(5, -1))], INVALID, "outside the vocabulary"),
    ("prompt beyond the context", [_open(prompt=(5,) * 600)], INVALID, "context length"),
    ("temperature NaN", [_open(temperature=math.nan)], INVALID, "temperature"),
    ("temperature negative", [_open(temperature=-0.5)], INVALID, "temperature"),
    ("temperature infinite", [_open(temperature=math.inf)], INVALID, "temperature"),
    ("top_p zero", [_open(top_p=0.0)], INVALID, "top_p"),
    ("top_p above one", [_open(top_p=1.5)], INVALID, "top_p"),
    ("top_k negative", [_open(top_k=-1)], INVALID, "top_k"),
    ("max_tokens zero", [_open(max_tokens=0)], INVALID, "max_tokens"),
    ("max_tokens negative", [_open(max_tokens=-4)], INVALID, "max_tokens"),
    ("seed out of range", [_open(seed=2**64 - 1)], INVALID, "seed"),
    ("duplicate sequence id", [_open(), _open()], ABORTED, "already open"),
    ("proposal for an unknown sequence", [_propose()], NOT_FOUND, "unknown sequence"),
    ("too many drafts", [_open(), _propose(drafts=(9,) * 9, q=None)], INVALID, "at most 8"),
    ("out-of-vocabulary draft", [_open(), _propose(drafts=(10_000,), q=None)], INVALID, "outside the vocabulary"),
    ("negative draft", [_open(), _propose(drafts=(-2,), q=None)], INVALID, "outside the vocabulary"),
    ("q NaN", [_open(), _propose(q=(((9, 4), (math.nan, 1.0)),))], INVALID, "finite"),
    ("q infinite", [_open(), _propose(q=(((9, 4), (math.inf, 0.0)),))], INVALID, "finite"),
    ("q negative", [_open(), _propose(q=(((9, 4), (1.5, -0.5)),))], INVALID, "finite and >= 0"),
    ("q not normalised", [_open(), _propose(q=(((9, 4), (0.3, 0.2)),))], INVALID, "sum to"),
    ("q duplicate token", [_open(), _propose(q=(((9, 9), (0.5, 0.5)),))], INVALID, "repeated token ids"),
    ("q gives the draft zero", [_open(), _propose(q=(((4, 5), (0.5, 0.5)),))], INVALID, "probability 0"),
    ("q ids and probs differ in length", [_open(), _propose(q=(((9, 4), (1.0,)),))], INVALID, "equal length"),
    ("q empty", [_open(), _propose(q=(((), ()),))], INVALID, "non-empty"),
    ("fewer q than drafts", [_open(), _propose(drafts=(9, 4), q=(((9,), (1.0,)),))], INVALID, "draft distributions"),
    ("q out-of-vocabulary id", [_open(), _propose(q=(((9, 10_000), (0.5, 0.5)),))], INVALID, "outside the vocabulary"),
    ("resume claiming the whole prompt as output", [_open(num_output_tokens=3)], INVALID, "at least one prompt"),
    ("resume past max_tokens", [_open(prompt=(5, 6, 7, 8), num_output_tokens=3)], INVALID, "has finished"),
    ("assumed token out of vocabulary", [_open(), _propose(start=5, assumed=(9, 10_000), q=None)], INVALID,
     "outside the vocabulary"),
    ("more assumed tokens than positions", [_open(), _propose(start=2, assumed=(5, 6, 7), q=None)], INVALID,
     "assumed tokens"),
    ("q on a coupled sequence", [_open(coupled=True), _propose()], INVALID, "token ids only"),
    ("a message without a kind", [verifier_pb2.DraftMessage()], INVALID, "unexpected empty message"),
    ("a second hello", [HELLO], INVALID, "unexpected hello"),
]


def _run_case(address: str, messages: list) -> list:
    """Send hello, the case's messages, then a well-formed sequence; return the replies up to the good
    sequence's verdict."""
    with grpc.insecure_channel(address) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        info = stub.GetInfo(verifier_pb2.GetInfoRequest(), timeout=10)
        hello = verifier_pb2.DraftMessage(hello=verifier_pb2.Hello(
            draft_model_id="bad-input", vocab_size=info.vocab_size, tokenizer_fingerprint=info.tokenizer_fingerprint))
        outbox: queue.Queue = queue.Queue()
        for m in [hello, *[hello if m is HELLO else m for m in messages], _open(GOOD, temperature=0.0),
                  _propose(GOOD, drafts=(), q=None)]:
            outbox.put(m)
        done = threading.Event()

        def requests():
            while not done.is_set():
                try:
                    yield outbox.get(timeout=0.1)
                except queue.Empty:
                    continue

        replies = stub.Verify(requests(), timeout=60)
        got = []
        for reply in replies:
            got.append(reply)
            if reply.WhichOneof("kind") == "verdict" and reply.verdict.seq_id == GOOD:
                break
        done.set()
        replies.cancel()
        return got


@pytest.mark.parametrize("case,messages,code,fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_input_on_the_verify_stream(text_stack, case, messages, code, fragment):
    replies = _run_case(text_stack.verifier, messages)
    assert replies[0].WhichOneof("kind") == "welcome"
    errors = [r.error for r in replies if r.WhichOneof("kind") == "error"]
    assert len(errors) == 1, errors
    error = errors[0]
    assert error.code == code and fragment in error.message, (error.code, error.message)
    assert error.seq_id in (BAD, 0)  # 0: a message that names no sequence
    # the well-formed sequence beside it was served on the same stream
    assert replies[-1].WhichOneof("kind") == "verdict" and len(replies[-1].verdict.token_ids) == 1
    text_stack.wait_for_metric("specwire_kv_blocks_used", 0)


def test_a_proposal_at_the_wrong_position_is_dropped_not_failed(text_stack):
    replies = _run_case(text_stack.verifier, [_open(), _propose(start=7)])
    dropped = [r.dropped for r in replies if r.WhichOneof("kind") == "dropped"]
    assert [(d.seq_id, d.start_position, d.num_verified) for d in dropped] == [(BAD, 7, 3)]
    assert not [r for r in replies if r.WhichOneof("kind") == "error"]
    text_stack.wait_for_metric("specwire_kv_blocks_used", 0)


def test_an_oversized_message_is_refused_by_size(text_stack):
    huge = verifier_pb2.DraftMessage(hello=verifier_pb2.Hello(draft_model_id="x" * (65 << 20)))  # > 64 MiB
    with grpc.insecure_channel(text_stack.verifier, options=[("grpc.max_send_message_length", 1 << 30)]) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Verify(iter([huge]), timeout=60))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    text_stack.wait_for_metric("specwire_kv_blocks_used", 0)


def test_a_message_before_hello_ends_the_stream_with_failed_precondition(text_stack):
    with grpc.insecure_channel(text_stack.verifier) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Verify(iter([_open()]), timeout=30))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "must be hello" in err.value.details()
    text_stack.wait_for_metric("specwire_kv_blocks_used", 0)
