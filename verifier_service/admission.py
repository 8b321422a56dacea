"""What the verifier takes in, and when it lets a sequence go: the policy the engine applies to each command before
a step (VerifierEngine.step: commands, schedule, run, postprocess).

- An open is refused when its id is already open on the stream (ABORTED, the live sequence goes on), when its
  stream or all streams together hold their most sequences, or when its prompt would wait for KV blocks behind
  more than --max-waiting-tokens (RESOURCE_EXHAUSTED); the prompt itself is checked by validation.check_open.
- A proposal is queued behind at most MAX_QUEUED_PROPOSALS others; the ones no verdict can make verifiable any
  more are dropped first.
- A sequence expires (DEADLINE_EXCEEDED, its blocks freed) when its client's deadline passes or when it waits
  longer than --sequence-idle-timeout for its next proposal.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import structlog

from common.block_manager import BlockManager
from common.errors import ErrorCode, ServiceError
from verifier_service.proposal_queue import drop_never_verifiable
from verifier_service.scheduler import Scheduler
from verifier_service.sequence import Sequence, SequenceStatus
from verifier_service.types import DroppedOut, ErrorOut, OpenCmd, Outcome, ProposeCmd
from verifier_service.validation import Limits, check_open, check_proposal_on

log = structlog.get_logger(__name__)

# Backpressure: proposals a sequence may have waiting. A synchronous draft has one; a pipelined one its block in
# flight and up to 8 branches (draft_service.pipelining.MAX_BRANCHES).
MAX_QUEUED_PROPOSALS = 16
EXPIRY_SCAN_INTERVAL_S = 0.25


@dataclass(frozen=True)
class AdmissionLimits:
    max_sequences_per_stream: int = 4096
    max_sequences: int = 16384
    max_waiting_tokens: int = 1 << 20
    sequence_idle_timeout_s: float = 0.0  # 0: none


class Admission:
    def __init__(self, scheduler: Scheduler, blocks: BlockManager, limits: Limits, policy: AdmissionLimits) -> None:
        self.scheduler = scheduler
        self.blocks = blocks
        self.limits = limits
        self.policy = policy
        self._next_expiry_scan = 0.0  # the scan walks every sequence: a few times a second, not every step

    def open(self, cmd: OpenCmd) -> None:
        """Add the sequence, admitted at once when nothing waits before it and the pool has room; raises the
        ServiceError that refuses it."""
        if cmd.key in self.scheduler.sequences:
            raise ServiceError(ErrorCode.ABORTED, f"sequence {cmd.key.seq_id} is already open on this stream")
        self._check_limits(cmd)  # O(1): before the prompt's O(n) checks
        check_open(cmd, self.limits, self.blocks)
        prompt = list(cmd.prompt_token_ids)
        seq = Sequence(cmd.key, prompt, len(prompt) - cmd.num_output_tokens, cmd.sampling,
                       last_active=time.monotonic(), deadline=cmd.deadline, cache_salt=cmd.cache_salt)
        self.scheduler.add(seq)
        if len(self.scheduler.waiting) == 1:  # nothing waits before it: admitted now if the pool has room
            self.scheduler.admit()
        if seq.status is SequenceStatus.WAITING:
            self._check_waiting_tokens(cmd, self.scheduler.num_waiting_tokens)  # refused: released by the caller

    def propose(self, cmd: ProposeCmd) -> list[DroppedOut]:
        """Queue the proposal; returns the proposals it made stale, or raises the ServiceError that refuses it."""
        seq = self.scheduler.sequences.get(cmd.key)
        if seq is None:
            raise ServiceError(ErrorCode.NOT_FOUND, f"unknown sequence {cmd.key.seq_id}: open it first (or it has "
                               "already finished)")
        # the rest of validation.check_proposal ran on the stream's side (servicer), off this thread
        check_proposal_on(cmd, seq.sampling)
        dropped = drop_never_verifiable(seq)
        if len(seq.proposals) >= MAX_QUEUED_PROPOSALS:
            raise ServiceError(ErrorCode.RESOURCE_EXHAUSTED, f"sequence {cmd.key.seq_id} already has "
                               f"{len(seq.proposals)} proposals waiting; a draft may run at most "
                               f"{MAX_QUEUED_PROPOSALS} ahead of its verdicts")
        seq.proposals.append(cmd)
        seq.last_active = time.monotonic()
        return dropped

    def _check_limits(self, cmd: OpenCmd) -> None:
        """What one stream and all streams together may hold, O(1) so that it runs before the prompt is checked:
        a new sequence past a limit is refused (RESOURCE_EXHAUSTED); the ones already open are never touched."""
        policy = self.policy
        if self.scheduler.sequences_on(cmd.key.stream_id) >= policy.max_sequences_per_stream:
            raise ServiceError(ErrorCode.RESOURCE_EXHAUSTED, f"this stream already has "
                               f"{policy.max_sequences_per_stream} open sequences "
                               "(--max-sequences-per-stream): finish or close some first")
        if len(self.scheduler.sequences) >= policy.max_sequences:
            raise ServiceError(ErrorCode.RESOURCE_EXHAUSTED, f"the verifier already holds {policy.max_sequences} "
                               "open sequences over all streams (--max-sequences): retry later")
        if self.scheduler.waiting:  # admission is first come, first served: this one would wait behind them
            self._check_waiting_tokens(cmd, self.scheduler.num_waiting_tokens + len(cmd.prompt_token_ids))

    def _check_waiting_tokens(self, cmd: OpenCmd, num_waiting_tokens: int) -> None:
        """--max-waiting-tokens: counted over the sequences still waiting once admission was tried, so a burst
        of opens that the pool takes at once is never refused by it. A resume (output already verified) is
        never refused by it either: after a verifier restart its draft reopens every sequence it had, which
        all fitted before."""
        limit = self.policy.max_waiting_tokens
        if cmd.num_output_tokens == 0 and num_waiting_tokens > limit:
            raise ServiceError(ErrorCode.RESOURCE_EXHAUSTED, f"a prompt of {len(cmd.prompt_token_ids)} tokens "
                               f"would wait for KV blocks, bringing the tokens waiting to {num_waiting_tokens}, "
                               f"above {limit} (--max-waiting-tokens): retry later")

    def expired(self) -> list[Outcome]:
        """Sequences end with DEADLINE_EXCEEDED, and their KV blocks go back to the pool, when their client's
        deadline has passed, or when they have waited longer than the idle timeout for their next proposal (a
        draft that opened them and went quiet, or a peer that vanished without closing its stream)."""
        now = time.monotonic()
        if now < self._next_expiry_scan:
            return []
        self._next_expiry_scan = now + EXPIRY_SCAN_INTERVAL_S
        idle_s = self.policy.sequence_idle_timeout_s
        ended: list[Outcome] = []
        for seq in list(self.scheduler.sequences.values()):
            if seq.deadline is not None and now >= seq.deadline:
                reason = "the client's deadline passed: the sequence was ended and its KV blocks freed"
            elif idle_s and not seq.proposals and now - seq.last_active > idle_s:
                reason = (f"no proposal for {idle_s:g}s (--sequence-idle-timeout): the sequence was ended and its "
                          "KV blocks freed")
            else:
                continue
            self.scheduler.release(seq.key)
            log.info("sequence_expired", seq_id=seq.key.seq_id, stream_id=seq.key.stream_id, reason=reason)
            ended.append(ErrorOut(seq.key, ErrorCode.DEADLINE_EXCEEDED, reason))
        return ended

    def next_expiry(self) -> float | None:
        """When the next sequence would expire (time.monotonic()), or None: the engine loop's wake-up time."""
        sequences = self.scheduler.sequences
        times = [seq.deadline for seq in sequences.values() if seq.deadline is not None]
        if self.policy.sequence_idle_timeout_s and sequences:
            times.append(min(seq.last_active for seq in sequences.values()) + self.policy.sequence_idle_timeout_s)
        return max(min(times), self._next_expiry_scan) if times else None
