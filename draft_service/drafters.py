"""Where a round's draft block comes from, chosen once per service: the draft model (batched across sequences by
the DraftBatcher) or prompt lookup (n-gram, no model)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from common.sampling import SamplingParams
from draft_service.batcher import DraftBatcher
from draft_service.draft_model import DraftJob
from draft_service.metrics import DraftMetrics
from draft_service.ngram import propose_ngram
from draft_service.sequence import DraftSequence
from draft_service.tree_calibration import IDENTITY, Calibration, TreeCalibration
from draft_service.tree_drafting import TreeShape
from draft_service.types import EMPTY_BLOCK, DraftBlock


class Drafter(Protocol):
    async def draft(self, seq: DraftSequence, k: int, *, may_defer: bool = False) -> DraftBlock:
        """Up to k draft tokens that continue seq's context: its verified tokens, then any assumed ones (its cache
        already rolled back). may_defer: the verifier chose k (--speculation auto), and none may be drafted this
        round when the draft has much of the context still to feed (draft_model.CATCH_UP_BUDGET_TOKENS)."""
        ...

    async def draft_after_guess(self, seq: DraftSequence, k: int, *, may_defer: bool = False
                                ) -> tuple[int, DraftBlock] | None:
        """Pipelining's full-acceptance branch: a guess of the token that follows seq's context (the verifier's
        bonus token), appended to seq's assumed tokens, then the block draft(seq, k) gives after it: exactly
        the block an unpipelined round drafts once the verifier has confirmed the guess. None: no guess (nor
        any, with may_defer, where its context is a catch-up past the batch's budget, as draft's)."""
        ...

    async def release(self, *seqs: DraftSequence) -> None:
        """Forget the sequences and free whatever they hold."""
        ...

    async def wait_for_batch(self) -> None:
        """Until the drafting batch now running (or about to) is done: a round of k = 0 then proposes with the
        sequences drafting beside it."""
        ...

    async def adopt(self, seq: DraftSequence, branch: DraftSequence) -> None:
        """seq continues as its pipelined branch, whose assumed tokens the verifier confirmed."""
        ...

    def warm(self, seq: DraftSequence) -> None:
        """While seq's round drafts nothing, prepare its next drafting round where there is idle time (its
        proposal is out; call settle() before seq changes again)."""
        ...

    def backlog(self, seq: DraftSequence) -> int:
        """What seq's next drafting round must feed before its first drafted token, as things stand (warming may
        feed some first; Proposal.draft_backlog_tokens)."""
        ...

    async def settle(self, seq: DraftSequence) -> None:
        """Ends warm(seq): nothing touches seq after this until it drafts."""
        ...

    def note_round(self, drafted: bool, running: int) -> None:
        """A round of a sequence that may draft drafted something (its block or a pipelined branch) or not, with
        `running` generations in all; whether to warm follows the recent rounds (DraftBatcher.note_round)."""
        ...

    def idle_again(self) -> None:
        """No generation runs any more."""
        ...

    def observe(self, seq: DraftSequence, block: DraftBlock, verified: tuple[int, ...]) -> None:
        """A verdict on seq's block: the tokens the verifier emitted for it (accepted, then corrected or bonus)."""
        ...


def calibration_kind(sampling: SamplingParams) -> str | None:
    """Which calibration table a sequence's trees learn from and read: greedy or coupled, whose output no tree
    changes; None for one-hot and sparse, whose sampled output depends on the tree (draft_service.tree_calibration)."""
    if sampling.is_greedy:
        return "greedy"
    return "coupled" if sampling.is_coupled else None


class ModelDrafter:
    """Drafts with the draft model; a block ends early when the draft's confidence in its next token falls below
    `min_confidence` (0 drafts all k). With `tree`, a round of k drafts a token tree of depth k instead of a chain
    (draft_service.tree_drafting), scaled down when k is below its depth."""

    def __init__(self, batcher: DraftBatcher, min_confidence: float = 0.0, tree: TreeShape | None = None,
                 trees_allowed: Callable[[], bool] = lambda: True, calibrate: bool = True,
                 metrics: DraftMetrics | None = None) -> None:
        """trees_allowed: whether the verifier now connected verifies such trees (a resume may land on one that
        does not); if not, rounds draft chains. calibrate: trees rank nodes by calibrated probabilities
        (draft_service.tree_calibration)."""
        self.batcher = batcher
        self.min_confidence = min_confidence
        self.tree = tree
        self.trees_allowed = trees_allowed
        self.calibrations: dict[str, TreeCalibration] | None = {} if calibrate and tree is not None else None
        self.metrics = metrics

    def _job(self, seq: DraftSequence, k: int, guess_first: bool = False, may_defer: bool = False) -> DraftJob:
        tree = self.tree.scaled(k) if self.tree is not None and k > 1 and self.trees_allowed() else None
        # a pipelined branch drafts the round after the one in flight: it knows every verdict but that round's, and
        # so does a round drafted after its verdict once that verdict is left out (draft_service.draw_acceptance)
        draws = seq.fork_from.draws.latest if seq.fork_from is not None else seq.draws.before_last
        return DraftJob(seq, k, self.min_confidence, guess_first=guess_first, tree=tree,
                        calibration=self._calibration(seq) if tree is not None else IDENTITY, draws=draws,
                        may_defer=may_defer)

    def _calibration(self, seq: DraftSequence) -> Calibration:
        table = self.calibrations.get(calibration_kind(seq.sampling)) if self.calibrations is not None else None
        return table.current if table is not None else IDENTITY

    def observe(self, seq: DraftSequence, block: DraftBlock, verified: tuple[int, ...]) -> None:
        if seq.sampling.sends_draft_probs:
            seq.draws.observe(block.parents, block.token_ids, verified)
        kind = calibration_kind(seq.sampling)
        if self.calibrations is None or kind is None or block.parents is None or block.node_probs is None:
            return
        table = self.calibrations.setdefault(kind, TreeCalibration())
        accepted, rejected = table.observe(block.parents, block.token_ids, block.node_ranks, block.node_probs, verified)
        if self.metrics is not None:
            self.metrics.tree_labels.labels(kind=kind, outcome="accepted").inc(accepted)
            self.metrics.tree_labels.labels(kind=kind, outcome="rejected").inc(rejected)

    async def draft(self, seq: DraftSequence, k: int, *, may_defer: bool = False) -> DraftBlock:
        if k == 0:
            return EMPTY_BLOCK
        return (await self.batcher.draft(self._job(seq, k, may_defer=may_defer))).block

    async def draft_after_guess(self, seq: DraftSequence, k: int, *, may_defer: bool = False
                                ) -> tuple[int, DraftBlock] | None:
        # one batch job: the guess is sampled from the logits the block's drafting starts from anyway
        drafted = await self.batcher.draft(self._job(seq, k, guess_first=True, may_defer=may_defer))
        if drafted.guess is None:
            return None
        seq.assumed_token_ids.append(drafted.guess)
        # k = 0 (the request's last token): the guess alone, and the empty block an unpipelined round sends
        return drafted.guess, drafted.block if k else EMPTY_BLOCK

    async def release(self, *seqs: DraftSequence) -> None:
        await self.batcher.release(*seqs)

    async def wait_for_batch(self) -> None:
        await self.batcher.wait_for_batch()

    async def adopt(self, seq: DraftSequence, branch: DraftSequence) -> None:
        await self.batcher.adopt(seq, branch)

    def warm(self, seq: DraftSequence) -> None:
        self.batcher.warm(seq)

    def backlog(self, seq: DraftSequence) -> int:
        return seq.num_unfed

    async def settle(self, seq: DraftSequence) -> None:
        await self.batcher.settle(seq)

    def note_round(self, drafted: bool, running: int) -> None:
        self.batcher.note_round(drafted, running)

    def idle_again(self) -> None:
        self.batcher.idle_again()


class NgramDrafter:
    """Prompt lookup: one-hot proposals, so sampled requests stay lossless without any q."""

    async def draft(self, seq: DraftSequence, k: int, *, may_defer: bool = False) -> DraftBlock:
        return DraftBlock(tuple(propose_ngram(seq.context_ids, k)), None)

    async def draft_after_guess(self, seq: DraftSequence, k: int, *, may_defer: bool = False
                                ) -> tuple[int, DraftBlock] | None:
        # the block is looked up again on the context that ends with the guess: the longest suffix that
        # includes it may match another earlier occurrence than the one the guess came from
        guess = propose_ngram(seq.context_ids, 1)
        if not guess:
            return None
        seq.assumed_token_ids.append(guess[0])
        return guess[0], await self.draft(seq, k)

    async def release(self, *seqs: DraftSequence) -> None:
        return None

    async def wait_for_batch(self) -> None:
        return None  # a lookup takes no time: proposals of one burst leave together anyway

    async def adopt(self, seq: DraftSequence, branch: DraftSequence) -> None:
        seq.adopt(branch)

    def warm(self, seq: DraftSequence) -> None:
        return None  # no model, no cache

    def backlog(self, seq: DraftSequence) -> int:
        return 0  # a lookup feeds nothing

    async def settle(self, seq: DraftSequence) -> None:
        return None

    def note_round(self, drafted: bool, running: int) -> None:
        return None  # nothing to warm

    def idle_again(self) -> None:
        return None

    def observe(self, seq: DraftSequence, block: DraftBlock, verified: tuple[int, ...]) -> None:
        return None  # lookups learn nothing
