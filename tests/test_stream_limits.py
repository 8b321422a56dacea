"""A Verify stream's bounds on the asyncio side (StreamOutbox): backpressure on the commands it reads (their
number and the tokens they hold), its backlog of replies, protocol errors in a row and what counts as one; and
the draft's handling of an error that names no sequence."""

from __future__ import annotations

import asyncio
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from structlog.testing import capture_logs

from common.errors import ErrorCode, ServiceError
from common.sampling import SamplingParams, SparseProbs
from draft_service.verifier_link import VerifierLink, _Placed
from specwire.v1 import verifier_pb2
from verifier_service.async_engine import AsyncEngine
from verifier_service.metrics import VerifierMetrics
from verifier_service.servicer import VerifierServicer
from verifier_service.stream_outbox import StreamLimits, StreamOutbox
from verifier_service.types import DroppedOut, ErrorOut, OpenCmd, ProposeCmd, RefusedCmd, SeqKey
from verifier_service.validation import Limits

KEY = SeqKey(1, 1)


def _outbox(**limits) -> tuple[StreamOutbox, list[int]]:
    failed: list[int] = []
    return StreamOutbox(StreamLimits(**limits), on_fail=lambda: failed.append(1)), failed


def test_a_stream_past_its_pending_commands_is_not_read_until_the_engine_applies_some():
    async def scenario():
        outbox, _ = _outbox(max_pending_commands=2)
        outbox.submitted()
        await asyncio.wait_for(outbox.wait_for_credit(), 1)  # one pending: room for another
        outbox.submitted()
        waiter = asyncio.ensure_future(outbox.wait_for_credit())
        await asyncio.sleep(0.01)
        assert not waiter.done()  # two pending: the reader waits
        outbox.applied(1)
        await asyncio.wait_for(waiter, 1)

    asyncio.run(scenario())


def test_a_backlog_past_its_limit_fails_the_stream_and_drops_its_replies():
    async def scenario():
        outbox, failed = _outbox(max_stream_backlog=3)
        for i in range(4):
            outbox.put(DroppedOut(KEY, i, 0))
        assert failed == [1] and outbox.failure.code is ErrorCode.RESOURCE_EXHAUSTED
        assert "--max-stream-backlog" in outbox.failure.message
        with pytest.raises(ServiceError):  # nothing of the backlog is sent: the failure comes first
            await outbox.get()
        outbox.put(DroppedOut(KEY, 9, 0))  # ignored from now on
        assert failed == [1]

    asyncio.run(scenario())


def test_protocol_errors_in_a_row_fail_the_stream_but_a_verdict_between_resets_them():
    outbox, failed = _outbox(max_protocol_errors=2)
    for _ in range(2):
        outbox.protocol_error()
    outbox.put(DroppedOut(KEY, 0, 0))  # the stream did something valid
    outbox.protocol_error()
    outbox.put(ErrorOut(SeqKey(1, 0), ErrorCode.ABORTED, "duplicate open"))  # counts too
    assert not failed
    outbox.protocol_error()
    assert failed == [1] and "--max-protocol-errors" in outbox.failure.message
    # errors that a correct draft may get (a refusal under load, a proposal after its sequence ended) never count
    other, failed = _outbox(max_protocol_errors=1)
    for code in (ErrorCode.RESOURCE_EXHAUSTED, ErrorCode.NOT_FOUND, ErrorCode.DEADLINE_EXCEEDED):
        other.put(ErrorOut(KEY, code, "x"))
    assert not failed


def test_the_draft_does_not_end_a_sequence_for_an_error_that_names_none():
    """seq id 0: a duplicate open or a message the verifier did not understand; logged, routed to no sequence."""
    async def scenario():
        link = VerifierLink("127.0.0.1:1", draft_model_id="d", vocab_size=8, tokenizer_fingerprint="f")
        link._inboxes[1] = inbox = asyncio.Queue()
        link._placed[1] = _Placed("127.0.0.1:1", 0)
        with capture_logs() as logs:
            link._dispatch("127.0.0.1:1", verifier_pb2.VerifierMessage(error=verifier_pb2.SequenceError(
                seq_id=0, code=ErrorCode.ABORTED.value, message="sequence 1 is already open on this stream")))
        assert inbox.empty()
        assert [(e["event"], e["code"]) for e in logs] == [("verifier_stream_error", "ABORTED")]
        # a verdict or a drop under seq id 0 (a field left unset) is no sequence's either: ignored, not a failure
        link._dispatch("127.0.0.1:1", verifier_pb2.VerifierMessage(verdict=verifier_pb2.Verdict(seq_id=0, token_ids=[3])))
        link._dispatch("127.0.0.1:1", verifier_pb2.VerifierMessage(dropped=verifier_pb2.ProposalDropped(seq_id=0)))
        assert inbox.empty()
        link._dispatch("127.0.0.1:1", verifier_pb2.VerifierMessage(error=verifier_pb2.SequenceError(
            seq_id=1, code=ErrorCode.INVALID_ARGUMENT.value, message="bad")))
        assert (await inbox.get()).code is ErrorCode.INVALID_ARGUMENT  # a sequence's own error still reaches it

    asyncio.run(scenario())


# -- what counts as a protocol error, on the stream's side ------------------------------------------------------

LIMITS = Limits(vocab_size=100, max_model_len=64, max_draft_tokens=4, max_q_support=8)


def _proposal(drafts=(9,), q_size=1) -> verifier_pb2.Proposal:
    ids = (9, *range(10, 10 + q_size - 1))
    return verifier_pb2.Proposal(seq_id=1, start_position=3, draft_token_ids=list(drafts), draft_probs=[
        verifier_pb2.SparseDistribution(token_ids=list(ids), probs=[1 / q_size] * q_size)])


def test_a_q_past_max_q_support_is_refused_but_is_no_protocol_error():
    """A draft configured with a larger --q-max-support than the verifier's --max-q-support is refused per
    proposal (RESOURCE_EXHAUSTED), not ended as a peer that sends garbage."""
    outbox, failed = _outbox(max_protocol_errors=2)
    for _ in range(5):
        cmd = VerifierServicer._proposal(_proposal(q_size=9), 1, outbox, LIMITS)
        assert isinstance(cmd, RefusedCmd) and cmd.code is ErrorCode.RESOURCE_EXHAUSTED
        assert "--max-q-support" in cmd.message
    assert not failed
    assert isinstance(VerifierServicer._proposal(_proposal(q_size=8), 1, outbox, LIMITS), ProposeCmd)
    for _ in range(3):  # malformed (more drafts than max_draft_tokens) does count
        assert VerifierServicer._proposal(_proposal(drafts=(9,) * 5), 1, outbox, LIMITS).code is ErrorCode.INVALID_ARGUMENT
    assert failed == [1] and "--max-protocol-errors" in outbox.failure.message


# -- pending commands are bounded by what they hold -------------------------------------------------------------

class _Engine:
    """What AsyncEngine needs of an engine to take commands: they are only kept, never applied."""

    def __init__(self) -> None:
        self.blocks = SimpleNamespace(num_blocks=1)
        self.commands: list = []
        self.applied: Counter[int] = Counter()

    def submit(self, command) -> None:
        self.commands.append(command)

    def take_applied(self) -> Counter[int]:
        applied, self.applied = self.applied, Counter()
        return applied


def test_a_stream_whose_pending_commands_hold_too_many_tokens_is_not_read():
    """--max-pending-tokens: two opens of 600 tokens pass 1000, so the stream is not read (backpressure) until
    the engine applies one, though two commands are far from --max-pending-commands."""
    engine = _Engine()
    with ThreadPoolExecutor(1) as executor:
        async_engine = AsyncEngine(engine, VerifierMetrics(), executor, limits=StreamLimits(max_pending_tokens=1000))
        stream_id, outbox = async_engine.open_stream()
        sampling = SamplingParams(temperature=0.0).with_seed()
        async_engine.submit(OpenCmd(SeqKey(stream_id, 1), (5,) * 600, sampling))
        assert outbox.num_pending_tokens == 600 and outbox.has_credit
        async_engine.submit(OpenCmd(SeqKey(stream_id, 2), (5,) * 600, sampling))
        assert outbox.num_pending_tokens == 1200 and not outbox.has_credit
        engine.applied[stream_id] = 1
        async_engine._credit_applied()
        assert outbox.num_pending_tokens == 600 and outbox.has_credit
        q = (SparseProbs((9, 4), (0.5, 0.5)),) * 2  # a proposal holds its drafts and its q entries
        async_engine.submit(ProposeCmd(SeqKey(stream_id, 1), 600, (9, 9), q, assumed_token_ids=(7,)))
        assert outbox.num_pending_tokens == 600 + 2 + 1 + 4
        async_engine.close_stream(stream_id)
        async_engine.submit(OpenCmd(SeqKey(stream_id, 3), (5,), sampling))  # a closed stream's: dropped
        assert [type(c).__name__ for c in engine.commands] == ["OpenCmd", "OpenCmd", "ProposeCmd", "CloseStreamCmd"]


def test_max_pending_tokens_is_a_flag_carried_to_the_streams_and_checked():
    from verifier_service.config import VerifierConfig

    config = VerifierConfig(model="m", max_pending_tokens=4096)
    assert StreamLimits.from_config(config).max_pending_tokens == 4096
    assert StreamLimits.from_config(VerifierConfig(model="m")).max_pending_tokens == 1 << 20
    with pytest.raises(ValueError, match="max_pending_tokens"):
        VerifierConfig(model="m", max_pending_tokens=0)
