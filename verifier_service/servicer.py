"""The gRPC edge of the verifier: protobuf <-> engine dataclasses. Nothing past this module sees protobuf."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator

import grpc
import structlog

from common.errors import ErrorCode, ServiceError
from common.sampling import WireMode
from specwire.v1 import verifier_pb2, verifier_pb2_grpc, wire
from verifier_service.async_engine import AsyncEngine
from verifier_service.stream_outbox import StreamOutbox
from verifier_service.types import (
    CloseCmd,
    DroppedOut,
    ErrorOut,
    LoadOut,
    OpenCmd,
    Outcome,
    ProposeCmd,
    RefusedCmd,
    SeqKey,
    VerdictOut,
)
from verifier_service.validation import check_prompt_length, check_proposal, check_proposal_size

log = structlog.get_logger(__name__)

LOAD_REPORT_INTERVAL_S = 0.2  # how often a stream's load report is refreshed (sent only when it changed)
DRAINING_MESSAGE = ("the verifier is draining (shutting down): open the sequence on another verifier, or again once "
                    "this one is back")


def outcome_to_proto(outcome: Outcome) -> verifier_pb2.VerifierMessage:
    if isinstance(outcome, VerdictOut):
        return verifier_pb2.VerifierMessage(verdict=verifier_pb2.Verdict(
            seq_id=outcome.key.seq_id, start_position=outcome.start_position, num_accepted=outcome.num_accepted,
            token_ids=outcome.token_ids, finish_reason=wire.finish_to_proto(outcome.finish_reason),
            batch_size=outcome.batch_size, step_time_s=outcome.step_time_s,
            next_draft_tokens=outcome.next_draft_tokens, step=outcome.step, step_verdicts=outcome.step_verdicts,
            plain_from=outcome.plain_from))
    if isinstance(outcome, ErrorOut):
        return verifier_pb2.VerifierMessage(error=verifier_pb2.SequenceError(
            seq_id=outcome.key.seq_id, code=outcome.code.value, message=outcome.message))
    if isinstance(outcome, LoadOut):
        return verifier_pb2.VerifierMessage(load=verifier_pb2.VerifierLoad(
            num_running=outcome.num_running, num_waiting=outcome.num_waiting, kv_cache_usage=outcome.kv_cache_usage,
            num_free_blocks=outcome.num_free_blocks, draining=outcome.draining))
    assert isinstance(outcome, DroppedOut)
    return verifier_pb2.VerifierMessage(dropped=verifier_pb2.ProposalDropped(
        seq_id=outcome.key.seq_id, start_position=outcome.start_position, num_verified=outcome.num_verified))


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, engine: AsyncEngine, info: verifier_pb2.VerifierInfo) -> None:
        self._engine = engine
        self._info = info
        self._aborts: set[asyncio.Task] = set()  # statuses of failed streams, sent once their peer reads

    async def GetInfo(self, request, context) -> verifier_pb2.VerifierInfo:
        return self._info

    async def Verify(self, request_iterator: AsyncIterator[verifier_pb2.DraftMessage],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[verifier_pb2.VerifierMessage]:
        timeout_s = self._engine.limits.handshake_timeout_s
        try:
            first = await asyncio.wait_for(anext(aiter(request_iterator)), timeout_s)
        except StopAsyncIteration:
            return
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"no hello within {timeout_s:g}s of the stream's "
                                "start (--handshake-timeout): the first message of a Verify stream must be hello")
        await self._check_hello(first, context)
        try:
            stream_id, outbox = self._engine.open_stream()
        except ServiceError as err:
            await context.abort(grpc.StatusCode[err.code.name], err.message)
        log.info("verify_stream_open", stream_id=stream_id, peer=context.peer(), draft_model=first.hello.draft_model_id)
        outbox.end_rpc = functools.partial(self._end_rpc, asyncio.current_task(), context)
        live: set[int] = set()  # sequences opened on this stream and not yet ended
        reader = asyncio.create_task(self._read(request_iterator, stream_id, outbox, live))
        reporter = asyncio.create_task(self._report_load(outbox)) if first.hello.load_reports else None
        draining = False
        try:
            outbox.writing = True  # until the peer takes it: a failure meanwhile ends the RPC (_end_rpc)
            yield verifier_pb2.VerifierMessage(welcome=verifier_pb2.Welcome(info=self._info))
            outbox.writing = False
            while not (draining and not live and outbox.empty()):
                try:
                    outcome = await outbox.get()
                except ServiceError as err:  # the stream failed (StreamOutbox): its sequences are freed already
                    await context.abort(grpc.StatusCode[err.code.name], err.message)
                if outcome is None:  # the draft closed its side: answer what is open, then end
                    draining = True
                    continue
                if isinstance(outcome, ErrorOut) or (isinstance(outcome, VerdictOut) and outcome.finish_reason):
                    live.discard(outcome.key.seq_id)
                outbox.writing = True
                yield outcome_to_proto(outcome)
                outbox.writing = False
        finally:
            reader.cancel()
            if reporter is not None:
                reporter.cancel()
            self._engine.close_stream(stream_id)
            log.info("verify_stream_closed", stream_id=stream_id)

    async def _report_load(self, outbox: StreamOutbox) -> None:
        """The verifier's load, after the welcome and then whenever it changes (checked every
        LOAD_REPORT_INTERVAL_S, and at once when a drain starts): a draft with several verifiers places new
        sequences by it, and stops placing any here once it says draining."""
        last = None
        draining = self._engine.draining
        while True:
            load = self._engine.load()
            if load != last:
                outbox.put(load)
                last = load
            if draining.is_set():
                await asyncio.sleep(LOAD_REPORT_INTERVAL_S)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(draining.wait(), LOAD_REPORT_INTERVAL_S)

    def _end_rpc(self, task: asyncio.Task, context: grpc.aio.ServicerContext, error: ServiceError) -> None:
        """A stream failed while its handler waits for the peer to take a reply, which a peer that does not read
        never does: the handler is cancelled, so it ends now (and its reader with it), and the failure is sent
        as the RPC's status, which the peer gets once it reads."""
        task.cancel()

        async def abort() -> None:
            with contextlib.suppress(Exception):  # AbortError once sent, or the RPC went meanwhile
                await context.abort(grpc.StatusCode[error.code.name], error.message)

        aborting = asyncio.get_running_loop().create_task(abort())
        self._aborts.add(aborting)
        aborting.add_done_callback(self._aborts.discard)

    async def _check_hello(self, msg: verifier_pb2.DraftMessage, context: grpc.aio.ServicerContext) -> None:
        if msg.WhichOneof("kind") != "hello":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "the first message of a Verify stream must be hello (model identity handshake)")
        mismatch = wire.handshake_mismatch(self._info, msg.hello)
        if mismatch is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, mismatch)

    async def _read(self, request_iterator, stream_id: int, outbox: StreamOutbox, live: set[int]) -> None:
        limits = self._engine.engine.limits
        try:
            async for msg in request_iterator:
                if outbox.failure is not None:
                    break
                kind = msg.WhichOneof("kind")
                if kind == "open":
                    cmd = self._open(msg.open, stream_id, outbox, limits)
                    if isinstance(cmd, OpenCmd) and self._engine.draining.is_set():
                        cmd = RefusedCmd(cmd.key, ErrorCode.UNAVAILABLE, DRAINING_MESSAGE, opening=True)
                    if isinstance(cmd, OpenCmd):
                        live.add(cmd.key.seq_id)
                    self._engine.submit(cmd)
                elif kind == "propose":
                    self._engine.submit(self._proposal(msg.propose, stream_id, outbox, limits))
                elif kind == "close":
                    live.discard(msg.close.seq_id)
                    self._engine.submit(CloseCmd(SeqKey(stream_id, msg.close.seq_id)))
                else:
                    outbox.protocol_error()
                    outbox.put(ErrorOut(SeqKey(stream_id, 0), ErrorCode.INVALID_ARGUMENT,
                                        f"unexpected {kind or 'empty'} message after the handshake"))
                # backpressure: the next message is read once the engine has room for it
                await outbox.wait_for_credit()
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            pass
        finally:
            outbox.put(None)

    @staticmethod
    def _open(o: verifier_pb2.OpenSequence, stream_id: int, outbox: StreamOutbox, limits) -> OpenCmd | RefusedCmd:
        """The open's checks that need the wire message; the engine checks the rest. A refused one goes through
        the engine too: it knows, in arrival order, whether a sequence is open under that id, which then goes
        on (the error names no sequence)."""
        key = SeqKey(stream_id, o.seq_id)
        try:
            if o.seq_id == 0:  # errors that name no sequence carry 0
                raise ServiceError(ErrorCode.INVALID_ARGUMENT, "seq_id 0 is reserved (an error with seq_id 0 names "
                                   "no sequence); number sequences from 1")
            check_prompt_length(len(o.prompt_token_ids), limits)  # before they are converted
            sampling = wire.sampling_from_proto(o.sampling, WireMode.COUPLED if o.coupled else None).with_seed()
            cache_salt = wire.cache_salt_from_proto(o)
        except ServiceError as err:
            outbox.refused(err.code)
            return RefusedCmd(key, err.code, err.message, opening=True)
        deadline = time.monotonic() + o.timeout_ms / 1000 if o.HasField("timeout_ms") else None
        return OpenCmd(key, tuple(o.prompt_token_ids), sampling, num_output_tokens=o.num_output_tokens,
                       deadline=deadline, cache_salt=cache_salt)

    @staticmethod
    def _proposal(p: verifier_pb2.Proposal, stream_id: int, outbox: StreamOutbox, limits) -> ProposeCmd | RefusedCmd:
        """The proposal checked here, on the stream's side, so that the engine thread's work per proposal stays
        bounded (at most max_draft_tokens x --max-q-support entries to pack) whatever a draft sends; a refused
        one still goes through the engine, which ends its sequence in arrival order."""
        key = SeqKey(stream_id, p.seq_id)
        try:
            # from the counts alone, before anything is converted: a refusal costs O(max_draft_tokens)
            check_proposal_size(len(p.draft_token_ids), len(p.assumed_token_ids),
                                [max(len(d.token_ids), len(d.probs))
                                 for d in p.draft_probs[:max(limits.max_draft_tokens, limits.max_tree_nodes) + 1]],
                                limits, num_parents=len(p.draft_parents))
            cmd = ProposeCmd(key, p.start_position, tuple(p.draft_token_ids),
                             wire.draft_probs_from_proto(p.draft_probs), tuple(p.assumed_token_ids),
                             p.max_draft_tokens if p.HasField("max_draft_tokens") else None,
                             p.draft_seconds if p.HasField("draft_seconds") else None,
                             tuple(p.draft_parents) or None, p.catch_up_tokens,
                             p.draft_backlog_tokens if p.HasField("draft_backlog_tokens") else None)
            check_proposal(cmd, limits)  # whether its sequence takes draft_probs is the engine's to check
            return cmd
        except ServiceError as err:
            outbox.refused(err.code)  # a q past --max-q-support (RESOURCE_EXHAUSTED) is not malformed
            return RefusedCmd(key, err.code, err.message)
