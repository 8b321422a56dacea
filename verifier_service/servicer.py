"""The gRPC edge of the verifier: protobuf <-> engine dataclasses. Nothing past this module sees protobuf."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator

import grpc
import structlog

from common.errors import ErrorCode, ServiceError
from specwire.v1 import verifier_pb2, verifier_pb2_grpc, wire
from verifier_service.async_engine import AsyncEngine
from verifier_service.types import CloseCmd, DroppedOut, ErrorOut, OpenCmd, Outcome, ProposeCmd, SeqKey, VerdictOut

log = structlog.get_logger(__name__)


def outcome_to_proto(outcome: Outcome) -> verifier_pb2.VerifierMessage:
    if isinstance(outcome, VerdictOut):
        return verifier_pb2.VerifierMessage(verdict=verifier_pb2.Verdict(
            seq_id=outcome.key.seq_id, start_position=outcome.start_position, num_accepted=outcome.num_accepted,
            token_ids=outcome.token_ids, finish_reason=wire.finish_to_proto(outcome.finish_reason),
            batch_size=outcome.batch_size, step_time_s=outcome.step_time_s))
    if isinstance(outcome, ErrorOut):
        return verifier_pb2.VerifierMessage(error=verifier_pb2.SequenceError(
            seq_id=outcome.key.seq_id, code=outcome.code.value, message=outcome.message))
    assert isinstance(outcome, DroppedOut)
    return verifier_pb2.VerifierMessage(dropped=verifier_pb2.ProposalDropped(
        seq_id=outcome.key.seq_id, start_position=outcome.start_position, num_verified=outcome.num_verified))


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, engine: AsyncEngine, info: verifier_pb2.VerifierInfo) -> None:
        self._engine = engine
        self._info = info

    async def GetInfo(self, request, context) -> verifier_pb2.VerifierInfo:
        return self._info

    async def Verify(self, request_iterator: AsyncIterator[verifier_pb2.DraftMessage],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[verifier_pb2.VerifierMessage]:
        try:
            first = await anext(aiter(request_iterator))
        except StopAsyncIteration:
            return
        await self._check_hello(first, context)
        stream_id, outbox = self._engine.open_stream()
        log.info("verify_stream_open", stream_id=stream_id, peer=context.peer(), draft_model=first.hello.draft_model_id)
        live: set[int] = set()  # sequences opened on this stream and not yet ended
        reader = asyncio.create_task(self._read(request_iterator, stream_id, outbox, live))
        draining = False
        try:
            yield verifier_pb2.VerifierMessage(welcome=verifier_pb2.Welcome(info=self._info))
            while not (draining and not live and outbox.empty()):
                outcome = await outbox.get()
                if outcome is None:  # the draft closed its side: answer what is open, then end
                    draining = True
                    continue
                if isinstance(outcome, ErrorOut) or (isinstance(outcome, VerdictOut) and outcome.finish_reason):
                    live.discard(outcome.key.seq_id)
                yield outcome_to_proto(outcome)
        finally:
            reader.cancel()
            self._engine.close_stream(stream_id)
            log.info("verify_stream_closed", stream_id=stream_id)

    async def _check_hello(self, msg: verifier_pb2.DraftMessage, context: grpc.aio.ServicerContext) -> None:
        if msg.WhichOneof("kind") != "hello":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "the first message of a Verify stream must be hello (model identity handshake)")
        mismatch = wire.handshake_mismatch(self._info, msg.hello)
        if mismatch is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, mismatch)

    async def _read(self, request_iterator, stream_id: int, outbox: asyncio.Queue, live: set[int]) -> None:
        try:
            async for msg in request_iterator:
                kind = msg.WhichOneof("kind")
                if kind == "open":
                    key = SeqKey(stream_id, msg.open.seq_id)
                    try:
                        sampling = wire.sampling_from_proto(msg.open.sampling).with_seed()
                        if msg.open.coupled:
                            sampling = dataclasses.replace(sampling, coupled=True)
                    except ServiceError as err:
                        outbox.put_nowait(ErrorOut(key, err.code, err.message))
                        continue
                    live.add(key.seq_id)
                    o = msg.open
                    deadline = time.monotonic() + o.timeout_ms / 1000 if o.HasField("timeout_ms") else None
                    self._engine.submit(OpenCmd(key, tuple(o.prompt_token_ids), sampling,
                                                num_output_tokens=o.num_output_tokens, deadline=deadline))
                elif kind == "propose":
                    p = msg.propose
                    self._engine.submit(ProposeCmd(SeqKey(stream_id, p.seq_id), p.start_position,
                                                   tuple(p.draft_token_ids), wire.draft_probs_from_proto(p.draft_probs),
                                                   tuple(p.assumed_token_ids)))
                elif kind == "close":
                    live.discard(msg.close.seq_id)
                    self._engine.submit(CloseCmd(SeqKey(stream_id, msg.close.seq_id)))
                else:
                    outbox.put_nowait(ErrorOut(SeqKey(stream_id, 0), ErrorCode.INVALID_ARGUMENT,
                                               f"unexpected {kind or 'empty'} message after the handshake"))
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            pass
        finally:
            outbox.put_nowait(None)
