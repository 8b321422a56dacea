"""A Verify stream's bounds on the asyncio side (StreamOutbox): backpressure on the commands it reads, its
backlog of replies, protocol errors in a row; and the draft's handling of an error that names no sequence."""

from __future__ import annotations

import asyncio

import pytest
from structlog.testing import capture_logs

from common.errors import ErrorCode, ServiceError
from draft_service.verifier_link import VerifierLink
from specwire.v1 import verifier_pb2
from verifier_service.async_engine import StreamLimits, StreamOutbox
from verifier_service.types import DroppedOut, ErrorOut, SeqKey

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
        with capture_logs() as logs:
            link._dispatch(verifier_pb2.VerifierMessage(error=verifier_pb2.SequenceError(
                seq_id=0, code=ErrorCode.ABORTED.value, message="sequence 1 is already open on this stream")))
        assert inbox.empty()
        assert [(e["event"], e["code"]) for e in logs] == [("verifier_stream_error", "ABORTED")]
        link._dispatch(verifier_pb2.VerifierMessage(error=verifier_pb2.SequenceError(
            seq_id=1, code=ErrorCode.INVALID_ARGUMENT.value, message="bad")))
        assert (await inbox.get()).code is ErrorCode.INVALID_ARGUMENT  # a sequence's own error still reaches it

    asyncio.run(scenario())
