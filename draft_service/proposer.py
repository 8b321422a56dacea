"""Drafting: the draft model proposes k tokens per sequence, batched across this process's sequences, with
its own paged cache. The generation loop rolls a sequence back to its verified prefix (DraftSequence.roll_back)
before asking for its next block; drafting then feeds only the tokens past what is still cached.

Each draft token is sampled from q = the request's temperature/top-k/top-p applied to the draft logits,
further truncated to its `q_max_support` most probable tokens and renormalised; that truncated q is exactly
what is sent (sparse-q mode), so the verifier's rejection sampling stays lossless.

A coupled sequence picks argmax q / E with E the verifier's own noise at that position (TARGET_SAMPLE): the
draft token is then the target's sample whenever q and p agree closely enough, and a mismatch costs only
acceptance, never losslessness (the verifier decides every token alone).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import structlog
import torch

from common.aio import coalesce
from common.block_manager import BlockManager
from common.compute_thread import compute_thread
from common.errors import ErrorCode, ServiceError
from common.paged_model import ForwardBatch, PagedCausalLM
from common.sampling import SparseProbs
from common.static_forward import StaticForward
from draft_service.pipelining import ALTERNATIVES  # guesses kept per drafted position for pipelined branches
from draft_service.sequence import DraftSequence
from draft_service.types import DraftBlock
from kernels.philox import Purpose, exponential64_reference
from kernels.sampling_probs import compute_probs

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


@dataclass(frozen=True)
class Drafted:
    block: DraftBlock
    guess: int | None = None  # a guess_first job's guess; None: none (non-finite draft logits)


@dataclass(frozen=True)
class Prefilling:
    """A job whose context is still being fed to the draft, one chunk of --max-num-batched-tokens per batch, so a
    long prompt never holds up the other sequences' drafting for its whole prefill: the Proposer puts it in its
    next batch, and its future waits."""

    num_left: int  # tokens still to feed, the first drafting step's included


def _kv_full() -> ServiceError:
    return ServiceError(ErrorCode.RESOURCE_EXHAUSTED, "the draft service's KV cache is full (raise its "
                        "--kv-cache-memory)")


def _never_fits(num_tokens: int, capacity: int) -> ServiceError:
    return ServiceError(ErrorCode.RESOURCE_EXHAUSTED, f"a sequence of {num_tokens} tokens does not fit in the draft "
                        f"service's whole KV pool ({capacity} tokens; raise its --kv-cache-memory)")


KV_SHORT_LOG_INTERVAL_S = 10.0


class DraftModel:
    """Synchronous; runs in the proposer's worker thread."""

    def __init__(self, runner: PagedCausalLM, blocks: BlockManager, q_max_support: int,
                 static: StaticForward | None = None, on_static_step: Callable[[], None] | None = None,
                 max_num_batched_tokens: int | None = None) -> None:
        """static: one-token-per-sequence steps run through its static device buffers (and graphs).
        max_num_batched_tokens: the most tokens one forward feeds (a long prompt is fed in chunks); None: any."""
        self.runner = runner
        self.blocks = blocks
        self.q_max_support = q_max_support
        self.static = static
        self._on_static_step = on_static_step
        self.max_num_batched_tokens = max_num_batched_tokens
        self._kv_short_logged_at: float | None = None

    def release(self, *seqs: DraftSequence) -> None:
        for seq in seqs:
            self.blocks.free(seq)
            seq.cached_token_ids.clear()

    def adopt(self, seq: DraftSequence, branch: DraftSequence) -> None:
        """`seq` continues as `branch` (the pipelined guess that held): its cache blocks and cached tokens."""
        self.blocks.free(seq)
        if self.blocks.has(branch):
            self.blocks.rename(branch, seq)
        seq.adopt(branch)

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
        num_steps = [job.k + lead[i] for i, job in enumerate(jobs)]
        failed, short = self._reserve(jobs, num_steps)
        pending: list[list[int]] = [job.seq.context_ids[job.seq.num_cached:] for job in jobs]
        drafted: list[list[int]] = [[] for _ in jobs]
        alternatives: list[list[tuple[int, ...]]] = [[] for _ in jobs]
        qs: list[list[SparseProbs]] = [[] for _ in jobs]
        guesses: list[int | None] = [None for _ in jobs]
        stopped = [n == 0 or i in failed or i in short for i, n in enumerate(num_steps)]
        prefilling = self._prefill([job.seq for job in jobs], pending, stopped)
        for i in prefilling:
            stopped[i] = True
        for step in range(max(num_steps)):
            active = [i for i, n in enumerate(num_steps) if step < n and not stopped[i]]
            if not active:
                break
            logits = self._forward([(jobs[i].seq, pending[i]) for i in active])
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
        return [failed[i] if i in failed else Prefilling(len(pending[i])) if i in prefilling else
                Drafted(DraftBlock(tuple(d), None if job.seq.sampling.is_greedy else tuple(q), tuple(alt)), guess)
                for i, (job, d, q, alt, guess) in enumerate(zip(jobs, drafted, qs, alternatives, guesses,
                                                                strict=True))]

    def _reserve(self, jobs: list[DraftJob], num_steps: list[int]) -> tuple[dict[int, ServiceError], set[int]]:
        """Give each job, before its first step, the blocks of every position it may write (what it feeds now
        and its drafts but the last). Returns the jobs that fail (a pipelined branch the pool cannot hold now,
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
            if self.blocks.blocks_for(seq.num_context) > self.blocks.num_blocks:
                failed[i] = _never_fits(seq.num_context, self.blocks.capacity_tokens)
                continue
            copies = self.blocks.reserve(seq, seq.num_cached, seq.num_context + num_steps[i] - 1)
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

    def _forward(self, feeds: list[tuple[DraftSequence, list[int]]]) -> torch.Tensor:  # [num_seqs, vocab]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        for seq, tokens in feeds:
            start = seq.num_cached
            end = start + len(tokens)
            # a pipelined branch shares its parent's last, partly written block: copy it before writing
            copies = self.blocks.copy_on_write(seq, start, end) if self.blocks.has(seq) else []
            if copies:
                self.runner.kv_cache.copy_blocks(copies)
            if copies is None or not self.blocks.allocate(seq, end):
                raise ServiceError(ErrorCode.RESOURCE_EXHAUSTED, "the draft service's KV cache is full "
                                    "(raise its --kv-cache-memory)")
            input_ids.extend(tokens)
            positions.extend(range(start, end))
            slots.extend(self.blocks.slots(seq, start, end))
            query_start.append(query_start[-1] + len(tokens))
            seq.cached_token_ids.extend(tokens)
        batch = ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start=query_start,
            context_lens=[seq.num_cached for seq, _ in feeds],
            block_tables=[self.blocks.table(seq) for seq, _ in feeds],
            # one token per sequence (a drafting step): every row wanted, so None, and the step may run static
            logits_indices=None if len(input_ids) == len(feeds) else torch.tensor([e - 1 for e in query_start[1:]],
                                                                                  dtype=torch.int64),
        )
        if self.static is not None and self.static.eligible(batch):
            if self._on_static_step:
                self._on_static_step()
            return self.static.run(batch)[0]
        return self.runner.forward(batch)

    def support(self, seq: DraftSequence) -> int:
        """How many of the most probable tokens of q a sequence keeps: --q-max-support, or its own smaller limit."""
        own = seq.q_max_support
        return self.q_max_support if own is None else max(1, min(own, self.q_max_support))

    def _sample(self, logits: torch.Tensor, seqs: list[DraftSequence], positions: list[int], *,
                need_confidence: bool = False) -> list[tuple[int | None, SparseProbs | None, float, tuple[int, ...]]]:
        """(token, q it was sampled from or None for greedy, the draft's confidence: max of its distribution;
        1.0 unless need_confidence, which costs a softmax over the vocabulary per row, and the ALTERNATIVES most
        likely tokens other than the drafted one, best first). A row whose logits are not all finite gives
        (None, None, 0.0, ()): that sequence's block ends there, and the verifier, which decides every token, is
        not misled (a draft's numerics cannot change the output, only its speed)."""
        num_rows, vocab_size = logits.shape
        finite_t = torch.isfinite(logits).all(dim=1)
        confidence_t = (logits.float().softmax(dim=1).max(dim=1).values if need_confidence
                        else logits.new_ones(num_rows, dtype=torch.float32))
        # temperature and top-k/p keep the logits' order
        top_t = logits.topk(min(ALTERNATIVES + 1, vocab_size), dim=1).indices
        # NOTE: everything the host needs from this step leaves the device in one copy, as float64 (token ids and
        # float32 probabilities are exact in it): per row finite, confidence, argmax and the runners-up, then
        # the sampled rows' q, [num_sampled, q_max_support] probabilities and ids. One sync per drafting step.
        head = torch.cat([t.double() for t in (finite_t.unsqueeze(1), confidence_t.unsqueeze(1),
                                               logits.argmax(dim=1, keepdim=True), top_t)], dim=1)
        sampled = [i for i, s in enumerate(seqs) if not s.sampling.is_greedy]
        parts = [head.flatten()]
        if sampled:
            params = [seqs[i].sampling for i in sampled]
            device = logits.device
            rows = torch.tensor(sampled, device=device)
            # a non-finite row's q is never used; zeros keep its probabilities finite
            safe = torch.where(finite_t[rows].unsqueeze(1), logits[rows], 0.0)
            probs = compute_probs(safe, torch.tensor([p.temperature for p in params], device=device),
                                  torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
                                  torch.tensor([p.top_p for p in params], device=device))
            # NOTE: always the model's --q-max-support, whatever the batch: a row's kept tokens (ties at its cut
            # included) then never depend on the other rows; a sequence with a smaller limit keeps its first ones
            top_probs_t, top_ids_t = probs.topk(min(self.q_max_support, probs.shape[1]), dim=1)
            parts += [top_probs_t.double().flatten(), top_ids_t.double().flatten()]
        host = torch.cat(parts).cpu()
        head_h = host[:head.numel()].view(num_rows, -1)
        finite = head_h[:, 0].bool().tolist()
        confidence = head_h[:, 1].tolist()
        top = head_h[:, 3:].long().tolist()

        def other_than(token: int, row: int) -> tuple[int, ...]:
            return tuple(t for t in top[row] if t != token)[:ALTERNATIVES]

        out: list[tuple[int | None, SparseProbs | None, float, tuple[int, ...]]] = [
            (t, None, c, other_than(t, row))
            for row, (t, c) in enumerate(zip(head_h[:, 2].long().tolist(), confidence, strict=True))]
        for i, ok in enumerate(finite):
            if not ok:
                out[i] = (None, None, 0.0, ())
        if not sampled:
            return out
        tail = host[head.numel():]
        top_probs = tail[:tail.numel() // 2].view(len(sampled), -1)
        top_ids = tail[tail.numel() // 2:].view(len(sampled), -1).long()
        for row, i in enumerate(sampled):
            if not finite[i]:
                continue
            # the sequence's own limit (the verifier's for a q that is sent) cuts q before it is sampled from:
            # the token is drawn from exactly the truncated, renormalised q that travels
            row_probs = top_probs[row][:self.support(seqs[i])]
            keep = row_probs > 0
            q_ids = top_ids[row][:row_probs.numel()][keep]
            # NOTE: the wire carries float32. The draft samples from exactly the float32 values that travel: the
            # exponential race argmax q / E draws from q / sum(q) without normalising, and the verifier divides
            # the same values by their exactly rounded sum (math.fsum), so both sides hold the same q.
            q_sent = (row_probs[keep] / row_probs[keep].sum()).to(torch.float32).to(torch.float64)
            coupled = seqs[i].sampling.coupled
            noise = exponential64_reference(seqs[i].sampling.seed, positions[i],
                                            Purpose.TARGET_SAMPLE if coupled else Purpose.DRAFT_SAMPLE, q_ids)
            scores = q_sent / noise
            ranked = scores.topk(min(ALTERNATIVES + 1, scores.numel())).indices
            token = int(q_ids[ranked[0]])
            # coupled: at a mismatch the verifier emits argmax p / E, best guessed by the runners-up of q / E
            alternatives = (tuple(q_ids[ranked[1:]].tolist()) if coupled else other_than(token, i))
            out[i] = (token, SparseProbs(tuple(q_ids.tolist()), tuple(q_sent.tolist())), float(q_sent.max()),
                      alternatives)
        return out


class Proposer:
    """Batches concurrent draft requests: while one batch drafts, new requests queue for the next."""

    def __init__(self, model: DraftModel, executor: ThreadPoolExecutor | None = None) -> None:
        """executor: the one thread the model runs on; pass the one that loaded it (see common.compute_thread)."""
        self.model = model
        self._pending: list[tuple[DraftJob, asyncio.Future]] = []
        self._wakeup = asyncio.Event()
        self._executor = executor or compute_thread("draft-model")
        self._task: asyncio.Task | None = None
        self._last_batch_s = 0.0
        self._batches_started = 0
        self._batches_done = 0
        self._batch_waiters: list[tuple[int, asyncio.Future]] = []  # (batches done awaited, future)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="draft-proposer")

    async def wait_for_batch(self) -> None:
        """Until the batch that drafts now, or the one the jobs waiting will make, is done (at once when there
        is none, after the same short window the batches wait for a burst). A sequence that drafts nothing this
        round (the verifier chose k = 0 for it) then proposes together with the sequences of its burst that do
        draft, and the verifier verifies them in one step: proposed at once, its proposal would be verified alone
        and the others' after it, and the two groups would stay out of step (measured: 4 streams split into 2 + 2,
        and each step of 2 cost about what a step of 4 does on a CPU)."""
        if not self._pending and self._batches_started == self._batches_done:
            await coalesce(min(0.002, 0.02 * self._last_batch_s))
        target = self._batches_started + (1 if self._pending else 0)
        if target <= self._batches_done:
            return
        future = asyncio.get_running_loop().create_future()
        self._batch_waiters.append((target, future))
        await future

    def _batch_done(self) -> None:
        self._batches_done += 1
        waiting = []
        for target, future in self._batch_waiters:
            if target <= self._batches_done:
                if not future.done():
                    future.set_result(None)
            else:
                waiting.append((target, future))
        self._batch_waiters = waiting

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=True)

    async def draft(self, job: DraftJob) -> Drafted:
        future = asyncio.get_running_loop().create_future()
        self._pending.append((job, future))
        self._wakeup.set()
        return await future

    async def release(self, *seqs: DraftSequence) -> None:
        """One hop to the model's thread for all of them (a round's pipelined branches). It happens even when
        the caller is cancelled meanwhile (a client gone while its branches draft): the model's one thread runs
        it after any batch still drafting them, so nothing they hold is left behind."""
        if seqs:
            await asyncio.shield(asyncio.get_running_loop().run_in_executor(self._executor, self.model.release,
                                                                            *seqs))

    async def adopt(self, seq: DraftSequence, branch: DraftSequence) -> None:
        await asyncio.shield(asyncio.get_running_loop().run_in_executor(self._executor, self.model.adopt, seq,
                                                                        branch))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wakeup.wait()
            # NOTE: wait a moment so the other sequences whose verdicts arrived in the same burst ask too, and
            # draft in one batch instead of a batch of one followed by the rest. Fragmented batches also make
            # drafting overlap verification, which on a shared host makes both slower. The window is 2 % of the
            # last batch's time, at most 2 ms: nothing for tiny models, nothing against a 100 ms draft step.
            await coalesce(min(0.002, 0.02 * self._last_batch_s))
            self._wakeup.clear()
            jobs = [job for job in self._pending if not job[1].cancelled()]
            self._pending = []
            if not jobs:
                self._batches_started += 1
                self._batch_done()
                continue
            self._batches_started += 1
            t0 = time.perf_counter()
            try:
                results = await loop.run_in_executor(self._executor, self.model.draft, [j for j, _ in jobs])
                self._last_batch_s = time.perf_counter() - t0
            except Exception as err:  # noqa: BLE001 - every waiting request learns of it
                for _, f in jobs:
                    if not f.done():
                        f.set_exception(err)
                self._batch_done()
                continue
            carried = []
            for job, result in zip(jobs, results, strict=True):
                f = job[1]
                if f.done():
                    continue
                if isinstance(result, Prefilling):  # its next prefill chunk goes first in the next batch
                    carried.append(job)
                elif isinstance(result, ServiceError):  # that sequence's own failure (its KV can never fit)
                    f.set_exception(result)
                else:
                    f.set_result(dataclasses.replace(
                        result, block=dataclasses.replace(result.block, draft_seconds=self._last_batch_s)))
            self._batch_done()
            if carried:
                self._pending = carried + self._pending
                self._wakeup.set()
