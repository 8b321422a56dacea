"""The verifier engine: applies the commands that arrived since the last step, then schedule -> run ->
postprocess.

Runs in one worker thread. The asyncio side only submits commands (thread-safe) and reads step results, so
no lock guards the sequence state.
"""

from __future__ import annotations

import queue
import time

import structlog

from common.block_manager import BlockManager
from common.errors import ErrorCode, ServiceError
from common.model_loading import LoadedModel
from common.paged_model import PagedCausalLM
from common.static_forward import StaticForward
from verifier_service.model_runner import VerifierRunner
from verifier_service.scheduler import Scheduler, SchedulerOutput
from verifier_service.sequence import Sequence
from verifier_service.types import (
    CloseCmd,
    CloseStreamCmd,
    Command,
    ErrorOut,
    OpenCmd,
    Outcome,
    ProposeCmd,
    StepResult,
    StepStats,
    VerdictOut,
)
from verifier_service.validation import Limits, check_open, check_proposal

log = structlog.get_logger(__name__)

# Backpressure: proposals a sequence may have waiting. A synchronous draft has one; a pipelined one its block in
# flight and up to 8 branches (draft_service.generation.MAX_BRANCHES).
MAX_QUEUED_PROPOSALS = 16
EXPIRY_SCAN_INTERVAL_S = 0.25


class VerifierEngine:
    def __init__(self, loaded: LoadedModel, model: PagedCausalLM, blocks: BlockManager, *,
                 max_draft_tokens: int, max_num_batched_tokens: int, dtype: str = "float32",
                 sequence_idle_timeout_s: float = 0.0, max_sequences_per_stream: int = 4096,
                 static: StaticForward | None = None) -> None:
        self.loaded = loaded
        self.dtype = dtype
        self.device = model.device
        self.blocks = blocks
        self.limits = Limits(loaded.vocab_size, loaded.max_model_len, max_draft_tokens)
        self.scheduler = Scheduler(blocks, max_num_batched_tokens=max_num_batched_tokens,
                                   max_draft_tokens=max_draft_tokens, max_model_len=loaded.max_model_len,
                                   eos_token_ids=frozenset(loaded.eos_token_ids))
        self.runner = VerifierRunner(model, blocks, static)
        self.sequence_idle_timeout_s = sequence_idle_timeout_s
        self.max_sequences_per_stream = max_sequences_per_stream
        self._next_expiry_scan = 0.0  # the scan walks every sequence: a few times a second, not every step
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()

    # -- called from any thread -------------------------------------------------------------------------------

    def submit(self, command: Command) -> None:
        self._commands.put(command)

    def has_pending_commands(self) -> bool:
        return not self._commands.empty()

    # -- called from the engine thread ------------------------------------------------------------------------

    def step(self) -> StepResult:
        outcomes = self._apply_commands()
        outcomes.extend(self._end_expired_sequences())
        scheduled = self.scheduler.schedule()
        outcomes.extend(scheduled.outcomes)
        if not scheduled.scheduled:
            return StepResult(outcomes, None)
        try:
            ran = self.runner.run(scheduled)
            verdicts = self.scheduler.postprocess(scheduled, ran.sampled, ran.forward_s + ran.sample_s)
        except Exception as err:  # noqa: BLE001 - the step's sequences end; every other sequence goes on
            outcomes.extend(self._fail(scheduled, err))
            return StepResult(outcomes, None)
        outcomes.extend(verdicts)
        now = time.monotonic()
        for item in scheduled.scheduled:
            item.seq.last_active = now
        stats = StepStats(
            num_seqs=len(scheduled.scheduled),
            num_tokens=ran.num_tokens,
            num_prefill_tokens=sum(item.num_prefill_tokens for item in scheduled.scheduled),
            num_prefix_hit_tokens=scheduled.num_prefix_hit_tokens,
            num_preempted=scheduled.num_preempted,
            num_emitted_tokens=sum(len(v.token_ids) for v in verdicts if isinstance(v, VerdictOut)),
            forward_s=ran.forward_s,
            sample_s=ran.sample_s,
            host_s=ran.host_s,
            device_s=ran.device_s,
            static=ran.static,
            tokens_by_stream=scheduled.tokens_by_stream,
        )
        for item, tokens in zip(scheduled.verifications, ran.sampled, strict=True):
            if tokens is not None:
                stats.record_verification(item.proposal.num_draft_tokens, num_accepted=len(tokens) - 1)
        return StepResult(outcomes, stats)

    def _end_expired_sequences(self) -> list[Outcome]:
        """Sequences end with DEADLINE_EXCEEDED, and their KV blocks go back to the pool, when their client's
        deadline has passed, or when they have waited longer than the idle timeout for their next proposal (a
        draft that opened them and went quiet, or a peer that vanished without closing its stream)."""
        now = time.monotonic()
        if now < self._next_expiry_scan:
            return []
        self._next_expiry_scan = now + EXPIRY_SCAN_INTERVAL_S
        idle_s = self.sequence_idle_timeout_s
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
        times = [seq.deadline for seq in self.scheduler.sequences.values() if seq.deadline is not None]
        if self.sequence_idle_timeout_s and self.scheduler.sequences:
            times.append(min(seq.last_active for seq in self.scheduler.sequences.values())
                         + self.sequence_idle_timeout_s)
        return max(min(times), self._next_expiry_scan) if times else None

    def _fail(self, scheduled: SchedulerOutput, err: Exception) -> list[Outcome]:
        """A step that raised ends exactly the sequences it ran, with INTERNAL, and frees their blocks: their
        proposals were taken off their queues, so waiting for a verdict would hang their clients."""
        log.exception("step_failed", num_seqs=len(scheduled.scheduled))
        failed = []
        for item in scheduled.scheduled:
            key = item.seq.key
            if key in self.scheduler.sequences:
                self.scheduler.release(key)
                failed.append(ErrorOut(key, ErrorCode.INTERNAL, f"the verification step failed "
                                       f"({type(err).__name__}: {err}); this sequence was ended"))
        return failed

    def has_runnable_work(self) -> bool:
        return self.scheduler.has_work()

    # -- commands ---------------------------------------------------------------------------------------------

    def _apply_commands(self) -> list[Outcome]:
        """Commands in arrival order; a refused one becomes an ErrorOut and frees its sequence."""
        errors: list[Outcome] = []
        while not self._commands.empty():
            cmd = self._commands.get_nowait()
            try:
                errors.extend(self._apply(cmd))
            except ServiceError as err:
                # ABORTED: a duplicate open; the sequence already open under that id is left alone
                if err.code is not ErrorCode.ABORTED:
                    self.scheduler.release(cmd.key)
                errors.append(ErrorOut(cmd.key, err.code, err.message))
        return errors

    def _apply(self, cmd: Command) -> list[Outcome]:
        """Apply one command; returns the proposals it made stale (dropped)."""
        match cmd:
            case OpenCmd():
                if cmd.key in self.scheduler.sequences:
                    raise ServiceError(ErrorCode.ABORTED, f"sequence {cmd.key.seq_id} is already open on this "
                                       "stream")
                check_open(cmd, self.limits, self.blocks)
                if self.scheduler.sequences_on(cmd.key.stream_id) >= self.max_sequences_per_stream:
                    raise ServiceError(ErrorCode.RESOURCE_EXHAUSTED, f"this stream already has "
                                       f"{self.max_sequences_per_stream} open sequences "
                                       "(--max-sequences-per-stream): finish or close some first")
                prompt = list(cmd.prompt_token_ids)
                self.scheduler.add(Sequence(cmd.key, prompt, len(prompt) - cmd.num_output_tokens, cmd.sampling,
                                            last_active=time.monotonic(), deadline=cmd.deadline))
            case ProposeCmd():
                seq = self.scheduler.sequences.get(cmd.key)
                if seq is None:
                    raise ServiceError(ErrorCode.NOT_FOUND, f"unknown sequence {cmd.key.seq_id}: open it first "
                                       "(or it has already finished)")
                check_proposal(cmd, self.limits, coupled=seq.sampling.coupled and not seq.sampling.is_greedy)
                dropped = self.scheduler.drop_dead_proposals(seq)
                if len(seq.proposals) >= MAX_QUEUED_PROPOSALS:
                    raise ServiceError(ErrorCode.RESOURCE_EXHAUSTED, f"sequence {cmd.key.seq_id} already has "
                                       f"{len(seq.proposals)} proposals waiting; a draft may run at most "
                                       f"{MAX_QUEUED_PROPOSALS} ahead of its verdicts")
                seq.proposals.append(cmd)
                seq.last_active = time.monotonic()
                return dropped
            case CloseCmd():
                self.scheduler.release(cmd.key)
            case CloseStreamCmd():
                for key in [k for k in self.scheduler.sequences if k.stream_id == cmd.stream_id]:
                    self.scheduler.release(key)
        return []
