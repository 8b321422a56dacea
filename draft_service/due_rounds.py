"""The sequences whose verdict has arrived but whose next round has not reached the draft model yet, and the
verdicts of a verifier step that are still on their way.

One verifier step answers many sequences at once, and each of them then drafts its next block. The verifier sends
the verdicts one message each; the draft reads each one after the event loop has run what the earlier ones woke
(their text, their client's stream), and each sequence's own work comes before its drafting job. At 64 streams on
2 cores one step's drafting jobs reached the batcher over about 10 ms (`bench/capacity.py --modes auto
--concurrency 64`, default pair, 2026-12-03), and a batch that started 2 ms after the first job (its window for a
burst) took a handful of them; the rest drafted in the next batch, one batch later (100 to 300 ms there), and the
verifier got the step's sequences back in two groups: two steps where one would do, each paying the step's fixed
cost (about a fifth of a 64-token step there), and two phases that stayed apart. So each verdict says how many
verdicts of its stream its step gave to sequences that go on (Verdict.step_verdicts), and a batch waits for all of
them to arrive and reach it (DraftBatcher), at most about one batch's time: the ones left out would wait that long
for the batch anyway."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

# a step's verdicts not all in after this long are not waited for any more (whatever a wait's own bound)
FORGET_S = 2.0
# a sequence a wait gave up on (its round did not start within the bound: a client that does not read its stream,
# say) is not waited for at its next this many verdicts
LATE_ROUNDS = 4


@dataclass
class _Burst:
    expected: int
    arrived: int
    first: float  # when its first verdict arrived


class DueRounds:
    """Sequence ids whose verdict has arrived (`arrived`, from the Verify stream's reader) and whose next round has
    not started (`left`, from the sequence's generation, before it drafts or proposes), and per verifier step the
    verdicts that have not arrived yet. A wait of bound B waits only for what arrived, or began arriving, less than
    B ago, and a sequence it gave up on is not waited for at its next LATE_ROUNDS verdicts: a client that stalls its
    own stream, or a verdict that never comes, holds the others' batches for at most B, once."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._due: dict[int, float] = {}  # seq id -> when its verdict arrived
        self._late: dict[int, int] = {}  # seq id -> verdicts of it still not waited for
        self._bursts: dict[Hashable, _Burst] = {}  # (verifier, stream, step) -> its verdicts that go on
        self._changed = asyncio.Event()

    def __len__(self) -> int:
        return len(self._due)

    def arrived(self, seq_id: int | None, step: Hashable | None = None, step_verdicts: int = 0) -> None:
        """A verdict whose sequence goes on: `seq_id` None when no round of this process waits for it (its sequence
        ended here meanwhile, or is busy drafting ahead); `step` (any key naming the verifier's stream and its step)
        and `step_verdicts` as the verdict states them (None and 0: not stated)."""
        now = self._clock()
        if seq_id is not None:
            if (late := self._late.get(seq_id)) is not None:
                if late <= 1:
                    del self._late[seq_id]
                else:
                    self._late[seq_id] = late - 1
            else:
                self._due[seq_id] = now
        if step is not None and step_verdicts > 1:
            burst = self._bursts.get(step)
            if burst is None:
                self._forget_old(now)
                burst = self._bursts[step] = _Burst(step_verdicts, 0, now)
            burst.arrived += 1
            if burst.arrived >= burst.expected:
                del self._bursts[step]
        self._changed.set()

    def left(self, seq_id: int) -> None:
        if self._due.pop(seq_id, None) is not None:
            self._changed.set()

    def forget(self, seq_id: int) -> None:
        """The sequence's generation ended."""
        self._late.pop(seq_id, None)
        self.left(seq_id)

    def waiting_for(self, max_wait_s: float) -> int:
        """How many verdicts a wait of bound `max_wait_s` waits for: arrived and not left, or not arrived yet."""
        now = self._clock()
        return (sum(1 for t in self._due.values() if now - t < max_wait_s)
                + sum(b.expected - b.arrived for b in self._bursts.values() if now - b.first < max_wait_s))

    def _next_expiry(self, now: float, max_wait_s: float) -> float | None:
        times = [t for t in self._due.values() if now - t < max_wait_s]
        times += [b.first for b in self._bursts.values() if now - b.first < max_wait_s]
        return min(times) + max_wait_s if times else None

    def _forget_old(self, now: float) -> None:
        for key in [key for key, b in self._bursts.items() if now - b.first >= FORGET_S]:
            del self._bursts[key]

    async def settled(self, max_wait_s: float) -> None:
        """Until nothing is waited for (see waiting_for), and at most `max_wait_s`; the sequences still due when
        the bound runs out are late (see the class)."""
        if max_wait_s <= 0:
            return
        deadline = self._clock() + max_wait_s
        while True:
            now = self._clock()
            expiry = self._next_expiry(now, max_wait_s)
            if expiry is None or now >= deadline:
                # still due past the bound: late (one that arrived within it is waited for by the next wait)
                for seq_id in [seq_id for seq_id, t in self._due.items() if now - t >= max_wait_s]:
                    del self._due[seq_id]
                    self._late[seq_id] = LATE_ROUNDS
                return
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), min(deadline, expiry) - now)
            except TimeoutError:
                pass
