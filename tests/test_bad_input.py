"""Bad input on the Verify stream, case by case, through a live verifier: each gets its status and a message a
draft's author can act on, the stream goes on serving a well-formed sequence beside it, and no KV block leaks."""

from __future__ import annotations

import math
import queue
import threading
import time

import grpc
import pytest

from specwire.launch import free_port, scrape_metric
from specwire.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

from stacks import InProcessStack

INVALID, NOT_FOUND, ABORTED, EXHAUSTED = (
    grpc.StatusCode.INVALID_ARGUMENT.value[0], grpc.StatusCode.NOT_FOUND.value[0], grpc.StatusCode.ABORTED.value[0],
    grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
BAD, GOOD = 1, 2  # seq ids: the case's sequence and the well-formed one beside it


def _open(seq_id=BAD, prompt=(5, 6, 7), num_output_tokens=0, coupled=False, cache_salt=None, **sampling):
    sampling = {"temperature": 0.8, "seed": 3, "max_tokens": 3, **sampling}
    return verifier_pb2.DraftMessage(open=verifier_pb2.OpenSequence(
        seq_id=seq_id, prompt_token_ids=list(prompt), sampling=common_pb2.SamplingParams(**sampling),
        num_output_tokens=num_output_tokens, coupled=coupled, cache_salt=cache_salt))


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
    ("sequence id 0", [_open(seq_id=0)], INVALID, "seq_id 0 is reserved"),
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
    ("cache_salt too long", [_open(cache_salt="s" * 257)], INVALID, "cache_salt must be 1 to 256 characters"),
    ("cache_salt empty", [_open(cache_salt="")], INVALID, "cache_salt must be 1 to 256 characters"),
    ("a message without a kind", [verifier_pb2.DraftMessage()], INVALID, "unexpected empty message"),
    ("a second hello", [HELLO], INVALID, "unexpected hello"),
    ("q support above --max-q-support", [_open(), _propose(q=((tuple(range(9, 9 + 257)), (1 / 257,) * 257),))],
     EXHAUSTED, "--max-q-support"),
]


def _hello(stub) -> verifier_pb2.DraftMessage:
    info = stub.GetInfo(verifier_pb2.GetInfoRequest(), timeout=10)
    return verifier_pb2.DraftMessage(hello=verifier_pb2.Hello(
        draft_model_id="bad-input", vocab_size=info.vocab_size, tokenizer_fingerprint=info.tokenizer_fingerprint))


def _run_case(address: str, messages: list, until: frozenset[int] = frozenset({GOOD})) -> list:
    """Send hello, the case's messages, then a well-formed sequence; return the replies up to the verdicts of
    the sequences in `until` (the good one)."""
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
        got, waiting_for = [], set(until)
        for reply in replies:
            got.append(reply)
            if reply.WhichOneof("kind") == "verdict":
                waiting_for.discard(reply.verdict.seq_id)
                if not waiting_for:
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


def test_a_duplicate_open_does_not_end_the_live_sequence(text_stack):
    """The ABORTED error names no sequence (seq id 0): under the live sequence's id the draft would take it for
    that sequence's end. The live one goes on and is served."""
    replies = _run_case(text_stack.verifier, [_open(), _open(), _propose(BAD, drafts=(), q=None)],
                        until=frozenset({BAD, GOOD}))
    errors = [r.error for r in replies if r.WhichOneof("kind") == "error"]
    assert [(e.seq_id, e.code) for e in errors] == [(0, ABORTED)] and "already open" in errors[0].message
    assert [r.verdict.seq_id for r in replies if r.WhichOneof("kind") == "verdict"].count(BAD) == 1
    text_stack.wait_for_metric("specwire_kv_blocks_used", 0)


class _Stream:
    """A Verify stream driven by hand: send() queues a message, replies is the call's iterator."""

    def __init__(self, address: str, *, hello: bool = True, timeout: float = 60) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = verifier_pb2_grpc.VerifierStub(self.channel)
        self._outbox: queue.Queue = queue.Queue()
        self._done = threading.Event()
        if hello:
            self.send(_hello(self.stub))
        self.replies = self.stub.Verify(self._requests(), timeout=timeout)

    def _requests(self):
        while not self._done.is_set():
            try:
                yield self._outbox.get(timeout=0.05)
            except queue.Empty:
                continue

    def send(self, *messages) -> None:
        for m in messages:
            self._outbox.put(m)

    def next(self, kind: str | None = None):
        """The next reply (of `kind`, skipping others)."""
        for reply in self.replies:
            if kind is None or reply.WhichOneof("kind") == kind:
                return reply
        raise AssertionError("the stream ended")

    def status(self) -> grpc.RpcError:
        """Read to the end; the error the stream ended with."""
        with pytest.raises(grpc.RpcError) as err:
            for _ in self.replies:
                pass
        return err.value

    def close(self) -> None:
        self._done.set()
        self.replies.cancel()
        self.channel.close()


def test_a_stream_sending_only_protocol_errors_is_ended(text_stack):
    """64 (--max-protocol-errors) malformed messages in a row are answered; the next ends the stream, whose
    sequences are freed."""
    s = _Stream(text_stack.verifier)
    try:
        assert s.next().WhichOneof("kind") == "welcome"
        s.send(_open(BAD, max_tokens=50), _propose(BAD, drafts=(), q=None))
        assert s.next("verdict").verdict.seq_id == BAD  # it holds KV blocks now
        s.send(*[verifier_pb2.DraftMessage()] * 65)
        err = s.status()
    finally:
        s.close()
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-protocol-errors" in err.details()
    text_stack.wait_for_metric("specwire_kv_blocks_used", 0)


# -- the global limits, on a verifier of its own with small ones ------------------------------------------------

@pytest.fixture(scope="module")
def limited(text_stack, tmp_path_factory):
    """A verifier with small limits: 3 streams, 4 sequences, 40 waiting tokens, a 1 s handshake, 16 replies of
    backlog, 8 KV blocks of 4 tokens."""
    with InProcessStack() as stack:
        metrics_port = free_port()
        verifier = stack.start("limited-verifier", [
            "verifier", "--model", str(text_stack.target_dir), "--dtype", "float64", "--num-blocks", "8",
            "--block-size", "4", "--max-draft-tokens", "4", "--max-streams", "3", "--max-sequences", "4",
            "--max-waiting-tokens", "40", "--handshake-timeout", "1", "--max-stream-backlog", "16",
            "--metrics-port", str(metrics_port)], log_dir=tmp_path_factory.mktemp("limited"), timeout_s=120)
        yield verifier.address, f"http://127.0.0.1:{metrics_port}/metrics"


def _wait_for(url: str, name: str, check, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check(scrape_metric(url, name)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert check(scrape_metric(url, name)), f"{name} is {scrape_metric(url, name)}"


def _all_blocks_free(limited) -> None:
    _wait_for(limited[1], "specwire_kv_blocks_used", lambda v: v == 0)


def test_streams_past_max_streams_are_refused(limited):
    streams = [_Stream(limited[0]) for _ in range(3)]
    try:
        for s in streams:
            assert s.next().WhichOneof("kind") == "welcome"
        extra = _Stream(limited[0])
        err = extra.status()
        extra.close()
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-streams" in err.details()
        streams.pop().close()
        _wait_for(limited[1], "specwire_verify_streams", lambda v: v == 2)
        streams.append(_Stream(limited[0]))  # room again
        assert streams[-1].next().WhichOneof("kind") == "welcome"
    finally:
        for s in streams:
            s.close()
    _all_blocks_free(limited)


def test_sequences_past_max_sequences_are_refused_on_any_stream(limited):
    a, b = _Stream(limited[0]), _Stream(limited[0])
    try:
        for seq_id in (1, 2, 3):
            a.send(_open(seq_id, max_tokens=50), _propose(seq_id, drafts=(), q=None))
        assert sorted(a.next("verdict").verdict.seq_id for _ in range(3)) == [1, 2, 3]
        b.send(_open(1, max_tokens=50), _open(2, max_tokens=50), _propose(1, drafts=(), q=None))
        error = b.next("error").error
        assert (error.seq_id, error.code) == (2, EXHAUSTED) and "--max-sequences" in error.message
        assert b.next("verdict").verdict.seq_id == 1  # the one within the limit is served
    finally:
        a.close()
        b.close()
    _all_blocks_free(limited)


def test_opens_past_max_waiting_tokens_are_refused(limited):
    s = _Stream(limited[0])
    try:
        s.send(_open(1, prompt=(5,) * 20, max_tokens=50), _propose(1, start=20, drafts=(), q=None))
        assert s.next("verdict").verdict.seq_id == 1  # running: it holds 6 of the 8 blocks
        s.send(_open(2, prompt=(6,) * 20, max_tokens=50))  # waits for blocks: 20 tokens waiting
        s.send(_open(3, prompt=(7,) * 21, max_tokens=50))  # 41 > 40
        error = s.next("error").error
        assert (error.seq_id, error.code) == (3, EXHAUSTED) and "--max-waiting-tokens" in error.message
    finally:
        s.close()
    _all_blocks_free(limited)


def test_a_stream_without_hello_is_ended_by_the_handshake_timeout(limited):
    s = _Stream(limited[0], hello=False)
    try:
        err = s.status()
    finally:
        s.close()
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "--handshake-timeout" in err.details()


def test_a_stream_that_does_not_read_its_replies_is_ended(limited):
    """Proposals at a wrong position are each answered (dropped); a draft that sends them and never reads fills
    its backlog (16 past what gRPC's flow control buffers) and the stream ends, freeing its sequence's blocks."""
    s = _Stream(limited[0])
    try:
        s.send(_open(1, max_tokens=50))
        _wait_for(limited[1], "specwire_kv_blocks_used", lambda v: v > 0)  # prefilled
        stale = _propose(1, start=1, drafts=(), q=None)
        for _ in range(100):  # until the verifier stops reading (then these wait in the client's queue)
            s.send(*[stale] * 2000)
            if scrape_metric(limited[1], "specwire_kv_blocks_used") == 0:
                break
            time.sleep(0.05)
        _all_blocks_free(limited)  # the failed stream's sequence was freed while its RPC still waits
        err = s.status()
    finally:
        s.close()
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-stream-backlog" in err.details()
