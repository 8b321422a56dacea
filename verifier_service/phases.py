"""When to start a verification step: phases of the sequences the verifier answers.

A sequence alternates between the verifier (its proposal is verified in a step) and its draft (the verdict
travels back, the draft drafts the next block, the proposal travels here). Sequences answered by the same step
come back at about the same time and form a phase. How many phases there should be follows from two times: the
verifier's step t(n) for n tokens (step_time.StepTimeModel, learned from its own steps here) and the draft's
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

An arrival is expected at the verdict's time + d + twice d's mean deviation. d is the stream's own, kept apart
for rounds that draft and rounds that draft nothing (k = 0 comes back in milliseconds, a drafted block after a
model step: one average of both was far off either, and its deviation put every due past what a hold may wait,
so a batch split in two by one late arrival stayed split). In the plan, d is the mean over the sequences of the
drafting rounds' (a stream with many sequences weighs more, one slow client does not set it alone) and c the
largest of the streams' (a stream's c is at most its d: compute cannot outlast the time away; a draft that does
not say its compute is taken to compute all the time it is away). Two phases are planned only where the
step-time model interpolates (between step sizes it has seen: outside them it scales in proportion and knows no
fixed cost), entered when 5 % shorter and left only once not shorter. A hold prices the merged step past the
sizes seen at the marginal cost per token (in proportion, merging would never save anything, and a split batch
whose merged size is never seen again would never merge). A hold that waits for sequences due within the saving
lasts until they are in or the saving is spent: one a little past its due still pays. A sequence later than
twice its expected turnaround, or whose stream has no estimate yet, holds nothing; a stream whose last two
proposals came late (none on time between) is not waited for until one comes on time; no hold lasts longer than
the saving it buys (a merging hold, below: `merge_rounds` savings, once per as many steps); and a sequence silent
for four of its turnarounds (plus a second) leaves the plan. So a client that never proposes again, or always
late, costs the others at most what a slow honest draft would. A step is never held for a sequence whose next
proposal is already in (pipelined drafting), nor on a verifier with no work.

A hold that merges two phases lasts longer. Sequences answered by another step than every one present are a phase
of their own, and once two phases form under one phase's plan, the plain rule keeps them apart for good: each
comes back while the other's step runs, and is due later than one step's saving (at two streams of the default
pair on 2 cores, steps of one sequence each alternated, the verifier idle half the time between them). A merge
saves its step every round it lasts, so such a hold may wait up to `merge_rounds` savings, betting that the merge
lasts that many rounds; it is taken at most once per `merge_rounds` steps that ran anything, so that where
merges never last (a draft always slower than the others, or a client that makes itself another phase on
purpose) merging holds add at most one saving per step on average to what the plain rule waits. The phases present
when a merging hold begins are kept until its step starts: the awaited phase's sequences come in one by one, and
each that came in must not make the rest look like the present phase.

A step that computes new prompts takes no merging hold (the plain rule's, at most one saving, stays) for
awaited sequences due before it would end (its prompts' tokens counted, up to the step budget): those are in by
then, and are present for the next step, which the new sequences, answered by this one, join after their
turnaround (the rules above, a merge included, then decide what it waits for); a merge now only idles the
verifier with the prompts in hand. Measured at 16 streams (default pair, 2 cores, d904e8b, --speculation auto):
each wave's first two arrivals were verified alone, chosen 4 tokens at that moment's light load, and the 3.3 s step
of the other 13 prompts was held 0.89 s for them as a merge (its saving, a step's fixed part, 0.23 s, times
merge_rounds), in both waves of the level. An open counts its prompt once, and not where its sequence is known
already (a duplicate) or closed before the step; one the engine then refuses still counts (it can only cost merging
holds, of the step it came in before).

Lives on the asyncio side (async_engine), between steps: no locks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import structlog

from verifier_service.step_time import StepTimeModel
from verifier_service.types import (
    CloseCmd,
    Command,
    DroppedOut,
    ErrorOut,
    OpenCmd,
    Outcome,
    ProposeCmd,
    SeqKey,
    VerdictOut,
)

log = structlog.get_logger(__name__)


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
    merges: bool = False  # it merges another phase into this step: it may wait up to merge_rounds savings


@dataclass(frozen=True)
class PhasePlan:
    num_phases: int
    round_s: float  # predicted time of one round of every sequence under that plan
    one_phase_s: float  # and under one phase


@dataclass
class _StreamTimes:
    turnaround: _Average | None = None  # of the rounds that drafted
    # of the rounds that drafted nothing (k = 0, which the goodput choice asks for under load): the draft answers
    # those at once, so one average of both would be far off either (milliseconds against a model step), and its
    # deviation would push every arrival's due past what a hold may wait
    plain_turnaround: _Average | None = None
    compute: _Average | None = None  # Proposal.draft_seconds of the drafting rounds
    # arrivals past their due in a row, per kind of round (a k = 0 round's due is milliseconds away: its jitter
    # must not stop the holds for the drafting rounds)
    late_in_a_row: int = 0
    plain_late_in_a_row: int = 0

    def due(self, sent: float, slack_s: float, plain: bool = False) -> float | None:
        """When a proposal answered at `sent` is expected back; `plain`: it is to draft nothing. A drafting round
        on a stream that has not drafted yet has no estimate (None: it holds nothing); a plain one takes the
        drafting rounds' (longer) estimate until it has its own."""
        t = self.turnaround_for(plain)
        return None if t is None else sent + t.mean + 2 * t.deviation + slack_s

    def turnaround_for(self, plain: bool) -> _Average | None:
        """The turnaround of a round that drafts (`plain` False) or drafts nothing."""
        return self.plain_turnaround if plain and self.plain_turnaround is not None else self.turnaround

    def late(self, plain: bool) -> int:
        return self.plain_late_in_a_row if plain else self.late_in_a_row

    def count_late(self, plain: bool, late: bool) -> None:
        if plain:
            self.plain_late_in_a_row = self.plain_late_in_a_row + 1 if late else 0
        else:
            self.late_in_a_row = self.late_in_a_row + 1 if late else 0

    def compute_s(self) -> float | None:
        if self.turnaround is None:
            return None
        return self.turnaround.mean if self.compute is None else min(self.compute.mean, self.turnaround.mean)


@dataclass
class PhasePlanner:
    decay: float = 0.8  # weight of a stream's past turnarounds
    # NOTE: a timer's granularity; an arrival is due at d + 2 deviations + this
    min_slack_s: float = 0.001
    margin: float = 0.05  # two phases only when this much shorter a round than one
    max_late: int = 2  # a stream late this many times in a row is not waited for
    split: bool = True  # False: one phase always (--phases hold)
    max_step_tokens: int | None = None  # the step's token budget: no merge past it is ever waited for
    merge_rounds: int = 4  # a hold that merges two phases waits up to this many savings, once per as many steps
    step_time: StepTimeModel = field(default_factory=lambda: StepTimeModel(decay=0.9))
    plan: PhasePlan | None = None  # the last one planned (metrics, logs)
    num_present: int = field(default=0, init=False)  # opens and proposals arrived since the last step started
    # the opens among them, each new sequence's once: key -> its prompt's tokens (the next step computes them, as
    # far as its budget allows)
    _opening: dict[SeqKey, int] = field(default_factory=dict, init=False, repr=False)
    # answered, next proposal not in yet: key -> when the verdict went out
    _awaited: dict[SeqKey, float] = field(default_factory=dict, init=False, repr=False)
    _outstanding: dict[SeqKey, int] = field(default_factory=dict, init=False, repr=False)  # in, not answered
    _block_tokens: dict[SeqKey, int] = field(default_factory=dict, init=False, repr=False)  # its next block's
    _streams: dict[int, _StreamTimes] = field(default_factory=dict, init=False, repr=False)
    # awaited past twice their expected turnaround: counted late once, held for no more
    _expired: set[SeqKey] = field(default_factory=set, init=False, repr=False)
    # the step (its number among the steps that ran anything) that last answered the sequence: its phase
    _answered: dict[SeqKey, int] = field(default_factory=dict, init=False, repr=False)
    _num_steps: int = field(default=0, init=False, repr=False)  # steps that ran anything
    _last_merge_step: int | None = field(default=None, init=False, repr=False)  # of the last merging hold
    _turns: int = field(default=0, init=False, repr=False)  # step_started() calls: a hold is one turn's
    _last_merge_turn: int | None = field(default=None, init=False, repr=False)
    # the phases present when this step's merging hold began: the awaited phase stays another one while its
    # sequences come in one by one (each becomes present, but is not what the hold is measured against)
    _merge_present: frozenset[int] = field(default=frozenset(), init=False, repr=False)

    # -- what the loop reports ---------------------------------------------------------------------------------

    def submitted(self, command: Command, now: float) -> None:
        if isinstance(command, ProposeCmd):
            key = command.key
            if not key.seq_id:  # no such sequence: the engine refuses it
                return
            self._outstanding[key] = self._outstanding.get(key, 0) + 1
            times = self._streams.setdefault(key.stream_id, _StreamTimes())
            sent = self._awaited.pop(key, None)
            expired = key in self._expired
            self._expired.discard(key)
            # a block drafted after a catch-up (Proposal.catch_up_tokens) came late for that: not a usual round
            usual = not command.catch_up_tokens
            if sent is not None and usual:
                plain = self._asked_plain(key)
                due = times.due(sent, self.min_slack_s, plain=plain)
                if not expired:  # one counted when it expired is not counted again
                    times.count_late(plain, due is not None and now > due)
                if command.num_draft_tokens:
                    times.turnaround = _add(times.turnaround, max(0.0, now - sent), self.decay)
                else:
                    times.plain_turnaround = _add(times.plain_turnaround, max(0.0, now - sent), self.decay)
            self._block_tokens[key] = command.num_draft_tokens + 1
            if command.draft_seconds is not None and command.num_draft_tokens and usual:
                times.compute = _add(times.compute, command.draft_seconds, self.decay)
        elif isinstance(command, CloseCmd):
            self._forget(command.key)
            return
        elif not isinstance(command, OpenCmd):
            return
        elif command.key not in self._answered and command.key not in self._outstanding:
            self._opening.setdefault(command.key, len(command.prompt_token_ids))  # a new sequence's, once
        self.num_present += 1

    def stream_closed(self, stream_id: int) -> None:
        for table in (self._awaited, self._outstanding, self._block_tokens, self._answered, self._opening):
            for key in [k for k in table if k.stream_id == stream_id]:
                del table[key]
        self._expired = {k for k in self._expired if k.stream_id != stream_id}
        self._streams.pop(stream_id, None)

    def step_started(self) -> None:
        self.num_present = 0
        self._opening.clear()
        self._turns += 1

    def stepped(self, num_tokens: int, seconds: float) -> None:
        """A step that verified or computed something (an empty turn of the loop is none): call it before
        replied() for its outcomes."""
        self._num_steps += 1
        self.step_time.observe(num_tokens, seconds)

    def awaited_keys(self) -> frozenset[SeqKey]:
        """The sequences answered and not back that the plan has not given up on: under one phase, those whose
        stream has a turnaround estimate and is not late twice in a row, and not past twice their turnaround
        (empty under two phases: a capped step's other half is the other phase). The goodput choice prices the
        batch with them. A hold may still start the step without some (due past what it may wait)."""
        if self.plan is not None and self.plan.num_phases != 1:
            return frozenset()
        return frozenset(key for key, sent in self._awaited.items() if self._due(key, sent) is not None)

    def awaits_drafting(self) -> bool:
        """Whether a sequence the plan waits for was asked to draft: a hold then waits for drafting, which is no
        part of plain decoding's own wait (a hold for plain proposals alone is)."""
        return any(not self._asked_plain(key) for key in self._awaited)

    def replied(self, outcome: Outcome, now: float) -> None:
        """An outcome sent to an open stream: a verdict the sequence goes on from is awaited back, unless its
        next proposal is already in (pipelined drafting); an ended sequence is forgotten. A verdict of a proposal
        this planner never counted, or forgot (its sequence closed meanwhile), is ignored."""
        key = outcome.key
        if isinstance(outcome, ErrorOut):
            if key.seq_id:
                self._forget(key)
            return
        if not isinstance(outcome, VerdictOut | DroppedOut):
            return
        outstanding = self._outstanding.pop(key, 0)
        if not outstanding:
            return
        if isinstance(outcome, VerdictOut) and outcome.finish_reason is not None:
            self._forget(key)
            return
        if isinstance(outcome, VerdictOut):  # its phase, pipelined or not
            self._answered[key] = self._num_steps
        if outstanding > 1:
            self._outstanding[key] = outstanding - 1
            return
        if isinstance(outcome, DroppedOut):  # a proposal that went stale; the next one is already on its way
            return
        if outcome.next_draft_tokens is not None:
            self._block_tokens[key] = outcome.next_draft_tokens + 1
        self._awaited[key] = now

    # -- the decisions -----------------------------------------------------------------------------------------

    def plan_phases(self, now: float) -> PhasePlan:
        """One phase or two, for the sequences the verifier expects back (see the module's docstring)."""
        self._drop_silent(now)
        keys = [*self._awaited, *self._outstanding]
        one_phase = PhasePlan(1, 0.0, 0.0)
        # each sequence's turnaround for the round it was asked for (a k = 0 round has no drafting to hide)
        turnarounds = []
        for k in keys:
            times = self._streams.get(k.stream_id)
            t = None if times is None else times.turnaround_for(self._asked_plain(k))
            if t is not None:
                turnarounds.append(t.mean)
        if not self.split or len(keys) < 2 or not turnarounds or not self.step_time.ready:
            return self._set_plan(one_phase)
        d = sum(turnarounds) / len(turnarounds)
        c = max(self._streams[sid].compute_s() or 0.0 for sid in {k.stream_id for k in keys}
                if sid in self._streams)
        tokens = sum(self._block_tokens.get(k, 1) for k in keys)
        half_tokens = math.ceil(tokens / 2)
        points = self.step_time.points()
        if not points[0][0] <= half_tokens <= tokens <= points[-1][0]:
            return self._set_plan(one_phase)  # outside what it has seen, t knows no fixed cost
        t = self.step_time.predict
        one = t(tokens) + d
        half = t(half_tokens)
        two = max(2 * half, d + half, 2 * c)
        staying = self.plan is not None and self.plan.num_phases == 2
        if two < one * (1 - self.margin) or (staying and two < one):
            return self._set_plan(PhasePlan(2, two, one))
        return self._set_plan(PhasePlan(1, one, one))

    def max_verifications(self) -> int | None:
        """The cap on the verifications of the next step: half the sequences under two phases; None: no cap."""
        if self.plan is None or self.plan.num_phases == 1:
            return None
        return math.ceil((len(self._awaited) + len(self._outstanding)) / 2)

    def hold(self, now: float, hold_started: float) -> HoldDecision | None:
        """Under one phase: whether the step that would start now waits, and until when; None: start it.
        `hold_started`: when the loop first asked for this step (a hold's length counts from there)."""
        if (self.plan is not None and self.plan.num_phases != 1) or not self._awaited or not self.step_time.ready:
            return None
        arrivals = []
        for key, sent in self._awaited.items():
            due = self._due(key, sent)
            if due is None:
                continue
            expiry = sent + 2 * (due - sent)  # twice its expected turnaround: it may be gone, and is late
            if now > expiry:
                self._expired.add(key)
                self._streams[key.stream_id].count_late(self._asked_plain(key), True)
                continue
            arrivals.append((due, expiry, self._block_tokens.get(key, 1), self._answered.get(key)))
        if not arrivals:
            return None
        present = sum(self._block_tokens.get(k, 1) for k in self._outstanding)
        # a step that computes new prompts merges none due before it would end (see the docstring)
        prompt_step_end = -math.inf
        if self._opening:
            work = present + sum(self._opening.values())
            work = work if self.max_step_tokens is None else min(work, self.max_step_tokens)
            prompt_step_end = now + self.step_time.predict(work, marginal_beyond=True)
        arrivals.sort(key=lambda a: a[:3])
        # the steps that answered the sequences present: an awaited one answered by none of them is another phase
        # (present sequences never answered, new ones, are a phase of their own)
        present_phases = frozenset(p for k in self._outstanding if (p := self._answered.get(k)) is not None)
        last = self._last_merge_step
        merging_now = self._last_merge_turn == self._turns  # this turn's merging hold, deciding again at an arrival
        if merging_now:
            present_phases = self._merge_present
        may_merge = last is None or merging_now or self._num_steps - last >= self.merge_rounds

        def t(n: int) -> float:
            return self.step_time.predict(n, marginal_beyond=True) if n else 0.0

        best = None
        awaited_tokens = 0
        last_expiry = 0.0
        another_phase = False  # among those due past one saving: a sequence of another phase
        for i, (due, expiry, tokens, phase) in enumerate(arrivals):
            awaited_tokens += tokens
            last_expiry = max(last_expiry, expiry)
            if self.max_step_tokens is not None and present + awaited_tokens > self.max_step_tokens:
                break  # no step holds them all: waiting would merge nothing
            saving = t(present) + t(awaited_tokens) - t(present + awaited_tokens)
            merging = False
            if due - hold_started >= saving:
                another_phase = another_phase or phase not in present_phases
                merging = may_merge and another_phase and due > prompt_step_end
            allowed = saving * (self.merge_rounds if merging else 1)
            if due - hold_started < allowed and now - hold_started < allowed:
                # until they are in, the allowance is spent, or they pass twice their turnaround: one a little
                # past its due still pays
                best = HoldDecision(min(hold_started + allowed, last_expiry), i + 1, saving, merging)
        if best is not None and best.merges and not merging_now:
            self._last_merge_step, self._last_merge_turn = self._num_steps, self._turns
            self._merge_present = present_phases
            log.info("phase_merge_hold", awaited=best.num_awaited, saving_ms=round(best.saving_s * 1e3, 1),
                      until_s=round(best.deadline - now, 3))
        return best

    # -- internals ---------------------------------------------------------------------------------------------

    def _set_plan(self, plan: PhasePlan) -> PhasePlan:
        if self.plan is not None and plan.num_phases != self.plan.num_phases:
            log.info("phase_plan", num_phases=plan.num_phases, round_ms=round(plan.round_s * 1e3, 1),
                     one_phase_round_ms=round(plan.one_phase_s * 1e3, 1))
        self.plan = plan
        return plan

    def _drop_silent(self, now: float) -> None:
        """Sequences awaited for four of their stream's turnarounds and a second more leave the plan (a client
        that went quiet; the idle timeout ends the sequence later)."""
        silent = []
        for key, sent in self._awaited.items():
            times = self._streams.get(key.stream_id)
            away = times.turnaround.mean if times is not None and times.turnaround is not None else 0.0
            if now - sent > 4 * away + 1.0:
                silent.append(key)
        for key in silent:
            times = self._streams.get(key.stream_id)
            if times is not None and key not in self._expired:
                times.count_late(self._asked_plain(key), True)  # silence is lateness
            self._forget(key)

    def _due(self, key: SeqKey, sent: float) -> float | None:
        """When `key`, answered at `sent`, is expected back; None when it is not waited for: its stream has no
        estimate yet or came late twice in a row, or it passed twice its turnaround."""
        times = self._streams.get(key.stream_id)
        plain = self._asked_plain(key)
        if times is None or times.late(plain) >= self.max_late or key in self._expired:
            return None
        return times.due(sent, self.min_slack_s, plain=plain)

    def _asked_plain(self, key: SeqKey) -> bool:
        """Whether `key`'s next block is to draft nothing (its verdict chose k = 0, or it drafted none last)."""
        return self._block_tokens.get(key, 1) <= 1

    def _forget(self, key: SeqKey) -> None:
        self._expired.discard(key)
        self._awaited.pop(key, None)
        self._outstanding.pop(key, None)
        self._block_tokens.pop(key, None)
        self._answered.pop(key, None)
        self._opening.pop(key, None)


def _add(average: _Average | None, x: float, decay: float) -> _Average:
    if average is None:
        return _Average(x)
    average.add(x, decay)
    return average
