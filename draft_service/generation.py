"""One client request, end to end. Each round: draft a block, propose it, await the verifier's verdict, extend
the sequence with the verified tokens, roll the draft cache back to them, emit their text. Until the verifier
ends the sequence or a stop string appears."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from common.errors import ErrorCode, ServiceError, invalid_argument
from common.sampling import FinishReason, SamplingParams, WireMode, validate_token_ids
from common.tokenizer import INLINE_PROMPT_IDS, IncrementalDetokenizer, PromptEncoder
from draft_service.adaptive import AdaptiveDraftLength, PipelineWidth
from draft_service.config import DraftConfig
from draft_service.drafters import Drafter
from draft_service.metrics import DraftMetrics
from draft_service.proposer import ALTERNATIVES
from draft_service.sequence import DraftSequence
from draft_service.stop_strings import StopStringMatcher
from draft_service.types import (
    DraftBlock,
    DroppedEvent,
    ErrorEvent,
    GenerationRequest,
    GenerationStats,
    StreamLost,
    TextChunk,
    VerdictEvent,
    VerifierIdentity,
)
from draft_service.verifier_link import LinkDown, VerifierLink
from specwire.v1 import wire

log = structlog.get_logger(__name__)


class VerifierFailed(ServiceError):
    """An error the verifier sent for a sequence: it has freed the sequence already. Any other failure, this
    service's own (a proposal it dropped unexpectedly, a resume that failed), still owes the verifier a
    CloseSequence."""


@dataclass
class _Flight:
    """One generation's proposals the verifier has not answered."""

    proposed: bool = False  # the block at the sequence's end has been sent on the current stream
    stale: int = 0  # pipelined proposals whose guess missed: the verifier drops them, their ProposalDropped is due
    resumed: bool = False  # the stream broke during the last wait: any pipelined proposal was lost with it
    proposal_bytes: int = 0  # serialized size of every proposal sent
    # --speculation auto: this service's cap on the next block, sent with each proposal to ask for the
    # verifier's choice of its length; None: the draft length is this service's alone
    max_draft_tokens: int | None = None


@dataclass(frozen=True)
class _Ahead:
    """A pipelined proposal: `block`, drafted on `branch` after the in-flight block's first `num_accepted`
    drafts and `guess`, the verifier's bonus token (all accepted) or corrected token (the next one rejected)."""

    num_accepted: int
    guess: int
    branch: DraftSequence
    block: DraftBlock
    sent: bool


# Pipelined branches per round: the verifier queues at most 16 proposals per sequence (MAX_QUEUED_PROPOSALS); the
# block in flight takes one, and the last round's branches are dropped as soon as the new ones arrive.
MAX_BRANCHES = 8


class TextOutput:
    """Verified tokens -> text deltas, held back while they could still be the start of a stop string."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...]) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._stops = StopStringMatcher(stop)
        self._has_stops = any(stop)

    def feed(self, token_ids: tuple[int, ...], *, final: bool) -> tuple[tuple[int, ...], str, bool]:
        """(the tokens to emit, their text, whether a stop string was found). At a stop string the tokens end
        with the one that completed it, whatever the round's size, so token ids, text and counts agree for
        every k; the text ends before the stop string."""
        if not self._has_stops:
            text, _ = self._stops.feed(self._detokenizer.add(list(token_ids), final=final), final=final)
            return token_ids, text, False
        text = ""
        for i, token in enumerate(token_ids):
            last = final and i == len(token_ids) - 1
            delta, stopped = self._stops.feed(self._detokenizer.add([token], final=last), final=last)
            text += delta
            if stopped:
                return token_ids[:i + 1], text, True
        return token_ids, text, False


# The longest token-id prompt taken before any verifier stated its context length (see check_num_prompt_ids).
MAX_PROMPT_TOKEN_IDS = 1 << 21


def checked_prompt_ids(token_ids: Sequence[int], vocab_size: int) -> list[int]:
    ids = list(token_ids)
    validate_token_ids(ids, vocab_size)
    return ids


def check_prompt_length(num_prompt_tokens: int, identity: VerifierIdentity) -> None:
    """The target's context must hold the prompt and at least one generated token."""
    if num_prompt_tokens >= identity.max_model_len:
        raise invalid_argument(f"prompt has {num_prompt_tokens} tokens; the target's context length "
                               f"(max_model_len) is {identity.max_model_len}, and at least one token must remain "
                               "to generate")


def q_support_limit(mode: WireMode, identity: VerifierIdentity) -> int | None:
    """A sequence's q support limit besides the draft's --q-max-support: the verifier's --max-q-support where q
    is sent (sparse mode), since it refuses a longer one; None: no other limit (ids only, or a verifier older
    than the field, which states 0)."""
    limit = identity.max_q_support
    return limit if mode is WireMode.SPARSE and limit > 0 else None


MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024


def check_stop_strings(stop: tuple[str, ...]) -> None:
    """Stop strings are matched against every streamed character: a bounded number of bounded, non-empty ones."""
    if len(stop) > MAX_STOP_STRINGS:
        raise invalid_argument(f"{len(stop)} stop strings; at most {MAX_STOP_STRINGS} are allowed")
    for s in stop:
        if not s:
            raise invalid_argument("stop strings must be non-empty")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise invalid_argument(f"a stop string of {len(s)} characters; at most {MAX_STOP_STRING_CHARS} are "
                                   "allowed")


class Generator:
    def __init__(self, config: DraftConfig, tokenizer: Any, vocab_size: int, link: VerifierLink, drafter: Drafter,
                 metrics: DraftMetrics | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.link = link
        self.drafter = drafter
        self.metrics = metrics or DraftMetrics()
        self.prompts = PromptEncoder(tokenizer, config.max_prompt_bytes)  # text prompts, tokenized off the loop
        self.speculation = config.speculation_mode
        self._recent_choice: int | None = None  # the verifier's last choice for any sequence (auto)
        # n-gram drafts cost nothing to make: there is no draft time for the own-cost rule to weigh
        self.weighs_own_cost = config.proposer == "model"
        # one-hot and coupled wire modes send ids only: the verifier then takes q = delta(x) (lossless for any q),
        # or decides every token from its own noise
        self.wire_mode = WireMode(config.wire_mode)
        # one width for the whole process: it learns from every sequence's rounds, and a short request does not
        # start over at the widest (drafting cost is the process's, not the sequence's)
        self.width = None
        if config.pipeline:
            fixed = config.pipeline_width > 0
            self.width = PipelineWidth(MAX_BRANCHES, width=config.pipeline_width if fixed else 2, learn=not fixed)

    async def generate(self, req: GenerationRequest) -> AsyncIterator[TextChunk | GenerationStats]:
        self.metrics.active.inc()
        outcome = "error"
        try:
            async for event in self._generate(req):
                if isinstance(event, GenerationStats):
                    outcome = "ok"
                    self.metrics.observe(event)
                yield event
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            self.metrics.active.dec()
            self.metrics.requests.labels(outcome=outcome).inc()

    async def _generate(self, req: GenerationRequest) -> AsyncIterator[TextChunk | GenerationStats]:
        t0 = time.perf_counter()
        check_stop_strings(req.stop)
        prompt = await self._prompt_ids(req)
        identity = await self.link.ensure_connected(self._retry_s(req.deadline))
        check_prompt_length(len(prompt), identity)  # before the draft prefills it
        k = self._num_speculative_tokens(req, identity)
        mode = req.wire_mode or self.wire_mode
        seq = DraftSequence(self._sampling(req.sampling.with_seed(), mode, identity), list(prompt), wire_mode=mode,
                            q_max_support=q_support_limit(mode, identity))
        varies = self.adapts_k(req, k, coupled=seq.sampling.coupled)
        # the own-cost rule: this sequence's tokens/s from its acceptance and this service's measured drafting and
        # waiting times; under auto it caps what the verifier may choose (drafting for many streams on few cores
        # is slow), under adaptive it decides alone
        adaptive = None
        if varies and self.weighs_own_cost:
            # under auto only a cap beside the verifier's choice: slower to react than alone (one rejection
            # otherwise cut k for the next rounds, measured on 2 cores)
            adaptive = (AdaptiveDraftLength(k, decay=0.95, tolerance=0.03) if self.speculation == "auto"
                        else AdaptiveDraftLength(k))
        follows_verifier = varies and self.speculation == "auto"
        # the verifier's choice for the next round, from the last verdict; before the first, the last it chose for
        # any sequence of this process: a request that starts under load does not begin with a full-k block
        choice: int | None = self._recent_choice if follows_verifier else None
        stats = GenerationStats(num_prompt_tokens=len(prompt), num_speculative_tokens=k)
        output = TextOutput(self.tokenizer, req.stop)
        seq_id = await self.link.open(prompt, seq.sampling, retry_s=self._retry_s(req.deadline),
                                      deadline=req.deadline, cache_salt=req.cache_salt)
        structlog.contextvars.bind_contextvars(seq_id=seq_id)
        finished = False
        flight = _Flight()
        block: DraftBlock | None = None  # the block proposed at the sequence's end, once drafted
        aheads: list[_Ahead] = []
        width = self.width
        try:
            while not finished:
                t_draft = time.perf_counter()
                own_cap = adaptive.next_k() if adaptive else k
                if follows_verifier:
                    # at least 1: the verifier brings k to 0 under load, and a draft that asked for 0 would never
                    # measure its drafting again (the own-cost rule's draft time is learnt from drafted rounds)
                    own_cap = max(1, own_cap)
                k_round = min(k, own_cap if choice is None else min(own_cap, choice))
                flight.max_draft_tokens = own_cap if follows_verifier else None
                if block is None:
                    if follows_verifier and k_round == 0:
                        await self.drafter.wait_for_batch()  # proposed with the sequences of its burst
                    block = await self.drafter.draft(seq, k_round)
                    flight.proposed = self._try_propose(seq_id, seq, seq.num_tokens, block, flight)
                width_used = min(width.next_width(), 1 + k_round * ALTERNATIVES) if width else 0
                aheads = (await self._draft_ahead(seq_id, seq, block, k_round, width_used, flight) if width_used
                          else [])
                t_sent = time.perf_counter()
                try:
                    verdict = await self._verify(seq_id, seq, len(prompt), block, req.deadline, flight)
                except VerifierFailed:
                    finished = True  # the verifier has already freed the sequence
                    raise
                t_verdict = time.perf_counter()
                wait_s = t_verdict - t_sent
                if width:
                    width.observe(width_used, max(0.0, t_verdict - verdict.received_at), t_verdict - t_draft)
                seq.assumed_token_ids.clear()
                seq.extend(verdict.token_ids)
                choice = verdict.next_draft_tokens if follows_verifier else None
                if choice is not None:
                    self._recent_choice = choice
                finished = verdict.finish_reason is not None
                verified_block, block = block, None
                if aheads:
                    block = await self._settle_branches(seq, verified_block, verdict, aheads, flight, finished)
                    aheads = []
                flight.resumed = False
                seq.roll_back()
                tokens, text, stopped = output.feed(verdict.token_ids, final=finished)
                stats.record_round(verified_block, verdict, tokens, t_sent - t_draft, wait_s)
                self.metrics.observe_round(t_sent - t_draft, wait_s, verdict.step_time_s)
                if stats.num_rounds == 1:
                    stats.time_to_first_token_s = time.perf_counter() - t0
                if adaptive:
                    adaptive.observe(verified_block.num_draft_tokens, verdict.num_accepted, t_sent - t_draft, wait_s)
                stats.finish_reason = FinishReason.STOP if stopped else verdict.finish_reason
                if stopped and not finished:  # the verifier would go on: tell it to free the sequence now
                    finished = True
                    self.link.release(seq_id, cancel=True)
                yield TextChunk(tokens, text)
        finally:
            # cancelled by the client or failed here: free it on the verifier too
            self.link.release(seq_id, cancel=not finished)
            await self.drafter.release(*(ahead.branch for ahead in aheads), seq)
            structlog.contextvars.unbind_contextvars("seq_id")
        stats.wall_time_s = time.perf_counter() - t0
        stats.proposal_bytes = flight.proposal_bytes
        self.metrics.proposal_bytes.labels(wire_mode=seq.wire_mode.value).inc(flight.proposal_bytes)
        log.info("generation_done", prompt_tokens=stats.num_prompt_tokens, generated=stats.num_generated_tokens,
                 rounds=stats.num_rounds, drafted=stats.num_draft_tokens, accepted=stats.num_accepted_tokens,
                 k=k, wall_s=round(stats.wall_time_s, 3), finish=stats.finish_reason and stats.finish_reason.value)
        yield stats

    def adapts_k(self, req: GenerationRequest, k: int, *, coupled: bool = False) -> bool:
        """Whether the draft length may vary by round (--speculation auto or adaptive). Both read clocks and
        load, and under rejection sampling a sampled token depends on where rounds start (a bonus token and a
        drafted one are decided differently). A seeded request verified by rejection sampling therefore keeps
        the fixed k, so the same seed gives the same tokens from the same service whatever the load. Greedy and
        coupled output never depend on k."""
        seeded_rejection = req.sampling.seed is not None and not req.sampling.is_greedy and not coupled
        return self.speculation != "fixed" and k > 0 and not seeded_rejection

    def _sampling(self, sampling: SamplingParams, mode: WireMode, identity: VerifierIdentity) -> SamplingParams:
        """The sequence's sampling parameters: coupled when a sampled request's wire mode is."""
        if mode is not WireMode.COUPLED or sampling.is_greedy:
            return sampling
        if wire.FEATURE_COUPLED not in identity.features:
            raise ServiceError(ErrorCode.FAILED_PRECONDITION, f"the coupled wire mode needs a verifier that "
                               f"implements it; {identity.model_id!r}'s verifier does not (upgrade it, or ask for "
                               "wire_mode sparse or one-hot)")
        return dataclasses.replace(sampling, coupled=True)

    def check_num_prompt_ids(self, num_ids: int) -> None:
        """Refuse a token-id prompt by its length alone, before its ids are converted or checked (a 60 MB message
        holds some 12M ids): against the target's context length once a verifier has stated it (the last one
        known), else against MAX_PROMPT_TOKEN_IDS."""
        identity = self.link.identity
        if identity is not None:
            check_prompt_length(num_ids, identity)
        elif num_ids > MAX_PROMPT_TOKEN_IDS:
            raise invalid_argument(f"prompt has {num_ids} token ids; at most {MAX_PROMPT_TOKEN_IDS} are taken before "
                                   "the verifier has stated its context length")

    async def _prompt_ids(self, req: GenerationRequest) -> list[int]:
        """The prompt's token ids; a long text prompt is tokenized, and a long id list converted and checked, on
        a thread, not on the event loop that serves every stream and health check."""
        if req.prompt_token_ids is not None:
            ids = req.prompt_token_ids
        elif req.prompt_text:
            ids = await self.prompts.encode(req.prompt_text)
        else:
            raise invalid_argument("prompt is empty: give prompt text or prompt token ids")
        self.check_num_prompt_ids(len(ids))
        return await self.prompts.call(checked_prompt_ids, ids, self.vocab_size, inline=len(ids) <= INLINE_PROMPT_IDS)

    def _num_speculative_tokens(self, req: GenerationRequest, identity: VerifierIdentity) -> int:
        k = self.config.num_speculative_tokens if req.num_speculative_tokens is None else req.num_speculative_tokens
        if k < 0:
            raise invalid_argument(f"num_speculative_tokens must be >= 0, got {k}")
        if k > identity.max_draft_tokens:
            raise invalid_argument(f"num_speculative_tokens {k} is above the verifier's maximum "
                                   f"{identity.max_draft_tokens}")
        return k

    def _retry_s(self, deadline: float | None) -> float:
        """How long to wait for the verifier: --verifier-retry-deadline, or less if the client's deadline is
        nearer."""
        retry_s = self.config.verifier_retry_deadline_s
        return retry_s if deadline is None else max(0.0, min(retry_s, deadline - time.monotonic()))

    def _try_propose(self, seq_id: int, seq: DraftSequence, start: int, block: DraftBlock, flight: _Flight,
                     assumed: tuple[int, ...] = ()) -> bool:
        """Propose; False when the stream is down (the verdict wait then resumes the sequence and proposes)."""
        try:
            flight.proposal_bytes += self.link.propose(seq_id, start, block, send_draft_probs=seq.sends_draft_probs,
                                                       assumed_token_ids=assumed,
                                                       max_draft_tokens=flight.max_draft_tokens)
        except LinkDown:
            return False
        return True

    async def _draft_ahead(self, seq_id: int, seq: DraftSequence, block: DraftBlock, k: int, width: int,
                           flight: _Flight) -> list[_Ahead]:
        """Pipelining: while `block`'s verdict is in flight, draft the next block on branches that each assume
        one verdict: all of `block` accepted, then the draft's guess of the bonus token (drafted first on that
        branch); or its first j drafts accepted and the next one corrected to the draft's best other token.
        Each branch's block is proposed at once, marked with what it assumed. The verifier verifies the one
        whose assumption the verdict confirms, if any, and drops the others, so what is verified never depends
        on pipelining. All branches draft in one batch, sharing the sequence's cache blocks; `width` caps
        their number: the full-acceptance branch first, then the best guess at each position (earliest first),
        then the second best."""
        if block.num_draft_tokens == 0 or k == 0:
            return []
        plans: list[tuple[int, int | None, DraftSequence]] = [
            (block.num_draft_tokens, None, seq.branch(list(block.token_ids)))]
        alternatives = block.alternatives or ()
        ranks = max((len(a) for a in alternatives), default=0)
        # each position's best guess first (earliest position first), then each one's second best
        guesses = [(j, alts[rank]) for rank in range(ranks) for j, alts in enumerate(alternatives) if rank < len(alts)]
        for j, alternative in guesses[:max(0, width - 1)]:
            plans.append((j, alternative, seq.branch([*block.token_ids[:j], alternative])))
        try:
            # the full-acceptance branch drafts its guess of the bonus token, then the block after it as the
            # next unpipelined round would: a pipelined proposal is always the one that round would send
            drafted = await asyncio.gather(*(self.drafter.draft_after_guess(branch, k) if guess is None
                                             else self.drafter.draft(branch, k) for _, guess, branch in plans),
                                           return_exceptions=True)
            aheads, unused, short = [], [], []
            for (j, guess, branch), d in zip(plans, drafted, strict=True):
                if isinstance(d, ServiceError):  # e.g. the draft's KV pool cannot hold this branch
                    short.append(d)
                    unused.append(branch)
                    continue
                if isinstance(d, BaseException):
                    raise d
                if guess is None:
                    if d is None:  # non-finite draft logits: no guess
                        unused.append(branch)
                        continue
                    guess, d = d
                sent = self._try_propose(seq_id, seq, seq.num_tokens + j + 1, d, flight,
                                         tuple(branch.assumed_token_ids))
                aheads.append(_Ahead(j, guess, branch, d, sent))
            if short:  # fewer branches this round; none at all only when not even one fit
                log.warning("pipelined_drafting_short", code=short[0].code.name, message=short[0].message,
                            branches_dropped=len(short), branches_kept=len(aheads))
            await self.drafter.release(*unused)
        except BaseException:
            # cancelled (the client went away) or failed while the branches draft: none of them may keep a block
            await self.drafter.release(*(branch for _, _, branch in plans))
            raise
        return aheads

    async def _settle_branches(self, seq: DraftSequence, block: DraftBlock, verdict: VerdictEvent,
                               aheads: list[_Ahead], flight: _Flight, finished: bool) -> DraftBlock | None:
        """After `block`'s verdict: the sequence continues on the branch that guessed it (its block, already
        proposed, is the new block in flight) and the other branches are freed; their proposals will be
        dropped. Returns the block in flight, or None when no branch guessed right."""
        match = None
        if not flight.resumed and not finished:
            match = next((a for a in aheads if verdict.token_ids == (*block.token_ids[:a.num_accepted], a.guess)),
                         None)
        missed = [ahead for ahead in aheads if ahead is not match]
        await self.drafter.release(*(ahead.branch for ahead in missed))
        if not flight.resumed:  # the verifier drops their proposals: their ProposalDropped is expected
            flight.stale += sum(ahead.sent for ahead in missed)
        self.metrics.pipelined_proposals.labels(outcome="dropped").inc(len(missed))
        if match is None:
            return None
        self.metrics.pipelined_proposals.labels(outcome="used").inc()
        await self.drafter.adopt(seq, match.branch)
        seq.assumed_token_ids.extend(match.block.token_ids)
        flight.proposed = match.sent
        return match.block

    async def _verify(self, seq_id: int, seq: DraftSequence, num_prompt_tokens: int, block: DraftBlock,
                      deadline: float | None, flight: _Flight) -> VerdictEvent:
        """The verdict of `block`, proposed at the sequence's end. When the stream breaks meanwhile, the sequence
        is reopened on a new stream with its verified tokens and the block proposed again: the verdict is the
        one the lost stream would have given (the random numbers are keyed by position)."""
        while True:
            try:
                if not flight.proposed:
                    flight.proposal_bytes += self.link.propose(seq_id, seq.num_tokens, block,
                                                               send_draft_probs=seq.sends_draft_probs,
                                                               max_draft_tokens=flight.max_draft_tokens)
                    flight.proposed = True
                event = await self.link.next_event(seq_id)
            except LinkDown as err:
                event = StreamLost(str(err))
            if isinstance(event, StreamLost):
                await self._resume(seq_id, seq, num_prompt_tokens, deadline, event.reason)
                flight.proposed, flight.stale, flight.resumed = False, 0, True
                continue
            if isinstance(event, ErrorEvent):
                raise VerifierFailed(event.code, event.message)
            if isinstance(event, DroppedEvent):
                self.metrics.dropped_proposals.inc()
                if flight.stale > 0:  # a pipelined proposal whose guess missed: normal flow
                    flight.stale -= 1
                    continue
                raise ServiceError(ErrorCode.INTERNAL, f"verifier dropped a proposal at {event.start_position}; it "
                                   f"has {event.num_verified} verified tokens")
            return event

    async def _resume(self, seq_id: int, seq: DraftSequence, num_prompt_tokens: int, deadline: float | None,
                      reason: str) -> None:
        retry_s = self._retry_s(deadline)
        log.warning("sequence_resuming", reason=reason, verified_tokens=seq.num_tokens, retry_s=round(retry_s, 3))
        try:
            await self.link.reopen(seq_id, seq.token_ids, seq.sampling,
                                   num_output_tokens=seq.num_tokens - num_prompt_tokens, retry_s=retry_s,
                                   deadline=deadline)
        except ServiceError as err:
            self.metrics.resume_failures.inc()
            raise ServiceError(err.code, f"{reason}, and the sequence could not be resumed within {retry_s:g}s "
                               f"(--verifier-retry-deadline): {err.message}") from err
        self.metrics.resumes.inc()
        # the new stream's verifier may take a shorter q: the next drafts sample from q cut to its limit
        seq.q_max_support = q_support_limit(seq.wire_mode, self.link.identity)
