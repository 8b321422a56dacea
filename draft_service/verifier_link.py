"""The draft side of the Verify stream: one long-lived bidirectional stream multiplexing every sequence of
this draft process. Protobuf ends here; callers see the typed events of draft_service/types.py.

When the stream breaks (the verifier restarted, the network dropped), every live sequence gets a StreamLost
event and the link reconnects in the background, with exponential backoff and jitter, on a fresh channel each
attempt (so gRPC's own reconnect backoff never delays noticing that the verifier is back). Each generation then
reopens its sequence on the new stream with its verified tokens (`reopen`) and proposes again.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time

import grpc
import structlog

from common.errors import ErrorCode, ServiceError
from common.sampling import SamplingParams
from common.security import read_token, tls_name_override, token_metadata
from draft_service.link_messages import event_of, open_message, proposal_message
from draft_service.link_security import LinkSecurity
from draft_service.types import (
    DraftBlock,
    ErrorEvent,
    LinkEvent,
    StreamLost,
    VerifierIdentity,
)
from specwire.v1 import verifier_pb2, verifier_pb2_grpc, wire

log = structlog.get_logger(__name__)

ATTEMPT_TIMEOUT_S = 5.0  # one connection attempt: GetInfo, then the hello/welcome handshake
BACKOFF_INITIAL_S = 0.05
BACKOFF_MAX_S = 2.0
# Errors no retry can fix: the attempt's error is reported at once to whoever waits with fail_fast.
_PERMANENT = (ErrorCode.FAILED_PRECONDITION, ErrorCode.UNAUTHENTICATED, ErrorCode.PERMISSION_DENIED)


class LinkDown(Exception):
    """A message could not be sent: the stream is down (the caller resumes, as for StreamLost)."""


class VerifierLink:
    def __init__(self, target: str, *, draft_model_id: str, vocab_size: int | None, tokenizer_fingerprint: str,
                 security: LinkSecurity | None = None, on_reconnect=None) -> None:
        """vocab_size None: a proposer without logits (n-gram) takes the verifier's. on_reconnect: called after
        each successful reconnection (not the first connection)."""
        self._target = target
        self._security = security or LinkSecurity()
        self._token = self._security.token
        self._hello = verifier_pb2.Hello(draft_model_id=draft_model_id, vocab_size=vocab_size or 0,
                                         tokenizer_fingerprint=tokenizer_fingerprint,
                                         protocol_version=wire.PROTOCOL_VERSION)
        self._channel: grpc.aio.Channel | None = None
        self._call = None
        self._reader: asyncio.Task | None = None
        self._writer: asyncio.Task | None = None
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._inboxes: dict[int, asyncio.Queue[LinkEvent]] = {}
        self._open_on: dict[int, int] = {}  # seq id -> the connection it was (re)opened on
        self._started_on: dict[int, VerifierIdentity] = {}  # seq id -> the target that began its output
        self._cache_salts: dict[int, str] = {}  # seq id -> its prefix-cache salt, sent again on every reopen
        self._seq_ids = itertools.count(1)
        self._reconnect_task: asyncio.Task | None = None
        self._attempted = asyncio.Event()  # set (and replaced) after every connection attempt
        self._last_error: ServiceError | None = None
        self._closed = False
        self._num_connections = 0
        self._on_reconnect = on_reconnect
        self.identity: VerifierIdentity | None = None

    @property
    def connected(self) -> bool:
        return self._reader is not None and not self._reader.done()

    # -- connection -------------------------------------------------------------------------------------------

    async def ensure_connected(self, timeout_s: float, *, fail_fast: bool = True) -> VerifierIdentity:
        """The verifier's identity once the stream is up; starts (re)connecting if it is not. Raises
        ServiceError: UNAVAILABLE after timeout_s, or at once, with fail_fast, an error no retry can fix (a
        handshake mismatch, a refused token)."""
        deadline = time.monotonic() + timeout_s
        while not self.connected:
            error = self._last_error
            if fail_fast and error is not None and error.code in _PERMANENT:
                raise error
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                detail = f": {error.message}" if error is not None else ""
                code = error.code if error is not None and error.code in _PERMANENT else ErrorCode.UNAVAILABLE
                raise ServiceError(code, f"the verifier at {self._target} was not reachable within "
                                   f"{timeout_s:g}s{detail}")
            self._start_reconnecting()
            attempted = self._attempted
            try:
                await asyncio.wait_for(attempted.wait(), remaining)
            except TimeoutError:
                pass
        return self.identity

    def reconnect_in_background(self) -> None:
        """Start reconnecting now if the stream is down (the health watcher's call: a restarted verifier is found
        before the next request needs it)."""
        if not self.connected and not self._closed:
            self._start_reconnecting()

    def _start_reconnecting(self) -> None:
        if self._closed:
            raise ServiceError(ErrorCode.UNAVAILABLE, "the draft service is shutting down")
        if self._reconnect_task is None or self._reconnect_task.done():
            self._reconnect_task = asyncio.create_task(self._reconnect(), name="verifier-link-reconnect")

    async def _reconnect(self) -> None:
        delay = BACKOFF_INITIAL_S
        while not self._closed and not self.connected:
            try:
                await self._connect_once()
                self._last_error = None
            except ServiceError as err:
                self._last_error = err
                log.warning("verifier_connect_failed", target=self._target, code=err.code.name, message=err.message,
                            retry_in_s=round(delay, 3))
            self._attempted.set()
            self._attempted = asyncio.Event()
            if self.connected:
                return
            await asyncio.sleep(delay * random.uniform(0.5, 1.5))  # jitter: drafts do not retry in lockstep
            delay = min(delay * 2, BACKOFF_MAX_S)

    async def _connect_once(self) -> None:
        """GetInfo, then the hello/welcome handshake, on a fresh channel."""
        await self._teardown()
        options = [*wire.CHANNEL_OPTIONS, *tls_name_override(self._security.server_name)]
        if self._security.credentials is not None:
            self._channel = grpc.aio.secure_channel(self._target, self._security.credentials, options=options)
        else:
            self._channel = grpc.aio.insecure_channel(self._target, options=options)
        stub = verifier_pb2_grpc.VerifierStub(self._channel)
        metadata = self._attempt_metadata()
        try:
            info = await stub.GetInfo(verifier_pb2.GetInfoRequest(), timeout=ATTEMPT_TIMEOUT_S, metadata=metadata)
            self._check_identity(info)
            self._call = stub.Verify(metadata=metadata)
            await self._call.write(verifier_pb2.DraftMessage(hello=self._hello))
            first = await asyncio.wait_for(self._call.read(), ATTEMPT_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            await self._teardown()
            raise ServiceError(wire.error_code_from_status_name(err.code().name),
                               f"verifier {self._target}: {err.details()}") from err
        except TimeoutError as err:
            await self._teardown()
            raise ServiceError(ErrorCode.UNAVAILABLE, f"verifier {self._target} did not answer the handshake "
                               f"within {ATTEMPT_TIMEOUT_S:g}s") from err
        except ServiceError:
            await self._teardown()
            raise
        if first is grpc.aio.EOF or first.WhichOneof("kind") != "welcome":
            await self._teardown()
            raise ServiceError(ErrorCode.UNAVAILABLE, f"verifier {self._target} closed the stream at handshake")
        self._outbox = asyncio.Queue()
        self._reader = asyncio.create_task(self._read_loop(), name="verifier-link-reader")
        self._writer = asyncio.create_task(self._write_loop(), name="verifier-link-writer")
        self._num_connections += 1
        log.info("verifier_connected", target=self._target, model=info.model_id,
                 max_draft_tokens=info.max_draft_tokens, tls=self._security.credentials is not None,
                 reconnect=self._num_connections > 1)
        if self._num_connections > 1 and self._on_reconnect is not None:
            self._on_reconnect()

    def _attempt_metadata(self) -> tuple[tuple[str, str], ...]:
        """The bearer token for one connection attempt. The token file is read again at each, so a draft whose
        token was rotated (the new one first in its file, the old one then retired on the verifier) reconnects
        with the new one instead of being refused for ever; a read that fails (a file caught mid-rewrite) keeps
        the last good token and logs why."""
        path = self._security.token_file
        if path:
            try:
                self._token = read_token(path)
            except ValueError as err:  # unreadable or no token: the message names the file, never a token
                log.error("verifier_token_file_read_failed", path=path, reason=str(err))
        return token_metadata(self._token)

    def _check_identity(self, info: verifier_pb2.VerifierInfo) -> None:
        if not self._hello.vocab_size:  # a proposer without logits takes the verifier's vocabulary
            self._hello.vocab_size = info.vocab_size
        mismatch = wire.handshake_mismatch(info, self._hello)
        if mismatch is not None:
            raise ServiceError(ErrorCode.FAILED_PRECONDITION, mismatch)
        self.identity = VerifierIdentity(info.model_id, info.vocab_size, info.tokenizer_fingerprint,
                                         info.max_draft_tokens, info.max_model_len, tuple(info.features),
                                         model_fingerprint=info.model_fingerprint, dtype=info.dtype,
                                         quantization=info.quantization, max_q_support=max(0, info.max_q_support))

    async def close(self) -> None:
        self._closed = True
        if self._reconnect_task is not None:
            self._reconnect_task.cancel()
            await asyncio.gather(self._reconnect_task, return_exceptions=True)
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

    async def open(self, prompt_token_ids: list[int], sampling: SamplingParams, *, retry_s: float,
                   deadline: float | None = None, cache_salt: str | None = None) -> int:
        """Open a sequence (waiting up to retry_s for the stream); returns its id on this link. `cache_salt`
        stays with the sequence: every reopen sends it again."""
        seq_id = next(self._seq_ids)
        if cache_salt is not None:
            self._cache_salts[seq_id] = cache_salt
        try:
            await self.reopen(seq_id, prompt_token_ids, sampling, num_output_tokens=0, retry_s=retry_s,
                              deadline=deadline)
        except BaseException:
            self._cache_salts.pop(seq_id, None)
            self._started_on.pop(seq_id, None)
            raise
        return seq_id

    async def reopen(self, seq_id: int, token_ids: list[int], sampling: SamplingParams, *, num_output_tokens: int,
                     retry_s: float, deadline: float | None = None) -> None:
        """(Re)open `seq_id` on the current stream with `token_ids`, the last num_output_tokens of them its
        verified output so far. Events of an earlier stream still queued for it are discarded. A sequence with
        output resumes only on the target it started on (VerifierIdentity.target_change): FAILED_PRECONDITION
        otherwise."""
        cache_salt = self._cache_salts.get(seq_id)
        while True:
            identity = await self.ensure_connected(retry_s)
            if sampling.coupled and wire.FEATURE_COUPLED not in identity.features:  # e.g. a resume on an older one
                raise ServiceError(ErrorCode.FAILED_PRECONDITION, f"the verifier at {self._target} does not "
                                   "implement the coupled wire mode")
            if cache_salt is not None and wire.FEATURE_CACHE_SALT not in identity.features:
                # an older verifier would ignore the salt and share this tenant's prefix cache with everyone
                raise ServiceError(ErrorCode.FAILED_PRECONDITION, f"the verifier at {self._target} does not "
                                   "implement cache_salt (prefix-cache isolation); send the request without it")
            started = self._started_on.get(seq_id)
            if started is not None and num_output_tokens:
                change = started.target_change(identity)
                if change is not None:
                    log.warning("resume_refused_target_changed", target=self._target, seq_id=seq_id, reason=change)
                    raise ServiceError(ErrorCode.FAILED_PRECONDITION, change)
            else:  # no output yet: whatever target it is (re)opened on produces all of it
                self._started_on[seq_id] = identity
            self._inboxes[seq_id] = asyncio.Queue()
            self._open_on[seq_id] = self._num_connections
            try:
                self._send(open_message(seq_id, token_ids, sampling, num_output_tokens, deadline, cache_salt))
                return
            except LinkDown:
                continue

    def propose(self, seq_id: int, start_position: int, block: DraftBlock, *, send_draft_probs: bool,
                assumed_token_ids: tuple[int, ...] = (), max_draft_tokens: int | None = None) -> int:
        """Send; returns the message's serialized size. Raises LinkDown when the sequence is not open on the
        current stream (it broke, and the sequence was not reopened yet): a proposal sent there would reach a
        verifier that does not know the sequence. `max_draft_tokens`: ask for the verifier's choice of the next
        block's length, at most this (sent only to a verifier with the goodput feature)."""
        if self._open_on.get(seq_id) != self._num_connections:
            raise LinkDown(f"sequence {seq_id} is not open on the current Verify stream to {self._target}")
        asks = max_draft_tokens is not None and self.identity is not None \
            and wire.FEATURE_GOODPUT in self.identity.features
        message = proposal_message(seq_id, start_position, block, send_draft_probs=send_draft_probs,
                                   assumed_token_ids=assumed_token_ids,
                                   max_draft_tokens=max_draft_tokens if asks else None)
        self._send(message)
        return message.ByteSize()

    async def next_event(self, seq_id: int) -> LinkEvent:
        return await self._inboxes[seq_id].get()

    def release(self, seq_id: int, *, cancel: bool) -> None:
        """Forget the sequence; with cancel, tell the verifier to free it (it frees finished ones itself)."""
        open_on = self._open_on.pop(seq_id, None)
        self._started_on.pop(seq_id, None)
        self._cache_salts.pop(seq_id, None)
        if self._inboxes.pop(seq_id, None) is not None and cancel and open_on == self._num_connections \
                and self.connected:
            self._send(verifier_pb2.DraftMessage(close=verifier_pb2.CloseSequence(seq_id=seq_id)))

    def _send(self, msg: verifier_pb2.DraftMessage) -> None:
        if not self.connected:
            raise LinkDown(f"the Verify stream to {self._target} is down")
        self._outbox.put_nowait(msg)

    async def _write_loop(self) -> None:
        while True:
            msg = await self._outbox.get()
            await self._call.write(msg)

    async def _read_loop(self) -> None:
        reason = "the verifier ended the stream"
        cancelled = False
        try:
            while True:
                msg = await self._call.read()
                if msg is grpc.aio.EOF:
                    break
                self._dispatch(msg)
        except grpc.aio.AioRpcError as err:
            reason = f"{err.code().name}: {err.details()}"
        except asyncio.CancelledError:
            reason, cancelled = "the link was closed", True
            raise
        finally:
            log.warning("verifier_stream_ended", target=self._target, reason=reason,
                        live_sequences=len(self._inboxes))
            lost = StreamLost(f"the Verify stream to {self._target} broke ({reason})")
            for inbox in self._inboxes.values():
                inbox.put_nowait(lost)
            if not cancelled and not self._closed and self._reader is asyncio.current_task():
                self._reader = None  # `connected` turns false at once, not only once this task is done
                asyncio.get_running_loop().call_soon(self._start_reconnecting)

    def _dispatch(self, msg: verifier_pb2.VerifierMessage) -> None:
        received = event_of(msg)
        if received is None:
            return
        seq_id, event = received
        if seq_id == 0:  # names no sequence: routed to none, and the stream goes on
            if isinstance(event, ErrorEvent):  # a duplicate open, a message the verifier did not understand: it
                # points at a bug in this draft, so it is logged
                log.warning("verifier_stream_error", target=self._target, code=event.code.name,
                            message=event.message)
            return
        inbox = self._inboxes.get(seq_id)
        if inbox is not None:
            inbox.put_nowait(event)
