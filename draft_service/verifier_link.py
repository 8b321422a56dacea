"""The draft side of the Verify stream: one long-lived bidirectional stream multiplexing every sequence of
this draft process. Protobuf ends here; callers see the typed events of draft_service/types.py.

The connection itself (handshake, reconnecting with backoff) is draft_service/verifier_connection.py. When the
stream breaks (the verifier restarted, the network dropped), every live sequence gets a StreamLost event while
the connection reconnects in the background. Each generation then reopens its sequence on the new stream with
its verified tokens (`reopen`) and proposes again.
"""

from __future__ import annotations

import asyncio
import itertools

import structlog

from common.errors import ErrorCode, ServiceError
from common.sampling import SamplingParams
from draft_service.link_messages import event_of, open_message, proposal_message
from draft_service.link_security import LinkSecurity
from draft_service.types import DraftBlock, ErrorEvent, LinkEvent, StreamLost, VerifierIdentity
from draft_service.verifier_connection import LinkDown, VerifierConnection
from specwire.v1 import verifier_pb2, wire

__all__ = ["LinkDown", "VerifierLink"]

log = structlog.get_logger(__name__)


class VerifierLink:
    def __init__(self, target: str, *, draft_model_id: str, vocab_size: int | None, tokenizer_fingerprint: str,
                 security: LinkSecurity | None = None, on_reconnect=None) -> None:
        """vocab_size None: a proposer without logits (n-gram) takes the verifier's. on_reconnect: called after
        each successful reconnection (not the first connection)."""
        self._target = target
        hello = verifier_pb2.Hello(draft_model_id=draft_model_id, vocab_size=vocab_size or 0,
                                   tokenizer_fingerprint=tokenizer_fingerprint, protocol_version=wire.PROTOCOL_VERSION)
        self._connection = VerifierConnection(target, hello, security=security or LinkSecurity(),
                                              on_message=self._dispatch, on_lost=self._lost,
                                              on_reconnect=on_reconnect)
        self._inboxes: dict[int, asyncio.Queue[LinkEvent]] = {}
        self._open_on: dict[int, int] = {}  # seq id -> the connection it was (re)opened on
        self._started_on: dict[int, VerifierIdentity] = {}  # seq id -> the target that began its output
        self._cache_salts: dict[int, str] = {}  # seq id -> its prefix-cache salt, sent again on every reopen
        self._seq_ids = itertools.count(1)

    # -- the connection ---------------------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._connection.connected

    @property
    def identity(self) -> VerifierIdentity | None:
        """The last verifier connected to (None before the first connection)."""
        return self._connection.identity

    async def ensure_connected(self, timeout_s: float, *, fail_fast: bool = True) -> VerifierIdentity:
        """See VerifierConnection.ensure_connected."""
        return await self._connection.ensure_connected(timeout_s, fail_fast=fail_fast)

    def reconnect_in_background(self) -> None:
        """Start reconnecting now if the stream is down (the health watcher's call: a restarted verifier is found
        before the next request needs it)."""
        if not self._connection.connected and not self._connection.closed:
            self._connection.start_reconnecting()

    async def close(self) -> None:
        await self._connection.close()

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
            self._check_features(identity, sampling, cache_salt)
            started = self._started_on.get(seq_id)
            if started is not None and num_output_tokens:
                change = started.target_change(identity)
                if change is not None:
                    log.warning("resume_refused_target_changed", target=self._target, seq_id=seq_id, reason=change)
                    raise ServiceError(ErrorCode.FAILED_PRECONDITION, change)
            else:  # no output yet: whatever target it is (re)opened on produces all of it
                self._started_on[seq_id] = identity
            self._inboxes[seq_id] = asyncio.Queue()
            self._open_on[seq_id] = self._connection.num_connections
            try:
                self._send(open_message(seq_id, token_ids, sampling, num_output_tokens, deadline, cache_salt))
                return
            except LinkDown:
                continue

    def _check_features(self, identity: VerifierIdentity, sampling: SamplingParams, cache_salt: str | None) -> None:
        """FAILED_PRECONDITION unless the verifier implements what the sequence needs (e.g. a resume on an older
        one)."""
        if sampling.is_coupled and wire.FEATURE_COUPLED not in identity.features:
            raise ServiceError(ErrorCode.FAILED_PRECONDITION, f"the verifier at {self._target} does not "
                               "implement the coupled wire mode")
        if cache_salt is not None and wire.FEATURE_CACHE_SALT not in identity.features:
            # an older verifier would ignore the salt and share this tenant's prefix cache with everyone
            raise ServiceError(ErrorCode.FAILED_PRECONDITION, f"the verifier at {self._target} does not "
                               "implement cache_salt (prefix-cache isolation); send the request without it")

    def propose(self, seq_id: int, start_position: int, block: DraftBlock, *, send_draft_probs: bool,
                assumed_token_ids: tuple[int, ...] = (), max_draft_tokens: int | None = None) -> int:
        """Send; returns the message's serialized size. Raises LinkDown when the sequence is not open on the
        current stream (it broke, and the sequence was not reopened yet): a proposal sent there would reach a
        verifier that does not know the sequence. `max_draft_tokens`: ask for the verifier's choice of the next
        block's length, at most this (sent only to a verifier with the goodput feature)."""
        if self._open_on.get(seq_id) != self._connection.num_connections:
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
        if self._inboxes.pop(seq_id, None) is not None and cancel \
                and open_on == self._connection.num_connections and self.connected:
            self._send(verifier_pb2.DraftMessage(close=verifier_pb2.CloseSequence(seq_id=seq_id)))

    def _send(self, msg: verifier_pb2.DraftMessage) -> None:
        self._connection.send(msg)

    # -- what the verifier sends ------------------------------------------------------------------------------

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

    def _lost(self, reason: str) -> None:
        """The stream ended: every live sequence must be resumed on the next one."""
        log.warning("verifier_stream_ended", target=self._target, reason=reason, live_sequences=len(self._inboxes))
        lost = StreamLost(f"the Verify stream to {self._target} broke ({reason})")
        for inbox in self._inboxes.values():
            inbox.put_nowait(lost)
