"""The verifier's phase plan (verifier_service/phases.py): when a step waits for the proposals on their way, when
it verifies only half of the sequences, and that the engine's cap on a step's verifications changes no output."""

from __future__ import annotations

import dataclasses

import pytest

from common.errors import ErrorCode, ServiceError
from common.sampling import FinishReason, SamplingParams
from verifier_service.config import VerifierConfig
from verifier_service.phases import HoldDecision, PhasePlan, PhasePlanner
from verifier_service.server import build_engine
from verifier_service.step_time import StepTimeModel
from verifier_service.types import (
    CloseCmd,
    DroppedOut,
    ErrorOut,
    OpenCmd,
    ProposeCmd,
    SeqKey,
    VerdictOut,
)
from verifier_service.validation import Limits, check_proposal

from tiny_models import greedy_continuation, make_text_pair


def _planner(fixed_s: float, per_token_s: float) -> PhasePlanner:
    """A planner whose step time is fixed_s + per_token_s * tokens (observed at 5, 10, 20 and 40 tokens)."""
    planner = PhasePlanner()
    for n in (5, 10, 20, 40):
        planner.stepped(n, fixed_s + per_token_s * n)
    return planner


def _verdict(key: SeqKey, next_k: int | None = 4, finished: bool = False) -> VerdictOut:
    return VerdictOut(key, 10, 4, (1, 2, 3, 4, 5), FinishReason.LENGTH if finished else None, 1,
                      next_draft_tokens=next_k)


def _propose(key: SeqKey, k: int = 4, draft_seconds: float | None = None) -> ProposeCmd:
    return ProposeCmd(key, 10, tuple(range(1, k + 1)), None, draft_seconds=draft_seconds)


def _rounds(planner: PhasePlanner, keys: list[SeqKey], turnaround: float, draft_seconds: float | None = None,
            *, rounds: int = 3, step_s: float = 0.5, start: float = 0.0) -> float:
    """Each key proposes at `start`; then `rounds` times: all are answered `step_s` later and propose again
    `turnaround` after that. Returns the time of the last proposals (all keys are in then). A `start` continues
    earlier rounds: the keys are in already."""
    t = start
    for key in keys if not start else ():
        planner.submitted(_propose(key, draft_seconds=draft_seconds), t)
    for _ in range(rounds):
        t += step_s
        for key in keys:
            planner.replied(_verdict(key), t)
        t += turnaround
        for key in keys:
            planner.submitted(_propose(key, draft_seconds=draft_seconds), t)
    return t


KEYS = [SeqKey(1, i) for i in range(1, 9)]


# -- the plan: one phase or two -------------------------------------------------------------------------------


def test_a_verifier_that_waits_for_its_drafts_longer_than_a_step_costs_splits_them_in_two_phases():
    planner = _planner(fixed_s=0.5, per_token_s=0.02)  # a CPU verifier: mostly fixed cost
    now = _rounds(planner, KEYS, turnaround=1.0, draft_seconds=0.8)
    plan = planner.plan_phases(now)
    assert plan.num_phases == 2
    assert plan.round_s < plan.one_phase_s
    assert planner.max_verifications() == 4  # half of the 8 sequences per step
    assert planner.hold(now, now) is None  # two phases: nothing is held


def test_drafts_that_come_back_fast_keep_one_phase_and_no_cap():
    planner = _planner(fixed_s=0.5, per_token_s=0.02)
    now = _rounds(planner, KEYS, turnaround=0.1, draft_seconds=0.08)
    assert planner.plan_phases(now).num_phases == 1
    assert planner.max_verifications() is None


def test_a_draft_slower_than_the_verifier_keeps_one_phase():
    """A CPU draft beside a GPU verifier: splitting would make the draft draft twice per round."""
    planner = _planner(fixed_s=0.010, per_token_s=0.0002)
    now = _rounds(planner, KEYS, turnaround=0.2, draft_seconds=0.19, step_s=0.02)
    assert planner.plan_phases(now).num_phases == 1


def test_a_draft_that_does_not_say_its_compute_is_taken_to_compute_all_the_time_it_is_away():
    """Without Proposal.draft_seconds the turnaround is all compute: the same times that split with a draft that
    says it computes 0.3 s of its 1.2 s away do not split; nor does a draft that claims more than its time away."""
    said, unsaid, inflated = _planner(0.5, 0.02), _planner(0.5, 0.02), _planner(0.5, 0.02)
    now = _rounds(said, KEYS, turnaround=1.2, draft_seconds=0.3)
    _rounds(unsaid, KEYS, turnaround=1.2)
    _rounds(inflated, KEYS, turnaround=1.2, draft_seconds=1e30)
    assert said.plan_phases(now).num_phases == 2
    assert unsaid.plan_phases(now).num_phases == 1
    assert inflated.plan_phases(now).num_phases == 1
    assert inflated._streams[1].compute_s() == pytest.approx(1.2)  # clamped to the time away


def test_no_plan_without_a_step_seen_a_turnaround_measured_or_outside_the_step_sizes_seen():
    planner = PhasePlanner()
    now = _rounds(planner, KEYS, turnaround=1.0)
    assert planner.plan_phases(now).num_phases == 1  # no step time yet
    planner = _planner(0.5, 0.02)
    for key in KEYS:
        planner.submitted(_propose(key), 0.0)
    for key in KEYS:
        planner.replied(_verdict(key), 0.5)
    assert planner.plan_phases(0.6).num_phases == 1  # nothing came back yet
    planner = PhasePlanner()
    planner.stepped(40, 1.3)  # one step size seen: t(20) would be taken for half of t(40), no fixed cost
    now = _rounds(planner, KEYS, turnaround=1.0, draft_seconds=0.1)
    assert planner.plan_phases(now).num_phases == 1


def test_two_phases_are_left_only_once_no_shorter():
    planner = _planner(fixed_s=0.5, per_token_s=0.02)
    # t(40) = 1.3, t(20) = 0.9: one phase 1.3 + d, two phases max(1.8, d + 0.9), so two win for d > 0.5
    now = _rounds(planner, KEYS, turnaround=0.52, draft_seconds=0.1, rounds=30)
    assert planner.plan_phases(now).num_phases == 1  # 1.80 against 1.82: not 5 % shorter
    now = _rounds(planner, KEYS, turnaround=0.7, draft_seconds=0.1, rounds=30, start=now)
    assert planner.plan_phases(now).num_phases == 2
    now = _rounds(planner, KEYS, turnaround=0.52, draft_seconds=0.1, rounds=30, start=now)
    assert planner.plan_phases(now).num_phases == 2  # still shorter: it stays
    now = _rounds(planner, KEYS, turnaround=0.3, draft_seconds=0.1, rounds=30, start=now)
    assert planner.plan_phases(now).num_phases == 1


# -- the hold, under one phase --------------------------------------------------------------------------------


def _one_phase_with_late_half(turnaround: float) -> tuple[PhasePlanner, float]:
    """8 sequences with a `turnaround` measured; then all are answered and half of them are back. Returns the
    planner and when the answers went out."""
    planner = _planner(fixed_s=0.5, per_token_s=0.02)
    now = _rounds(planner, KEYS, turnaround=turnaround, draft_seconds=turnaround * 0.9) + 0.5
    for key in KEYS:
        planner.replied(_verdict(key), now)
    for key in KEYS[:4]:
        planner.submitted(_propose(key), now + turnaround * 0.5)
    assert planner.plan_phases(now + turnaround * 0.5).num_phases == 1
    return planner, now


def test_a_hold_waits_for_drafting_only_where_an_awaited_sequence_was_asked_to_draft():
    """The goodput choice leaves a hold for drafting sequences out of plain decoding's wait, not a hold for
    plain proposals alone (that one is plain decoding's own)."""
    planner, _ = _one_phase_with_late_half(turnaround=0.1)
    for key in KEYS[4:]:
        planner._block_tokens[key] = 1  # asked for k = 0
    assert not planner.awaits_drafting()
    planner._block_tokens[KEYS[5]] = 3
    assert planner.awaits_drafting()
    planner._block_tokens[KEYS[0]] = 3  # back already: not awaited
    planner._block_tokens[KEYS[5]] = 1
    assert not planner.awaits_drafting()


def test_a_step_waits_for_the_sequences_answered_with_it_when_they_are_due_before_the_saving():
    planner, sent = _one_phase_with_late_half(turnaround=0.1)
    now = sent + 0.05
    decision = planner.hold(now, now)
    assert decision is not None
    assert decision.num_awaited == 4
    assert decision.saving_s == pytest.approx(0.5)  # a step's fixed cost
    # due at about sent + 0.1 (their turnaround, twice its deviation and slack); held until they are in, or
    # twice that has passed (within the saving)
    due = planner._streams[1].due(sent, planner.min_slack_s)
    assert sent + 0.1 < due < sent + 0.15
    assert decision.deadline == pytest.approx(sent + 2 * (due - sent))


def test_a_hold_outlasts_a_due_that_passed_but_not_the_saving_nor_twice_the_turnaround():
    """Due at sent + 0.101 and a little late: the step still waits for them (a split batch stays split
    otherwise), until twice their turnaround; a longer turnaround is waited for at most the saving."""
    planner, sent = _one_phase_with_late_half(turnaround=0.1)
    due = planner._streams[1].due(sent, planner.min_slack_s)
    decision = planner.hold(due + 0.01, sent + 0.05)
    assert decision is not None and decision.num_awaited == 4
    assert decision.deadline == pytest.approx(sent + 2 * (due - sent))
    slow, sent = _one_phase_with_late_half(turnaround=0.4)  # due after about 0.4 s, gone after about 0.8 s
    assert slow._streams[1].due(sent, slow.min_slack_s) > sent + 0.4
    decision = slow.hold(sent + 0.2, sent + 0.2)
    assert decision.deadline == pytest.approx(sent + 0.7)  # the saving: 0.5 s
    assert slow.hold(sent + 0.71, sent + 0.2) is None  # the saving is spent


def test_sequences_past_twice_their_turnaround_hold_nothing_and_count_as_late():
    """A client that goes silent: its sequences stop holding steps once twice their turnaround has passed, and
    count as late, once each; two in a row and the stream is not waited for until one comes on time."""
    planner, sent = _one_phase_with_late_half(turnaround=0.1)
    gone = sent + 2 * (planner._streams[1].due(sent, planner.min_slack_s) - sent)
    assert planner.hold(gone - 0.01, gone - 0.01) is not None
    assert planner._streams[1].late_in_a_row == 0
    assert planner.hold(gone + 0.01, gone - 0.01) is None
    assert planner._streams[1].late_in_a_row == planner.max_late  # counted until the stream is not waited for
    expired = set(planner._expired)
    assert len(expired) == planner.max_late
    planner.hold(gone + 0.1, gone + 0.1)
    assert planner._streams[1].late_in_a_row == planner.max_late
    for key in expired:
        planner.submitted(_propose(key), gone + 0.2)  # they come after all: not counted twice
    assert planner._streams[1].late_in_a_row == planner.max_late


def test_a_step_starts_once_the_awaited_are_in():
    planner, sent = _one_phase_with_late_half(turnaround=0.1)
    for key in KEYS[4:6]:
        planner.submitted(_propose(key), sent + 0.08)
    assert planner.hold(sent + 0.08, sent + 0.05).num_awaited == 2
    for key in KEYS[6:]:
        planner.submitted(_propose(key), sent + 0.09)
    assert planner.hold(sent + 0.09, sent + 0.05) is None  # all in


def test_no_hold_for_a_merge_past_the_step_token_budget():
    planner, sent = _one_phase_with_late_half(turnaround=0.1)
    planner.max_step_tokens = 24  # 4 present blocks of 5 tokens: no awaited block of 5 fits beside them
    assert planner.hold(sent + 0.05, sent + 0.05) is None
    planner.max_step_tokens = 35  # three of them fit: the wait is for those
    assert planner.hold(sent + 0.05, sent + 0.05).num_awaited == 3
    planner.max_step_tokens = 40
    assert planner.hold(sent + 0.05, sent + 0.05).num_awaited == 4


def test_rounds_that_draft_nothing_do_not_set_when_a_drafting_round_is_due():
    """Under load the goodput choice alternates k = 0 rounds (back in milliseconds) with drafting ones (back after
    a model step, 0.45 s here). A sequence asked to draft is expected after the drafting rounds' turnaround, one
    asked for k = 0 after the plain rounds': one average of both would put a drafting round's due (mean plus two
    deviations) past the 0.5 s a merged step saves, and a step that starts at once would not wait."""
    planner = _planner(fixed_s=0.5, per_token_s=0.02)
    t = 0.0
    for key in KEYS:
        planner.submitted(_propose(key), t)
    for r in range(12):
        t += 0.5
        k = 0 if r % 2 else 2
        for key in KEYS:
            planner.replied(_verdict(key, next_k=k), t)
        t += 0.45 if k else 0.005
        for key in KEYS:
            planner.submitted(_propose(key, k=k), t)
    t += 0.5
    for key in KEYS:
        planner.replied(_verdict(key, next_k=2), t)
    others = [SeqKey(2, i) for i in range(1, 5)]  # another stream's work, in at once
    for key in others:
        planner.submitted(_propose(key), t + 0.01)
    now = t + 0.01
    assert planner.plan_phases(now).num_phases == 1
    times = planner._streams[1]
    assert times.due(t, 0.0) == pytest.approx(t + 0.45, abs=0.01)
    assert times.due(t, 0.0, plain=True) == pytest.approx(t + 0.005, abs=0.01)
    decision = planner.hold(now, now)
    assert decision is not None and decision.num_awaited == 8


def test_a_drafting_round_on_a_stream_that_never_drafted_holds_nothing():
    """A probe after a long k = 0 stretch: the stream's only estimate is the plain rounds' milliseconds, which
    says nothing of when a drafted block comes back."""
    planner = _planner(fixed_s=0.5, per_token_s=0.02)
    t = 0.0
    for key in KEYS:
        planner.submitted(_propose(key, k=0), t)
    for _ in range(3):
        t += 0.5
        for key in KEYS:
            planner.replied(_verdict(key, next_k=0), t)
        t += 0.005
        for key in KEYS:
            planner.submitted(_propose(key, k=0), t)
    t += 0.5
    for key in KEYS:
        planner.replied(_verdict(key, next_k=1 if key in KEYS[4:] else 0), t)
    for key in KEYS[:4]:
        planner.submitted(_propose(key, k=0), t + 0.004)
    assert planner.hold(t + 0.004, t + 0.004) is None


def test_a_hold_prices_a_merged_step_past_the_sizes_seen_at_the_marginal_cost():
    """Two halves of a batch, 40 tokens each, and no step seen above 40: in proportion the merged 80 tokens would
    cost as much as both halves (nothing saved, so never merged); at the marginal cost they save the fixed 0.5 s."""
    planner, sent = _one_phase_with_late_half(turnaround=0.1)
    for key in KEYS:
        planner._block_tokens[key] = 10  # 4 present and 4 awaited blocks of 10: 40 + 40 tokens
    decision = planner.hold(sent + 0.05, sent + 0.05)
    assert decision is not None and decision.saving_s == pytest.approx(0.5, abs=0.05)
    model = planner.step_time
    assert model.predict(80) == pytest.approx(2 * model.predict(40))
    assert model.predict(80, marginal_beyond=True) == pytest.approx(0.5 + 0.02 * 80)
    flat = StepTimeModel()
    for n, seconds in ((10, 1.0), (40, 1.0)):  # pooled flat: no token is free, a tenth of proportional at least
        flat.observe(n, seconds)
    assert flat.predict(80, marginal_beyond=True) == pytest.approx(1.0 + 40 * 0.1 / 40)
    near = StepTimeModel()
    for n, seconds in ((32, 1.0), (33, 1.1)):  # no step of at most half the largest: in proportion
        near.observe(n, seconds)
    assert near.predict(66, marginal_beyond=True) == pytest.approx(near.predict(66))


def test_no_hold_longer_than_the_step_it_saves():
    """With a step's fixed cost of 0.5 s, sequences due in about 0.6 s are not waited for (answered by the same
    step as the one present: one phase, the plain rule)."""
    planner = _planner(fixed_s=0.5, per_token_s=0.02)
    now = _rounds(planner, KEYS, turnaround=0.6, draft_seconds=0.05) + 0.5
    for key in KEYS:
        planner.replied(_verdict(key), now)
    planner.submitted(_propose(KEYS[0]), now)
    planner.plan_phases(now)
    assert planner.hold(now, now) is None


def _alternating(planner: PhasePlanner, rounds: int = 4, gap_s: float = 0.4, step_s: float = 0.6,
                 per_phase: int = 1) -> float:
    """Two phases of `per_phase` sequences each (KEYS[:per_phase] and the next as many): steps of one phase each,
    alternating, as at two streams on 2 shared cores. Each phase's proposals come in `gap_s` after the other's step
    ended, so each comes back `gap_s + step_s + gap_s` after its verdict. Returns the time the first phase's
    last proposals are in, the second's answered `gap_s` before and awaited."""
    a, b = KEYS[:per_phase], KEYS[per_phase:2 * per_phase]
    t = 0.0
    for key in a:
        planner.submitted(_propose(key), t)
    for r in range(2 * rounds):
        keys, others = (a, b) if r % 2 == 0 else (b, a)
        planner.step_started()
        t += step_s
        planner.stepped(5 * per_phase, step_s)
        for key in keys:
            planner.replied(_verdict(key), t)
        t += gap_s
        for key in others:
            planner.submitted(_propose(key), t)
    return t


def test_a_hold_merges_two_phases_waiting_up_to_merge_rounds_savings_once_per_as_many_steps():
    """Under one phase's plan the sequence of the other phase is due in 1.0 s, past the 0.5 s a merged step
    saves: the plain rule never waits for it (the phases stay apart for good); a merging hold waits up to
    merge_rounds savings, and not again within merge_rounds steps."""
    plain = _planner(fixed_s=0.5, per_token_s=0.02)
    plain.split = False
    plain.merge_rounds = 1
    now = _alternating(plain)
    assert plain.plan_phases(now).num_phases == 1
    assert plain.hold(now, now) is None

    planner = _planner(fixed_s=0.5, per_token_s=0.02)
    planner.split = False
    now = _alternating(planner)
    assert planner._streams[1].due(now - 0.4, planner.min_slack_s) == pytest.approx(now + 1.0, abs=0.01)
    planner.plan_phases(now)
    decision = planner.hold(now, now)
    assert decision is not None and decision.merges and decision.num_awaited == 1
    assert decision.saving_s == pytest.approx(0.5)
    assert decision.deadline == pytest.approx(now + 4 * 0.5)  # merge_rounds savings (before twice its turnaround)
    assert planner.hold(now + 1.2, now).merges  # the same step's hold decides again at each arrival: still on
    assert planner.hold(now + 2.01, now) is None  # the allowance is spent
    for _ in range(10):  # turns of the loop that step nothing (a command woke it) are not steps, nor the same hold
        planner.step_started()
        assert planner.hold(now, now) is None
    for _ in range(planner.merge_rounds - 1):  # no merging hold again within merge_rounds steps
        planner.step_started()
        planner.stepped(5, 0.6)
        assert planner.hold(now, now) is None
    planner.step_started()
    planner.stepped(5, 0.6)
    assert planner.hold(now, now).merges


def test_a_step_that_computes_prompts_takes_no_merging_hold_for_what_is_due_before_it_would_end():
    """The merging hold above (the other phase due in 1.0 s) is not taken where new prompts came in whose step
    would outlast that: the awaited sequence is in by its end, present for the next step. A short prompt, whose step
    ends before the due, leaves the hold as it was, and so does a long one that the step budget cuts short, or a
    duplicate open's; a step that started takes its prompts with it."""
    planner = _planner(fixed_s=0.5, per_token_s=0.02)
    planner.split = False
    now = _alternating(planner)
    planner.plan_phases(now)
    assert planner.hold(now, now).merges
    short = OpenCmd(SeqKey(2, 1), tuple(range(2)), SamplingParams())
    planner.submitted(short, now)
    assert planner.step_time.predict(1 + 2) < 1.0 and planner.hold(now, now).merges
    planner.submitted(OpenCmd(KEYS[1], tuple(range(60)), SamplingParams()), now)  # a duplicate: the awaited one's
    assert planner.hold(now, now).merges
    planner.submitted(OpenCmd(SeqKey(2, 2), tuple(range(60)), SamplingParams()), now)
    assert planner.step_time.predict(5 + 62) > 1.0 > planner.step_time.predict(12)
    planner.max_step_tokens = 12  # the step computes 12 tokens at most: over before the due
    assert planner.hold(now, now).merges
    planner.max_step_tokens = None
    assert planner.hold(now, now) is None
    planner.step_started()  # its prompts computed: the next step's hold is the merge's again (once per 4 steps)
    for _ in range(planner.merge_rounds):
        planner.stepped(5, 0.6)
    assert planner.hold(now, now).merges

    # one awaited sequence due within the prompts' step and one after it: the hold is decided as before
    planner = _planner(fixed_s=0.5, per_token_s=0.02)
    planner.split = False
    now = _alternating(planner)
    planner.submitted(_propose(KEYS[5]), now - 2.0)
    planner.replied(_verdict(KEYS[5]), now + 0.5)  # due 1.4 s later, the other 0.5 s after now + 0.5
    later = now + 0.5
    planner.plan_phases(later)
    before = planner.hold(later, later)
    planner.submitted(OpenCmd(SeqKey(2, 3), tuple(range(20)), SamplingParams()), later)
    assert 0.5 < planner.step_time.predict(5 + 20) < 1.4
    assert before is not None and planner.hold(later, later) == before

    # one due within the prompts' step and one too late for any hold: the first is not merged for either
    def one_late() -> tuple[PhasePlanner, float]:
        planner = _planner(fixed_s=0.5, per_token_s=0.02)
        planner.split = False
        now = _alternating(planner)
        planner.submitted(_propose(KEYS[5]), now - 2.0)
        planner.replied(_verdict(KEYS[5]), now + 1.6)  # due 3.0 s from now, past 4 savings
        planner.plan_phases(now)
        return planner, now

    planner, now = one_late()
    assert planner.hold(now, now).merges
    planner, now = one_late()
    planner.submitted(OpenCmd(SeqKey(2, 3), tuple(range(60)), SamplingParams()), now)
    assert 1.0 < planner.step_time.predict(5 + 60, marginal_beyond=True) < 3.0
    assert planner.hold(now, now) is None


def test_an_open_counts_its_prompt_once_and_not_once_closed():
    """Opens of one sequence twice in a step count its prompt once (else a client could make a short prompt look
    long), and a sequence closed before the step counts none: the merging hold stays."""
    planner = _planner(fixed_s=0.5, per_token_s=0.02)
    planner.split = False
    now = _alternating(planner)
    planner.plan_phases(now)
    key = SeqKey(2, 1)
    for _ in range(30):
        planner.submitted(OpenCmd(key, tuple(range(2)), SamplingParams()), now)
        planner.submitted(OpenCmd(key, tuple(range(60)), SamplingParams()), now)
    assert planner.hold(now, now).merges
    planner.submitted(OpenCmd(SeqKey(2, 2), tuple(range(60)), SamplingParams()), now)
    assert planner.hold(now, now) is None
    planner.submitted(CloseCmd(SeqKey(2, 2)), now)
    assert planner.hold(now, now).merges
    planner.submitted(OpenCmd(SeqKey(3, 1), tuple(range(60)), SamplingParams()), now)
    planner.stream_closed(3)
    assert planner.hold(now, now).merges


def test_a_step_that_computes_prompts_still_waits_for_sequences_due_within_the_saving():
    """The plain rule's hold (the late half due in 0.1 s, within a step's 0.5 s fixed part) is kept with new prompts
    present: without it the late ones would miss the step and come back a phase of their own."""
    planner, sent = _one_phase_with_late_half(turnaround=0.1)
    now = sent + 0.05
    before = planner.hold(now, now)
    planner.submitted(OpenCmd(SeqKey(2, 1), tuple(range(60)), SamplingParams()), now)
    assert before is not None and not before.merges and planner.hold(now, now) == before


def test_a_merging_hold_waits_for_the_whole_other_phase_as_it_comes_in():
    """Two sequences per phase: the first of the awaited phase coming in (now present) does not make the second
    look like the present phase; the hold waits on for it, up to the merging allowance."""
    planner = _planner(fixed_s=0.5, per_token_s=0.02)
    planner.split = False
    now = _alternating(planner, per_phase=2)
    planner.plan_phases(now)
    first = planner.hold(now, now)
    assert first is not None and first.merges and first.num_awaited == 2
    planner.submitted(_propose(KEYS[2]), now + 0.9)
    again = planner.hold(now + 0.9, now)
    assert again is not None and again.merges and again.num_awaited == 1
    assert again.deadline > now + 2 * again.saving_s  # past what a plain hold would wait


def test_a_pipelined_sequence_answered_with_the_awaited_ones_is_of_their_phase():
    """A sequence whose next proposal was in before its verdict (pipelined) is present at once; answered by the
    same step as the awaited one, it is of its phase: the plain rule holds, and the awaited one, due past the
    saving, is not waited for (a merging hold would wait)."""
    planner = _planner(fixed_s=0.5, per_token_s=0.02)
    planner.split = False
    t = _rounds(planner, KEYS[:2], turnaround=0.8, draft_seconds=0.7)
    piped = KEYS[0]
    planner.submitted(_propose(piped), t + 0.01)  # drafted ahead: its next block is in before its verdict
    planner.stepped(10, 0.7)
    for key in KEYS[:2]:
        planner.replied(_verdict(key), t + 0.7)
    now = t + 0.7
    planner.plan_phases(now)
    assert planner.hold(now, now) is None


def test_a_stream_late_twice_in_a_row_is_not_waited_for():
    """Stream 2's sequences come back just past due, twice: the steps stop waiting for them (its own arrivals
    on time would make it waited for again)."""
    others = [SeqKey(2, i) for i in range(1, 5)]

    def late_twice(max_late: int) -> HoldDecision | None:
        planner = _planner(fixed_s=0.5, per_token_s=0.02)
        planner.max_late = max_late
        now = _rounds(planner, KEYS[:4] + others, turnaround=0.1, draft_seconds=0.09) + 0.5
        for _ in range(3):
            for key in KEYS[:4] + others:
                planner.replied(_verdict(key), now)
            for key in KEYS[:4]:
                planner.submitted(_propose(key), now + 0.05)
            decision = planner.hold(now + 0.05, now + 0.05)
            for key in others:
                planner.submitted(_propose(key), planner._streams[2].due(now, planner.min_slack_s) + 0.01)
            now += 1.0
        return decision

    assert late_twice(max_late=99) is not None  # still due soon enough to wait for
    assert late_twice(max_late=2) is None


def test_a_sequence_whose_next_proposal_is_already_in_is_not_awaited():
    """Pipelined drafting: the next block arrives before the verdict of the one in flight."""
    planner, sent = _one_phase_with_late_half(turnaround=0.1)
    key = SeqKey(2, 1)
    planner.submitted(_propose(key), sent + 1.0)
    planner.submitted(_propose(key), sent + 1.01)  # drafted ahead
    planner.replied(_verdict(key), sent + 1.2)
    assert key not in planner._awaited
    planner.replied(_verdict(key), sent + 1.4)
    assert key in planner._awaited


def test_ended_closed_silent_and_unknown_sequences_are_forgotten():
    planner, sent = _one_phase_with_late_half(turnaround=0.1)
    planner.submitted(_propose(KEYS[4]), sent + 0.1)
    planner.replied(_verdict(KEYS[4], finished=True), sent + 0.2)
    planner.replied(ErrorOut(KEYS[5], ErrorCode.DEADLINE_EXCEEDED, "idle"), sent + 0.2)
    planner.submitted(CloseCmd(KEYS[6]), sent + 0.2)
    planner.replied(_verdict(KEYS[6]), sent + 0.2)  # its verdict was in flight when it closed: ignored
    planner.replied(DroppedOut(KEYS[0], 10, 12), sent + 0.2)  # stale, the sequence goes on: its next one comes
    planner.submitted(_propose(SeqKey(1, 0)), sent + 0.2)  # seq 0 names no sequence
    planner.replied(_verdict(SeqKey(3, 9)), sent + 0.2)  # never proposed here
    assert set(planner._awaited) == {KEYS[7]}
    assert set(planner._outstanding) == set(KEYS[1:4])
    planner.plan_phases(sent + 10.0)  # silent for far longer than its turnaround
    assert not planner._awaited
    planner.stream_closed(1)
    assert not planner._outstanding and not planner._block_tokens and not planner._streams


# -- the engine's cap ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_text_pair(tmp_path_factory.mktemp("phases"), "qwen2")


def test_a_capped_step_verifies_the_others_first_in_the_next_and_outputs_do_not_change(pair):
    target, _ = pair
    engine = build_engine(VerifierConfig(model=str(target), dtype="float64", block_size=4, max_draft_tokens=4))
    prompts = {SeqKey(1, i): [3 + i, 7, 11, 13] for i in range(1, 5)}
    n = 12
    oracle = {key: greedy_continuation(target, prompt, n) for key, prompt in prompts.items()}
    for key, prompt in prompts.items():
        engine.submit(OpenCmd(key, tuple(prompt), SamplingParams(temperature=0.0, max_tokens=n,
                                                                 ignore_eos=True).with_seed()))
    engine.step()  # the prefills
    out: dict[SeqKey, list[int]] = {key: [] for key in prompts}
    served: list[set[SeqKey]] = []
    pending: set[SeqKey] = set()
    for _ in range(40):
        for key in prompts:
            if len(out[key]) < n and key not in pending:
                j = len(out[key])
                engine.submit(ProposeCmd(key, len(prompts[key]) + j, tuple(oracle[key][j:j + 3]), None))
                pending.add(key)
        verdicts = [o for o in engine.step(max_verifications=2).outcomes if isinstance(o, VerdictOut)]
        if not verdicts:
            break
        assert len(verdicts) <= 2
        served.append({v.key for v in verdicts})
        for v in verdicts:
            out[v.key].extend(v.token_ids)
            pending.discard(v.key)
    assert served[0] | served[1] == set(prompts)  # those left out of a step go first in the next
    assert out == oracle


def test_a_block_drafted_after_a_catch_up_teaches_the_plan_nothing_of_the_drafts_times():
    """Proposal.catch_up_tokens: the round's time away and its draft_seconds are mostly the draft feeding tokens
    it had not seen, not what its rounds take: neither its turnaround nor its compute is learnt from it. The
    field crosses the wire as the draft sends it, and is unset for a usual round."""
    from draft_service.link_messages import proposal_message
    from draft_service.types import DraftBlock
    from verifier_service.servicer import VerifierServicer

    planner = _planner(0.5, 0.02)
    now = _rounds(planner, KEYS, turnaround=0.2, draft_seconds=0.1)
    times = planner._streams[1]

    def learnt():
        return [(a.mean, a.deviation) if a else None for a in (times.turnaround, times.compute, times.plain_turnaround)]

    before = learnt()
    for key in KEYS:
        planner.replied(_verdict(key), now + 0.5)
    for key in KEYS:
        planner.submitted(dataclasses.replace(_propose(key, draft_seconds=2.5), catch_up_tokens=40), now + 3.5)
    assert learnt() == before
    for key in KEYS:  # the next usual round counts again
        planner.replied(_verdict(key), now + 4.0)
    for key in KEYS:
        planner.submitted(_propose(key, draft_seconds=0.1), now + 4.4)
    assert learnt()[0][0] > before[0][0]

    limits = Limits(vocab_size=100, max_model_len=64, max_draft_tokens=4, max_q_support=16)
    for catch_up in (0, 40):
        block = DraftBlock((5, 6), None, draft_seconds=0.5, catch_up_tokens=catch_up)
        msg = proposal_message(7, 10, block, send_draft_probs=False, assumed_token_ids=(), max_draft_tokens=4)
        assert msg.propose.HasField("catch_up_tokens") == bool(catch_up)
        cmd = VerifierServicer._proposal(msg.propose, 1, None, limits)
        assert isinstance(cmd, ProposeCmd) and cmd.catch_up_tokens == catch_up and cmd.draft_seconds == 0.5
    # the draft's backlog (Proposal.draft_backlog_tokens) crosses as sent, 0 included; unset reads as unknown
    for backlog in (None, 0, 9):
        msg = proposal_message(7, 10, DraftBlock((), None), send_draft_probs=False, assumed_token_ids=(),
                               max_draft_tokens=4, draft_backlog_tokens=backlog)
        cmd = VerifierServicer._proposal(msg.propose, 1, None, limits)
        assert isinstance(cmd, ProposeCmd) and cmd.draft_backlog_tokens == backlog


def test_draft_seconds_must_be_a_finite_time():
    limits = Limits(vocab_size=100, max_model_len=64, max_draft_tokens=4, max_q_support=16)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ServiceError) as err:
            check_proposal(_propose(SeqKey(1, 1), draft_seconds=bad), limits)
        assert err.value.code is ErrorCode.INVALID_ARGUMENT
    check_proposal(_propose(SeqKey(1, 1), draft_seconds=0.25), limits)


@pytest.mark.parametrize("whole_batch", [False, True])
def test_the_engine_loop_steps_with_the_plans_cap_and_reports_its_holds(pair, whole_batch):
    """AsyncEngine asks the planner before each step and passes its cap to the engine, and with
    --whole-batch-goodput the sequences the plan waits for (None without it)."""
    import asyncio

    from verifier_service.async_engine import AsyncEngine
    from verifier_service.metrics import VerifierMetrics

    target, _ = pair
    engine = build_engine(VerifierConfig(model=str(target), dtype="float64", block_size=4, max_draft_tokens=4))
    real_step, caps, verified, awaits, holds = engine.step, [], [], [], []

    def step(max_verifications=None, awaited=None, held_s=0.0):
        caps.append(max_verifications)
        awaits.append(awaited)
        holds.append(held_s)
        result = real_step(max_verifications, awaited, held_s)
        verified.append(sum(isinstance(o, VerdictOut) for o in result.outcomes))
        return result

    engine.step = step
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True).with_seed()

    async def scenario() -> list[list[VerdictOut]]:
        async_engine = AsyncEngine(engine, VerifierMetrics(), whole_batch_goodput=whole_batch)
        async_engine.phases.max_verifications = lambda: 1
        planned_hold = async_engine._planned_hold

        async def hold():  # the plan held 0.2 s, 0.123 of it for sequences asked to draft
            held, cap = await planned_hold()
            async_engine._held_for_drafts = 0.123
            return 0.2, cap

        async_engine._planned_hold = hold
        async_engine.start()
        stream_id, outbox = async_engine.open_stream()
        keys = [SeqKey(stream_id, i) for i in (1, 2)]
        for key in keys:
            async_engine.submit(OpenCmd(key, (3, 4, 5, 6), greedy))
        for key in keys:
            async_engine.submit(ProposeCmd(key, 4, (7, 7), None))
        verdicts = [await asyncio.wait_for(outbox.get(), 30) for _ in keys]
        await async_engine.stop()
        return verdicts

    verdicts = asyncio.run(scenario())
    assert {v.key.seq_id for v in verdicts} == {1, 2}
    assert 1 in caps  # the plan's cap reached the engine
    assert max(verified) == 1  # one verification per step, though both proposals came together
    assert all(isinstance(a, frozenset) for a in awaits) if whole_batch else set(awaits) == {None}
    assert set(holds) == {0.123}  # the hold for drafting sequences goes to the engine (priced apart)


def test_the_sequences_the_plan_waits_for_are_the_ones_it_has_not_given_up_on():
    """awaited_keys(), what the goodput choice prices beside a step: answered and not back, of streams with an
    estimate and not late twice in a row, not expired; none under two phases; a closed stream's are gone."""
    planner, sent = _one_phase_with_late_half(turnaround=0.1)
    assert planner.awaited_keys() == frozenset(KEYS[4:])
    planner._streams[1].late_in_a_row = planner.max_late
    assert planner.awaited_keys() == frozenset()
    planner._streams[1].late_in_a_row = 0
    planner._expired.add(KEYS[4])
    assert planner.awaited_keys() == frozenset(KEYS[5:])
    fresh = SeqKey(9, 1)  # a stream with no turnaround measured yet
    planner.submitted(_propose(fresh), sent)
    planner.replied(_verdict(fresh), sent + 0.1)
    assert fresh in planner._awaited and fresh not in planner.awaited_keys()
    planner.stream_closed(1)
    assert planner.awaited_keys() == frozenset()
    split, _ = _one_phase_with_late_half(turnaround=0.1)
    split.plan = PhasePlan(2, 1.0, 1.2)
    assert split.awaited_keys() == frozenset()
