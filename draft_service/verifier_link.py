"""The draft side of the Verify streams: one long-lived bidirectional stream per verifier, each multiplexing
every sequence this draft process placed there. Protobuf ends here; callers see the typed events of
draft_service/types.py.

The connection itself (handshake, reconnecting with backoff) is draft_service/verifier_connection.py, one per
verifier; where a sequence goes is draft_service/placement.py. When a stream breaks (its verifier restarted,
was killed, or the network dropped), every sequence on it gets a StreamLost event while the connection
reconnects in the background. Each generation then reopens its sequence with its verified tokens (`reopen`):
on the same verifier if it is back, else on another one, and proposes again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from common.errors import ErrorCode, ServiceError
from common.sampling import SamplingParams
from draft_service.link_messages import event_of, open_message, proposal_message
from draft_service.link_security import LinkSecurity
from draft_service.placement import VerifierLoad, VerifierState, VerifierTargets, choose, prefix_hashes
from draft_service.types import DraftBlock, ErrorEvent, LinkEvent, StreamLost, VerdictEvent, VerifierIdentity
from draft_service.verifier_connection import PERMANENT_ERRORS, LinkDown, VerifierConnection
from specwire.v1 import verifier_pb2, wire

__all__ = ["LinkDown", "VerifierLink"]

log = structlog.get_logger(__name__)

RESOLVE_INTERVAL_S = 5.0  # how often a dns:/// target is resolved again
MIN_RESOLVE_INTERVAL_S = 1.0  # at most this often when a request waits for a verifier the name does not give yet
RESOLVE_TIMEOUT_S = 10.0  # a lookup that takes longer keeps what was known
WAIT_POLL_S = 0.05  # while no verifier can take a sequence: how often to look again


@dataclass(eq=False)
class _Verifier:
    connection: VerifierConnection
    state: VerifierState


@dataclass
class _Placed:
    address: str
    connection_number: int  # the stream (of that verifier's connection) it was (re)opened on


class VerifierLink:
    def __init__(self, target: str, *, draft_model_id: str, vocab_size: int | None, tokenizer_fingerprint: str,
                 security: LinkSecurity | None = None, on_reconnect=None, metrics=None,
                 on_verdict: Callable[[int | None, tuple | None, int], None] | None = None) -> None:
        """`target`: --verifier (one HOST:PORT, a list of them, or dns:///NAME:PORT). vocab_size None: a proposer
        without logits (n-gram) takes the verifier's. on_reconnect: called after each successful reconnection
        (not a verifier's first connection). metrics: DraftMetrics (placements, failovers, sequences per
        verifier), or None. on_verdict (also settable later): called for every verdict that does not end its
        sequence, as it arrives, with its sequence id (None when no generation here awaits it), (verifier, stream,
        step) or None when unstated, and the step's number of such verdicts on the stream
        (draft_service.generation.Generator.verdict_arrived)."""
        self._targets = VerifierTargets.parse(target)
        self._target = target
        # one hello for every verifier: a proposer without logits takes the first one's vocabulary, and the others
        # must then have the same
        self._hello = verifier_pb2.Hello(draft_model_id=draft_model_id, vocab_size=vocab_size or 0,
                                         tokenizer_fingerprint=tokenizer_fingerprint,
                                         protocol_version=wire.PROTOCOL_VERSION, load_reports=True)
        security = security or LinkSecurity()
        if self._targets.resolves and security.server_name is None:  # certificates name the DNS name, not an IP
            security = dataclasses.replace(security, server_name=self._targets.dns_host)
        self._security = security
        self._on_reconnect = on_reconnect
        self.on_verdict = on_verdict
        self._metrics = metrics
        self._verifiers: dict[str, _Verifier] = {}
        for address in self._targets.addresses:
            self._add(address)
        self._resolved_at = -float("inf")
        self._resolving = asyncio.Lock()  # one lookup at a time, whatever number of requests wait
        self._closed = False
        self._inboxes: dict[int, asyncio.Queue[LinkEvent]] = {}
        self._placed: dict[int, _Placed] = {}  # seq id -> where it is open
        self._started_on: dict[int, VerifierIdentity] = {}  # seq id -> the target that began its output
        self._cache_salts: dict[int, str] = {}  # seq id -> its prefix-cache salt, sent again on every reopen
        self._seq_ids = itertools.count(1)

    # -- the verifiers ----------------------------------------------------------------------------------------

    def _add(self, address: str) -> None:
        def reconnected() -> None:
            verifier.state.reset()
            identity = verifier.connection.identity
            if identity is not None and wire.FEATURE_LOAD not in identity.features:
                verifier.state.draining = False  # no report will ever clear it: this verifier does not drain
            if self._on_reconnect is not None:
                self._on_reconnect()

        connection = VerifierConnection(address, self._hello, security=self._security,
                                        on_message=lambda msg: self._dispatch(address, msg),
                                        on_lost=lambda reason: self._lost(address, reason),
                                        on_reconnect=reconnected)
        verifier = _Verifier(connection, VerifierState(address))
        self._verifiers[address] = verifier

    async def refresh(self, *, force: bool = False) -> None:
        """Follow the resolver (dns:/// targets; at most every RESOLVE_INTERVAL_S unless `force`): new addresses
        get a connection; one that went takes no new sequence, and is closed once none of this draft's is left
        on it. A failed lookup keeps what was known."""
        if not self._targets.resolves or self._closed or self._resolving.locked():
            return  # a lookup is under way: nobody waits for it, they go on with what is known
        if time.monotonic() - self._resolved_at < (MIN_RESOLVE_INTERVAL_S if force else RESOLVE_INTERVAL_S):
            return
        async with self._resolving:
            self._resolved_at = time.monotonic()
            try:
                addresses = set(await asyncio.wait_for(self._targets.resolve(), RESOLVE_TIMEOUT_S))
            except (OSError, TimeoutError) as err:
                log.warning("verifier_resolve_failed", target=self._target, error=str(err) or type(err).__name__)
                return
            await self._follow(addresses)

    async def _follow(self, addresses: set[str]) -> None:
        for address in sorted(addresses - self._verifiers.keys()):
            log.info("verifier_added", target=self._target, address=address)
            self._add(address)
        for address, verifier in list(self._verifiers.items()):
            verifier.state.gone = address not in addresses
            if verifier.state.gone and not verifier.state.num_sequences:
                log.info("verifier_removed", target=self._target, address=address)
                del self._verifiers[address]
                await verifier.connection.close()
                if self._metrics is not None:
                    with contextlib.suppress(KeyError):  # never placed on: no series
                        self._metrics.verifier_sequences.remove(address)

    @property
    def can_place(self) -> bool:
        """Whether some verifier takes new sequences now (up, not draining, still resolved)."""
        return bool(self._placeable())

    @property
    def connected(self) -> bool:
        """Whether some verifier's stream is up."""
        return any(v.connection.connected for v in self._verifiers.values())

    @property
    def identity(self) -> VerifierIdentity | None:
        """A connected verifier's (the last known of any when none is connected; None before the first)."""
        known = [v.connection for v in self._verifiers.values() if v.connection.identity is not None]
        return next((c.identity for c in known if c.connected), known[0].identity if known else None)

    def identity_of(self, seq_id: int) -> VerifierIdentity | None:
        """The identity of the verifier the sequence is open on."""
        placed = self._placed.get(seq_id)
        verifier = self._verifiers.get(placed.address) if placed is not None else None
        return verifier.connection.identity if verifier is not None else self.identity

    def sequences_per_verifier(self) -> dict[str, int]:
        return {address: v.state.num_sequences for address, v in self._verifiers.items()}

    async def ensure_connected(self, timeout_s: float, *, fail_fast: bool = True) -> VerifierIdentity:
        """The identity of a verifier that takes new sequences, once one does; starts (re)connecting those that
        are down. Raises ServiceError: UNAVAILABLE after timeout_s, or at once, with fail_fast, an error no retry
        can fix (a handshake mismatch, a refused token) when no verifier is up."""
        verifier = await self._wait_for(lambda: self._placeable(), timeout_s, fail_fast=fail_fast)
        return verifier.connection.identity

    def reconnect_in_background(self) -> None:
        """Start reconnecting every verifier whose stream is down (the health watcher's call: a restarted verifier
        is found before the next request needs it)."""
        for verifier in self._verifiers.values():
            if not verifier.connection.connected and not verifier.connection.closed and not verifier.state.gone:
                verifier.connection.start_reconnecting()

    async def close(self) -> None:
        self._closed = True
        await asyncio.gather(*(v.connection.close() for v in self._verifiers.values()))

    def _placeable(self, started: VerifierIdentity | None = None) -> list[_Verifier]:
        """Verifiers that take a sequence now: connected, not draining, still resolved, and (for a sequence with
        output) serving the target it started on."""
        return [v for v in self._verifiers.values()
                if v.connection.connected and not v.state.draining and not v.state.gone
                and (started is None or started.target_change(v.connection.identity) is None)]

    async def _wait_for(self, candidates, timeout_s: float, *, fail_fast: bool = True) -> _Verifier:
        """The first of `candidates()` once there is one (a function of the link's state), reconnecting those
        that are down meanwhile."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self._closed:
                raise ServiceError(ErrorCode.UNAVAILABLE, "the draft service is shutting down")
            await self.refresh(force=not self._verifiers)
            found = candidates()
            if found:
                return found[0]
            errors = [v.connection.last_error for v in self._verifiers.values() if v.connection.last_error]
            permanent = [e for e in errors if e.code in PERMANENT_ERRORS]
            if fail_fast and permanent and not self.connected:
                raise permanent[0]
            if time.monotonic() >= deadline:
                detail = f": {errors[0].message}" if errors else ""
                code = permanent[0].code if permanent and not self.connected else ErrorCode.UNAVAILABLE
                what = (f"the verifier at {self._target} was not" if len(self._verifiers) == 1
                        else f"no verifier of {self._target} that could take the sequence was")
                raise ServiceError(code, f"{what} reachable within {timeout_s:g}s{detail}")
            self.reconnect_in_background()
            await asyncio.sleep(min(WAIT_POLL_S, max(0.0, deadline - time.monotonic())))

    # -- sequences --------------------------------------------------------------------------------------------

    async def open(self, prompt_token_ids: list[int], sampling: SamplingParams, *, retry_s: float,
                   deadline: float | None = None, cache_salt: str | None = None) -> int:
        """Open a sequence on the verifier placement picks (waiting up to retry_s for one); returns its id on this
        link. `cache_salt` stays with the sequence: every reopen sends it again."""
        seq_id = next(self._seq_ids)
        if cache_salt is not None:
            self._cache_salts[seq_id] = cache_salt
        try:
            await self.reopen(seq_id, prompt_token_ids, sampling, num_output_tokens=0, retry_s=retry_s,
                              deadline=deadline)
        except BaseException:
            self.release(seq_id, cancel=False)
            raise
        return seq_id

    async def reopen(self, seq_id: int, token_ids: list[int], sampling: SamplingParams, *, num_output_tokens: int,
                     retry_s: float, deadline: float | None = None) -> None:
        """(Re)open `seq_id` with `token_ids`, the last num_output_tokens of them its verified output so far: on
        its verifier if that one is up again and not draining, else on the one placement picks. Events of an
        earlier stream still queued for it are discarded. A sequence with output resumes only on the target it
        started on (VerifierIdentity.target_change): FAILED_PRECONDITION when no verifier serves it."""
        cache_salt = self._cache_salts.get(seq_id)
        started = self._started_on.get(seq_id) if num_output_tokens else None
        hashes = prefix_hashes(token_ids, cache_salt)
        until = time.monotonic() + retry_s
        while True:
            verifier = await self._wait_for(lambda: self._placeable(started) or self._refusal(started),
                                            max(0.0, until - time.monotonic()))
            change = started.target_change(verifier.connection.identity) if started is not None else None
            if change is not None:
                log.warning("resume_refused_target_changed", target=verifier.state.address, seq_id=seq_id,
                            reason=change)
                raise ServiceError(ErrorCode.FAILED_PRECONDITION, change)
            chosen, reason = self._choose(seq_id, started, hashes, len(token_ids))
            identity = chosen.connection.identity
            self._check_features(chosen.state.address, identity, sampling, cache_salt)
            if not num_output_tokens:  # no output yet: whatever target it is (re)opened on produces all of it
                self._started_on[seq_id] = identity
            self._inboxes[seq_id] = asyncio.Queue()
            self._move(seq_id, chosen, reason)
            try:
                chosen.connection.send(open_message(seq_id, token_ids, sampling, num_output_tokens, deadline,
                                                    cache_salt))
            except LinkDown:
                continue
            chosen.state.placed(seq_id, hashes)
            return

    def _refusal(self, started: VerifierIdentity | None) -> list[_Verifier]:
        """Placeable verifiers that all serve another target than the sequence started on: the first, so that
        reopen refuses the resume with FAILED_PRECONDITION naming the change instead of waiting for nothing."""
        return self._placeable() if started is not None and not self._placeable(started) else []

    def _choose(self, seq_id: int, started: VerifierIdentity | None, hashes: list[int],
                num_tokens: int) -> tuple[_Verifier, str]:
        candidates = self._placeable(started)
        placed = self._placed.get(seq_id)
        if placed is not None:
            same = self._verifiers.get(placed.address)
            if same is not None and same in candidates:
                return same, "resume"  # its verifier is back (a restart, a broken connection): it stays there
        chosen, reason = choose([v.state for v in candidates], hashes, num_tokens)
        return self._verifiers[chosen.address], "failover" if placed is not None else reason

    def _move(self, seq_id: int, verifier: _Verifier, reason: str) -> None:
        previous = self._placed.get(seq_id)
        if previous is not None and previous.address in self._verifiers:
            self._verifiers[previous.address].state.num_sequences -= 1
            self._verifiers[previous.address].state.answered(seq_id)
        self._placed[seq_id] = _Placed(verifier.state.address, verifier.connection.num_connections)
        verifier.state.num_sequences += 1
        if previous is not None and previous.address != verifier.state.address:
            log.warning("sequence_failover", seq_id=seq_id, source=previous.address, destination=verifier.state.address)
        if self._metrics is not None:
            self._metrics.placements.labels(reason=reason).inc()
            if reason == "failover":
                self._metrics.failovers.inc()
            self._set_gauges()

    def _set_gauges(self) -> None:
        if self._metrics is not None:
            for address, verifier in self._verifiers.items():
                self._metrics.verifier_sequences.labels(verifier=address).set(verifier.state.num_sequences)

    def _check_features(self, address: str, identity: VerifierIdentity, sampling: SamplingParams,
                        cache_salt: str | None) -> None:
        """FAILED_PRECONDITION unless the verifier implements what the sequence needs (e.g. a resume on an older
        one)."""
        if sampling.is_coupled and wire.FEATURE_COUPLED not in identity.features:
            raise ServiceError(ErrorCode.FAILED_PRECONDITION, f"the verifier at {address} does not "
                               "implement the coupled wire mode")
        if cache_salt is not None and wire.FEATURE_CACHE_SALT not in identity.features:
            # an older verifier would ignore the salt and share this tenant's prefix cache with everyone
            raise ServiceError(ErrorCode.FAILED_PRECONDITION, f"the verifier at {address} does not "
                               "implement cache_salt (prefix-cache isolation); send the request without it")

    def _open_connection(self, seq_id: int) -> VerifierConnection:
        """The connection the sequence is open on; LinkDown when that stream is not the one it was opened on."""
        placed = self._placed.get(seq_id)
        verifier = self._verifiers.get(placed.address) if placed is not None else None
        if verifier is None or placed.connection_number != verifier.connection.num_connections:
            where = placed.address if placed is not None else self._target
            raise LinkDown(f"sequence {seq_id} is not open on the current Verify stream to {where}")
        return verifier.connection

    def propose(self, seq_id: int, start_position: int, block: DraftBlock, *, send_draft_probs: bool,
                assumed_token_ids: tuple[int, ...] = (), max_draft_tokens: int | None = None,
                draft_backlog_tokens: int = 0) -> int:
        """Send; returns the message's serialized size. Raises LinkDown when the sequence is not open on its
        verifier's current stream (it broke, and the sequence was not reopened yet): a proposal sent there would
        reach a verifier that does not know the sequence. `max_draft_tokens`: ask for the verifier's choice of
        the next block's length, at most this (sent only to a verifier with the goodput feature), with
        `draft_backlog_tokens`, what the draft's next drafting round must feed first (Proposal's)."""
        connection = self._open_connection(seq_id)
        asks = max_draft_tokens is not None and connection.identity is not None \
            and wire.FEATURE_GOODPUT in connection.identity.features
        message = proposal_message(seq_id, start_position, block, send_draft_probs=send_draft_probs,
                                   assumed_token_ids=assumed_token_ids,
                                   max_draft_tokens=max_draft_tokens if asks else None,
                                   draft_backlog_tokens=draft_backlog_tokens if asks else None)
        connection.send(message)
        return message.ByteSize()

    async def next_event(self, seq_id: int) -> LinkEvent:
        return await self._inboxes[seq_id].get()

    def release(self, seq_id: int, *, cancel: bool) -> None:
        """Forget the sequence; with cancel, tell its verifier to free it (it frees finished ones itself)."""
        try:
            connection = self._open_connection(seq_id)
        except LinkDown:
            connection = None
        placed = self._placed.pop(seq_id, None)
        if placed is not None and (verifier := self._verifiers.get(placed.address)) is not None:
            verifier.state.num_sequences -= 1
            verifier.state.answered(seq_id)
            self._set_gauges()
        self._started_on.pop(seq_id, None)
        self._cache_salts.pop(seq_id, None)
        if self._inboxes.pop(seq_id, None) is not None and cancel and connection is not None \
                and connection.connected:
            connection.send(verifier_pb2.DraftMessage(close=verifier_pb2.CloseSequence(seq_id=seq_id)))

    # -- what the verifiers send ------------------------------------------------------------------------------

    def _dispatch(self, address: str, msg: verifier_pb2.VerifierMessage) -> None:
        if msg.WhichOneof("kind") == "load":
            self._reported(address, msg.load)
            return
        received = event_of(msg)
        if received is None:
            return
        seq_id, event = received
        if seq_id == 0:  # names no sequence: routed to none, and the stream goes on
            if isinstance(event, ErrorEvent):  # a duplicate open, a message the verifier did not understand: it
                # points at a bug in this draft, so it is logged
                log.warning("verifier_stream_error", target=address, code=event.code.name, message=event.message)
            return
        placed = self._placed.get(seq_id)
        inbox = self._inboxes.get(seq_id)
        delivered = inbox is not None and placed is not None and placed.address == address  # not a verifier it left
        if delivered and (verifier := self._verifiers.get(address)) is not None:
            verifier.state.answered(seq_id)
        if delivered:
            inbox.put_nowait(event)
        if self.on_verdict is not None and isinstance(event, VerdictEvent) and event.finish_reason is None:
            # a step is named by its stream too: a verifier restarted at the same address counts steps from 1
            verifier = self._verifiers.get(address)
            stream = verifier.connection.num_connections if verifier is not None else 0
            self.on_verdict(seq_id if delivered else None, (address, stream, event.step) if event.step else None,
                            event.step_verdicts)

    def _reported(self, address: str, load: verifier_pb2.VerifierLoad) -> None:
        verifier = self._verifiers.get(address)
        if verifier is None:
            return
        if load.draining and not verifier.state.draining:
            log.warning("verifier_draining", target=address, sequences_here=verifier.state.num_sequences)
        verifier.state.reported(VerifierLoad(load.num_running, load.num_waiting, load.kv_cache_usage,
                                             load.num_free_blocks), load.draining)

    def _lost(self, address: str, reason: str) -> None:
        """A stream ended: every sequence on it must be resumed, there or elsewhere."""
        on_it = [seq_id for seq_id, placed in self._placed.items() if placed.address == address]
        log.warning("verifier_stream_ended", target=address, reason=reason, live_sequences=len(on_it))
        lost = StreamLost(f"the Verify stream to {address} broke ({reason})")
        for seq_id in on_it:
            if (inbox := self._inboxes.get(seq_id)) is not None:
                inbox.put_nowait(lost)
