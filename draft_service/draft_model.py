"""The draft model's steps: k tokens per sequence for a batch of this process's sequences, with its own paged
cache. The generation loop rolls a sequence back to its verified prefix (DraftSequence.roll_back) before asking
for its next block; drafting then feeds only the tokens past what is still cached. Each step's tokens are sampled
by draft_service.draft_sampling.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import structlog
import torch

from common.block_manager import BlockManager
from common.errors import ErrorCode, ServiceError
from common.paged_model import ForwardBatch, PagedCausalLM
from common.sampling import SparseProbs
from common.static_forward import StaticForward
from draft_service.draft_sampling import Sample, sample_drafts, support
from draft_service.draw_acceptance import DrawAcceptance
from draft_service.sequence import DraftSequence
from draft_service.tree_calibration import IDENTITY, Calibration
from draft_service.tree_drafting import NodeFeed, TreeGrowth, TreeShape, tree_rows
from draft_service.types import DraftBlock
from kernels.paged_attention import TreeMask

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class DraftJob:
    """One sequence's part of a drafting batch. A sequence stops drafting early when the draft's own probability
    of its next token (the max of its q) falls below min_confidence; a block's first token is always drafted."""

    seq: DraftSequence
    k: int
    min_confidence: float = 0.0
    # pipelining's full-acceptance branch: first a guess of the verifier's bonus token, then k tokens drafted
    # after it exactly as an unpipelined round drafts them once that token is verified (the block's own step
    # count for the confidence rule, the same positions for the random numbers)
    guess_first: bool = False
    tree: TreeShape | None = None  # a token tree of this shape instead of a chain of k (draft_service.tree_drafting)
    calibration: Calibration = IDENTITY  # how the tree scores the draft's probabilities (tree_calibration)
    draws: DrawAcceptance = DrawAcceptance()  # how a sparse tree scores its draws (draw_acceptance)
    # a round whose length the verifier chose (--speculation auto): it may draft nothing instead of a long catch-up
    # (see CATCH_UP_BUDGET_TOKENS), which the verifier then decodes as a plain round
    may_defer: bool = False


# a token list continues the sequence's cache; a NodeFeed feeds tree nodes at their slots past growth.first (they
# are not added to the sequence's cached tokens)
Feed = tuple[DraftSequence, "list[int] | tuple[TreeGrowth, NodeFeed]"]


@dataclass(frozen=True)
class Drafted:
    block: DraftBlock
    guess: int | None = None  # a guess_first job's guess; None: none (non-finite draft logits)
    deferred: bool = False  # drafted nothing: its catch-up did not fit the batch's (CATCH_UP_BUDGET_TOKENS)


@dataclass(frozen=True)
class Prefilling:
    """A job whose context is still being fed to the draft, one chunk of --max-num-batched-tokens per batch, so a
    long prompt never holds up the other sequences' drafting for its whole prefill: the batcher puts it in its
    next batch, and its future waits."""

    num_left: int  # tokens still to feed, the first drafting step's included


def _deferred(jobs: list[DraftJob], pending: list[list[int]], num_steps: list[int], fits: Callable[[int], bool]
              ) -> set[int]:
    """The deferrable jobs whose catch-up does not fit this batch's (see CATCH_UP_BUDGET_TOKENS). A job's catch-up
    is what it feeds before its first drafting step (all but the last of `pending`); the others' long catch-ups
    count first. A job whose context the pool can never hold (`fits`) is not deferred: its round fails."""
    catch_up = [len(p) - 1 if n and len(p) - 1 > CATCH_UP_FREE_TOKENS else 0
                for p, n in zip(pending, num_steps, strict=True)]
    left = CATCH_UP_BUDGET_TOKENS - sum(c for job, c in zip(jobs, catch_up, strict=True) if not job.may_defer)
    deferred = set()
    candidates = [i for i, job in enumerate(jobs) if job.may_defer and catch_up[i] and fits(job.seq.num_context)]
    for taken, i in enumerate(sorted(candidates, key=catch_up.__getitem__)):
        if taken < CATCH_UP_MIN_JOBS or catch_up[i] <= left:
            left -= catch_up[i]
        else:
            deferred.add(i)
    return deferred


def feeds_catch_up(jobs: list[DraftJob]) -> bool:
    """Whether a batch of these jobs would feed more than CATCH_UP_FREE_TOKENS of catch-up in all (before any
    deferral: the first CATCH_UP_MIN_JOBS are fed whatever their length)."""
    return sum(max(0, job.seq.num_context - job.seq.num_cached - 2) for job in jobs
               if job.seq is not None) > CATCH_UP_FREE_TOKENS


@dataclass(frozen=True)
class RowCounts:
    """The rows (token positions) one draft forward computed, by what they fed: the prompt's tokens; generated
    tokens the draft had not fed, past the last two (a catch-up: it drafted nothing for a while, or a tree's
    accepted path other than the one it kept in its cache is fed again); a round's usual
    feed (the last verified token, and the last draft before it where all were accepted); drafted tokens (a
    block's own drafts, a pipelined branch's assumed tokens, a tree's nodes). The cost of each kind is the
    draft's CPU (or GPU) time that kind took."""
    prompt: int = 0
    catch_up: int = 0
    round: int = 0
    draft: int = 0


ROUND_FEED_TOKENS = 2  # the verified tokens a usual round feeds at most (RowCounts.round)


def count_rows(feeds: list[Feed]) -> RowCounts:
    """RowCounts of one forward's feeds (positions from each sequence's cache, as _forward_rows writes them)."""
    prompt = catch_up = round_ = draft = 0
    for seq, feed in feeds:
        if isinstance(feed, tuple):  # a tree's nodes
            draft += len(feed[1].token_ids)
            continue
        start, end = seq.num_cached, seq.num_cached + len(feed)
        verified = seq.num_tokens
        prompt += max(0, min(end, seq.num_prompt_tokens) - start)
        tail = max(seq.num_prompt_tokens, verified - ROUND_FEED_TOKENS)  # a round's usual feed starts here
        catch_up += max(0, min(end, tail) - max(start, seq.num_prompt_tokens))
        round_ += max(0, min(end, verified) - max(start, tail))
        draft += max(0, end - max(start, verified))
    return RowCounts(prompt, catch_up, round_, draft)


def _kv_full() -> ServiceError:
    return ServiceError(ErrorCode.RESOURCE_EXHAUSTED, "the draft service's KV cache is full (raise its "
                        "--kv-cache-memory)")


def _never_fits(num_tokens: int, capacity: int) -> ServiceError:
    return ServiceError(ErrorCode.RESOURCE_EXHAUSTED, f"a sequence of {num_tokens} tokens does not fit in the draft "
                        f"service's whole KV pool ({capacity} tokens; raise its --kv-cache-memory)")


KV_SHORT_LOG_INTERVAL_S = 10.0
# A sequence the verifier asked to draft after rounds of plain decoding first feeds the draft every token it has
# not seen (the draft warms sequences only while its rounds draft, draft_service.batcher): a drafting batch takes
# the catch-ups of more than CATCH_UP_FREE_TOKENS tokens of its deferrable jobs, shortest first, the first
# CATCH_UP_MIN_JOBS whatever their length (the verifier's probes of a few sequences: deferred, a probe would learn
# nothing) and the others while all sum to at most CATCH_UP_BUDGET_TOKENS; the rest draft nothing this round and
# are warmed meanwhile. Without a bound a
# choice to draft for all 64 sequences at 64 streams (default pair, 2 cores) made the verifier wait 9.8 s while
# the draft fed each one's 30 or so tokens; warming every sequence instead, in case it drafts, cost the draft 35
# CPU seconds in a 73 s level in which the verifier chose drafts for 1 % of its rounds, on the cores the verifier
# shares.
CATCH_UP_FREE_TOKENS = 8
CATCH_UP_BUDGET_TOKENS = 64
CATCH_UP_MIN_JOBS = 4
# A batch that fed more than CATCH_UP_FREE_TOKENS of catch-up in all (past the one token a usual round may feed
# besides its last) says how many on its blocks (DraftBlock.catch_up_tokens): its time is mostly that feeding,
# and the verifier learns it as a round of that many rows more, not as a usual round, and not its wait (measured
# at 4 streams, default pair, 2 cores, commit cf8e9db: the first drafting round after the prompts, 4 sequences'
# 11 tokens each, kept the verifier 1.2 s against 0.75 to 0.9 s for the drafting rounds after it; priced as a
# usual round, drafting looked dear and the verifier chose plain rounds for the next 20 steps, where fixed k = 4
# was 1.30x plain decoding in the same run). Deferred and pool-short jobs' empty blocks carry it too: the step
# that verifies them waited for that batch as well.


class DraftModel:
    """Synchronous; runs on the batcher's one thread (draft_service.batcher)."""

    def __init__(self, runner: PagedCausalLM, blocks: BlockManager, q_max_support: int,
                 static: StaticForward | None = None, on_static_step: Callable[[], None] | None = None,
                 max_num_batched_tokens: int | None = None,
                 on_rows: Callable[[RowCounts, bool], None] | None = None) -> None:
        """static: one-token-per-sequence steps run through its static device buffers (and graphs).
        max_num_batched_tokens: the most tokens one forward feeds (a long prompt is fed in chunks); None: any.
        on_rows: called after each forward with the rows it computed by what they fed (count_rows) and whether it
        was a warming forward (warm) rather than a drafting one."""
        self.runner = runner
        self.blocks = blocks
        self.q_max_support = q_max_support
        self.static = static
        self._on_static_step = on_static_step
        self._on_rows = on_rows
        self.max_num_batched_tokens = max_num_batched_tokens
        self._kv_short_logged_at: float | None = None

    def release(self, *seqs: DraftSequence) -> None:
        for seq in seqs:
            self.blocks.free(seq)
            seq.cached_token_ids.clear()

    def _pool_holds(self, num_tokens: int) -> bool:
        """Whether the whole pool can hold a sequence of num_tokens tokens at all."""
        return self.blocks.blocks_for(num_tokens) <= self.blocks.num_blocks

    def adopt(self, seq: DraftSequence, branch: DraftSequence) -> None:
        """`seq` continues as `branch` (the pipelined guess that held): its cache blocks and cached tokens."""
        self.blocks.free(seq)
        held = self.blocks.has(branch)
        if held:
            self.blocks.rename(branch, seq)
        seq.adopt(branch)
        if not held:  # a branch that drafted nothing (its request's last token) never forked a block: none cached
            seq.cached_token_ids = []

    @torch.inference_mode()
    def draft(self, jobs: list[DraftJob]) -> list[Drafted | Prefilling | ServiceError]:
        """Each job's block; Prefilling for a job whose context is not all fed yet (at most one prefill chunk per
        call, see _prefill); an empty block for a sequence the pool cannot hold now (a round of k = 0: the
        verifier decodes one token alone, and the next round drafts again); RESOURCE_EXHAUSTED for a pipelined
        branch the pool cannot hold now, and for a sequence it can never hold. The other jobs draft on."""
        for job in jobs:
            seq = job.seq
            if seq.num_cached >= seq.num_context:
                raise ValueError("draft a sequence only after rolling it back to its context")
            # NOTE: the blocks of rolled-back positions are returned here, not in roll_back: the block manager
            # belongs to this worker thread. A new pipelined branch first shares its parent's blocks.
            if seq.fork_from is not None and not self.blocks.has(seq) and self.blocks.has(seq.fork_from):
                self.blocks.fork(seq.fork_from, seq)
            self.blocks.truncate(seq, seq.num_cached)
        lead = [int(job.guess_first) for job in jobs]  # steps before a job's block starts: its guess
        # a tree's forwards: its root, then each depth but the last
        num_steps = [(job.tree.depth if job.tree else job.k) + lead[i] for i, job in enumerate(jobs)]
        # cache indices written past the context: a chain's drafts but the last, a tree's fed nodes (TreeGrowth.feed)
        spans = [n - 1 if job.tree is None else lead[i] + job.tree.max_fed
                 for i, (job, n) in enumerate(zip(jobs, num_steps, strict=True))]
        pending: list[list[int]] = [job.seq.context_ids[job.seq.num_cached:] for job in jobs]
        deferred = _deferred(jobs, pending, num_steps, self._pool_holds)
        for i in deferred:
            num_steps[i] = 0  # nothing reserved, fed or drafted
        failed, short = self._reserve(jobs, num_steps, spans)
        growths: list[TreeGrowth | None] = [None] * len(jobs)
        drafted: list[list[int]] = [[] for _ in jobs]
        alternatives: list[list[tuple[int, ...]]] = [[] for _ in jobs]
        qs: list[list[SparseProbs]] = [[] for _ in jobs]
        guesses: list[int | None] = [None for _ in jobs]
        stopped = [n == 0 or i in failed or i in short for i, n in enumerate(num_steps)]
        to_feed = [len(p) for p in pending]
        prefilling = self._prefill([job.seq for job in jobs], pending, stopped)
        # the rows fed beyond a usual round's (its last token and one more): a drafting job's catch-up, and the
        # chunk a job still prefilling fed (it drafts nothing this time)
        catch_up = sum(to_feed[i] - len(pending[i]) if i in prefilling else max(0, to_feed[i] - 2)
                       for i, s in enumerate(stopped) if not s)
        catch_up = catch_up if catch_up > CATCH_UP_FREE_TOKENS else 0
        for i in prefilling:
            stopped[i] = True
        for step in range(max(num_steps)):
            active = [i for i, n in enumerate(num_steps) if step < n and not stopped[i]]
            if not active:
                break
            feeds: list[Feed] = [(jobs[i].seq, (growths[i], growths[i].feed()) if growths[i] else pending[i])
                                 for i in active]
            logits, rows = self._forward_rows(feeds)
            fed = active
            # a tree's root and depths: their rows give the next depth
            trees = [i for i in fed if jobs[i].tree is not None and step >= lead[i]]
            if trees:
                self._grow(jobs, growths, trees, logits, [rows[fed.index(i)] for i in trees], stopped)
            active = [i for i in fed if i not in trees]
            if not active:
                continue
            if trees:  # the others' rows: each feed's last
                logits = logits[[rows[fed.index(i)].stop - 1 for i in active]]
            # a guess_first job's block starts one position later: its positions are those an unpipelined
            # round uses after the guess is verified
            samples = self._sample(logits, [jobs[i].seq for i in active],
                                   [jobs[i].seq.num_context + step for i in active],
                                   need_confidence=any(jobs[i].min_confidence > 0 for i in active))
            for i, (token, q, confidence, alternative) in zip(active, samples, strict=True):
                block_step = step - lead[i]
                # None: non-finite draft logits
                if token is None or (block_step > 0 and confidence < jobs[i].min_confidence):
                    stopped[i] = True
                    continue
                pending[i] = [token]
                if block_step < 0:
                    guesses[i] = token
                    continue
                drafted[i].append(token)
                alternatives[i].append(alternative)
                if q is not None:
                    qs[i].append(q)
        moves: list[tuple[int, int]] = []
        blocks = [self._keep_best_path(g, moves) if g is not None else
                  DraftBlock(tuple(d), None if job.seq.sampling.is_greedy else tuple(q), tuple(alt))
                  for job, g, d, q, alt in zip(jobs, growths, drafted, qs, alternatives, strict=True)]
        if catch_up:
            blocks = [replace(block, catch_up_tokens=catch_up) for block in blocks]
        if moves:  # every tree's at once
            self.runner.kv_cache.copy_slots(moves)
        return [failed[i] if i in failed else Prefilling(len(pending[i])) if i in prefilling else
                Drafted(block, guess, deferred=i in deferred)
                for i, (block, guess) in enumerate(zip(blocks, guesses, strict=True))]

    def _grow(self, jobs: list[DraftJob], growths: list[TreeGrowth | None], trees: list[int], logits: torch.Tensor,
              rows: list[range], stopped: list[bool]) -> None:
        """The tree jobs' next depth, from their rows of this step (a root's one row, or a depth's rows)."""
        for i in trees:
            if growths[i] is None:  # its root row: the context (and a guess) is now cached
                seq = jobs[i].seq
                growths[i] = TreeGrowth(seq, jobs[i].tree, first=seq.num_cached, calibration=jobs[i].calibration,
                                        draws=jobs[i].draws)
        parents = [growths[i].fed or [-1] for i in trees]
        seqs = [jobs[i].seq for i, ps in zip(trees, parents, strict=True) for _ in ps]
        # the position each row's children decide: the tree's first one past its parents' depth
        positions = [growths[i].first + (0 if p < 0 else growths[i].nodes[p].depth + 1)
                     for i, ps in zip(trees, parents, strict=True) for p in ps]
        index = torch.tensor([r for span in rows for r in span], dtype=torch.int64, device=logits.device)
        branches = max(jobs[i].tree.branches for i in trees)
        choices = tree_rows(logits[index], seqs, positions, self.q_max_support, branches)
        at = 0
        for i, ps in zip(trees, parents, strict=True):
            if not growths[i].grow(choices[at:at + len(ps)]):
                stopped[i] = True
            at += len(ps)

    def _keep_best_path(self, growth: TreeGrowth, moves: list[tuple[int, int]]) -> DraftBlock:
        """The tree's block; its best path's fed nodes' K/V are to move (added to `moves`: source and destination
        slots) to the positions they hold if accepted, and become the sequence's cached drafts, as a chain's are
        (its next round rolls back to what was verified)."""
        block, path = growth.block()
        seq = growth.seq
        kept = [growth.nodes[n] for n in path if growth.nodes[n].slot >= 0]  # fed: a prefix of the path
        moves.extend((self.blocks.slots(seq, growth.first + node.slot, growth.first + node.slot + 1)[0],
                      self.blocks.slots(seq, growth.first + d, growth.first + d + 1)[0])
                     for d, node in enumerate(kept) if node.slot != d)
        seq.cached_token_ids.extend(node.token for node in kept)
        return block

    @torch.inference_mode()
    def warm(self, seqs: list[DraftSequence], max_tokens: int) -> list[bool]:
        """Feed each sequence's context but its last token into its cache, at most `max_tokens` in all in one
        forward (a prompt a k = 0 round left unfed, or the tokens verified since the last drafted block): the next
        round that drafts then starts at once. Its drafts are the same as without (the same tokens at the same
        positions; the last one is always fed by the drafting round, whose logits it samples). A sequence the
        pool cannot hold now is left as it is (its drafting round decides). Returns, per sequence, whether
        tokens are left to feed (False for one the pool could not hold)."""
        feeds: list[tuple[DraftSequence, list[int]]] = []
        stop: list[bool] = []
        room = max_tokens
        for seq in seqs:
            stop.append(True)
            if seq.num_cached >= seq.num_context or seq.fork_from is not None:
                continue  # not rolled back to its context (a block in flight), or a pipelined branch
            stop[-1] = False
            self.blocks.truncate(seq, seq.num_cached)
            n = min(seq.num_unfed, room)
            if n <= 0:
                continue
            # all of what is left at once, or none (pieces held by several sequences would leave none whole),
            # and never a context the whole pool cannot hold
            copies = None if self.blocks.blocks_for(seq.num_context) > self.blocks.num_blocks else \
                self.blocks.reserve(seq, seq.num_cached, seq.num_context - 1)
            if copies is None:
                stop[-1] = True  # the pool is short: its drafting round decides
                continue
            if copies:
                self.runner.kv_cache.copy_blocks(copies)
            feeds.append((seq, seq.context_ids[seq.num_cached:seq.num_cached + n]))
            room -= n
        if feeds:
            starts = [seq.num_cached for seq, _ in feeds]
            try:
                self._forward(feeds, warming=True)  # only its K/V is wanted
            except Exception:
                for (seq, _), start in zip(feeds, starts, strict=True):  # no cached token without its K/V
                    del seq.cached_token_ids[start:]
                    self.blocks.truncate(seq, start)
                raise
        # more to feed: fed in part, or not reached for lack of room in this forward (each call feeds the first
        # that has any, so warming ends)
        return [not s and seq.num_cached < seq.num_context - 1 for s, seq in zip(stop, seqs, strict=True)]

    def _reserve(self, jobs: list[DraftJob], num_steps: list[int],
                 spans: list[int]) -> tuple[dict[int, ServiceError], set[int]]:
        """Give each job, before its first step, the blocks of every position it may write (what it feeds now,
        then `spans` more: a chain's drafts but the last, a tree's nodes). Returns the jobs that fail (a pipelined branch the pool cannot hold now,
        any sequence whose context alone exceeds the whole pool) and the plain sequences the pool cannot hold
        now, which draft nothing this round (k = 0); nothing of either is written. Plain sequences are served
        first, then pipelined branches by their rank within their sequence (every sequence's first branch
        before anyone's second), so a short pool costs pipelining its least likely branches first and plain
        drafting last. A block an early stop leaves unused is returned at the sequence's next draft (its
        truncate).

        NOTE: plain first holds within a batch only: the branches of other sequences drafted in earlier batches
        keep their blocks until their verdicts, and a sequence that finds the pool short then falls back to a
        k = 0 round instead of failing its generation; the pool frees as those verdicts arrive."""
        ranks: dict[int, int] = {}
        order = []
        for i, job in enumerate(jobs):
            parent = job.seq.fork_from
            rank = -1 if parent is None else ranks.get(id(parent), 0)
            if parent is not None:
                ranks[id(parent)] = rank + 1
            order.append((rank, i))
        failed: dict[int, ServiceError] = {}
        short: set[int] = set()
        for _, i in sorted(order):
            seq = jobs[i].seq
            if num_steps[i] == 0:
                continue
            if not self._pool_holds(seq.num_context):
                failed[i] = _never_fits(seq.num_context, self.blocks.capacity_tokens)
                continue
            copies = self.blocks.reserve(seq, seq.num_cached, seq.num_context + spans[i])
            if copies is None:
                if seq.fork_from is None:
                    short.add(i)
                else:
                    failed[i] = _kv_full()
            elif copies:
                self.runner.kv_cache.copy_blocks(copies)
        if short:
            now = time.monotonic()
            if self._kv_short_logged_at is None or now - self._kv_short_logged_at >= KV_SHORT_LOG_INTERVAL_S:
                self._kv_short_logged_at = now
                log.warning("draft_kv_short", undrafted_sequences=len(short), free_blocks=self.blocks.num_free_blocks,
                            hint="these rounds decode with k = 0; raise --kv-cache-memory")
        return failed, short

    def _prefill(self, seqs: list[DraftSequence], pending: list[list[int]], skip: list[bool]) -> set[int]:
        """At most one forward of at most max_num_batched_tokens prompt tokens per call, so other sequences'
        drafting steps run between a long prompt's chunks. When the jobs' pending tokens do not all fit in the
        first drafting step, the jobs with one token to feed and those whose tokens fit what is left of the
        budget draft now; the others get one chunk of their leading tokens (in job order, each keeping at least
        its last token, whose logits are sampled) and draft now if what is left of them fits too. Returns the
        jobs that still have a prefill to go (Prefilling); `pending` is left holding what each job still feeds.
        The drafts are the same as from one long forward. A drafting step of more sequences than the budget
        still feeds one token each."""
        budget = self.max_num_batched_tokens
        live = [i for i, s in enumerate(skip) if not s]
        if budget is None or sum(len(pending[i]) for i in live) <= budget:
            return set()
        room = budget - sum(1 for i in live if len(pending[i]) == 1)  # of the first drafting step
        longer = []
        for i in live:
            n = len(pending[i])
            if n > 1 and n <= room:
                room -= n
            elif n > 1:
                longer.append(i)
        chunk: list[tuple[DraftSequence, list[int]]] = []
        chunk_room = budget
        for i in longer:
            n = min(len(pending[i]) - 1, chunk_room)
            if n > 0:
                chunk.append((seqs[i], pending[i][:n]))
                pending[i] = pending[i][n:]
                chunk_room -= n
            if chunk_room == 0:
                break
        if chunk:
            self._forward(chunk)  # only its K/V is wanted
        waiting = set()
        for i in longer:
            if len(pending[i]) <= room:
                room -= len(pending[i])
            else:
                waiting.add(i)
        return waiting

    def _forward(self, feeds: list[tuple[DraftSequence, list[int]]], warming: bool = False) -> torch.Tensor:
        """Token lists only: each feed's last row's logits (a row per feed)."""
        return self._forward_rows(feeds, warming)[0]

    def _forward_rows(self, feeds: list[Feed], warming: bool = False) -> tuple[torch.Tensor, list[range]]:
        """One forward over the feeds: a token list continues its sequence's cache (its last row's logits), a
        NodeFeed feeds a tree's depth (a row per node). Returns the logits and each feed's rows of them."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        context_lens: list[int] = []
        logit_rows: list[int] = []
        rows: list[range] = []
        cached: list[tuple[DraftSequence, list[int]]] = []  # added to the sequences' cached tokens once computed
        tree_starts: list[int] = []
        tree_masks: list[int] = []
        for seq, feed in feeds:
            if isinstance(feed, tuple):
                growth, nodes = feed
                start, end = growth.first + nodes.slots.start, growth.first + nodes.slots.stop
            else:
                start = seq.num_cached
                end = start + len(feed)
            # a pipelined branch shares its parent's last, partly written block: copy it before writing
            copies = self.blocks.copy_on_write(seq, start, end) if self.blocks.has(seq) else []
            if copies:
                self.runner.kv_cache.copy_blocks(copies)
            if copies is None or not self.blocks.allocate(seq, end):
                raise ServiceError(ErrorCode.RESOURCE_EXHAUSTED, "the draft service's KV cache is full "
                                    "(raise its --kv-cache-memory)")
            slots.extend(self.blocks.slots(seq, start, end))
            query_start.append(query_start[-1] + end - start)
            context_lens.append(end)
            if isinstance(feed, tuple):
                input_ids.extend(nodes.token_ids)
                positions.extend(growth.first + d for d in nodes.depths)
                tree_starts.append(growth.first)
                tree_masks.extend(nodes.masks)
                rows.append(range(len(logit_rows), len(logit_rows) + len(nodes.token_ids)))
                logit_rows.extend(range(query_start[-2], query_start[-1]))
            else:
                input_ids.extend(feed)
                positions.extend(range(start, end))
                cached.append((seq, feed))
                tree_starts.append(end)
                tree_masks.extend([-1] * len(feed))
                rows.append(range(len(logit_rows), len(logit_rows) + 1))
                logit_rows.append(query_start[-1] - 1)
        any_tree = any(isinstance(feed, tuple) for _, feed in feeds)
        batch = ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start=query_start,
            context_lens=context_lens,
            block_tables=[self.blocks.table(seq) for seq, _ in feeds],
            # one token per sequence (a drafting step): every row wanted, so None, and the step may run static
            logits_indices=None if len(logit_rows) == len(input_ids) else torch.tensor(logit_rows, dtype=torch.int64),
            tree=TreeMask(torch.tensor(tree_starts, dtype=torch.int32), torch.tensor(tree_masks, dtype=torch.int64),
                          torch.tensor(positions, dtype=torch.int64)) if any_tree else None,
        )
        if self.static is not None and self.static.eligible(batch):
            if self._on_static_step:
                self._on_static_step()
            logits = self.static.run(batch)[0]
        else:
            logits = self.runner.forward(batch)
        if self._on_rows:
            self._on_rows(count_rows(feeds), warming)
        for seq, tokens in cached:  # no cached token without its K/V, whatever failed before this
            seq.cached_token_ids.extend(tokens)
        return logits, rows

    def support(self, seq: DraftSequence) -> int:
        return support(seq, self.q_max_support)

    def _sample(self, logits: torch.Tensor, seqs: list[DraftSequence], positions: list[int], *,
                need_confidence: bool = False) -> list[Sample]:
        return sample_drafts(logits, seqs, positions, self.q_max_support, need_confidence=need_confidence)
