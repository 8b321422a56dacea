"""One client request, end to end. Each round: draft a block, propose it, await the verifier's verdict, extend
the sequence with the verified tokens, roll the draft cache back to them, emit their text. Until the verifier
ends the sequence or a stop string appears. With pipelining, the next block is drafted on branches while the
verdict is in flight (draft_service.pipelining), and the branch the verdict confirms is the next block in flight."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import structlog

from common.errors import ErrorCode, ServiceError, invalid_argument
from common.generation_stats import GenerationStats
from common.sampling import FinishReason, SamplingParams, WireMode, validate_token_ids
from common.tokenizer import INLINE_PROMPT_IDS, PromptEncoder
from draft_service.adaptive import AdaptiveDraftLength, RecentChoices, RoundLength
from draft_service.config import SETTLE_WAITS, DraftConfig
from draft_service.draft_model import CATCH_UP_BUDGET_TOKENS
from draft_service.drafters import Drafter
from draft_service.due_rounds import DueRounds
from draft_service.metrics import DraftMetrics
from draft_service.pipelining import Branch, Flight, Pipeline
from draft_service.sequence import DraftSequence
from draft_service.text_output import TextOutput, check_stop_strings
from draft_service.types import (
    DraftBlock,
    DroppedEvent,
    ErrorEvent,
    GenerationRequest,
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


def tokens_left(seq: DraftSequence, num_prompt_tokens: int, max_model_len: int) -> tuple[int, int]:
    """(the tokens the request may still emit, the tokens the target's context still holds)."""
    return seq.sampling.max_tokens - (seq.num_tokens - num_prompt_tokens), max_model_len - seq.num_tokens


def draft_room(tokens_left: int, context_left: int) -> int:
    """The draft tokens a sequence's next block may hold, as the verifier caps its choice: a block of k yields
    k + 1 tokens, within what the request may still emit and what the target's context still holds."""
    return min(tokens_left, context_left) - 1


def q_support_limit(sampling: SamplingParams, identity: VerifierIdentity) -> int | None:
    """A sequence's q support limit besides the draft's --q-max-support: the verifier's --max-q-support where q
    is sent (sparse mode), since it refuses a longer one; None: no other limit (ids only, or a verifier older
    than the field, which states 0)."""
    limit = identity.max_q_support
    return limit if sampling.sends_draft_probs and limit > 0 else None


class _VerdictWait:
    """A round's wait for its verdict, during which its sequence is in `awaiting` (Generator.verdict_arrived: the
    next round is then due, and a drafting batch waits for it). While `job` drafts the next block ahead, the
    sequence joins only once that is done: its next drafting is in the batch already. (A verdict that arrives
    meanwhile and misses the job's guess is not due either: its next round drafts once the job is done, and no
    batch waits for it.)"""

    def __init__(self, awaiting: set[int], seq_id: int, job: asyncio.Future | None) -> None:
        self._awaiting, self._seq_id, self._waiting = awaiting, seq_id, True
        if job is None or job.done():
            awaiting.add(seq_id)
        else:
            job.add_done_callback(self._join)

    def _join(self, _job: asyncio.Future) -> None:
        if self._waiting:
            self._awaiting.add(self._seq_id)

    def end(self) -> None:
        self._waiting = False
        self._awaiting.discard(self._seq_id)


class Generator:
    def __init__(self, config: DraftConfig, tokenizer: Any, vocab_size: int, link: VerifierLink, drafter: Drafter,
                 metrics: DraftMetrics | None = None, due: DueRounds | None = None) -> None:
        """due: the sequences whose verdict is in (the link tells verdict_arrived); each round here says when it
        starts."""
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.link = link
        self.drafter = drafter
        self.metrics = metrics or DraftMetrics()
        self.due = due
        self._awaiting: set[int] = set()  # sequence ids whose generation waits for its verdict now
        self._running = 0  # generations in progress
        self._arrival_waiters: set[asyncio.Future[None]] = set()  # openings waiting for another one (_alone)
        self._preparing = 0  # generations counted (_arrived) whose opening has not reached its wait yet (_prepared)
        self._burst_deadline = 0.0  # the loop time by which the openings waiting now all leave (_alone)
        self.prompts = PromptEncoder(tokenizer, config.max_prompt_bytes)  # text prompts, tokenized off the loop
        self.speculation = config.speculation_mode
        self._recent_choices = RecentChoices()  # the verifier's recent choices on this process, by load (auto)
        # n-gram drafts cost nothing to make: there is no draft time for the own-cost rule to weigh
        self.weighs_own_cost = config.proposer == "model"
        # the own-cost rule's estimate over every sequence's rounds: where a new sequence's starts
        self._pooled_own = AdaptiveDraftLength.for_mode(config.num_speculative_tokens, self.speculation)
        # one-hot and coupled wire modes send ids only: the verifier then takes q = delta(x) (lossless for any q),
        # or decides every token from its own noise
        self.wire_mode = WireMode(config.wire_mode)
        self.pipeline = Pipeline.from_flags(drafter, self.metrics, config.pipeline, config.pipeline_width)

    def verdict_arrived(self, seq_id: int | None, step: tuple | None, step_verdicts: int) -> None:
        """The link's on_verdict: a verdict whose sequence goes on. Its round is due (a drafting batch waits for
        it) only while its generation waits for that verdict: one busy drafting ahead (pipelining) has its jobs in
        the batch already, which must not wait for it."""
        if self.due is not None:
            self.due.arrived(seq_id if seq_id in self._awaiting else None, step, step_verdicts)

    async def generate(self, req: GenerationRequest) -> AsyncIterator[TextChunk | GenerationStats]:
        self.metrics.active.inc()
        self._arrived()
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
            self._running -= 1
            if not self._running:
                self.drafter.idle_again()
            self.metrics.requests.labels(outcome=outcome).inc()

    def _arrived(self) -> None:
        """A generation starts: counted, and the openings waiting for their burst learn of it and wait for it to
        reach its own wait (_prepared; one that fails its checks releases them then, one slow to prepare holds them
        to their bound: at most SETTLE_WAITS waits in all)."""
        self._running += 1
        self._preparing += 1
        self._wake_waiters()

    def _prepared(self) -> None:
        """A generation's opening reaches its wait (_alone), or its checks failed before it: the openings waiting
        wait for it no more, and those of its burst start their wait again with it."""
        self._preparing -= 1
        self._wake_waiters()

    def _wake_waiters(self) -> None:
        for waiter in self._arrival_waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def _generate(self, req: GenerationRequest) -> AsyncIterator[TextChunk | GenerationStats]:
        t0 = time.perf_counter()
        prompt, seq, length, max_model_len = await self._prepare(req)
        stats = GenerationStats(num_prompt_tokens=len(prompt), num_speculative_tokens=length.k)
        output = TextOutput(self.tokenizer, req.stop)
        seq_id = await self.link.open(prompt, seq.sampling, retry_s=self._retry_s(req.deadline),
                                      deadline=req.deadline, cache_salt=req.cache_salt)
        structlog.contextvars.bind_contextvars(seq_id=seq_id)
        max_model_len = self._context_length(seq_id, max_model_len)  # the verifier it was placed on
        flight = Flight(self.link, seq_id, metrics=self.metrics)
        finished = False
        block: DraftBlock | None = None  # the block in flight at the sequence's end, once drafted
        branches: list[Branch] = []  # the next block drafted ahead, one branch per verdict it guesses
        ahead_job: asyncio.Future | None = None  # an opening's block drafted ahead, while its verdict is awaited
        try:
            while not finished:
                t_draft = time.perf_counter()
                k, flight.max_draft_tokens = length.next_round()
                # tokens this sequence may still emit, where the verifier verifies no draft past them (greedy and
                # coupled output ignores where rounds end); None: every block is drafted and verified whole
                left = self._tokens_left(seq, len(prompt), max_model_len)
                ending = left is not None and left <= 1  # the request's last token: nothing to draft, whatever k
                if left is not None:
                    k = min(k, max(0, left - 1))
                if self.due is not None:
                    self.due.left(seq_id)  # before its drafting job or its wait for the batch (in one loop turn)
                proposing = block is None
                if block is None:
                    block = await self._draft(seq, k, length, opening=not stats.num_rounds)
                # an opening's block drafted ahead (RoundLength.ahead): the round drafts, and that branch feeds
                # the prompt (not while it would end the sequence)
                ahead = length.ahead if not ending else 0
                # a round that drafts nothing, of a sequence that may draft again: its cache catches up meanwhile,
                # while the model has nothing to draft, sooner while recent rounds draft (never for k = 0
                # requests: they never draft, and are not counted); not while the verifier chose 0 for it, which
                # it mostly chooses again (at 64 streams, default pair, 2 cores, warming the prompts of a burst
                # on the drafting share alone cost the draft 16 CPU seconds of a 73 s level that drafted in 1 %
                # of its rounds): a probe, or a later choice to draft, catches it up (draft_model's bound).
                # The proposal says what the next drafting round must still feed: nothing where this round drafts
                # (pipelined branches follow only a block that drafted, or an opening's drafted ahead, which feeds
                # the prompt and leaves its cache to the sequence whether its guess holds or not), else what is
                # unfed now (warming may feed some before the verdict: not counted, it may not get the thread)
                drafts = bool(block.num_draft_tokens) or ahead > 0
                chose_plain = length.follows_verifier and length.choice == 0
                warming = not drafts and length.k > 0 and not chose_plain and not ending
                if warming:
                    self.drafter.warm(seq)
                if proposing:
                    flight.draft_backlog_tokens = 0 if drafts else self.drafter.backlog(seq)
                    flight.proposed = flight.try_propose(seq, seq.num_tokens, block)
                width = 0
                if ahead:  # drafts while the verdict is awaited: the first token need not wait for it
                    ahead_job = asyncio.ensure_future(self._draft_ahead(seq, block, ahead, flight, left,
                                                                        flight.resumes))
                else:
                    width = self.pipeline.width_for(block, k)
                    branches = await self.pipeline.draft_branches(seq, block, k, width, flight, tokens_left=left)
                    if length.k > 0 and not ending:
                        self.drafter.note_round(bool(block.num_draft_tokens or branches), self._running)
                t_sent = time.perf_counter()
                waits = _VerdictWait(self._awaiting, seq_id, ahead_job)
                try:
                    verdict = await self._verify(seq, len(prompt), block, req.deadline, flight)
                    t_verdict = time.perf_counter()  # before any wait for warming: the round's times
                except VerifierFailed:
                    finished = True  # the verifier has already freed the sequence
                    raise
                finally:
                    waits.end()
                    if warming:
                        await self.drafter.settle(seq)  # before seq changes (or is released)
                fed = None  # the verdict's text, when already handed to the client
                if ahead_job is not None:
                    if not ahead_job.done():
                        fed = output.feed(verdict.token_ids, final=verdict.finish_reason is not None)
                        stats.time_to_first_token_s = time.perf_counter() - t0
                        yield TextChunk(fed[0], fed[1])
                        if fed[2] and verdict.finish_reason is None:  # a stop string: the verifier would go on,
                            finished = True  # so it frees the sequence now, not after the drafting ahead stops
                            self.link.release(seq_id, cancel=True)
                    # a verdict that ends the sequence leaves nothing to draft ahead for
                    ends = finished or verdict.finish_reason is not None
                    branches = await self._end_drafting_ahead(seq, ahead_job, cancel=ends)
                    ahead_job = None
                # (an opening's branch is no pipelined round: its stall is the prompt's feeding)
                self.pipeline.observe(width, max(0.0, t_verdict - verdict.received_at), t_verdict - t_draft)
                if verdict.finish_reason is None:
                    self.pipeline.observe_verdict(block, verdict)
                seq.assumed_token_ids.clear()
                seq.extend(verdict.token_ids)
                finished = finished or verdict.finish_reason is not None
                max_model_len = self._context_length(seq_id, max_model_len)  # a resume may have moved it
                verified, block = block, await self.pipeline.settle(seq, block, verdict, branches, flight, finished,
                                                                    opening=ahead > 0)
                branches = []
                flight.resumed = False
                seq.roll_back()
                tokens, text, stopped = fed if fed is not None else output.feed(verdict.token_ids, final=finished)
                room = None if finished else draft_room(*tokens_left(seq, len(prompt), max_model_len))
                self._record_round(stats, length, seq, verified, verdict, tokens, t0, t_sent - t_draft,
                                   t_verdict - t_sent, room)
                stats.finish_reason = FinishReason.STOP if stopped else verdict.finish_reason
                if stopped and not finished:  # the verifier would go on: tell it to free the sequence now
                    finished = True
                    self.link.release(seq_id, cancel=True)
                if fed is None:
                    yield TextChunk(tokens, text)
        finally:
            # cancelled by the client or failed here: free it on the verifier too
            self.link.release(seq_id, cancel=not finished)
            if self.due is not None:
                self.due.forget(seq_id)
            try:
                if ahead_job is not None:
                    branches = await self._end_drafting_ahead(seq, ahead_job, cancel=True)
            finally:  # cancelled again meanwhile: the job frees its own branch, and the sequence is freed here
                await self.drafter.release(*(branch.seq for branch in branches), seq)
                structlog.contextvars.unbind_contextvars("seq_id")
        yield self._finish(stats, seq, flight, t0)

    async def _draft_ahead(self, seq: DraftSequence, block: DraftBlock, k: int, flight: Flight, left: int | None,
                           resumes: int) -> list[Branch]:
        """An opening's block drafted ahead (RoundLength.ahead), beside the prompt's step: its branch, or none,
        when the prompt is warmed instead (its drafting deferred past the batch's budget, or no guess).
        `resumes`: flight.resumes when the opening's block was proposed (draft_branches)."""
        branches = await self.pipeline.draft_branches(seq, block, k, 1, flight, tokens_left=left, opening=True,
                                                      resumes=resumes)
        if not branches:
            self.drafter.warm(seq)
        self.drafter.note_round(bool(branches), self._running)
        return branches

    async def _end_drafting_ahead(self, seq: DraftSequence, job: asyncio.Future, cancel: bool) -> list[Branch]:
        """The branches `job` (_draft_ahead) drafted, once it is done; with `cancel`, none: it is stopped where it
        still drafts (draft_branches then frees its branches) and what it drafted is freed. A warming it began is
        settled either way, before the sequence changes or is released."""
        if cancel and not job.done():
            job.cancel()
        await asyncio.wait({job})
        if job.cancelled():
            return []
        if (err := job.exception()) is not None:
            if cancel:  # the generation ends anyway: said, not raised
                log.warning("drafting_ahead_failed", error=f"{type(err).__name__}: {err}")
                return []
            raise err
        branches = job.result()
        if not branches:  # the prompt was warmed instead
            await self.drafter.settle(seq)
        if cancel:
            await self.drafter.release(*(branch.seq for branch in branches))
            return []
        return branches

    async def _prepare(self, req: GenerationRequest) -> tuple[list[int], DraftSequence, RoundLength, int]:
        """The request checked against this service and its verifier: (prompt ids, the sequence, its rounds'
        draft length, the verifier's context length)."""
        try:
            check_stop_strings(req.stop)
            self._check_fixed(req)  # before the prompt is tokenized or a verifier waited for
            prompt = await self._prompt_ids(req)
            identity = await self.link.ensure_connected(self._retry_s(req.deadline))
            check_prompt_length(len(prompt), identity)  # before the draft prefills it
            self._check_trees(identity)
            k = self._num_speculative_tokens(req, identity)
            requested = dataclasses.replace(req.sampling, wire_mode=req.sampling.wire_mode or self.wire_mode)
            sampling = self._sampling(requested.with_seed(), identity)
            seq = DraftSequence(sampling, list(prompt), q_max_support=q_support_limit(sampling, identity),
                                num_prompt_tokens=len(prompt))
            varies = self.adapts_k(requested, k) and not req.fixed_k
        except BaseException:
            self._prepared()  # failed or cancelled: the burst's waiting openings wait for it no more
            raise
        alone = await self._alone(varies, k)
        length = RoundLength.for_mode(k, self.speculation, varies=varies, weighs_own_cost=self.weighs_own_cost,
                                      recent_choice=self._recent_choices.opening(self._running, k),
                                      pooled=self._pooled_own, alone=alone)
        return prompt, seq, length, identity.max_model_len

    async def _alone(self, varies: bool, k: int) -> bool:
        """Whether no other generation ran on the process as this one opened (RoundLength.for_mode's `alone`), once
        its burst has arrived. Under auto, with a choice or the verifier's plain_from on record (else the opening
        drafts ahead at the full k), an opening waits until no other request has arrived for --opening-wait-ms
        and none that has arrived is still on its way to its own wait (its prompt tokenized, its checks), at most
        SETTLE_WAITS such waits from the start of the first of its burst to wait (so the burst's openings leave
        together, none at a bound of its own), and then counts the process's generations (_prepare: the load its
        first block's length, k at most, is looked up at). It waits where the verifier's plain_from for k
        already says the load runs plain as well: the wait also keeps the burst's prompts in one step. (Where those
        beside others went at once, the first of a burst, alone when it opened, waited, and the verifier could run a
        prompt step without it. With external_clients.sh at 4 streams and the word at 1 from the wave before,
        aiperf's 4 prompts went in steps of 3 and 1 where k = 0's went in one (6400954: 0.96x k = 0); waiting
        (744ae9a), they went in one (0.99x). In the tenth sweep's run of the outside clients, both clients' time to
        first token p99 was about a prompt step above p50 (1,275 and 2,085 ms; 1,271 and 2,368) where k = 0's were
        within 10 ms, as such a split would make it (those logs were not kept). The steps:
        docs/bench/external-clients-c4-burst-6400954-744ae9a.md.)

        A burst's requests arrive a little apart (1 to 3 ms on loopback, bench/capacity.py at 4 and 16 streams, 2
        cores), and each opening counted only those before it: the first, finding itself alone, proposed its prompt
        alone and came apart from its wave, and the rest took the choices of loads from 1 to the burst's, some
        drafting, some not, at a load where the verifier then ran plain (16 streams, f307590: 8 of 16 openings
        drafted, and those finished about 3 s apart from the rest). A request that stays alone (one stream) pays one
        wait before its prompt goes out, an opening beside others one to five: each arrival starts the wait again,
        and a request still being prepared (a long text prompt in the tokenizer's pool, a verifier being
        reconnected) holds the burst to its bound. It comes before the sequence is opened on the verifier: an idle
        verifier computes an opened prompt at once, and a lone opening's proposal must reach it with the prompt, not
        a step later."""
        self._prepared()
        wait_s = self.config.opening_wait_ms / 1e3
        alone = self._running <= 1
        if not (varies and self.speculation == "auto") or not self._recent_choices.knows() or wait_s <= 0:
            return alone
        loop = asyncio.get_running_loop()
        if not self._arrival_waiters:  # the first of a burst to wait: its bound is the whole burst's
            self._burst_deadline = loop.time() + SETTLE_WAITS * wait_s
        while (left := min(wait_s, self._burst_deadline - loop.time())) > 0:
            arrival = loop.create_future()
            self._arrival_waiters.add(arrival)
            try:
                await asyncio.wait({arrival}, timeout=left)
            finally:
                self._arrival_waiters.discard(arrival)
                arrival.cancel()
            if self._preparing > 0:  # one arrived and is still on its way here (its prompt, its checks)
                alone = False
                continue
            if arrival.cancelled():  # none arrived
                break
            alone = False  # one that arrived is of its burst, even where it has ended since
        log.debug("opening_alone" if alone else "opening_joined_a_burst", running=self._running)
        return alone

    def _check_fixed(self, req: GenerationRequest) -> None:
        """A request's speculation FIXED needs --allow-request-fixed where it changes anything (a k above 0 on a
        service whose rounds may vary): it drafts under load the verifier would run plain, which slows every
        sequence of its steps."""
        if req.fixed_k and self._requested_k(req) > 0 and self.speculation != "fixed" and not self.config.allow_request_fixed:
            raise ServiceError(ErrorCode.FAILED_PRECONDITION, "this draft service does not take a request's "
                               "speculation FIXED (start it with --allow-request-fixed): a fixed k drafts under load "
                               "the verifier would run plain")

    def _context_length(self, seq_id: int, known: int) -> int:
        """The target's context length on the verifier the sequence is open on now: the one it was opened on, or,
        after a resume, the one it moved to (which may take a longer or shorter context than the first)."""
        identity = self.link.identity_of(seq_id)
        return identity.max_model_len if identity is not None else known

    @staticmethod
    def _tokens_left(seq: DraftSequence, num_prompt_tokens: int, max_model_len: int) -> int | None:
        """What the sequence may still emit (max_tokens, and the target's context) where its output ignores the
        drafts: the verifier verifies no draft past that (a block of k yields up to k + 1 tokens), so none is
        drafted. None for rejection sampling, whose blocks go whole (a seeded request's tokens would change with
        where its last round ends)."""
        if not seq.sampling.output_ignores_drafts:
            return None
        return min(tokens_left(seq, num_prompt_tokens, max_model_len))

    async def _draft(self, seq: DraftSequence, k: int, length: RoundLength, opening: bool) -> DraftBlock:
        """`opening`: the sequence's first round, which waits for no burst's batch (one that drafts nothing
        proposes its prompt at once). One that drafts (RoundLength.opens_ahead False) feeds a prompt of at most
        CATCH_UP_BUDGET_TOKENS whatever the batch's catch-up budget, as a fixed k's round does: deferred, it would
        propose the prompt alone, a round apart from the openings of its burst. A longer prompt is deferrable as
        any catch-up, so that a burst of long prompts is not fed whole before the running sequences' drafting
        steps. A burst of short ones is (16 prompts of 30 tokens are 480 rows against the budget's 64), as a fixed
        k's openings are."""
        if length.follows_verifier and k == 0 and not opening:
            await self.drafter.wait_for_batch()  # proposed with the sequences of its burst
        feeds_whole = opening and k > 0 and seq.num_prompt_tokens <= CATCH_UP_BUDGET_TOKENS
        return await self.drafter.draft(seq, k, may_defer=length.follows_verifier and not feeds_whole)

    def _record_round(self, stats: GenerationStats, length: RoundLength, seq: DraftSequence, block: DraftBlock,
                      verdict: VerdictEvent, tokens: tuple[int, ...], t0: float, draft_s: float, wait_s: float,
                      room: int | None) -> None:
        """`room`: the draft tokens the sequence's next block may hold (draft_room; None: it ended)."""
        stats.record_round(num_draft_tokens=block.num_draft_tokens, num_accepted=verdict.num_accepted,
                           num_emitted=len(tokens), draft_s=draft_s, wait_s=wait_s, verify_s=verdict.step_time_s,
                           num_positions=block.num_positions)
        self.metrics.observe_round(draft_s, wait_s, verdict.step_time_s)
        self.drafter.observe(seq, block, verdict.token_ids)
        if stats.num_rounds == 1 and not stats.time_to_first_token_s:  # not handed on before the round's end
            stats.time_to_first_token_s = time.perf_counter() - t0
        # a tree counts by its positions (its depth), as the length it was drafted for; a round whose batch fed a
        # catch-up first says nothing of drafting's usual time
        own_draft_s = None if block.catch_up_tokens else draft_s
        timed = not (length.follows_verifier and stats.num_rounds == 1)  # an opening's times are its prompt's
        length.observe(block.num_positions, verdict.num_accepted, verdict.next_draft_tokens, own_draft_s, wait_s,
                       timed=timed)
        # a round that drafted nothing says nothing of drafting
        if length.own and block.num_draft_tokens and timed:
            self._pooled_own.observe(block.num_positions, verdict.num_accepted, own_draft_s, wait_s)
        # the figure is for the cap the round asked the verifier about, or a fixed k's block
        self._recent_choices.note_plain_from(
            verdict.plain_from, length.asked if length.asked is not None else block.num_positions)
        choice = length.load_choice(room)
        if choice is not None:
            self._recent_choices.record(self._running, choice)

    def _finish(self, stats: GenerationStats, seq: DraftSequence, flight: Flight, t0: float) -> GenerationStats:
        stats.wall_time_s = time.perf_counter() - t0
        stats.proposal_bytes = flight.proposal_bytes
        self.metrics.proposal_bytes.labels(wire_mode=seq.sampling.wire_mode.value).inc(flight.proposal_bytes)
        log.info("generation_done", prompt_tokens=stats.num_prompt_tokens, generated=stats.num_generated_tokens,
                 rounds=stats.num_rounds, drafted=stats.num_draft_tokens, accepted=stats.num_accepted_tokens,
                 k=stats.num_speculative_tokens, wall_s=round(stats.wall_time_s, 3),
                 finish=stats.finish_reason and stats.finish_reason.value)
        return stats

    def adapts_k(self, requested: SamplingParams, k: int) -> bool:
        """Whether the draft length may vary by round (--speculation auto or adaptive). Both read clocks and
        load, and under rejection sampling a sampled token depends on where rounds start (a bonus token and a
        drafted one are decided differently). A seeded request verified by rejection sampling therefore keeps
        the fixed k, so the same seed gives the same tokens from the same service whatever the load. Greedy and
        coupled output never depend on k. `requested`: the request's parameters (its own seed or none), with its
        wire mode decided."""
        seeded_rejection = requested.seed is not None and not requested.output_ignores_drafts
        return self.speculation != "fixed" and k > 0 and not seeded_rejection

    def _sampling(self, sampling: SamplingParams, identity: VerifierIdentity) -> SamplingParams:
        """The sequence's sampling parameters, once its verifier can verify them as their wire mode says."""
        if sampling.is_coupled and wire.FEATURE_COUPLED not in identity.features:
            raise ServiceError(ErrorCode.FAILED_PRECONDITION, f"the coupled wire mode needs a verifier that "
                               f"implements it; {identity.model_id!r}'s verifier does not (upgrade it, or ask for "
                               "wire_mode sparse or one-hot)")
        return sampling

    def _check_trees(self, identity: VerifierIdentity) -> None:
        """Token trees need a verifier that verifies them, at least as large as this service grows them."""
        if self.config.tree_branches <= 1:
            return
        if not identity.takes_trees(self.config.tree_nodes):
            why = ("does not verify token trees" if not identity.max_tree_nodes else
                   f"verifies trees of at most {identity.max_tree_nodes} nodes")
            raise ServiceError(ErrorCode.FAILED_PRECONDITION, f"this draft service grows token trees of "
                               f"{self.config.tree_nodes} nodes (--tree-nodes), but {identity.model_id!r}'s verifier "
                               f"{why}: lower --tree-nodes, or run the draft with --tree-branches 1 (chains)")

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

    def _requested_k(self, req: GenerationRequest) -> int:
        """The request's k, or this service's where it names none (not yet checked)."""
        return self.config.num_speculative_tokens if req.num_speculative_tokens is None else req.num_speculative_tokens

    def _num_speculative_tokens(self, req: GenerationRequest, identity: VerifierIdentity) -> int:
        k = self._requested_k(req)
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

    async def _verify(self, seq: DraftSequence, num_prompt_tokens: int, block: DraftBlock, deadline: float | None,
                      flight: Flight) -> VerdictEvent:
        """The verdict of `block`, proposed at the sequence's end. When the stream breaks meanwhile, the sequence
        is reopened on a new stream with its verified tokens and the block proposed again: the verdict is the
        one the lost stream would have given (the random numbers are keyed by position)."""
        while True:
            try:
                if not flight.proposed:
                    flight.propose(seq, seq.num_tokens, block)
                    flight.proposed = True
                event = await self.link.next_event(flight.seq_id)
            except LinkDown as err:
                event = StreamLost(str(err))
            if isinstance(event, ErrorEvent) and event.code is ErrorCode.UNAVAILABLE:
                # its verifier did not take it (it drains) and freed it: opened again, elsewhere if it can be
                event = StreamLost(f"the verifier did not take the sequence: {event.message}")
            if isinstance(event, StreamLost):
                flight.resumes += 1  # before the resume's first await: a branch drafting ahead sends nothing now
                await self._resume(flight.seq_id, seq, num_prompt_tokens, deadline, event.reason)
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
        seq.q_max_support = q_support_limit(seq.sampling, self.link.identity_of(seq_id))
