"""Pipelined drafting: while a block's verdict is in flight, draft the next block on branches that each assume one
verdict, and propose each at once, marked with what it assumed.

A branch assumes either that the whole block is accepted and then the draft's guess of the bonus token, or that
its first j drafts are accepted and the next one is corrected to one of the draft's best other tokens (the
ALTERNATIVES it kept per position; for a token tree, its best path's and the best tokens outside the tree's
children there). The verifier verifies the one proposal whose assumption the verdict
confirms, if any, and drops the others, so what is verified never depends on pipelining. Two calls, one on each
side of a verdict: `Pipeline.draft_branches` and `Pipeline.settle`; `PipelineWidth` decides how many branches a
round drafts, from what drafting ahead costs the rounds beside it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog

from common.errors import ServiceError
from draft_service.draft_sampling import ALTERNATIVES
from draft_service.metrics import DraftMetrics
from draft_service.sequence import DraftSequence
from draft_service.types import DraftBlock, VerdictEvent
from draft_service.verifier_link import LinkDown, VerifierLink

if TYPE_CHECKING:
    from draft_service.drafters import Drafter

log = structlog.get_logger(__name__)

# Pipelined branches per round: the verifier queues at most 16 proposals per sequence (MAX_QUEUED_PROPOSALS); the
# block in flight takes one, and the last round's branches are dropped as soon as the new ones arrive.
MAX_BRANCHES = 8


@dataclass
class Flight:
    """One sequence's proposals on the wire that the verifier has not answered."""

    link: VerifierLink
    seq_id: int
    proposed: bool = False  # the block at the sequence's end has been sent on the current stream
    stale: int = 0  # pipelined proposals whose guess missed: the verifier drops them, their ProposalDropped is due
    resumed: bool = False  # the stream broke during the last wait: any pipelined proposal was lost with it
    resumes: int = 0  # streams broken under the sequence so far (counted before each resume starts)
    proposal_bytes: int = 0  # serialized size of every proposal sent
    # --speculation auto: this service's cap on the next block, sent with each proposal to ask for the
    # verifier's choice of its length; None: the draft length is this service's alone
    max_draft_tokens: int | None = None
    # and with it, what the draft's next drafting round must feed first (Drafter.backlog; 0 when warmed)
    draft_backlog_tokens: int = 0
    metrics: DraftMetrics | None = None  # counts the token trees sent, by shape

    def propose(self, seq: DraftSequence, start: int, block: DraftBlock, assumed: tuple[int, ...] = ()) -> None:
        """Send `block` for positions from `start` (raises LinkDown when the stream is down)."""
        self.proposal_bytes += self.link.propose(self.seq_id, start, block, send_draft_probs=seq.sampling.sends_draft_probs,
                                                 assumed_token_ids=assumed, max_draft_tokens=self.max_draft_tokens,
                                                 draft_backlog_tokens=self.draft_backlog_tokens)
        if block.parents is not None and self.metrics is not None:
            shape = "branched" if block.num_draft_tokens > block.num_positions else "chain"
            self.metrics.tree_proposals.labels(shape=shape, pipelined=str(bool(assumed)).lower()).inc()

    def try_propose(self, seq: DraftSequence, start: int, block: DraftBlock, assumed: tuple[int, ...] = ()) -> bool:
        """Propose; False when the stream is down (the verdict wait then resumes the sequence and proposes)."""
        try:
            self.propose(seq, start, block, assumed)
        except LinkDown:
            return False
        return True


@dataclass(frozen=True)
class Branch:
    """A pipelined proposal: `block`, drafted on `seq` after the in-flight block's first `num_accepted` drafts
    and `guess`, the verifier's bonus token (all accepted) or corrected token (the next one rejected)."""

    num_accepted: int
    guess: int
    seq: DraftSequence
    block: DraftBlock
    sent: bool


@dataclass
class PipelineWidth:
    """How many pipelined branches a sequence drafts per round; one instance per draft process, fed by every
    sequence's rounds.

    Drafting ahead is free only while it ends before the verdict it runs beside: the verdict that arrives first
    waits for it. So each round measures that stall (from the verdict's arrival to its processing): a stall
    above `narrow_share` of the round drops a branch, one below `widen_share` adds one back. At width 0
    pipelining is off for the sequence, and one branch is tried again every `probe_rounds` rounds. The width
    only decides which proposals are sent early, never what is verified: outputs do not depend on it. With
    `learn` False the width stays as set (--pipeline-width).

    A branch after a rejection is drafted only while such branches are adopted. Each alternative is known by its
    guess's rank and position, (rank, j) (Pipeline.planned_guesses), and every verdict of a block says which of
    the block's planned alternatives it would have confirmed, drafted or not: per (rank, j), the share of recent
    verdicts that confirmed it (decaying by `use_decay` a verdict that planned it, from `use_prior`). A round's
    width stops after the last of its block's planned alternatives with a share of at least `min_use_share` (a
    block with none, e.g. prompt lookup's, drafts one branch, and a stall then turns pipelining off at once).
    The stall alone does not price a branch that is never adopted: drafting it delays the proposals that
    drafting ahead sends for the verifier's next step (with a draft that always agrees, on a core of its own,
    the width learned from the stall alone drafted the agreeing pair's 16 streams at 413 and 441 tokens/s
    against 507 and 511 with one branch). A token tree's alternatives are the best tokens outside a node's
    children, so its rank-r guess at j is not always the draft's same rank there: a looser bound, not a wrong
    one.
    """

    max_width: int
    width: int = -1  # -1: start at max_width
    narrow_share: float = 0.2
    widen_share: float = 0.05
    probe_rounds: int = 16
    learn: bool = True
    min_use_share: float = 0.03
    use_decay: float = 0.95
    use_prior: float = 0.1
    _off_rounds: int = 0
    # per alternative, (its guess's rank, its position): the recent share of verdicts that confirmed it
    _use: dict[tuple[int, int], float] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.width < 0:
            self.width = self.max_width

    def next_width(self, slots: Sequence[tuple[int, int]] = ()) -> int:
        """The round's width; `slots`: its block's planned alternatives, (rank, j), in planned order."""
        if self.width > 0:
            return min(self.width, self.useful_width(slots))
        self._off_rounds += 1
        if self._off_rounds >= self.probe_rounds:
            self._off_rounds = 0
            return 1
        return 0

    def useful_width(self, slots: Sequence[tuple[int, int]]) -> int:
        """1, and `slots` up to the last one adopted often enough (the learned width's bound)."""
        if not self.learn:
            return self.max_width
        return 1 + max((i + 1 for i, slot in enumerate(slots)
                        if self._use.get(slot, self.use_prior) >= self.min_use_share), default=0)

    def observe_verdict(self, adopted: tuple[int, int] | None, slots: Sequence[tuple[int, int]]) -> None:
        """A verdict of a block whose planned alternatives are `slots`: `adopted` is the one it confirms, None:
        none of them (the whole block accepted, or a correction the draft did not guess)."""
        for slot in slots:
            share = self._use.get(slot, self.use_prior)
            self._use[slot] = self.use_decay * share + (1.0 - self.use_decay) * (slot == adopted)

    def observe(self, width_used: int, stall_s: float, round_s: float) -> None:
        if not self.learn or width_used == 0 or round_s <= 0:
            return
        if stall_s > self.narrow_share * round_s:
            self.width = width_used - 1
        elif stall_s < self.widen_share * round_s:
            self.width = min(self.max_width, width_used + 1)
        else:
            self.width = width_used


class Pipeline:
    """The draft process's pipelining: `width` None when it is off (--pipeline false)."""

    def __init__(self, drafter: Drafter, metrics: DraftMetrics, width: PipelineWidth | None) -> None:
        self.drafter = drafter
        self.metrics = metrics
        self.width = width

    @classmethod
    def from_flags(cls, drafter: Drafter, metrics: DraftMetrics, pipeline: bool, fixed_width: int) -> Pipeline:
        """--pipeline and --pipeline-width (0: learnt, from 2). One width for the whole process: it learns from
        every sequence's rounds, and a short request does not start over at the widest (drafting cost is the
        process's, not the sequence's)."""
        width = None
        if pipeline:
            fixed = fixed_width > 0
            width = PipelineWidth(MAX_BRANCHES, width=fixed_width if fixed else 2, learn=not fixed)
        return cls(drafter, metrics, width)

    def width_for(self, block: DraftBlock, k: int) -> int:
        """Branches to draft beside `block` (in flight), of `k` drafts each: no more than there are guesses."""
        if not self.width:
            return 0
        slots = [(rank, j) for rank, j, _ in self.planned_guesses(block)]
        return min(self.width.next_width(slots), 1 + k * ALTERNATIVES)

    def observe(self, width_used: int, stall_s: float, round_s: float) -> None:
        if self.width:
            self.width.observe(width_used, stall_s, round_s)

    @staticmethod
    def planned_guesses(block: DraftBlock) -> list[tuple[int, int, int]]:
        """The verdicts the branches after the first assume, in the order they are drafted: (rank, j, token), j
        drafts of the block's path accepted and the next corrected to token, the draft's rank-th other guess
        there; the best guess at each position, earliest first, then the second best."""
        alternatives = block.alternatives or ()
        ranks = max((len(a) for a in alternatives), default=0)
        return [(rank, j, alts[rank]) for rank in range(ranks) for j, alts in enumerate(alternatives)
                if rank < len(alts)]

    def observe_verdict(self, block: DraftBlock, verdict: VerdictEvent) -> None:
        """Which planned alternative `verdict` of `block` confirms, drafted or not (PipelineWidth.observe_verdict)."""
        if not self.width or not block.num_draft_tokens:
            return
        guesses = self.planned_guesses(block)
        path, tokens = block.path_token_ids, verdict.token_ids
        adopted = None
        if 0 < len(tokens) <= len(path) and tuple(path[:len(tokens) - 1]) == tokens[:-1]:
            adopted = next(((rank, j) for rank, j, token in guesses if (j, token) == (len(tokens) - 1, tokens[-1])),
                           None)
        self.width.observe_verdict(adopted, [(rank, j) for rank, j, _ in guesses])

    async def draft_branches(self, seq: DraftSequence, block: DraftBlock, k: int, width: int,
                             flight: Flight, tokens_left: int | None = None, opening: bool = False,
                             resumes: int | None = None) -> list[Branch]:
        """While `block`'s verdict is in flight, draft and propose up to `width` branches of `k` drafts each:
        the full-acceptance branch first, then the best guess at each position (earliest first), then the second
        best. All branches draft in one batch, sharing the sequence's cache blocks. `tokens_left`: what the
        sequence may still emit before `block`'s verdict, where no draft past it is verified (Generator's
        _tokens_left): each branch drafts within what its verdict would leave, and none follows a verdict
        that would end the sequence (one that would leave a single token gets a branch of no drafts: that
        token's proposal is then at the verifier already, as before). `opening`: `block` is a sequence's first,
        empty one, and its branch the second round's block drafted ahead (RoundLength.ahead); otherwise an empty
        block has none. `resumes`: flight.resumes when `block` was proposed (None: now); after another resume the
        branches are not sent (_propose_branches)."""
        if not width or k == 0 or (block.num_draft_tokens == 0 and not opening):
            return []
        if resumes is None:
            resumes = flight.resumes
        plans: list[tuple[int, int | None, DraftSequence]] = []
        lengths: list[int] = []

        def plan(j: int, guess: int | None, assumed: list[int]) -> None:
            # the verdict it assumes emits j + 1 tokens: j accepted drafts and a correction (or the bonus)
            room = k if tokens_left is None else min(k, tokens_left - (j + 1) - 1)
            if room >= 0:
                plans.append((j, guess, seq.branch(assumed)))
                lengths.append(room)

        plan(len(block.path_token_ids), None, list(block.path_token_ids))
        for _, j, alternative in self.planned_guesses(block)[:max(0, width - 1)]:
            plan(j, alternative, [*block.path_token_ids[:j], alternative])
        if not plans:
            return []
        try:
            # the full-acceptance branch drafts its guess of the bonus token, then the block after it as the
            # next unpipelined round would: a pipelined proposal is always the one that round would send
            # (an opening's branch feeds the prompt: a catch-up the batch's budget may defer, as a first round's
            # drafting was before it; deferred, nothing is drafted ahead)
            drafted = await asyncio.gather(*(self.drafter.draft_after_guess(branch, n, may_defer=opening)
                                             if guess is None
                                             else self.drafter.draft(branch, n)
                                             for (_, guess, branch), n in zip(plans, lengths, strict=True)),
                                           return_exceptions=True)
            return await self._propose_branches(seq, plans, drafted, flight, resumes)
        except BaseException:
            # cancelled (the client went away) or failed while the branches draft: none of them may keep a block
            await self.drafter.release(*(branch for _, _, branch in plans))
            raise

    async def _propose_branches(self, seq: DraftSequence, plans: list[tuple[int, int | None, DraftSequence]],
                                drafted: list, flight: Flight, resumes: int) -> list[Branch]:
        """`resumes`: flight.resumes when their block was proposed. A stream that broke since (an opening's branch
        drafts while its verdict is awaited, which may resume the sequence) lost what they assumed with it: they
        are not sent, so no proposal on the new stream runs ahead of the resumed sequence's own."""
        branches, unused, short = [], [], []
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
            sent = flight.resumes == resumes and flight.try_propose(seq, seq.num_tokens + j + 1, d,
                                                                    tuple(branch.assumed_token_ids))
            branches.append(Branch(j, guess, branch, d, sent))
        if short:  # fewer branches this round; none at all only when not even one fit
            log.warning("pipelined_drafting_short", code=short[0].code.name, message=short[0].message,
                        branches_dropped=len(short), branches_kept=len(branches))
        await self.drafter.release(*unused)
        return branches

    async def settle(self, seq: DraftSequence, block: DraftBlock, verdict: VerdictEvent, branches: list[Branch],
                     flight: Flight, finished: bool, opening: bool = False) -> DraftBlock | None:
        """After `block`'s verdict (already applied to `seq`): the sequence continues on the branch that guessed
        it (its block, already proposed, is the new block in flight) and the other branches are freed; their
        proposals will be dropped. Returns the block in flight, or None when no branch guessed right. `opening`:
        `block` is a sequence's first, and its branch the block drafted ahead (draft_branches')."""
        if not branches:
            return None
        match = None
        if not flight.resumed and not finished:
            match = next((b for b in branches if verdict.token_ids == (*block.path_token_ids[:b.num_accepted], b.guess)),
                         None)
        missed = [branch for branch in branches if branch is not match]
        # an opening's missed branch holds the prompt the sequence has not fed (RoundLength.ahead): the sequence
        # takes its cache, and its rollback keeps the prompt (the guess and its drafts go)
        kept = missed[0] if opening and match is None and not finished and missed[0].seq.num_cached else None
        await self.drafter.release(*(branch.seq for branch in missed if branch is not kept))
        if kept is not None:
            await self.drafter.adopt(seq, kept.seq)
        if not flight.resumed:  # the verifier drops their proposals: their ProposalDropped is expected
            flight.stale += sum(branch.sent for branch in missed)
        self.metrics.pipelined_proposals.labels(outcome="dropped").inc(len(missed))
        if match is None:
            return None
        self.metrics.pipelined_proposals.labels(outcome="used").inc()
        await self.drafter.adopt(seq, match.seq)
        seq.assumed_token_ids.extend(match.block.path_token_ids)
        flight.proposed = match.sent
        return match.block
