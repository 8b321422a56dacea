"""Batching of the draft model's steps across this process's sequences: while one batch drafts on the model's one
thread, new requests queue for the next."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import structlog

from common.aio import coalesce
from common.compute_thread import compute_thread
from common.errors import ServiceError
from draft_service.draft_model import Drafted, DraftJob, DraftModel, Prefilling, feeds_catch_up
from draft_service.due_rounds import DueRounds
from draft_service.sequence import DraftSequence

log = structlog.get_logger(__name__)


# tokens one warming forward feeds at most: the model's thread is busy that long when a drafting batch arrives. A
# forward's time grows with the sequences it feeds: 64 sequences' one new token each took 400 ms on 2 cores (64
# streams, default pair), and a verdict that found such a forward running waited for the rest of it
WARM_CHUNK_TOKENS = 16
# a sequence is warmed once this many of its tokens wait to be fed: a forward's cost hardly grows with its tokens
# at a few rows, and on a host it shares with the verifier each one slows the verifier's step (measured through
# guidellm at one stream, default pair, 2 cores: plain steps of 230 to 290 ms beside a warming forward every
# round, against about 185 ms without)
WARM_MIN_TOKENS = 8
# but not while fewer than this share of the recent rounds drafted (note_round: an average over the rounds of all
# this model's sequences, over about DRAFTING_WINDOW_ROUNDS rounds, or 4 a sequence where more run): the verifier
# then decodes plainly and drafts to probe a few sequences, and warming mostly slows it. Through guidellm at 16
# streams (default pair, 2 cores, random prompts, drafts accepted 16 to 40 %) the verifier drafted in about 6 % of
# the rounds, and its plain steps took 14 % longer and their sampling 20 % longer than k = 0 requests' (which never
# warm), the draft's warming forwards (16 sequences' 64-token prompts, then 8 tokens each) beside them on the same
# cores; warming once 32 tokens waited still cost the draft 35 CPU seconds in a 73 s level at 64 streams (default
# pair, 2 cores) that drafted in 1 % of the rounds. A drafting round's catch-up stays bounded without it: a batch
# defers the long ones (draft_model.CATCH_UP_BUDGET_TOKENS), and a deferred sequence is warmed whatever the share.
# With no generation running the share starts over at 1 (idle_again): the next burst arrives on a verifier that is
# not busy, where drafting pays and prompts are worth warming.
WARM_MIN_DRAFTING = 0.1
DRAFTING_WINDOW_ROUNDS = 50
# the longest a batch waits for the sequences whose verdicts are in (DueRounds), whatever the last batch took
MAX_DUE_WAIT_S = 1.0


class DraftBatcher:
    """Batches concurrent draft requests: while one batch drafts, new requests queue for the next.

    While no drafting is waiting, the model's thread warms the sequences whose rounds draft nothing (k = 0: a
    new sequence's first round, or the verifier's choice under load) once WARM_MIN_TOKENS of their tokens wait
    (none while fewer than WARM_MIN_DRAFTING of the recent rounds drafted: under plain decoding warming mostly
    slows the verifier; but always a sequence whose drafting was deferred for its catch-up, at once):
    it feeds their context, in forwards of at most WARM_CHUNK_TOKENS, so the round that drafts again starts at
    once (or after a forward of fewer than WARM_MIN_TOKENS). Measured at 64 streams on 2
    cores before this: the draft prefilled 64 prompts only when the verifier first asked them to draft, 3 to 9 s in
    which the verifier waited. A sequence is warmed only between its proposal and its verdict: settle() before
    the sequence changes again ends its warming (waiting at most for the forward running).

    With `due` (draft_service.due_rounds), a batch and a round that drafts nothing (wait_for_batch) first wait for
    the sequences whose verdicts are in and whose rounds have not started, at most the last batch's time: the
    sequences one verifier step answered then draft in one batch and come back to the verifier together."""

    def __init__(self, model: DraftModel, executor: ThreadPoolExecutor | None = None,
                 due: DueRounds | None = None) -> None:
        """executor: the one thread the model runs on; pass the one that loaded it (see common.compute_thread)."""
        self.model = model
        self.due = due
        self._due_wait: asyncio.Future | None = None  # the one wait for `due` that every caller shares
        self._pending: list[tuple[DraftJob, asyncio.Future]] = []
        self._wakeup = asyncio.Event()
        self._executor = executor or compute_thread("draft-model")
        self._task: asyncio.Task | None = None
        self._last_batch_s = 0.0
        self._batches_started = 0
        self._batches_done = 0
        self._catching_up = False  # the batch drafting now feeds a catch-up first (wait_for_batch does not wait)
        self._batch_waiters: list[tuple[int, asyncio.Future]] = []  # (batches done awaited, future)
        self._warm: dict[DraftSequence, None] = {}  # the sequences to warm, in order (compared by identity)
        self._warming: asyncio.Future | None = None  # done when the warming forward running now is
        self._warming_seqs: set[DraftSequence] = set()  # the ones it feeds
        self._deferred: set[DraftSequence] = set()  # drafted nothing for their catch-up: warmed whatever the share
        self.drafting_share = 1.0  # of the recent rounds (note_round), those that drafted

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="draft-batcher")

    async def wait_for_batch(self) -> None:
        """Until the batch that drafts now, or the one the jobs waiting will make, is done (at once when there
        is none, after the same short window the batches wait for a burst, and, with `due`, once the other
        sequences of its verifier step have started their rounds: their jobs may make one). A sequence that drafts nothing this
        round (the verifier chose k = 0 for it) then proposes together with the sequences of its burst that do
        draft, and the verifier verifies them in one step: proposed at once, its proposal would be verified alone
        and the others' after it, and the two groups would stay out of step (measured: 4 streams split into 2 + 2,
        and each step of 2 cost about what a step of 4 does on a CPU). Not for a batch that feeds a catch-up
        first (the verifier's probe of a few sequences after plain rounds): that takes a second or more, in which
        the verifier can step the plain sequences several times (measured at 8 streams, default pair, 2 cores: a
        probe of 4 sequences held all 8 for 0.8 to 1.5 s against 0.3 s for a plain step)."""
        if not self._pending and self._batches_started == self._batches_done:
            await coalesce(min(0.002, 0.02 * self._last_batch_s))
        await self._await_due()
        if self._catching_up:
            return
        pending = [job for job, f in self._pending if not f.cancelled()]
        target = self._batches_started + (1 if self._pending else 0)
        if pending and feeds_catch_up(pending):
            target = self._batches_started  # the batch drafting now, if any, not the catch-up to come
        if target <= self._batches_done:
            return
        future = asyncio.get_running_loop().create_future()
        self._batch_waiters.append((target, future))
        await future

    def _due_wait_s(self) -> float:
        return min(MAX_DUE_WAIT_S, self._last_batch_s)

    async def _await_due(self) -> None:
        """Until `due` has settled (at most the last batch's time). One wait, shared: under plain decoding every
        sequence of a step waits here, and a wait each would wake all of them at every verdict."""
        bound = self._due_wait_s()
        if self.due is None or not self.due.waiting_for(bound):
            return
        if self._due_wait is None or self._due_wait.done():
            self._due_wait = asyncio.ensure_future(self.due.settled(bound))
        await asyncio.shield(self._due_wait)

    def _batch_done(self) -> None:
        self._batches_done += 1
        self._catching_up = False
        self._release_waiters(self._batches_done)

    def _release_waiters(self, upto: int) -> None:
        """Frees those waiting for a batch numbered at most `upto` (wait_for_batch)."""
        waiting = []
        for target, future in self._batch_waiters:
            if target <= upto:
                if not future.done():
                    future.set_result(None)
            else:
                waiting.append((target, future))
        self._batch_waiters = waiting

    async def stop(self) -> None:
        tasks = [t for t in (self._task, self._due_wait) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._executor.shutdown(wait=True)

    def warm(self, seq: DraftSequence) -> None:
        """Warm `seq` while the model's thread has nothing to draft (see the class), once WARM_MIN_TOKENS of its
        tokens wait to be fed (not while the recent rounds hardly draft, unless its drafting was deferred); call
        settle() before the sequence changes again."""
        if seq in self._deferred:
            least = 1
        elif self.drafting_share >= WARM_MIN_DRAFTING:
            least = WARM_MIN_TOKENS
        else:
            return
        if seq.fork_from is None and seq.num_unfed >= least:
            self._warm[seq] = None
            self._wakeup.set()

    async def settle(self, seq: DraftSequence) -> None:
        """Ends `seq`'s warming: after this the model's thread does not touch it until it is asked to draft."""
        self._warm.pop(seq, None)
        while self._warming is not None and seq in self._warming_seqs:
            await asyncio.shield(self._warming)

    def note_round(self, drafted: bool, running: int) -> None:
        """One sequence's round (of a request that may draft) drafted something or not, with `running`
        generations in all: the recent share of drafting rounds, which warming needs (WARM_MIN_DRAFTING)."""
        rate = 1.0 / max(DRAFTING_WINDOW_ROUNDS, 4 * running)
        self.drafting_share += rate * ((1.0 if drafted else 0.0) - self.drafting_share)

    def idle_again(self) -> None:
        """No generation runs: the next ones start as on a fresh service (see WARM_MIN_DRAFTING)."""
        self.drafting_share = 1.0

    async def draft(self, job: DraftJob) -> Drafted:
        future = asyncio.get_running_loop().create_future()
        self._pending.append((job, future))
        self._wakeup.set()
        return await future

    async def release(self, *seqs: DraftSequence) -> None:
        """One hop to the model's thread for all of them (a round's pipelined branches). It happens even when
        the caller is cancelled meanwhile (a client gone while its branches draft): the model's one thread runs
        it after any batch still drafting them, so nothing they hold is left behind."""
        for seq in seqs:
            self._warm.pop(seq, None)
            self._deferred.discard(seq)
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
            if self._pending:
                await self._await_due()
            self._wakeup.clear()
            jobs = [job for job in self._pending if not job[1].cancelled()]
            self._pending = []
            if not jobs:
                self._batches_started += 1  # an empty batch: frees those waiting for it (wait_for_batch)
                self._batch_done()
                if self._warm:
                    await self._warm_once(loop)
                continue
            self._batches_started += 1
            t0 = time.perf_counter()
            try:
                # a round of k = 0 that waits for this batch proposes now (wait_for_batch)
                self._catching_up = feeds_catch_up([j for j, _ in jobs])
                if self._catching_up:
                    self._release_waiters(self._batches_started)
                results = await loop.run_in_executor(self._executor, self.model.draft, [j for j, _ in jobs])
                batch_s = time.perf_counter() - t0
                # a batch that fed a catch-up says little of the next one's time (coalesce, _await_due)
                if not any(isinstance(r, Drafted) and r.block.catch_up_tokens for r in results):
                    self._last_batch_s = batch_s
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
                    if result.deferred:
                        self._deferred.add(job[0].seq)
                    else:  # caught up
                        self._deferred.discard(job[0].seq)
                    f.set_result(dataclasses.replace(
                        result, block=dataclasses.replace(result.block, draft_seconds=batch_s)))
            self._batch_done()
            if carried:
                self._pending = carried + self._pending
                self._wakeup.set()
            if self._warm:
                self._wakeup.set()

    async def _warm_once(self, loop: asyncio.AbstractEventLoop) -> None:
        """One warming forward over the sequences waiting for it (the model's thread is otherwise idle)."""
        seqs = list(self._warm)
        self._warming_seqs = set(seqs)
        self._warming = loop.create_future()
        try:
            chunk = min(WARM_CHUNK_TOKENS, self.model.max_num_batched_tokens or WARM_CHUNK_TOKENS)
            left = await loop.run_in_executor(self._executor, self.model.warm, seqs, chunk)
        except Exception:  # noqa: BLE001 - warming is an optimisation: the drafting round does what it did not
            log.exception("draft_warm_failed", sequences=len(seqs))
            left = [False] * len(seqs)
        finally:
            self._warming.set_result(None)
            self._warming, self._warming_seqs = None, set()
        for seq, more in zip(seqs, left, strict=True):
            if not more:
                self._warm.pop(seq, None)
                self._deferred.discard(seq)
        if self._warm or self._pending:
            self._wakeup.set()
