"""The verifier engine: sequence state, scheduling, one batched forward pass per step, verdicts.

Runs in one worker thread. The asyncio side only submits commands (thread-safe) and reads step results, so
no lock guards the sequence state.
"""

from __future__ import annotations

import math
import queue
import time
from collections import deque
from dataclasses import dataclass, field

import structlog
import torch

from common.block_manager import BlockManager
from common.errors import ErrorCode, SpecwireError
from common.model_loading import LoadedModel
from common.paged_model import ForwardBatch, PagedCausalLM
from common.sampling import FinishReason, SamplingParams, count_positions, validate_token_ids
from verifier_service.types import (
    CloseCmd,
    CloseStreamCmd,
    Command,
    DroppedOut,
    ErrorOut,
    OpenCmd,
    Outcome,
    ProposeCmd,
    SeqKey,
    StepResult,
    StepStats,
    VerdictOut,
)
from verifier_service.verification import VerifyItem, verify_batch

log = structlog.get_logger(__name__)

# A proposal's q must sum to 1 within this (float32 on the wire).
_Q_SUM_TOLERANCE = 1e-3


@dataclass
class Sequence:
    key: SeqKey
    token_ids: list[int]  # verified: prompt + generated
    num_prompt_tokens: int
    sampling: SamplingParams
    num_cached: int = 0  # tokens whose K/V is in the cache (always < len(token_ids))
    proposals: deque[ProposeCmd] = field(default_factory=deque)
    running: bool = False  # admitted: holds KV blocks

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class _Work:
    seq: Sequence
    start: int  # first position fed in this step
    end: int  # one past the last position fed (drafts included)
    proposal: ProposeCmd | None


class VerifierEngine:
    def __init__(self, loaded: LoadedModel, runner: PagedCausalLM, block_manager: BlockManager, *,
                 max_draft_tokens: int, max_num_batched_tokens: int) -> None:
        self.loaded = loaded
        self.runner = runner
        self.blocks = block_manager
        self.max_draft_tokens = max_draft_tokens
        self.max_num_batched_tokens = max_num_batched_tokens
        self.vocab_size = loaded.vocab_size
        self.max_model_len = loaded.max_model_len
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self.sequences: dict[SeqKey, Sequence] = {}  # every open sequence
        self.running: dict[SeqKey, Sequence] = {}  # admitted, in admission order
        self.waiting: deque[Sequence] = deque()  # not admitted (new, or preempted), first come first served
        self.num_preemptions = 0

    # -- called from any thread -------------------------------------------------------------------------------

    def submit(self, command: Command) -> None:
        self._commands.put(command)

    def has_pending_commands(self) -> bool:
        return not self._commands.empty()

    # -- called from the engine thread ------------------------------------------------------------------------

    def step(self) -> StepResult:
        outcomes: list[Outcome] = []
        while not self._commands.empty():
            self._apply(self._commands.get_nowait(), outcomes)
        stats = StepStats()
        work = self._schedule(outcomes, stats)
        if not work:
            return StepResult(outcomes, None)
        stats.num_seqs = len(work)
        t0 = time.perf_counter()
        batch, items = self._build_batch(work)
        stats.num_tokens = batch.input_ids.numel()
        logits = self.runner.forward(batch)
        t1 = time.perf_counter()
        stats.forward_s = t1 - t0
        results = iter(verify_batch(logits, items) if items else [])
        stats.sample_s = time.perf_counter() - t1
        step_time = stats.forward_s + stats.sample_s
        for w in work:
            seq = w.seq
            if w.proposal is None:
                seq.num_cached = w.end
                stats.num_prefill_tokens += w.end - w.start
            else:
                stats.num_prefill_tokens += len(seq.token_ids) - 1 - w.start
                outcomes.append(self._finish_round(w, next(results), len(work), stats, step_time))
            if seq.key in self.running:  # only verified tokens are registered, never drafts
                self.blocks.commit(seq.key, seq.token_ids, seq.num_cached)
        return StepResult(outcomes, stats)

    def num_live_sequences(self) -> int:
        return len(self.sequences)

    def has_runnable_work(self) -> bool:
        return bool(self.waiting) or any(s.proposals or s.num_cached < len(s.token_ids) - 1
                                         for s in self.running.values())

    # -- commands ---------------------------------------------------------------------------------------------

    def _apply(self, cmd: Command, outcomes: list[Outcome]) -> None:
        try:
            if isinstance(cmd, OpenCmd):
                self._open(cmd)
            elif isinstance(cmd, ProposeCmd):
                self._propose(cmd)
            elif isinstance(cmd, CloseCmd):
                self._release(cmd.key)
            elif isinstance(cmd, CloseStreamCmd):
                for key in [k for k in self.sequences if k.stream_id == cmd.stream_id]:
                    self._release(key)
        except SpecwireError as err:
            key = cmd.key
            if key in self.sequences and err.code is not ErrorCode.ABORTED:
                self._release(key)
            outcomes.append(ErrorOut(key, err.code, err.message))

    def _open(self, cmd: OpenCmd) -> None:
        if cmd.key in self.sequences:
            raise SpecwireError(ErrorCode.ABORTED, f"sequence {cmd.key.seq_id} is already open on this stream")
        prompt = list(cmd.prompt_token_ids)
        validate_token_ids(prompt, self.vocab_size)
        if len(prompt) >= self.max_model_len:
            raise SpecwireError(ErrorCode.INVALID_ARGUMENT, f"prompt has {len(prompt)} tokens; the target's context "
                                f"length is {self.max_model_len} and one token must remain to generate")
        needed = len(prompt) + self.max_draft_tokens + 1
        if self.blocks.blocks_for(needed) > self.blocks.num_blocks:
            raise SpecwireError(ErrorCode.RESOURCE_EXHAUSTED, f"prompt of {len(prompt)} tokens plus a draft block "
                                f"needs {self.blocks.blocks_for(needed)} KV blocks; the verifier's pool has "
                                f"{self.blocks.num_blocks} (raise --kv-cache-memory or --num-blocks)")
        seq = Sequence(cmd.key, prompt, len(prompt), cmd.sampling)
        self.sequences[cmd.key] = seq
        self.waiting.append(seq)

    def _propose(self, cmd: ProposeCmd) -> None:
        seq = self.sequences.get(cmd.key)
        if seq is None:
            raise SpecwireError(ErrorCode.NOT_FOUND, f"unknown sequence {cmd.key.seq_id}: open it first (or it "
                                "has already finished)")
        k = len(cmd.draft_token_ids)
        if k > self.max_draft_tokens:
            raise SpecwireError(ErrorCode.INVALID_ARGUMENT, f"proposal has {k} draft tokens; this verifier "
                                f"accepts at most {self.max_draft_tokens} (GetInfo.max_draft_tokens)")
        if k:
            validate_token_ids(list(cmd.draft_token_ids), self.vocab_size, what="draft")
        if cmd.draft_q is not None:
            self._check_q(cmd)
        seq.proposals.append(cmd)

    def _check_q(self, cmd: ProposeCmd) -> None:
        if len(cmd.draft_q) != len(cmd.draft_token_ids):
            raise SpecwireError(ErrorCode.INVALID_ARGUMENT, f"proposal has {len(cmd.draft_token_ids)} draft tokens "
                                f"but {len(cmd.draft_q)} draft distributions")
        for j, (x, q) in enumerate(zip(cmd.draft_token_ids, cmd.draft_q, strict=True)):
            where = f"draft distribution {j}"
            if len(q.token_ids) != len(q.probs) or not q.token_ids:
                raise SpecwireError(ErrorCode.INVALID_ARGUMENT, f"{where}: token_ids and probs must be non-empty "
                                    "and of equal length")
            if len(set(q.token_ids)) != len(q.token_ids):
                raise SpecwireError(ErrorCode.INVALID_ARGUMENT, f"{where}: repeated token ids")
            validate_token_ids(list(q.token_ids), self.vocab_size, what=where)
            if any(not (p >= 0.0) or math.isinf(p) for p in q.probs):
                raise SpecwireError(ErrorCode.INVALID_ARGUMENT, f"{where}: probabilities must be finite and >= 0")
            if abs(sum(q.probs) - 1.0) > _Q_SUM_TOLERANCE:
                raise SpecwireError(ErrorCode.INVALID_ARGUMENT, f"{where}: probabilities sum to {sum(q.probs):.6f}, "
                                    "not 1")
            try:
                px = q.probs[q.token_ids.index(x)]
            except ValueError:
                px = 0.0
            if px <= 0.0:
                raise SpecwireError(ErrorCode.INVALID_ARGUMENT, f"{where}: the drafted token {x} has probability 0 "
                                    "under it, so it cannot be the distribution the draft sampled from")

    def _release(self, key: SeqKey) -> None:
        seq = self.sequences.pop(key, None)
        if seq is not None and not seq.running:
            self.waiting.remove(seq)
        self.running.pop(key, None)
        self.blocks.free(key)

    # -- scheduling -------------------------------------------------------------------------------------------

    def _schedule(self, outcomes: list[Outcome], stats: StepStats) -> list[_Work]:
        self._admit(stats)
        budget = self.max_num_batched_tokens
        work: list[_Work] = []
        for seq in list(self.running.values()):
            if not seq.running:  # preempted earlier in this loop
                continue
            while seq.proposals and seq.proposals[0].start_position != len(seq.token_ids):
                stale = seq.proposals.popleft()
                outcomes.append(DroppedOut(seq.key, stale.start_position, len(seq.token_ids)))
            if seq.proposals:
                proposal = seq.proposals[0]
                # never feed past the context length: drop the drafts that would not fit
                room = self.max_model_len - len(seq.token_ids)
                end = len(seq.token_ids) + min(len(proposal.draft_token_ids), room - 1)
                if end - seq.num_cached <= budget or not work:
                    if self._reserve(seq, seq.num_cached, end, work, outcomes, stats):
                        seq.proposals.popleft()
                        if end - len(seq.token_ids) < len(proposal.draft_token_ids):
                            proposal = _truncate(proposal, end - len(seq.token_ids))
                        work.append(_Work(seq, seq.num_cached, end, proposal))
                        budget -= end - seq.num_cached
                        continue
                    if not seq.running:
                        continue
            prefill_end = min(len(seq.token_ids) - 1, seq.num_cached + budget)
            if prefill_end > seq.num_cached and self._reserve(seq, seq.num_cached, prefill_end, work, outcomes, stats):
                work.append(_Work(seq, seq.num_cached, prefill_end, None))
                budget -= prefill_end - seq.num_cached
            if budget <= 0:
                break
        return work

    def _admit(self, stats: StepStats) -> None:
        """Admit waiting sequences in order while the pool has room for their tokens and one full draft block;
        their longest cached prefix comes from the prefix cache instead of being recomputed."""
        while self.waiting:
            seq = self.waiting[0]
            before = self.blocks.num_prefix_hit_tokens
            matched = self.blocks.match_prefix(seq.key, seq.token_ids, len(seq.token_ids) - 1)
            if not self.blocks.can_allocate(seq.key, len(seq.token_ids) + self.max_draft_tokens):
                self.blocks.free(seq.key)
                self.blocks.num_prefix_hit_tokens = before
                return
            self.waiting.popleft()
            seq.num_cached = matched
            seq.running = True
            self.running[seq.key] = seq
            stats.num_prefix_hit_tokens += matched

    def _reserve(self, seq: Sequence, start: int, end: int, work: list[_Work], outcomes: list[Outcome],
                 stats: StepStats) -> bool:
        """Blocks for positions [start, end) of `seq`, exclusively its own. When the pool is short, preempt the
        most recently admitted sequence that has no work in this step (it is recomputed later)."""
        while True:
            copies = self.blocks.copy_on_write(seq.key, start, end)
            if copies is not None and self.blocks.allocate(seq.key, end):
                self.runner.kv_cache.copy_blocks(copies)
                return True
            if copies:
                self.runner.kv_cache.copy_blocks(copies)
            busy = {w.seq.key for w in work}
            victims = [s for s in reversed(self.running.values()) if s.key not in busy]
            if not victims or victims[0] is seq and len(victims) == 1:
                if self.blocks.blocks_for(end) > self.blocks.num_blocks:
                    self._release(seq.key)
                    outcomes.append(ErrorOut(seq.key, ErrorCode.RESOURCE_EXHAUSTED, f"the sequence reached {end} "
                                             f"tokens, more than the verifier's KV pool holds "
                                             f"({self.blocks.capacity_tokens}); raise --kv-cache-memory"))
                return False
            victim = victims[0] if victims[0] is not seq else victims[1]
            self._preempt(victim)
            stats.num_preempted += 1

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq.key)
        del self.running[seq.key]
        seq.running = False
        seq.num_cached = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        log.info("preempted", seq_id=seq.key.seq_id, stream_id=seq.key.stream_id, tokens=len(seq.token_ids))

    def _build_batch(self, work: list[_Work]) -> tuple[ForwardBatch, list[VerifyItem]]:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        logits_rows: list[int] = []
        items: list[VerifyItem] = []
        for w in work:
            seq = w.seq
            drafts = list(w.proposal.draft_token_ids) if w.proposal else []
            tokens = (seq.token_ids + drafts)[w.start:w.end]
            input_ids.extend(tokens)
            positions.extend(range(w.start, w.end))
            slots.extend(self.blocks.slots(seq.key, w.start, w.end))
            query_start.append(query_start[-1] + len(tokens))
            if w.proposal is not None:
                logits_rows.extend(range(query_start[-1] - len(drafts) - 1, query_start[-1]))
                items.append(VerifyItem(seq.sampling, len(seq.token_ids), tuple(drafts), w.proposal.draft_q))
        batch = ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start=query_start,
            context_lens=[w.end for w in work],
            block_tables=[self.blocks.table(w.seq.key) for w in work],
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64),
        )
        return batch, items

    def _finish_round(self, w: _Work, tokens: list[int], batch_size: int, stats: StepStats,
                      step_time: float) -> VerdictOut:
        seq = w.seq
        start = len(seq.token_ids)
        k = len(w.proposal.draft_token_ids)
        num_accepted = len(tokens) - 1
        stats.num_verifications += 1
        stats.num_draft_tokens += k
        stats.num_accepted_tokens += num_accepted
        count_positions(stats.drafted_per_position, k)
        count_positions(stats.accepted_per_position, num_accepted)
        emitted: list[int] = []
        finish: FinishReason | None = None
        for t in tokens:
            emitted.append(t)
            seq.token_ids.append(t)
            if t in self.eos_token_ids and not seq.sampling.ignore_eos:
                finish = FinishReason.STOP
            elif seq.num_generated >= seq.sampling.max_tokens or len(seq.token_ids) >= self.max_model_len:
                finish = FinishReason.LENGTH
            if finish is not None:
                break
        stats.num_emitted_tokens += len(emitted)
        if finish is not None:
            self._release(seq.key)
        else:
            # the K/V of the accepted drafts stays; the slots past them are reused by the next block
            seq.num_cached = start + num_accepted
            self.blocks.truncate(seq.key, seq.num_cached)
        return VerdictOut(seq.key, start, min(num_accepted, len(emitted)), tuple(emitted), finish, batch_size,
                          step_time)


def _truncate(p: ProposeCmd, k: int) -> ProposeCmd:
    return ProposeCmd(p.key, p.start_position, p.draft_token_ids[:k], p.draft_q[:k] if p.draft_q else p.draft_q)
