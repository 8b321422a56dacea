"""The verifier's scheduling policy: which sequences hold KV blocks, what each runs in the next step within the
token budget, whom to preempt when the pool is short, and what a verdict does to a sequence.

Plain Python over the block manager; the model runner does the tensors. Admission is first come, first served;
preemption takes the most recently admitted sequence with no work in the step, which is recomputed later.

The step's token budget is shared fairly between Verify streams (one per draft process): streams take turns,
the least recently served first, and so do the sequences within a stream. A draft running 16 sequences and one
running 1 each get a turn per step; admission order alone would let the 16 fill every step.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import replace

import structlog

from common.block_manager import BlockManager
from common.errors import ErrorCode
from common.sampling import FinishReason
from verifier_service.proposal_queue import drop_until_verifiable
from verifier_service.sequence import Sequence, SequenceStatus
from verifier_service.types import (
    ErrorOut,
    ProposeCmd,
    ScheduledSeq,
    SchedulerOutput,
    SeqKey,
    VerdictOut,
)

log = structlog.get_logger(__name__)


class Scheduler:
    def __init__(self, blocks: BlockManager, *, max_num_batched_tokens: int, max_draft_tokens: int,
                 max_model_len: int, eos_token_ids: frozenset[int],
                 on_release: Callable[[SeqKey], None] | None = None) -> None:
        # a verification is never split and never exceeds the budget, so the budget must hold the largest one
        # (VerifierConfig refuses this too), or a sequence would wait for it forever
        if max_num_batched_tokens < max_draft_tokens + 1:
            raise ValueError(f"max_num_batched_tokens {max_num_batched_tokens} cannot hold a verification block "
                             f"of max_draft_tokens + 1 = {max_draft_tokens + 1} tokens")
        self.blocks = blocks
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_draft_tokens = max_draft_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.sequences: dict[SeqKey, Sequence] = {}  # every open sequence
        self._per_stream: Counter[int] = Counter()  # open sequences per Verify stream
        self.running: dict[SeqKey, Sequence] = {}  # admitted, in admission order
        self.waiting: deque[Sequence] = deque()  # not admitted (new or preempted), first come first served
        self.num_waiting_tokens = 0  # tokens of the sequences in `waiting` (their count does not change there)
        self._num_prefix_hit_tokens = 0  # taken from the prefix cache by admissions since the last schedule()
        self.num_preemptions = 0
        self._num_steps = 0
        self._stream_last_served: dict[int, int] = {}  # stream id -> the step it last had a sequence scheduled
        self._on_release = on_release  # what else keeps per-sequence state forgets it here (goodput)

    # -- membership -------------------------------------------------------------------------------------------

    def sequences_on(self, stream_id: int) -> int:
        return self._per_stream[stream_id]

    def add(self, seq: Sequence) -> None:
        self.sequences[seq.key] = seq
        self._per_stream[seq.key.stream_id] += 1
        self.waiting.append(seq)
        self.num_waiting_tokens += seq.num_tokens

    def release(self, key: SeqKey) -> None:
        """Forget the sequence and return its blocks to the pool (verified blocks stay in the prefix cache)."""
        seq = self.sequences.pop(key, None)
        if seq is None:
            return
        self._per_stream[key.stream_id] -= 1
        if not self._per_stream[key.stream_id]:
            del self._per_stream[key.stream_id]
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            self.num_waiting_tokens -= seq.num_tokens
        else:
            del self.running[key]
        self.blocks.free(key)
        if self._on_release is not None:
            self._on_release(key)

    def has_work(self) -> bool:
        return bool(self.waiting) or any(seq.has_work for seq in self.running.values())

    # -- one step ---------------------------------------------------------------------------------------------

    def schedule(self, max_verifications: int | None = None) -> SchedulerOutput:
        """The step's work within the token budget; at most `max_verifications` proposals verified (None: no
        cap), the others served first next step. Prefill chunks are not capped."""
        out = SchedulerOutput()
        num_verifications = 0
        self.admit()
        out.num_prefix_hit_tokens, self._num_prefix_hit_tokens = self._num_prefix_hit_tokens, 0
        preemptions_before = self.num_preemptions
        budget = self.max_num_batched_tokens
        self._num_steps += 1
        order = self._service_order()
        # under a cap, a sequence whose proposal waits for the next step is no victim for preemption either
        deferred = {s.key for s in order if s.proposals} if max_verifications is not None else set()
        out.tokens_by_stream = dict.fromkeys(self._stream_last_served, 0)
        for seq in order:
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted for a sequence earlier in this step
                continue
            out.outcomes.extend(drop_until_verifiable(seq))
            capped = max_verifications is not None and num_verifications >= max_verifications
            if capped and not seq.needs_prefill:
                continue
            item = self._schedule_one(seq, budget, out, verify=not capped, spare=deferred)
            if item is not None:
                num_verifications += item.proposal is not None
                out.scheduled.append(item)
                budget -= item.num_tokens
                out.tokens_by_stream[seq.key.stream_id] += item.num_tokens
                seq.last_scheduled_step = self._stream_last_served[seq.key.stream_id] = self._num_steps
        out.num_preempted = self.num_preemptions - preemptions_before
        return out

    def _service_order(self) -> list[Sequence]:
        """Running sequences with work, in the order the budget serves them: round-robin over streams, the
        stream served least recently first; within a stream, its least recently served sequence first (ties in
        admission order)."""
        by_stream: dict[int, list[Sequence]] = {}
        for seq in sorted((s for s in self.running.values() if s.has_work), key=lambda s: s.last_scheduled_step):
            by_stream.setdefault(seq.key.stream_id, []).append(seq)
        self._stream_last_served = {sid: self._stream_last_served.get(sid, 0) for sid in by_stream}
        turns = sorted(by_stream.values(), key=lambda seqs: self._stream_last_served[seqs[0].key.stream_id])
        return [seqs[i] for i in range(max(map(len, turns), default=0)) for seqs in turns if i < len(seqs)]

    def postprocess(self, out: SchedulerOutput, sampled: list[list[int] | None],
                    step_time_s: float) -> list[VerdictOut | ErrorOut]:
        """Apply the step: prefill chunks are now cached; each verification's sampled tokens (accepted drafts,
        then the recovered or bonus token) extend its sequence, which then finishes or keeps going. A
        verification without tokens (non-finite target logits) ends its sequence with INTERNAL."""
        verdicts: list[VerdictOut | ErrorOut] = []
        batch_size = len(out.scheduled)
        sampled_iter = iter(sampled)
        for item in out.scheduled:
            seq = item.seq
            if item.proposal is None:
                seq.num_cached = item.end
            else:
                tokens = next(sampled_iter)
                if tokens is None:
                    self.release(seq.key)
                    verdicts.append(ErrorOut(seq.key, ErrorCode.INTERNAL, "the target model produced non-finite "
                                             f"logits at position {seq.num_tokens} (numerical overflow in its "
                                             "dtype?); this sequence was ended"))
                    continue
                verdicts.append(self._apply_verdict(item, tokens, batch_size, step_time_s))
            if seq.status is SequenceStatus.RUNNING:  # only verified tokens are registered, never drafts
                self.blocks.commit(seq.key, seq.token_ids, seq.num_cached)
        return verdicts

    # -- admission --------------------------------------------------------------------------------------------

    def admit(self) -> None:
        """Admit waiting sequences in order while the pool has room for their tokens and one full draft block.
        Their longest cached prefix comes from the prefix cache instead of being recomputed (those tokens are
        counted in the next schedule()'s output). schedule() calls it first; the engine also calls it when it
        opens a sequence, so that what --max-waiting-tokens counts is what still waits once admission was tried."""
        while self.waiting:
            seq = self.waiting[0]
            if not self.blocks.can_admit(seq.token_ids, seq.num_tokens - 1, seq.num_tokens + self.max_draft_tokens,
                                         cache_salt=seq.cache_salt):
                break
            self.waiting.popleft()
            self.num_waiting_tokens -= seq.num_tokens
            seq.num_cached = self.blocks.match_prefix(seq.key, seq.token_ids, seq.num_tokens - 1,
                                                      cache_salt=seq.cache_salt)
            seq.status = SequenceStatus.RUNNING
            self.running[seq.key] = seq
            self._num_prefix_hit_tokens += seq.num_cached

    # -- what a sequence runs ---------------------------------------------------------------------------------

    def _candidates(self, seq: Sequence, budget: int) -> list[ScheduledSeq]:
        """What `seq` could run in this step, best first: its next proposal's verification, with the rest of its
        prefill, when both fit the budget (first with the pipelined proposal after it, where it folds: _folded);
        then the next chunk of its prefill. So a proposal that arrives before
        the prefill is done (a small draft prefills faster) waits while the prefill goes on in chunks, and no
        step exceeds the budget, which is what the device's memory was profiled for. Once the prefill is done, a
        verification is at most max_draft_tokens + 1 <= max_num_batched_tokens tokens: it fits whenever it is
        first in a step, which fair turns make it within a few steps."""
        candidates = []
        if seq.proposals:
            head = seq.proposals[0]
            if (folded := _folded(seq)) is not None:
                fold = self._verification(seq, replace(
                    folded, start_position=head.start_position, assumed_token_ids=head.assumed_token_ids,
                    draft_token_ids=folded.assumed_token_ids + folded.draft_token_ids), budget, folded)
                if fold is not None and fold.proposal.num_draft_tokens:  # its guess at least is verified
                    candidates.append(fold)
            if (alone := self._verification(seq, head, budget)) is not None:
                candidates.append(alone)
        prefill_end = min(seq.num_tokens - 1, seq.num_cached + budget)
        if prefill_end > seq.num_cached:
            candidates.append(ScheduledSeq(seq, seq.num_cached, prefill_end, None,
                                           num_prefill_tokens=prefill_end - seq.num_cached))
        return candidates

    def _verification(self, seq: Sequence, proposal: ProposeCmd, budget: int,
                      folded: ProposeCmd | None = None) -> ScheduledSeq | None:
        """The verification of `proposal` (the head of the queue, or a fold: `folded`), with the rest of the
        prefill, or None where it does not fit the budget."""
        # never feed past the context length: drop the drafts that would not fit; nor, in a fold (the guess and a
        # block), more than a chain may hold (a tree's own nodes are bounded by its depth and --tree-nodes)
        room = self.max_model_len - seq.num_tokens
        proposal = proposal.truncated(room - 1 if folded is None else min(room - 1, self.max_draft_tokens))
        if seq.sampling.output_ignores_drafts:
            # nor verify drafts past what the sequence may still emit (a block of k yields up to k + 1
            # tokens): a fixed k's last rounds, a pipelined branch drafted before the room was known
            proposal = proposal.within_positions(seq.num_output_left - 1)
        end = seq.num_tokens + proposal.num_draft_tokens
        if end - seq.num_cached > budget:
            return None
        return ScheduledSeq(seq, seq.num_cached, end, proposal, num_prefill_tokens=seq.num_tokens - 1 - seq.num_cached,
                            folded=folded)

    def _schedule_one(self, seq: Sequence, budget: int, out: SchedulerOutput, *, verify: bool = True,
                      spare: set[SeqKey] = frozenset()) -> ScheduledSeq | None:
        """verify=False: only a prefill chunk (the step's verifications are capped). `spare`: sequences
        preempted only when no other sequence outside the step can be."""
        busy = {item.seq.key for item in out.scheduled}
        for item in self._candidates(seq, budget):
            if not verify and item.proposal is not None:
                continue
            copies = self._reserve(item, busy, spare)
            if copies is not None:
                if item.proposal is not None:
                    seq.proposals.popleft()
                return replace(item, block_copies=tuple(copies))
            if item.folded is None and self.blocks.blocks_for(item.end) > self.blocks.num_blocks:
                self.release(seq.key)
                out.outcomes.append(ErrorOut(
                    seq.key, ErrorCode.RESOURCE_EXHAUSTED, f"the sequence reached {item.end} tokens, more than "
                    f"the verifier's KV pool holds ({self.blocks.capacity_tokens}); raise --kv-cache-memory"))
                return None
        return None

    def _reserve(self, item: ScheduledSeq, busy: set[SeqKey],
                 spare: set[SeqKey] = frozenset()) -> list[tuple[int, int]] | None:
        """Blocks for positions [start, end) of the item's sequence, exclusively its own: the copy-on-write
        copies to apply before the forward, or None (nothing changed) when they cannot be had. While the pool
        is short, preempt the most recently admitted other sequence with no work in this step."""
        while True:
            copies = self.blocks.reserve(item.seq.key, item.start, item.end)
            if copies is not None or item.folded is not None:  # a fold takes free blocks only: it is optional
                return copies
            # a capped prefill chunk never evicts a proposal that waits for the next step
            victim = self._pick_victim(item.seq, busy | spare) or (
                self._pick_victim(item.seq, busy) if spare and item.proposal is not None else None)
            if victim is None:
                return None
            self._preempt(victim)

    def _pick_victim(self, seq: Sequence, busy: set[SeqKey]) -> Sequence | None:
        for other in reversed(self.running.values()):
            if other is not seq and other.key not in busy:
                return other
        return None

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq.key)
        del self.running[seq.key]
        seq.status = SequenceStatus.WAITING
        seq.num_cached = 0
        self.waiting.appendleft(seq)
        self.num_waiting_tokens += seq.num_tokens
        self.num_preemptions += 1
        log.info("preempted", seq_id=seq.key.seq_id, stream_id=seq.key.stream_id, tokens=seq.num_tokens)

    # -- verdicts ---------------------------------------------------------------------------------------------

    def _apply_verdict(self, item: ScheduledSeq, tokens: list[int], batch_size: int,
                       step_time_s: float) -> VerdictOut:
        seq = item.seq
        start = seq.num_tokens
        num_accepted = len(tokens) - 1
        split = 0
        emitted: list[int] = []
        finish: FinishReason | None = None
        for t in tokens:
            emitted.append(t)
            seq.token_ids.append(t)
            finish = self._finish_reason(seq, t)
            if finish is not None:
                break
        if finish is not None:
            # what this step verified stays in the prefix cache too (a request of one token, or one that ends on
            # accepted drafts, registered nothing of its last step): the K/V of the prompt and of every accepted
            # draft up to the finishing token is written; a recovered or bonus token has none
            self.blocks.commit(seq.key, seq.token_ids, start + min(num_accepted, len(emitted)))
            self.release(seq.key)
        else:
            # the K/V of the accepted drafts stays; the slots past them are reused by the next block
            seq.num_cached = start + num_accepted
            self.blocks.truncate(seq.key, seq.num_cached)
        accepted = min(num_accepted, len(emitted))
        if item.folded is not None:
            if len(emitted) > 1:  # its guess held and the sequence went on: the folded proposal is answered too
                split = 1
                if seq.proposals and seq.proposals[0] is item.folded:
                    seq.proposals.popleft()
            else:  # the empty proposal's verdict alone (a missed guess: the folded one is dropped as stale)
                accepted = 0
        return VerdictOut(seq.key, start, accepted, tuple(emitted), finish, batch_size, step_time_s, split=split)

    def _finish_reason(self, seq: Sequence, last_token: int) -> FinishReason | None:
        if last_token in self.eos_token_ids and not seq.sampling.ignore_eos:
            return FinishReason.STOP
        if seq.num_generated >= seq.sampling.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None


def _folded(seq: Sequence) -> ProposeCmd | None:
    """The pipelined proposal second in `seq`'s queue that its head's verification can take along (a fold), or
    None. A draft under --speculation auto with no other generation on its process opens a sequence with an empty
    block (beside others its opening drafts first and proposes the prompt with its block, which needs no fold:
    draft_service.adaptive.RoundLength.opens_ahead), so that the prompt's step samples
    the first token at once, and drafts the next block beside that step, after a guess of that token (one assumed
    token; draft_service.adaptive.RoundLength): under load the prompt's step waits for a step before it, and that
    block can be in before it starts (where the draft is fast against the verifier's steps: see below). The step then verifies the guess and the block after the prompt, as one
    block of drafts: a missed guess is a rejected first draft, whose correction is the first token that the
    empty block alone would have given. Only where no draft can change a token (greedy, coupled: the target's
    own token at each position, whatever the blocks and wherever rounds start), so the output is the same. A
    chain without q only (a tree or a sparse block is verified on its own), one token assumed right after the
    empty head. Measured before it, at 16 streams of the agreeing pair: each request took one round more than
    when the first block went with the prompt. With it (bench/capacity.py, 2 cores, docs/benchmarks.md): two
    runs of the agreeing pair at 8 and 16 streams folded 13 openings in 65 steps and 3 in 61; the default pair
    none in a sweep from 1 to 64 streams (there the draft's prompt and block ahead, where it drafted any, came
    after the prompt's step had started)."""
    if len(seq.proposals) < 2 or not seq.sampling.output_ignores_drafts:
        return None
    head, folded = seq.proposals[0], seq.proposals[1]
    if (head.num_draft_tokens or len(folded.assumed_token_ids) != 1
            or folded.start_position != head.start_position + 1
            or folded.draft_parents is not None or folded.draft_probs is not None):
        return None
    return folded
