"""When to start a verification step: phases of the sequences the verifier answers.

A sequence alternates between the verifier (its proposal is verified in a step) and its draft (the verdict
travels back, the draft drafts the next block, the proposal travels here). Sequences answered by the same step
come back at about the same time and form a phase. How many phases there should be follows from two times: the
verifier's step t(n) for n tokens (goodput.StepTimeModel, learned from its own steps here) and the draft's
turnaround d, from a verdict to the same sequence's next proposal (a moving average per Verify stream), of
which c is the draft model's own compute (Proposal.draft_seconds; the rest is the network and waits). For
sequences feeding N tokens in all, one round of every sequence takes

    one phase:   T1 = t(N) + d                                   (the verifier waits while all of them draft)
    two phases:  T2 = max(2 t(N/2), d + t(N/2), 2 c)             (one half verified while the other drafts)

Two phases cost a step's fixed part once more and hide the draft's time behind the other half's step; they win
when the verifier would otherwise wait for its drafts longer than a step's fixed cost, and the draft is not the
slower side (a CPU draft beside a GPU verifier: 2 c > T1). PhasePlanner picks the shorter (two only when at
least `margin` shorter) and enforces it before each step:

- one phase: the step is held for the sequences answered and not heard back from, while waiting costs less
  than the extra step it saves, h < t(P) + t(M) - t(P + M) for the work P present and the sequences M awaited
  (a 4-token draft comes back later than a 1-token one, a k = 0 round at once, the network adds jitter; without
  the hold the late ones miss the step and the two groups stay apart for good, each proposing while the
  other's step runs, two steps where one would do);
- two phases: a step verifies at most half of the sequences (max_verifications), so that a phase whose
  proposals all arrived at once splits in two, and each half drafts while the other is verified.

An arrival is expected at the verdict's time + d + twice d's mean deviation. A sequence later than that, or
whose stream has no estimate yet, holds nothing, and no hold lasts longer than the saving it buys: a client that
never proposes again, or always late, costs the others at most what a slow honest draft would. A step is never
held for a sequence whose next proposal is already in (pipelined drafting), nor on a verifier with no work.

Lives on the asyncio side (async_engine), between steps: no locks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from verifier_service.goodput import StepTimeModel
from verifier_service.types import CloseCmd, DroppedOut, ErrorOut, OpenCmd, Outcome, ProposeCmd, SeqKey, VerdictOut


@dataclass
class _Average:
    """A moving average and its mean absolute deviation."""

    mean: float
    deviation: float = 0.0

    def add(self, x: float, decay: float) -> None:
        self.deviation = decay * self.deviation + (1 - decay) * abs(x - self.mean)
        self.mean = decay * self.mean + (1 - decay) * x


@dataclass(frozen=True)
class HoldDecision:
    deadline: float  # time.monotonic() until which the step waits, unless everything awaited comes first
    num_awaited: int  # sequences the wait is for
    saving_s: float  # the step time it expects to save


@dataclass(frozen=True)
class PhasePlan:
    num_phases: int
    round_s: float  # predicted time of one round of every sequence under that plan
    one_phase_s: float  # and under one phase


@dataclass
class PhasePlanner:
    decay: float = 0.8  # weight of a stream's past turnarounds
    min_slack_s: float = 0.001  # added to an expected arrival, with twice the stream's mean deviation
    margin: float = 0.05  # two phases only when this much shorter a round than one
    step_time: StepTimeModel = field(default_factory=lambda: StepTimeModel(decay=0.9))
    # answered, next proposal not in yet: key -> when the verdict went out
    _awaited: dict[SeqKey, float] = field(default_factory=dict)
    _outstanding: dict[SeqKey, int] = field(default_factory=dict)  # proposals in and not yet answered
    _block_tokens: dict[SeqKey, int] = field(default_factory=dict)  # tokens the sequence's next block feeds
    _turnaround: dict[int, _Average] = field(default_factory=dict)  # per stream
    _compute: dict[int, _Average] = field(default_factory=dict)  # per stream: Proposal.draft_seconds
    num_present: int = 0  # opens and proposals arrived since the last step started
    plan: PhasePlan | None = None  # the last one planned (metrics, logs)

    # -- what the loop reports ---------------------------------------------------------------------------------

    def submitted(self, command: object, now: float) -> None:
        if isinstance(command, ProposeCmd):
            key = command.key
            self._outstanding[key] = self._outstanding.get(key, 0) + 1
            self._block_tokens[key] = command.num_draft_tokens + 1
            sent = self._awaited.pop(key, None)
            if sent is not None:
                self._add(self._turnaround, key.stream_id, max(0.0, now - sent))
            if command.draft_seconds is not None:
                self._add(self._compute, key.stream_id, command.draft_seconds)
        elif isinstance(command, CloseCmd):
            self._forget(command.key)
            return
        elif not isinstance(command, OpenCmd):
            return
        self.num_present += 1

    def stream_closed(self, stream_id: int) -> None:
        for table in (self._awaited, self._outstanding, self._block_tokens):
            for key in [k for k in table if k.stream_id == stream_id]:
                del table[key]
        self._turnaround.pop(stream_id, None)
        self._compute.pop(stream_id, None)

    def step_started(self) -> None:
        self.num_present = 0

    def stepped(self, num_tokens: int, seconds: float) -> None:
        self.step_time.observe(num_tokens, seconds)

    def replied(self, outcome: Outcome, now: float) -> None:
        """An outcome the loop sends: a verdict the sequence goes on from is awaited back, unless its next
        proposal is already in (pipelined drafting); an ended sequence is forgotten."""
        key = outcome.key
        if isinstance(outcome, ErrorOut):
            if key.seq_id:
                self._forget(key)
            return
        if not isinstance(outcome, VerdictOut | DroppedOut):
            return
        if isinstance(outcome, VerdictOut) and outcome.finish_reason is not None:
            self._forget(key)
            return
        outstanding = self._outstanding.pop(key, 0)
        if outstanding > 1:
            self._outstanding[key] = outstanding - 1
            return
        if isinstance(outcome, DroppedOut):  # a proposal that went stale; the next one is already on its way
            return
        if outcome.next_draft_tokens is not None:
            self._block_tokens[key] = outcome.next_draft_tokens + 1
        self._awaited[key] = now

    # -- the decisions -----------------------------------------------------------------------------------------

    def plan_phases(self) -> PhasePlan:
        """One phase or two, for the sequences the verifier knows to come back (see the module's docstring)."""
        keys = [*self._awaited, *(k for k in self._outstanding if k not in self._awaited)]
        turnarounds = [self._turnaround[k.stream_id].mean for k in keys if k.stream_id in self._turnaround]
        if len(keys) < 2 or not turnarounds or not self.step_time.ready:
            self.plan = PhasePlan(1, 0.0, 0.0)
            return self.plan
        d = sum(turnarounds) / len(turnarounds)
        # a stream whose draft does not say its compute may be computing all the time it is away
        c = max((self._compute[s].mean if s in self._compute else self._turnaround[s].mean)
                for s in {k.stream_id for k in keys} if s in self._turnaround)
        tokens = sum(self._block_tokens.get(k, 1) for k in keys)
        t = self.step_time.predict
        one = t(tokens) + d
        half = t(math.ceil(tokens / 2))
        two = max(2 * half, d + half, 2 * c)
        self.plan = PhasePlan(2, two, one) if two < one * (1 - self.margin) else PhasePlan(1, one, one)
        return self.plan

    def max_verifications(self) -> int | None:
        """The cap on the verifications of the next step: half the sequences under two phases; None: no cap."""
        if self.plan is None or self.plan.num_phases == 1:
            return None
        return math.ceil((len(self._awaited) + sum(1 for k in self._outstanding if k not in self._awaited)) / 2)

    def hold(self, now: float, hold_started: float) -> HoldDecision | None:
        """Under one phase: whether the step that would start now waits, and until when; None: start it.
        `hold_started`: when the loop first asked for this step (a hold's length counts from there)."""
        if (self.plan is not None and self.plan.num_phases != 1) or not self._awaited or not self.step_time.ready:
            return None
        arrivals = []
        for key, sent in self._awaited.items():
            turnaround = self._turnaround.get(key.stream_id)
            if turnaround is None:
                continue
            due = sent + turnaround.mean + 2 * turnaround.deviation + self.min_slack_s
            if due > now:
                arrivals.append((due, self._block_tokens.get(key, 1)))
        if not arrivals:
            return None
        arrivals.sort()
        t = self.step_time.predict
        present = sum(self._block_tokens.get(k, 1) for k in self._outstanding)
        best = None
        awaited_tokens = 0
        for i, (due, tokens) in enumerate(arrivals):
            awaited_tokens += tokens
            saving = (t(present) if present else 0.0) + t(awaited_tokens) - t(present + awaited_tokens)
            if due - hold_started < saving:
                best = HoldDecision(due, i + 1, saving)
        return best

    # -- internals ---------------------------------------------------------------------------------------------

    def _add(self, table: dict[int, _Average], stream_id: int, x: float) -> None:
        if stream_id in table:
            table[stream_id].add(x, self.decay)
        else:
            table[stream_id] = _Average(x)

    def _forget(self, key: SeqKey) -> None:
        self._awaited.pop(key, None)
        self._outstanding.pop(key, None)
        self._block_tokens.pop(key, None)
