"""Typed messages between the gRPC edge and the engine (no protobuf past the servicer)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.errors import ErrorCode
from common.sampling import FinishReason, SamplingParams, SparseProbs, count_positions
from common.token_tree import ancestor_masks, tree_depths

if TYPE_CHECKING:
    from verifier_service.sequence import Sequence  # it holds ProposeCmds: imported here only for annotations


@dataclass(frozen=True)
class SeqKey:
    stream_id: int
    seq_id: int


@dataclass(frozen=True)
class OpenCmd:
    key: SeqKey
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    num_output_tokens: int = 0  # a resume: the tail of prompt_token_ids is earlier output
    deadline: float | None = None  # time.monotonic() past which the client no longer waits
    cache_salt: str | None = None  # prefix-cache isolation: blocks are shared only within one salt


@dataclass(frozen=True)
class ProposeCmd:
    key: SeqKey
    start_position: int
    draft_token_ids: tuple[int, ...]
    draft_probs: tuple[SparseProbs, ...] | None  # q of each draft token; None: one-hot (or greedy)
    assumed_token_ids: tuple[int, ...] = ()  # pipelined: what it was drafted after, ending at start_position
    # --speculation auto: the draft's cap on its next block, and its ask for the verifier's choice; None: it
    # decides its draft length alone (a fixed k, an older draft)
    max_draft_tokens: int | None = None
    draft_seconds: float | None = None  # the draft's compute for the batch that drafted it (phases.py); None: unknown
    # a token tree: each draft token's parent among them (-1: the last verified token); None: a chain
    draft_parents: tuple[int, ...] | None = None
    # context the draft's batch fed before drafting it, past a usual round's (Proposal.catch_up_tokens): its
    # draft_seconds, and the wait for it, are mostly that; 0: a usual round
    catch_up_tokens: int = 0
    # context the draft expects still to feed its own model before its next drafting round (Proposal.
    # draft_backlog_tokens): that round's catch-up, priced by the goodput choice; None: unknown (an older draft)
    draft_backlog_tokens: int | None = None

    @property
    def num_draft_tokens(self) -> int:
        return len(self.draft_token_ids)

    @property
    def depths(self) -> list[int]:
        """Each draft token's depth: its position less start_position (a chain's: 0, 1, ...)."""
        if self.draft_parents is None:
            return list(range(self.num_draft_tokens))
        return tree_depths(self.draft_parents)

    @property
    def num_positions(self) -> int:
        """The positions its drafts decide (a chain's k, a tree's depth): the most tokens it can have accepted."""
        return max(self.depths, default=-1) + 1

    def ancestor_masks(self) -> list[int]:
        """Per draft token, the bits of itself and its ancestors (tree attention, kernels.paged_attention)."""
        return ancestor_masks(self.draft_parents if self.draft_parents is not None
                              else range(-1, self.num_draft_tokens - 1))

    def truncated(self, num_draft_tokens: int) -> ProposeCmd:
        """The same proposal with only its first `num_draft_tokens` drafts: a chain's first positions, a tree's
        first nodes (its parents come first, so the kept ones stay a tree; they occupy as many cache slots, and
        span no more positions)."""
        if num_draft_tokens >= self.num_draft_tokens:
            return self
        draft_probs = self.draft_probs[:num_draft_tokens] if self.draft_probs else self.draft_probs
        parents = self.draft_parents[:num_draft_tokens] if self.draft_parents and num_draft_tokens else None
        return dataclasses.replace(self, draft_token_ids=self.draft_token_ids[:num_draft_tokens],
                                   draft_probs=draft_probs, draft_parents=parents)

    def within_positions(self, num_positions: int) -> ProposeCmd:
        """The same proposal without its drafts past its first `num_positions` positions: a chain's first
        positions; a tree's nodes that shallow, in their order (a shallow node's ancestors are shallower: they
        stay a tree)."""
        if num_positions >= self.num_positions:
            return self
        if self.draft_parents is None:
            return self.truncated(max(0, num_positions))
        keep = [i for i, depth in enumerate(self.depths) if depth < num_positions]
        if not keep:
            return self.truncated(0)
        index = {node: k for k, node in enumerate(keep)}
        return dataclasses.replace(
            self, draft_token_ids=tuple(self.draft_token_ids[i] for i in keep),
            draft_probs=tuple(self.draft_probs[i] for i in keep) if self.draft_probs else self.draft_probs,
            draft_parents=tuple(index[p] if (p := self.draft_parents[i]) >= 0 else -1 for i in keep))


@dataclass(frozen=True)
class CloseCmd:
    key: SeqKey


@dataclass(frozen=True)
class CloseStreamCmd:
    stream_id: int


@dataclass(frozen=True)
class RefusedCmd:
    """A message the stream's side refused (it checks proposals, so that the engine thread never validates a
    large one): the engine ends the sequence with this error in arrival order, as if it had refused it. A
    refused open (`opening`) ends nothing: if a sequence is open under its id, the error names no sequence."""

    key: SeqKey
    code: ErrorCode
    message: str
    opening: bool = False


Command = OpenCmd | ProposeCmd | CloseCmd | CloseStreamCmd | RefusedCmd


@dataclass(frozen=True)
class VerdictOut:
    key: SeqKey
    start_position: int
    num_accepted: int
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    batch_size: int
    step_time_s: float = 0.0
    next_draft_tokens: int | None = None  # the verifier's choice of the next block's length (goodput)
    # the step's number, and the verdicts of this stream in it whose sequences go on (Verdict.step_verdicts)
    step: int = 0
    step_verdicts: int = 0
    # a verification that answers two proposals (ScheduledSeq.folded): its first `split` tokens are the earlier,
    # empty proposal's verdict, sent apart before the rest (split_folded); 0: it answers one
    split: int = 0
    # the load from which the verifier would decode the sequence's group plainly (DraftLengthController.plain_from_of;
    # Verdict.plain_from; past goodput.PLAIN_FROM_MOST: drafting pays at every load it looks at); None: not worked
    # out (no cap, a stream that asks for no choice, no model yet, the step's budget)
    plain_from: int | None = None


@dataclass(frozen=True)
class ErrorOut:
    key: SeqKey
    code: ErrorCode
    message: str


@dataclass(frozen=True)
class DroppedOut:
    key: SeqKey
    start_position: int
    num_verified: int


@dataclass(frozen=True)
class LoadOut:
    """The verifier's load as one stream's draft sees it (VerifierLoad on the wire): what a draft with several
    verifiers places new sequences by, and whether this one is draining."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    draining: bool = False


Outcome = VerdictOut | ErrorOut | DroppedOut


def split_folded(outcome: Outcome) -> list[Outcome]:
    """A verdict that answers two proposals (VerdictOut.split) as the two verdicts the draft awaits: the empty
    proposal's, its first token (accepted nothing; no step number, since the draft drafts nothing after it: the
    block it drafted ahead is the next one), then the folded proposal's, from the next position."""
    if not isinstance(outcome, VerdictOut) or not outcome.split:
        return [outcome]
    n = outcome.split
    first = VerdictOut(outcome.key, outcome.start_position, 0, outcome.token_ids[:n], None, outcome.batch_size,
                       outcome.step_time_s, outcome.next_draft_tokens, plain_from=outcome.plain_from)
    rest = dataclasses.replace(outcome, start_position=outcome.start_position + n,
                               num_accepted=outcome.num_accepted - n, token_ids=outcome.token_ids[n:], split=0)
    return [first, rest]


@dataclass
class StepStats:
    num_seqs: int = 0
    num_tokens: int = 0
    num_prefill_tokens: int = 0  # prompt (or recomputed) tokens computed in this step
    num_prefix_hit_tokens: int = 0  # prompt tokens taken from the prefix cache at admission
    num_preempted: int = 0
    num_verifications: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    num_folded: int = 0  # verifications that folded an opening's block drafted ahead in (ScheduledSeq.folded)
    num_folds_held: int = 0  # of them, those whose guess of the first token held (answered as two verdicts)
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    forward_s: float = 0.0
    sample_s: float = 0.0
    host_s: float = 0.0  # of forward_s: building the batch on the host
    device_s: float | None = None  # on a GPU: the device's time for the forward and the verification
    static: bool = False  # the forward ran through the static buffers (replayed a graph with --cuda-graphs)
    tokens_by_stream: dict[int, int] = field(default_factory=dict)  # streams with work -> tokens scheduled
    chosen_draft_lengths: list[int] = field(default_factory=list)  # the next lengths chosen after this step
    predicted_goodput: float | None = None  # verified tokens/s the choice expects of the next step
    predicted_plain_goodput: float | None = None  # and what it expects of plain decoding over the same sequences
    # the gain of a choice that drafted which the plain margin (or hysteresis) turned to plain decoding, in expected
    # tokens a plain step per sequence it drafted for (goodput.Allocation.declined_gain; a probe may still draft
    # a token for a few); None: none was turned, or the trial's plain arm ran
    declined_gain: float | None = None
    # how the choice priced the verifier's wait: seconds no length changes, per token of the longest block, per
    # drafted token, where nothing is drafted (None: as the first), and per row of a draft's catch-up
    priced_wait: tuple[float, float, float, float | None, float] | None = None
    # the plain_from its verdicts carry, the lowest where their groups differ (None: none worked out, or none)
    plain_from: int | None = None
    speculation_arm: str | None = None  # the arm of the speculation trial the next choices follow

    @property
    def budget_fairness(self) -> float:
        """Jain's index of the tokens scheduled per stream with work: 1 when equal, 1/n when one took all."""
        shares = list(self.tokens_by_stream.values())
        total = sum(shares)
        return total * total / (len(shares) * sum(x * x for x in shares)) if total else 1.0

    @property
    def step_time_s(self) -> float:
        return self.forward_s + self.sample_s

    def record_verification(self, num_draft_tokens: int, num_accepted: int, num_positions: int | None = None) -> None:
        """num_positions: the positions the drafts decide (a tree's depth); default num_draft_tokens (a chain)."""
        self.num_verifications += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        count_positions(self.drafted_per_position, num_draft_tokens if num_positions is None else num_positions)
        count_positions(self.accepted_per_position, num_accepted)


@dataclass
class StepResult:
    outcomes: list[Outcome]
    stats: StepStats | None  # None when no forward pass ran


# -- a step, as the scheduler plans it and the model runner runs it ------------------------------------------

@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's part of a step: positions [start, end) are fed. A verification feeds the rest of the
    prefill, if any, then [last verified token, drafts]; a prefill chunk feeds verified tokens only."""

    seq: Sequence
    start: int
    end: int
    proposal: ProposeCmd | None  # None: a prefill chunk
    num_prefill_tokens: int  # verified tokens among those fed (the last one excepted in a verification)
    # copy-on-write (source, destination) blocks to apply before the forward; set once its blocks are reserved,
    # so only an item in the step carries copies
    block_copies: tuple[tuple[int, int], ...] = ()
    # the pipelined proposal this verification's block leads with (Scheduler._folded): `proposal` is the empty one
    # at the head of the queue with this one's guess and drafts after it; None: no fold
    folded: ProposeCmd | None = None

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def token_ids(self) -> list[int]:
        """The tokens fed: verified ones from `start`, then the drafts (no copy of the whole sequence)."""
        verified = self.seq.token_ids[self.start:self.end]
        if self.proposal is None:
            return verified
        return verified + list(self.proposal.draft_token_ids[:self.end - self.seq.num_tokens])


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)  # stale proposals dropped, sequences refused
    num_prefix_hit_tokens: int = 0
    num_preempted: int = 0
    tokens_by_stream: dict[int, int] = field(default_factory=dict)  # every stream with work, scheduled or not

    @property
    def verifications(self) -> list[ScheduledSeq]:
        return [s for s in self.scheduled if s.proposal is not None]

    @property
    def block_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write, before the forward: those of the scheduled items only, so a step that ends up empty
        has none left unapplied."""
        return [copy for s in self.scheduled for copy in s.block_copies]
