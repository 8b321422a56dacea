"""A Verify stream's bounds on the asyncio side: the commands it has sent that wait for the engine (their number
and the tokens they hold), its backlog of replies, and protocol errors in a row (StreamLimits, StreamOutbox)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from common.errors import ErrorCode, ServiceError
from verifier_service.types import Command, DroppedOut, ErrorOut, OpenCmd, Outcome, ProposeCmd, VerdictOut

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class StreamLimits:
    """What the Verify streams may hold on the asyncio side (the flags of the same names in config.py)."""

    max_streams: int = 256
    max_pending_commands: int = 4096
    max_stream_backlog: int = 65536
    max_protocol_errors: int = 64
    handshake_timeout_s: float = 10.0
    max_pending_tokens: int = 1 << 20

    @classmethod
    def from_config(cls, config) -> StreamLimits:
        return cls(config.max_streams, config.max_pending_commands, config.max_stream_backlog,
                   config.max_protocol_errors, config.handshake_timeout_s, config.max_pending_tokens)


_FAILED = object()  # the outbox's last item once its stream has failed
# Refusals that only a malformed message gets. The others (RESOURCE_EXHAUSTED, NOT_FOUND, DEADLINE_EXCEEDED,
# FAILED_PRECONDITION) come from load or from a sequence's state, which a correct draft meets too.
PROTOCOL_ERROR_CODES = frozenset({ErrorCode.INVALID_ARGUMENT})


def pending_size(command: Command) -> int:
    """What a command holds while it waits for the engine, in token ids (and draft-distribution entries): a
    prompt's tokens, a proposal's drafts, assumed tokens and q entries."""
    if isinstance(command, OpenCmd):
        return len(command.prompt_token_ids)
    if isinstance(command, ProposeCmd):
        return (command.num_draft_tokens + len(command.assumed_token_ids)
                + sum(len(q.token_ids) for q in command.draft_probs or ()))
    return 0


class StreamOutbox:
    """One Verify stream's side of the engine: the replies waiting to be sent, bounded, and the commands read
    but not yet applied, bounded by backpressure (in number and in tokens). A stream past its backlog (its
    draft does not read) or past its protocol errors in a row fails: its replies are dropped, its sequences and
    its --max-streams slot freed at once, and get() raises the failure, which the servicer turns into the RPC's
    status; if the servicer is blocked sending a reply to a peer that does not read, `end_rpc` ends the RPC."""

    def __init__(self, limits: StreamLimits, on_fail) -> None:
        self._limits = limits
        self._queue: asyncio.Queue = asyncio.Queue()
        self._on_fail = on_fail
        self._errors_in_a_row = 0
        self.failure: ServiceError | None = None
        self.num_pending = 0  # commands submitted and not yet applied by the engine
        self.num_pending_tokens = 0  # what they hold (pending_size)
        self._pending_sizes: deque[int] = deque()  # per pending command, in order: the engine applies in order
        self._credit = asyncio.Event()
        self._credit.set()
        # Set by the servicer: True while it waits for the peer to take a reply (gRPC flow control), and how to
        # end the RPC then, since it would not see the failure in get() until the peer reads.
        self.writing = False
        self.end_rpc: Callable[[ServiceError], None] | None = None

    def put(self, outcome: Outcome | None) -> None:
        """A reply, or None: the draft closed its side. Never blocks."""
        if self.failure is not None:
            return
        if isinstance(outcome, VerdictOut | DroppedOut):
            self._errors_in_a_row = 0
        elif isinstance(outcome, ErrorOut) and outcome.code is ErrorCode.ABORTED:  # a duplicate open
            self.protocol_error()
            if self.failure is not None:
                return
        if outcome is not None and self._queue.qsize() >= self._limits.max_stream_backlog:
            self.fail(ServiceError(ErrorCode.RESOURCE_EXHAUSTED, f"{self._limits.max_stream_backlog} replies "
                                   "are waiting to be sent on this stream (--max-stream-backlog): the draft does "
                                   "not read its stream, so it was ended"))
            return
        self._queue.put_nowait(outcome)

    def refused(self, code: ErrorCode) -> None:
        """A message the stream's side refused with `code`: a protocol error if only a malformed message gets
        that code (PROTOCOL_ERROR_CODES)."""
        if code in PROTOCOL_ERROR_CODES:
            self.protocol_error()

    def protocol_error(self) -> None:
        """A message no correct draft sends (malformed, a duplicate open, an invalid proposal): too many in a row,
        with no verdict between, and the stream fails."""
        self._errors_in_a_row += 1
        if self._errors_in_a_row > self._limits.max_protocol_errors:
            self.fail(ServiceError(ErrorCode.RESOURCE_EXHAUSTED, f"more than {self._limits.max_protocol_errors} "
                                   "protocol errors in a row with no verdict between (--max-protocol-errors): "
                                   "the stream was ended"))

    def fail(self, error: ServiceError) -> None:
        if self.failure is not None:
            return
        self.failure = error
        log.warning("verify_stream_failed", code=error.code.name, message=error.message)
        while not self._queue.empty():  # nothing more is sent: drop the backlog now
            self._queue.get_nowait()
        self._queue.put_nowait(_FAILED)
        self._credit.set()  # a reader waiting for credit sees the failure
        self._on_fail()
        if self.writing and self.end_rpc is not None:
            self.end_rpc(error)

    async def get(self) -> Outcome | None:
        item = await self._queue.get()
        if item is _FAILED:
            raise self.failure
        return item

    def empty(self) -> bool:
        return self._queue.empty()

    # -- backpressure on the commands -------------------------------------------------------------------------

    def submitted(self, size: int = 0) -> None:
        """A command of `size` (pending_size) went to the engine."""
        self.num_pending += 1
        self.num_pending_tokens += size
        self._pending_sizes.append(size)
        if not self._has_room():
            self._credit.clear()

    def applied(self, n: int) -> None:
        """The engine applied this stream's next `n` commands."""
        for _ in range(min(n, len(self._pending_sizes))):
            self.num_pending_tokens -= self._pending_sizes.popleft()
        self.num_pending = max(0, self.num_pending - n)
        if self._has_room() or self.failure is not None:
            self._credit.set()

    @property
    def has_credit(self) -> bool:
        """Whether the stream's next message may be read now."""
        return self._credit.is_set()

    def _has_room(self) -> bool:
        return (self.num_pending < self._limits.max_pending_commands
                and self.num_pending_tokens < self._limits.max_pending_tokens)

    async def wait_for_credit(self) -> None:
        """Until the engine has applied enough of this stream's commands to take another (or it failed): the
        stream is not read meanwhile, so gRPC's flow control holds the draft back. One message is always read
        when nothing is pending, so a prompt larger than --max-pending-tokens still gets in (and is judged)."""
        await self._credit.wait()
