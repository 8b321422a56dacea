"""The draft side of the Verify stream: one long-lived bidirectional stream multiplexing every sequence of
this draft process. Protobuf ends here; callers see the typed events of draft_service/types.py."""

from __future__ import annotations

import asyncio
import itertools

import grpc
import structlog

from common.errors import ErrorCode, ServiceError
from common.sampling import SamplingParams
from draft_service.types import DraftBlock, DroppedEvent, ErrorEvent, LinkEvent, VerdictEvent, VerifierIdentity
from specwire.v1 import verifier_pb2, verifier_pb2_grpc, wire

log = structlog.get_logger(__name__)


class VerifierLink:
    def __init__(self, target: str, *, draft_model_id: str, vocab_size: int | None, tokenizer_fingerprint: str) -> None:
        """vocab_size None: a proposer without logits (n-gram) takes the verifier's."""
        self._target = target
        self._hello = verifier_pb2.Hello(draft_model_id=draft_model_id, vocab_size=vocab_size or 0,
                                         tokenizer_fingerprint=tokenizer_fingerprint,
                                         protocol_version=wire.PROTOCOL_VERSION)
        self._channel: grpc.aio.Channel | None = None
        self._call = None
        self._reader: asyncio.Task | None = None
        self._writer: asyncio.Task | None = None
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._inboxes: dict[int, asyncio.Queue[LinkEvent]] = {}
        self._seq_ids = itertools.count(1)
        self._connect_lock = asyncio.Lock()
        self.identity: VerifierIdentity | None = None

    @property
    def connected(self) -> bool:
        return self._reader is not None and not self._reader.done()

    async def connect(self, timeout_s: float = 10.0) -> VerifierIdentity:
        """GetInfo, then the hello/welcome handshake. A mismatch raises ServiceError(FAILED_PRECONDITION)."""
        async with self._connect_lock:
            if self.connected:
                return self.identity
            await self._teardown()
            self._channel = grpc.aio.insecure_channel(self._target, options=wire.CHANNEL_OPTIONS)
            stub = verifier_pb2_grpc.VerifierStub(self._channel)
            try:
                info = await stub.GetInfo(verifier_pb2.GetInfoRequest(), timeout=timeout_s, wait_for_ready=True)
                self._check_identity(info)
                self._call = stub.Verify()
                await self._call.write(verifier_pb2.DraftMessage(hello=self._hello))
                first = await asyncio.wait_for(self._call.read(), timeout_s)
            except grpc.aio.AioRpcError as err:
                await self._teardown()
                raise ServiceError(wire.error_code_from_status_name(err.code().name),
                                   f"verifier {self._target}: {err.details()}") from err
            except TimeoutError as err:
                await self._teardown()
                raise ServiceError(ErrorCode.UNAVAILABLE, f"verifier {self._target} did not answer the handshake "
                                    f"within {timeout_s}s") from err
            if first is grpc.aio.EOF or first.WhichOneof("kind") != "welcome":
                await self._teardown()
                raise ServiceError(ErrorCode.UNAVAILABLE, f"verifier {self._target} closed the stream at handshake")
            self._outbox = asyncio.Queue()
            self._reader = asyncio.create_task(self._read_loop(), name="verifier-link-reader")
            self._writer = asyncio.create_task(self._write_loop(), name="verifier-link-writer")
            log.info("verifier_connected", target=self._target, model=info.model_id,
                     max_draft_tokens=info.max_draft_tokens)
            return self.identity

    def _check_identity(self, info: verifier_pb2.VerifierInfo) -> None:
        if not self._hello.vocab_size:  # a proposer without logits takes the verifier's vocabulary
            self._hello.vocab_size = info.vocab_size
        mismatch = wire.handshake_mismatch(info, self._hello)
        if mismatch is not None:
            raise ServiceError(ErrorCode.FAILED_PRECONDITION, mismatch)
        self.identity = VerifierIdentity(info.model_id, info.vocab_size, info.tokenizer_fingerprint,
                                         info.max_draft_tokens, info.max_model_len)

    async def close(self) -> None:
        await self._teardown()

    async def _teardown(self) -> None:
        for task in (self._reader, self._writer):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._reader = self._writer = None
        if self._call is not None:
            self._call.cancel()
            self._call = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    # -- sequences --------------------------------------------------------------------------------------------

    async def open(self, prompt_token_ids: list[int], sampling: SamplingParams) -> int:
        if not self.connected:
            await self.connect()
        seq_id = next(self._seq_ids)
        self._inboxes[seq_id] = asyncio.Queue()
        self._send(verifier_pb2.DraftMessage(open=verifier_pb2.OpenSequence(
            seq_id=seq_id, prompt_token_ids=prompt_token_ids, sampling=wire.sampling_to_proto(sampling))))
        return seq_id

    def propose(self, seq_id: int, start_position: int, block: DraftBlock, *, send_draft_probs: bool) -> None:
        msg = verifier_pb2.Proposal(seq_id=seq_id, start_position=start_position, draft_token_ids=block.token_ids)
        if send_draft_probs and block.draft_probs is not None:
            msg.draft_probs.extend(wire.draft_probs_to_proto(block.draft_probs))
        self._send(verifier_pb2.DraftMessage(propose=msg))

    async def next_event(self, seq_id: int) -> LinkEvent:
        return await self._inboxes[seq_id].get()

    def release(self, seq_id: int, *, cancel: bool) -> None:
        """Forget the sequence; with cancel, tell the verifier to free it (it frees finished ones itself)."""
        if self._inboxes.pop(seq_id, None) is not None and cancel and self.connected:
            self._send(verifier_pb2.DraftMessage(close=verifier_pb2.CloseSequence(seq_id=seq_id)))

    def _send(self, msg: verifier_pb2.DraftMessage) -> None:
        if not self.connected:
            raise ServiceError(ErrorCode.UNAVAILABLE, f"the Verify stream to {self._target} is down")
        self._outbox.put_nowait(msg)

    async def _write_loop(self) -> None:
        while True:
            msg = await self._outbox.get()
            await self._call.write(msg)

    async def _read_loop(self) -> None:
        error = ErrorEvent(ErrorCode.UNAVAILABLE, f"the Verify stream to {self._target} ended")
        try:
            while True:
                msg = await self._call.read()
                if msg is grpc.aio.EOF:
                    break
                self._dispatch(msg)
        except grpc.aio.AioRpcError as err:
            error = ErrorEvent(wire.error_code_from_status_name(err.code().name),
                               f"verifier {self._target}: {err.details()}")
        except asyncio.CancelledError:
            error = ErrorEvent(ErrorCode.UNAVAILABLE, f"the Verify stream to {self._target} was closed")
            raise
        finally:
            log.warning("verifier_stream_ended", target=self._target, reason=error.message,
                        live_sequences=len(self._inboxes))
            for inbox in self._inboxes.values():
                inbox.put_nowait(error)

    def _dispatch(self, msg: verifier_pb2.VerifierMessage) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "verdict":
            v = msg.verdict
            event: LinkEvent = VerdictEvent(v.start_position, v.num_accepted, tuple(v.token_ids),
                                            wire.finish_from_proto(v.finish_reason), v.batch_size, v.step_time_s)
            seq_id = v.seq_id
        elif kind == "error":
            e = msg.error
            event, seq_id = ErrorEvent(wire.error_code_from_proto(e.code), e.message), e.seq_id
        elif kind == "dropped":
            d = msg.dropped
            event, seq_id = DroppedEvent(d.start_position, d.num_verified), d.seq_id
        else:
            return
        inbox = self._inboxes.get(seq_id)
        if inbox is not None:
            inbox.put_nowait(event)
