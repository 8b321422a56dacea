"""The verifier's goodput controller (verifier_service.goodput) with synthetic step-time models."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verifier_service.goodput import Candidate, choose_draft_lengths
from verifier_service.step_time import AcceptanceTracker, StepTimeModel


def model_of(fn, sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)) -> StepTimeModel:
    """A step-time model that has seen steps of every size in `sizes` taking fn(n) seconds."""
    m = StepTimeModel()
    for n in sizes:
        for _ in range(20):
            m.observe(n, fn(n))
    return m


def memory_then_compute(n: int) -> float:
    """A GPU-like step: flat (weights-bound) up to 64 tokens, then 0.2 ms per token."""
    return 0.010 + 0.0002 * max(0, n - 64)


def compute_bound(n: int) -> float:
    """A CPU-like step: 1 ms per token on top of 2 ms."""
    return 0.002 + 0.001 * n


def expected_tokens(rates, k):
    return 1 + sum(itertools.accumulate(rates[:k], lambda a, b: a * b))


def test_an_idle_verifier_gets_the_full_k_and_a_loaded_one_plain_decoding():
    step = model_of(memory_then_compute)
    one = [Candidate("a", 4, (0.8,) * 4)]
    assert choose_draft_lengths(one, step).draft_lengths == {"a": 4}
    # 64 sequences: one token each already fills the flat part; every drafted token costs more than it brings
    many = [Candidate(i, 4, (0.8,) * 4) for i in range(64)]
    chosen = choose_draft_lengths(many, step)
    assert set(chosen.draft_lengths.values()) == {0}
    # in between, the batch shares the flat part: 16 sequences x 4 drafts = 64 tokens + 16
    mid = choose_draft_lengths([Candidate(i, 4, (0.8,) * 4) for i in range(16)], step)
    assert 0 < sum(mid.draft_lengths.values()) < 64


def test_the_batch_term_decides_not_each_sequence_alone():
    """Each sequence alone would draft its whole cap (1 + 4 tokens sit in the flat part); 32 of them together
    are past it, so drafting costs the batch goodput. A rule that prices each sequence's draft by its own step
    (dropping the batch term) chooses k = 4 here, and this test fails."""
    step = model_of(memory_then_compute)
    batch = [Candidate(i, 4, (0.7,) * 4) for i in range(32)]
    lengths = choose_draft_lengths(batch, step).draft_lengths
    assert sum(lengths.values()) < 32 * 4
    # what it chose is at least as good as every uniform k for the whole batch
    best_uniform = max(32 * expected_tokens((0.7,) * 4, k) / step.predict(32 * (1 + k)) for k in range(5))
    assert choose_draft_lengths(batch, step).goodput >= best_uniform * (1 - 1e-9)


def test_low_acceptance_lowers_k_at_any_load():
    step = model_of(compute_bound)
    # alone on a compute-bound verifier: a draft accepted 5 % of the time is never worth a token
    assert choose_draft_lengths([Candidate("x", 8, (0.05,) * 8)], step).draft_lengths == {"x": 0}
    # a draft that always agrees is worth its tokens when the step has a fixed part to share
    step_flat = model_of(memory_then_compute)
    assert choose_draft_lengths([Candidate("x", 8, (1.0,) * 8)], step_flat).draft_lengths == {"x": 8}


def test_better_sequences_get_the_tokens_first():
    step = model_of(memory_then_compute)
    good = [Candidate(("good", i), 8, (0.95,) * 8) for i in range(12)]
    bad = [Candidate(("bad", i), 8, (0.2,) * 8) for i in range(12)]
    lengths = choose_draft_lengths(good + bad, step).draft_lengths
    assert min(lengths[c.key] for c in good) > max(lengths[c.key] for c in bad)


def test_caps_are_kept_and_no_model_yet_means_the_caps():
    step = StepTimeModel()
    cands = [Candidate("a", 3, (0.9,) * 3), Candidate("b", 0, ())]
    assert choose_draft_lengths(cands, step).draft_lengths == {"a": 3, "b": 0}
    step = model_of(lambda n: 0.01)
    assert choose_draft_lengths(cands, step).draft_lengths == {"a": 3, "b": 0}


@settings(max_examples=60, deadline=None)
@given(rates=st.lists(st.lists(st.floats(0.0, 1.0), min_size=0, max_size=3), min_size=1, max_size=3),
       fixed=st.floats(0.0, 0.02), per_token=st.floats(0.0, 0.002), other=st.integers(0, 8),
       per_block_token=st.sampled_from([0.0, 0.0005, 0.003]), other_longest=st.integers(0, 2),
       per_drafted_token=st.sampled_from([0.0, 0.0004, 0.002]))
def test_the_choice_is_the_best_of_every_allocation(rates, fixed, per_token, other, per_block_token,
                                                    other_longest, per_drafted_token):
    """Against brute force over every combination of lengths (up to 3 sequences, k <= 3), the wait for
    drafting priced by the longest block and by the tokens drafted, the other work's included."""
    step = model_of(lambda n: fixed + per_token * n + 1e-4)
    cands = [Candidate(i, len(r), tuple(r)) for i, r in enumerate(rates)]
    other_drafted = 2 * other_longest
    chosen = choose_draft_lengths(cands, step, other_tokens=other, idle_per_block_token=per_block_token,
                                  other_longest_block=other_longest, idle_per_drafted_token=per_drafted_token,
                                  other_drafted=other_drafted)
    best = 0.0
    for ks in itertools.product(*(range(c.max_k + 1) for c in cands)):
        tokens = sum(expected_tokens(c.rates, k) for c, k in zip(cands, ks, strict=True))
        block = max(other_longest, *ks)
        wait = per_block_token * block + (per_drafted_token * (sum(ks) + other_drafted) if block else 0.0)
        best = max(best, tokens / (step.predict(len(cands) + other + sum(ks)) + wait))
    assert chosen.goodput == pytest.approx(best, rel=1e-9)
    lengths = [chosen.draft_lengths[c.key] for c in cands]  # the allocation is the one its goodput is of
    tokens = sum(expected_tokens(c.rates, k) for c, k in zip(cands, lengths, strict=True))
    assert chosen.expected_tokens == pytest.approx(tokens, rel=1e-9)
    assert chosen.step_tokens == len(cands) + other + sum(lengths)


def test_step_time_model_interpolates_and_guesses_proportionally_outside():
    m = StepTimeModel()
    assert not m.ready
    m.observe(8, 0.010)
    m.observe(32, 0.020)
    assert m.predict(8) == pytest.approx(0.010)
    assert m.predict(20) == pytest.approx(0.015)
    assert m.predict(4) == pytest.approx(0.005)  # untried smaller steps: in proportion (look cheap)
    assert m.predict(64) == pytest.approx(0.040)  # untried larger steps: in proportion (look dear)
    m.observe(16, 0.005)  # noise below a smaller step's time: the curve stays non-decreasing
    assert m.predict(16) >= m.predict(8)
    ns = [1, 4, 8, 12, 16, 20, 32, 64, 100]
    assert list(m.predict_many(np.array(ns))) == pytest.approx([m.predict(n) for n in ns])


def test_a_step_size_starts_from_the_faster_of_its_first_two_steps():
    """A size's first step may run cold (the service's first forwards), and a step beside other work runs slower:
    a bucket starts from the faster of its first two steps, and averages from the third; until its second it is
    not a size seen (has_seen: the calibration does not judge against a lone step). Through guidellm at 4 streams
    (default pair, 2 cores) a first 4-token step of 783 ms, averaged with the next two, priced 4-token steps at
    about 730 ms where they took 484 to 514."""
    m = StepTimeModel()
    m.observe(4, 0.783)
    assert m.predict(4) == pytest.approx(0.783) and not m.has_seen(4)  # all it has, not yet a size seen
    m.observe(4, 0.514)
    assert m.predict(4) == pytest.approx(0.514) and m.has_seen(4)
    m.observe(4, 0.484)
    assert m.predict(4) == pytest.approx(0.8 * 0.514 + 0.2 * 0.484)  # from here on, averaged (decay 0.8)
    m.observe(8, 0.6)  # another bucket's first steps are its own: the faster kept whichever came first
    m.observe(8, 0.9)
    assert m.predict(8) == pytest.approx(0.6) and m.has_seen(8)
    m.observe(4, 0.5)
    assert m.predict(4) == pytest.approx(0.8 * (0.8 * 0.514 + 0.2 * 0.484) + 0.2 * 0.5)
    # a bucket of several sizes (5 and 6 tokens) keeps the faster step's own size with its time
    m.observe(6, 0.7)
    m.observe(5, 0.55)
    assert m.predict(5) == pytest.approx(0.55) and m.predict(6) > 0.55


def test_a_rarely_seen_slow_step_size_does_not_price_the_sizes_seen_often():
    """On shared cores a few small steps run slow (a prefill beside them); the many steps of the usual size say
    what that size costs. The curve stays non-decreasing by pooling the two, weighted by how often each was seen,
    not by lifting the usual size to the rare maximum (which made longer drafts look free)."""
    m = StepTimeModel()
    for i in range(60):
        m.observe(6, 0.40)
        if i % 30 == 0:
            m.observe(2, 0.90)
    assert m.predict(6) < 0.5 and m.predict(2) <= m.predict(6)
    assert m.predict(8) == pytest.approx(m.predict(6) * 8 / 6)


def test_acceptance_tracker_conditions_on_earlier_positions_and_drifts_back():
    t = AcceptanceTracker(max_positions=4)
    for _ in range(30):
        t.observe("s", num_drafted=4, num_accepted=1)  # first accepted, second rejected, the rest unjudged
    rates = t.rates("s", 4)
    assert rates[0] > 0.9 and rates[1] < 0.15
    assert rates[2] == pytest.approx(t.shared_rate(2))  # never judged: the shared rate
    for _ in range(60):  # plain decoding: nothing judged, the sequence's own counts fade
        t.observe("s", num_drafted=0, num_accepted=0)
    assert t.rates("s", 2)[1] == pytest.approx(t.shared_rate(1), abs=0.02)
    t.forget("s")
    assert t.rates("s", 1) == [t.shared_rate(0)]


def test_a_few_old_rejections_do_not_hold_a_deep_position_down():
    """A first request's drafts were rejected at the third position; since then 8 sequences drafted one token a
    round for 25 rounds, every one accepted, so nothing reached the third position again. Its shared rate leans on
    the group's rate over all positions, and a CPU-like verifier with 8 sequences goes back to the full k. Taking
    the position's few old counts alone (with the fixed default as their prior) held it at 2."""
    t = AcceptanceTracker(4, decay=0.95, prior_strength=4.0, group_of=lambda key: key[0])
    t.observe(("s", 0), num_drafted=4, num_accepted=0)
    t.observe(("s", 0), num_drafted=4, num_accepted=2)
    t.forget(("s", 0))
    for _ in range(25):
        for i in range(1, 9):
            t.observe(("s", i), num_drafted=1, num_accepted=1)
    rates = t.rates(("s", 1), 4)
    assert rates[2] > 0.8 and rates[3] > 0.9
    step = model_of(lambda n: 0.4 + 0.02 * n)
    batch = [Candidate(("s", i), 4, tuple(t.rates(("s", i), 4))) for i in range(1, 9)]
    assert set(choose_draft_lengths(batch, step).draft_lengths.values()) == {4}
    # one rejection and nothing else: not counted twice (in the position and in the rate it is drawn towards)
    cold = AcceptanceTracker(4)
    cold.observe("x", num_drafted=4, num_accepted=0)
    assert cold.shared_rate(0, "x") == pytest.approx((0 + 2 * 0.7) / 3)
    # a position judged often keeps its own rate: rejected at the second position 40 times, it stays low
    for _ in range(40):
        t.observe(("s", 9), num_drafted=4, num_accepted=1)
    assert t.shared_rate(1, ("s", 9)) < 0.25


def test_the_other_work_s_output_is_priced_in():
    """15 fixed-k sequences (75 tokens, all accepted: 75 emitted) and one asking sequence with low acceptance, on a
    compute-bound verifier: a draft slows the others' output too, so the best for the batch is k = 0. Counting
    only the asking sequence's tokens (dropping other_output) chooses a draft."""
    step = model_of(lambda n: 0.001 * n)
    one = [Candidate("auto", 4, (0.3,) * 4)]
    assert choose_draft_lengths(one, step, other_tokens=75, other_output=75.0).draft_lengths == {"auto": 0}
    assert choose_draft_lengths(one, step, other_tokens=75).draft_lengths["auto"] > 0


def test_time_the_verifier_waits_between_steps_makes_drafts_cheaper():
    """A compute-bound step alone says every drafted token costs its share; when the verifier waits 20 ms between
    steps (the network, the draft), a step's extra tokens hardly lengthen the round."""
    step = model_of(lambda n: 0.001 * n)
    one = [Candidate("a", 4, (0.8,) * 4)]
    assert choose_draft_lengths(one, step).draft_lengths == {"a": 0}
    assert choose_draft_lengths(one, step, idle_s=0.020).draft_lengths == {"a": 4}


def test_probes_try_one_token_more_and_the_prior_is_per_group():
    from verifier_service.goodput import DraftLengthController

    control = DraftLengthController(4, step_time=model_of(lambda n: 0.001 * n), probe_every=3,
                                    max_probe_every=12, min_evidence=0.0)
    lengths = [control.choose({"a": 4}).draft_lengths["a"] for _ in range(36)]
    # one more than the best at the third choice; as long as no choice drafts, each probe comes twice as late
    # (a probe makes a draft held at k = 0 catch up on everything verified since), up to every 12th
    assert [i + 1 for i, k in enumerate(lengths) if k] == [3, 9, 21, 33]
    assert set(lengths) == {0, 1}
    control.idle_s = 0.020  # the verifier now waits between steps: drafting pays, and probes come every third
    lengths = [control.choose({"a": 4}).draft_lengths["a"] for _ in range(6)]
    assert lengths == [4] * 6
    assert control._probe_interval == 3
    control.idle_s = 0.0
    lengths = [control.choose({"a": 4}).draft_lengths["a"] for _ in range(6)]
    assert [k for k in lengths if k] == [1]  # three choices on, and no choice drafted since: then every sixth
    assert control._probe_interval == 6
    tracker = AcceptanceTracker(2, group_of=lambda key: key[0], max_groups=2)
    for _ in range(50):
        tracker.observe(("garbage", 1), 2, 0)  # one client's drafts are always rejected
    assert tracker.rates(("good", 1), 1)[0] == pytest.approx(tracker.default_rate)
    assert tracker.rates(("garbage", 2), 1)[0] < 0.1
    tracker.observe(("b", 1), 1, 1)
    tracker.observe(("c", 1), 1, 1)  # a third group: the least recently seen ("garbage") goes
    assert tracker.rates(("garbage", 2), 1)[0] == pytest.approx(tracker.default_rate)


def test_a_fresh_controller_probes_early_then_at_the_usual_rate():
    """A start on a few cold steps and one rejection held k at 0 for a whole first request at one stream (capacity
    bench, 2026-12-03: 30 steps until the 32nd choice probed). A fresh controller probes after 4 choices, then
    twice as late at each probe: up to probe_every while choices draft, further while none does."""
    from verifier_service.goodput import DraftLengthController

    idle = DraftLengthController(4, step_time=model_of(lambda n: 0.001 * n), probe_every=32, max_probe_every=512,
                                 min_evidence=0.0)
    lengths = [idle.choose({"a": 4}).draft_lengths["a"] for _ in range(130)]
    assert [i + 1 for i, k in enumerate(lengths) if k] == [4, 12, 28, 60, 124]  # k = 0 is best: 4, 8, 16, 32, 64
    idle.idle_s = 0.020  # drafting pays now: probes at the usual rate again, not the first ones'
    assert [idle.choose({"a": 4}).draft_lengths["a"] for _ in range(3)] == [4] * 3
    assert idle._probe_interval == 32

    drafting = DraftLengthController(4, step_time=model_of(lambda n: 0.001 * n), probe_every=32, min_evidence=0.0)
    drafting.idle_s = 0.020  # drafting pays: every choice drafts, the probes come every 4, 8, 16, then 32 choices
    intervals = []
    for _ in range(100):
        assert drafting.choose({"a": 4}).draft_lengths["a"] == 4
        intervals.append(drafting._probe_interval)
    assert [intervals[i] for i in (0, 3, 11, 27, 59, 91, 99)] == [4, 8, 16, 32, 32, 32, 32]


def test_time_waiting_for_drafting_makes_longer_drafts_dearer_unless_it_is_hidden():
    """A CPU verifier (mostly fixed cost) that waits 1 s per round, all of it the drafts drafting 4 tokens at
    0.25 s each: drafting is the dearest part of a long block, and the choice falls; the same 1 s taken as a
    wait no length changes keeps k = 4. With drafting hidden (the verifier does not wait: idle 0) it costs nothing,
    even after a spell of waiting."""
    from verifier_service.goodput import DraftLengthController

    def controller(idle_s: float, drafting_s: float | None, exposure: float = 0.0) -> DraftLengthController:
        c = DraftLengthController(4, step_time=model_of(lambda n: 0.5 + 0.02 * n), probe_every=0)
        c.idle_s, c.mean_longest_k, c.exposure = idle_s, 4.0, exposure
        for _ in range(50):
            if drafting_s is not None:
                c.observe_drafting(drafting_s, 4)
        return c

    caps = {i: 4 for i in range(8)}

    def mean_k(c: DraftLengthController) -> float:
        c.acceptance.default_rate = 0.6
        chosen = c.choose(caps)
        return sum(chosen.draft_lengths.values()) / len(caps)

    assert mean_k(controller(1.0, None)) == 4  # the draft does not say: the wait is fixed, as before
    waiting = controller(1.0, 1.0)
    assert waiting.exposure == pytest.approx(1.0, abs=0.01)
    assert mean_k(waiting) < 2
    hidden = controller(0.0, 1.0, exposure=1.0)
    assert hidden.exposure == pytest.approx(0.0, abs=0.01)
    assert mean_k(hidden) == mean_k(controller(0.0, None)) > 0


def test_the_wait_for_drafting_is_priced_by_the_longest_block():
    """A draft drafts its sequences' blocks in one batch, a token of each per draft step: the verifier waits as
    long as the longest block takes, whatever the others draft. One well-predicted sequence among seven poor ones
    then does not pay for holding up all eight (priced by the mean block, its tokens looked 8 times cheaper);
    eight well-predicted ones do, and they draft alike."""
    step = model_of(lambda n: 0.1)
    one_good = [Candidate("good", 4, (0.95,) * 4)] + [Candidate(i, 4, (0.05,) * 4) for i in range(7)]
    assert set(choose_draft_lengths(one_good, step, idle_per_block_token=0.05).draft_lengths.values()) == {0}
    all_good = [Candidate(i, 4, (0.95,) * 4) for i in range(8)]
    lengths = set(choose_draft_lengths(all_good, step, idle_per_block_token=0.05).draft_lengths.values())
    assert len(lengths) == 1 and lengths.pop() > 0


def test_the_tolerance_is_a_share_of_the_candidates_tokens_not_of_the_whole_step():
    """Within 3 % of the best goodput the longest draft is taken (noise in the estimates), but the 3 % is of what
    the candidates themselves yield: beside 100 tokens of fixed-k verifications on a compute-bound verifier, six
    drafted tokens lose 0.7 of the candidate's 6 expected tokens, well within 3 % of the whole step's goodput."""
    step = model_of(lambda n: max(0.05, 0.002 * n))
    one = [Candidate("a", 6, (0.95,) * 6)]
    assert choose_draft_lengths(one, step, tolerance=0.03).draft_lengths == {"a": 6}  # flat: drafting is free
    beside = choose_draft_lengths(one, step, other_tokens=100, other_output=100.0, tolerance=0.03)
    assert beside.draft_lengths["a"] <= 1


def test_the_tolerance_never_trades_a_best_plain_decoding_for_a_draft():
    """Plain decoding 2 % better than one drafted token: the tolerance (3 %) takes the longest near draft only
    where the best option drafts; where plain decoding is best it stays (at high load the estimates sit near
    break-even, and the tolerance turned every sequence to its longest draft at once)."""
    step = model_of(lambda n: 0.000661 + 0.01 * n, sizes=(1, 2, 3, 4))
    one = [Candidate("a", 1, (0.9,))]
    assert choose_draft_lengths(one, step, tolerance=0.0).draft_lengths == {"a": 0}
    assert choose_draft_lengths(one, step, tolerance=0.03).draft_lengths == {"a": 0}
    flat = model_of(lambda n: 0.01 + 0.0001 * n, sizes=(1, 2, 3, 4))
    assert choose_draft_lengths([Candidate("a", 1, (0.9,))], flat, tolerance=0.03).draft_lengths == {"a": 1}


def test_plain_decoding_is_priced_with_the_wait_of_rounds_that_draft_nothing():
    """A drafting round's proposals leave the draft together after its batch; a plain round's leave as each verdict
    is handled. Measured apart: steps after drafting rounds waited 0.6 s (0.2 s of it the one drafted token),
    after plain rounds 0.02 s. Plain decoding priced with its own wait wins; priced with the drafting rounds'
    fixed part (one average for both, as before), a draft looked better."""
    from verifier_service.goodput import DraftLengthController

    c = DraftLengthController(1, step_time=model_of(lambda n: 0.5 + 0.01 * n), probe_every=0)
    for i in range(40):
        drafting = i % 2 == 0
        c.observe_step(16 if drafting else 8, 0.66 if drafting else 0.58, 0.6 if drafting else 0.02)
        c.observe_drafting(0.2 if drafting else 0.0, 1 if drafting else 0, drafting, 8 if drafting else 0)
    assert c.plain_idle_s == pytest.approx(0.02, rel=0.01) and c.draft_idle_s == pytest.approx(0.6, rel=0.01)
    fixed, per_block, per_drafted, plain = c.idle_split()
    assert fixed == pytest.approx(0.4, rel=0.05) and plain == c.plain_idle_s
    assert per_block + 8 * per_drafted == pytest.approx(0.2, rel=0.05)  # each round: a token for 8 sequences
    c.acceptance.default_rate = 0.9
    caps = {i: 1 for i in range(8)}
    assert set(c.choose(caps).draft_lengths.values()) == {0}
    c.plain_idle_s = None  # one wait for both kinds of round
    assert set(c.choose(caps).draft_lengths.values()) == {1}
    c.plain_idle_s = 0.02
    c.observe_step(16, 0.66, 0.6)
    c.observe_drafting(0.2, 1, True, 8)
    assert c._steps_since_plain == 1
    for _ in range(10):  # plain steps the phase plan held 1.28 s for sequences away drafting: not plain's wait
        c.observe_step(8, 0.58, 1.3, held_s=1.28)
        c.observe_drafting(0.0, 0, False, 0)
    assert c.plain_idle_s == pytest.approx(0.02, rel=0.01) and c._steps_since_plain == 0  # not a quiet spell
    assert set(c.choose(caps).draft_lengths.values()) == {0}
    before = c.draft_idle_s
    c.observe_step(16, 0.66, 0.9, held_s=0.3)  # a drafting step keeps its hold: it waited for its own drafts
    c.observe_drafting(0.2, 1, True, 8)
    assert c.draft_idle_s == pytest.approx(0.8 * before + 0.2 * 0.9, rel=0.01)
    # a step after the draft fed a catch-up first (Proposal.catch_up_tokens): its wait says nothing of drafting's
    state = (c.draft_idle_s, c.plain_idle_s, c.mean_longest_k, c.mean_drafted_m, c.exposure, c._steps_since_plain)
    c.observe_step(16, 0.66, 0.6)  # a wait that counts (not a quiet spell) but for the catch-up
    c.observe_drafting(0.5, 1, True, 8, catch_up_tokens=40)
    assert (c.draft_idle_s, c.plain_idle_s, c.mean_longest_k, c.mean_drafted_m, c.exposure,
            c._steps_since_plain) == state


def test_a_catch_up_round_teaches_the_price_of_drafting_by_its_rows():
    """Under auto, the drafting rounds after plain ones are catch-ups: the draft feeds every token verified since
    its last block in its first step's rows. The draft here takes 70 ms a step and 6.5 ms a row. Its first round,
    cold, took 1.0 s for 4 tokens of one sequence; then only probes come, 4 sequences' one token each after 24
    tokens of catch-up (28 rows, 0.252 s). Learnt from, a usual round of 4 tokens for 4 sequences is priced
    nearer what it takes (0.38 s), and drafting wins; left out, the cold round's 1.27 s stays the price, and the
    choice with it is plain decoding (measured so at 4 streams, default pair, 2 cores: auto drafted 0.09 tokens
    a verification)."""
    from verifier_service.goodput import DraftLengthController

    c = DraftLengthController(4, step_time=model_of(lambda n: 0.3 + 0.01 * n), probe_every=0)
    c.acceptance.default_rate = 0.9
    c.observe_step(5, 0.35, None)
    c.observe_drafting(1.0, 4, True, 4)
    cold = c.draft_time.predict(4, 16)
    assert cold == pytest.approx(1.0 * (1 + 0.1 * 4) / 1.1, rel=0.02)  # the prior: a row 0.1 of a step's fixed part
    assert not any(c.choose({i: 4 for i in range(4)}).draft_lengths.values())
    for _ in range(30):
        c.observe_step(4, 0.34, 0.01)
        c.observe_drafting(0.0, 0, False, 0)
        c.observe_step(8, 0.38, 0.3)
        c.observe_drafting(0.07 + 28 * 0.0065, 1, True, 4, catch_up_tokens=24)
    assert 0.35 < c.draft_time.predict(4, 16) < 0.8
    assert set(c.choose({i: 4 for i in range(4)}).draft_lengths.values()) == {4}
    assert c.last_price[4] > 0 and c.last_price[4] == pytest.approx(c.exposure * c.draft_time.catch_up_coefficient())
    # the choice prices a catch-up's rows by that coefficient: sequences that never drafted feed their 40 tokens
    sizes = {i: (40, 40) for i in range(4, 8)}
    assert set(c.choose({i: 4 for i in range(4, 8)}, sizes=sizes).draft_lengths.values()) == {4}
    c.draft_time.catch_up_coefficient = lambda: 0.08
    assert not any(c.choose({i: 4 for i in range(4, 8)}, sizes=sizes).draft_lengths.values())
    # over two draft processes (Verify streams), two sequences each, the rows go into two batches side by side
    from verifier_service.types import SeqKey

    two = [SeqKey(1 + i % 2, i) for i in range(4)]
    chosen = c.choose(dict.fromkeys(two, 4), sizes={k: (40, 40) for k in two}, probe=False)
    assert set(chosen.draft_lengths.values()) == {4}
    c.draft_time.catch_up_coefficient = lambda: 0.2  # halved once, still too dear
    assert not any(c.choose(dict.fromkeys(two, 4), sizes={k: (40, 40) for k in two}, probe=False).draft_lengths.values())
    # a batch is learnt once (several steps may verify its blocks, each with its whole catch-up), and one of more
    # rows than max_catch_up_rows (a prompt's, or a draft's claim) not at all
    learnt = c.draft_time.predict(4, 16)
    c.observe_drafting(1.0, 1, True, 4, catch_up_tokens=24, batch=(1, 1.0))
    once = c.draft_time.predict(4, 16)
    assert once > learnt
    for i in range(20):
        c.observe_drafting(1.0, 1, True, 4, catch_up_tokens=24, batch=(1, 1.0))
        c.observe_drafting(5.0, 1, True, 4, catch_up_tokens=c.max_catch_up_rows + 1, batch=(1, 2.0 + i))
    c.observe_drafting(0.0, 0, True, 0, catch_up_tokens=24, batch=(1, 9.0))  # nothing drafted: nothing to learn
    assert c.draft_time.predict(4, 16) == once


def test_a_step_is_priced_by_what_steps_of_its_kind_took_against_the_model():
    """The step-time model (learnt from every step, prompt chunks too) says 0.5 + 0.01 n s, and steps that verify
    nothing drafted take that, while steps that verify drafted tokens take 1.5 times it (sampling per drafted
    position, attention over each sequence's context). Priced by the model alone one drafted token per sequence
    wins; priced by each kind's ratio plain decoding does. Steps with prompt chunks (drafted None) are not
    counted."""
    from verifier_service.goodput import DraftLengthController

    def model(n: int) -> float:
        return 0.5 + 0.01 * n

    c = DraftLengthController(1, step_time=model_of(model), probe_every=0)
    c.acceptance.default_rate = 0.9
    caps = {i: 1 for i in range(32)}
    assert set(c.choose(caps).draft_lengths.values()) == {1}
    for i in range(60):
        drafting = i % 2 == 0
        n = 64 if drafting else 32
        c.observe_step(n, model(n) * (1.5 if drafting else 1.0))
        c.observe_drafting(0.0, 0, drafting)
        c.step_time = model_of(model)  # the model as it was: only the ratios learn here
        c.observe_step(200, 0.1)  # a step with prompt chunks, far off the model: not counted
        c.observe_drafting(0.0, 0, None)
        c.step_time = model_of(model)
    assert c.draft_step_ratio == pytest.approx(1.5, rel=0.05) and c.plain_step_ratio == pytest.approx(1.0, rel=0.05)
    assert set(c.choose(caps).draft_lengths.values()) == {0}
    c.calibrate, c.draft_step_ratio = False, 1.0
    assert set(c.choose(caps).draft_lengths.values()) == {1}


def test_two_slow_steps_do_not_move_a_kinds_step_time_ratio_but_a_lasting_change_does():
    """Two plain steps slowed by something else (the draft's forwards beside them on a shared host) leave plain
    decoding's price as it was; steps that stay slower move it."""
    from verifier_service.goodput import DraftLengthController

    def model(n: int) -> float:
        return 0.5 + 0.01 * n

    c = DraftLengthController(1, step_time=model_of(model), probe_every=0)

    def plain_step(slower: float) -> None:
        c.observe_step(16, model(16) * slower)
        c.observe_drafting(0.0, 0, False)
        c.step_time = model_of(model)  # only the ratios learn here

    for _ in range(10):
        plain_step(1.0)
    for _ in range(2):
        plain_step(1.6)
    assert c.plain_step_ratio == pytest.approx(1.0, abs=0.02)
    for _ in range(12):
        plain_step(1.5)
    assert c.plain_step_ratio == pytest.approx(1.5, abs=0.05)


def test_a_kinds_ratios_from_before_a_long_run_of_the_other_kind_are_set_aside():
    """Drafting steps took 1.4 times the model; then plain decoding ran long enough for the drafting ratio to
    drift back towards 1. The next drafting step, as the model says, lowers the ratio further: the old window of
    1.4s is not its median."""
    from verifier_service.goodput import STALE_RATIO_STEPS, DraftLengthController

    def model(n: int) -> float:
        return 0.5 + 0.01 * n

    c = DraftLengthController(1, step_time=model_of(model), probe_every=0)
    for drafting, slower, steps in ((False, 1.0, 3), (True, 1.4, 20), (False, 1.0, STALE_RATIO_STEPS + 1),
                                    (True, 1.0, 1)):
        for _ in range(steps):
            before = c.draft_step_ratio
            c.observe_step(32 if drafting else 16, model(32 if drafting else 16) * slower)
            c.observe_drafting(0.0, 0, drafting)
            c.step_time = model_of(model)
    assert 1.0 < c.draft_step_ratio < before < 1.4


def test_plain_decoding_waits_no_longer_than_a_drafting_round():
    """Plain rounds' last waits were long (a client's pause between requests), and since then one sequence drafting
    made every round a drafting one, whose fixed wait is short: once that has lasted STALE_PLAIN_STEPS steps,
    plain decoding is priced with the shorter; before, with its own."""
    from verifier_service.goodput import STALE_PLAIN_STEPS, DraftLengthController

    c = DraftLengthController(1, step_time=model_of(lambda n: 0.25 + 0.005 * n), probe_every=0)
    for _ in range(3):
        c.observe_step(4, 0.27, 0.5)
        c.observe_drafting(0.0, 0, False)
    for _ in range(STALE_PLAIN_STEPS - 1):
        c.observe_step(5, 0.275, 0.08)
        c.observe_drafting(0.07, 1, True)
    assert c.idle_split()[3] == c.plain_idle_s > 0.3
    for _ in range(30):
        c.observe_step(5, 0.275, 0.08)
        c.observe_drafting(0.07, 1, True)
    fixed, per_token, _, plain = c.idle_split()
    assert c.plain_idle_s > 0.3 and plain == fixed == pytest.approx(0.01, abs=0.005)
    c.acceptance.default_rate = 0.2
    assert set(c.choose({i: 1 for i in range(4)}).draft_lengths.values()) == {0}


def test_a_step_of_a_size_never_seen_does_not_calibrate_its_kind():
    """A fresh verifier has seen one prompt chunk (64 tokens in 0.5 s): a first 5-token verification, which the model
    guesses in proportion (0.04 s) and which takes 0.4 s, says nothing of how verifications differ, and moves no
    ratio; once 5-token steps have been seen, their ratio is learnt."""
    from verifier_service.goodput import DraftLengthController

    c = DraftLengthController(4, probe_every=0)
    c.observe_step(64, 0.5)
    c.observe_drafting(0.0, 0, None)
    c.observe_step(5, 0.4)
    c.observe_drafting(0.1, 4, True)
    assert c.draft_step_ratio == 1.0 and c.plain_step_ratio == 1.0
    for _ in range(20):
        c.observe_step(5, 0.4)
        c.observe_drafting(0.1, 4, True)
    assert c.draft_step_ratio == pytest.approx(1.0, abs=0.1)  # the model now knows 5-token steps itself


def test_a_size_s_lone_first_step_does_not_calibrate_its_kind():
    """A cold first 5-token verification (0.8 s), then a warm one (0.4 s): the bucket starts from the faster, and
    the second is not judged against the lone first (the model corrects that itself; judged, the ratio would
    correct it again, and price drafting steps at half their time); from the third on, steps are judged."""
    from verifier_service.goodput import DraftLengthController

    c = DraftLengthController(4, probe_every=0)
    c.observe_step(64, 0.5)
    c.observe_drafting(0.0, 0, None)
    for seconds in (0.8, 0.4):
        c.observe_step(5, seconds)
        c.observe_drafting(0.1, 4, True)
    assert c.draft_step_ratio == 1.0 and c.plain_step_ratio == 1.0
    c.observe_step(5, 0.6)  # judged against the bucket's 0.4
    c.observe_drafting(0.1, 4, True)
    assert c.draft_step_ratio > 1.0


def test_a_choice_without_a_step_time_model_is_not_judged_against_plain_decoding():
    """With no step seen, every candidate gets its cap and there is no plain price to judge it by: decline_below
    leaves it (a gain of 0 would turn it plain)."""
    from verifier_service.goodput import decline_below

    chosen = choose_draft_lengths([Candidate(i, 4, (0.9,) * 4) for i in range(4)], StepTimeModel())
    assert decline_below(chosen, 0.5) is chosen and sum(chosen.draft_lengths.values()) == 16


def test_the_draft_time_model_prices_rounds_as_they_took_and_learns_the_per_sequence_part():
    """Rounds all for 16 sequences (M = 16 L) cannot tell a step's fixed part from its per-row part: the fit
    prices them as they took, and a round for 32 sequences at more (the prior: a row 0.1 of the fixed part);
    rounds for 1, 16 and 32 sequences recover a step of 0.07 s + 0.005 s a row."""
    from verifier_service.step_time import DraftTimeModel

    m = DraftTimeModel()
    assert not m.ready and m.predict(4, 64) == 0.0
    for _ in range(30):
        m.observe(4 * 0.15, 4, 64)
    assert m.predict(4, 64) == pytest.approx(0.6, rel=0.02)
    assert m.predict(4, 128) == pytest.approx(0.6 * 4.2 / 2.6, rel=0.02)  # 0.6 * (1 + 0.1 * 32) / (1 + 0.1 * 16)
    truth = DraftTimeModel()
    for _ in range(30):
        for rows, k in ((1, 4), (16, 2), (32, 4), (16, 1)):
            truth.observe(k * (0.07 + 0.005 * rows), k, rows * k)
    a, b = truth.coefficients()
    assert a == pytest.approx(0.07, rel=0.05) and b == pytest.approx(0.005, rel=0.05)
    skew = DraftTimeModel()
    for _ in range(30):  # rows cost nothing, more rows took less: never a negative term
        skew.observe(0.5, 1, 1)
        skew.observe(0.4, 1, 32)
    a, b = skew.coefficients()
    assert b == 0.0 and a == pytest.approx(0.45, rel=0.05)  # the per-step term alone


def test_a_catch_up_does_not_price_the_rows_of_drafting_for_more_sequences():
    """A draft step's time is concave in its rows (measured for the default draft on 2 cores: 70, 215, 284 and 440
    ms for 1, 16, 32 and 64 rows): a catch-up puts tens of rows into one step, each at a fraction of what one more
    sequence adds to every step. Here a step takes 60.5 ms and 9.5 ms a drafted row, a catch-up row 3.5 ms, and
    the draft served one and two streams, each request's first round feeding 40 rows of prompt. Learnt as drafted
    rows, the catch-ups priced a round of 4 tokens for 8 sequences at 0.35 s where it takes 0.55 (measured so at
    0b586a1: 8 streams after one, 0.45 s priced, about 0.67 s waited)."""
    from verifier_service.goodput import DraftLengthController

    a, b, c = 0.0605, 0.0095, 0.0035
    control = DraftLengthController(4, step_time=model_of(lambda n: 0.3 + 0.01 * n))
    for _ in range(6):
        for sequences in (1, 2):
            control.observe_drafting(4 * a + 4 * sequences * b + 40 * c, 4, True, 4 * sequences, catch_up_tokens=40)
            for _ in range(5):
                control.observe_drafting(4 * a + 4 * sequences * b, 4, True, 4 * sequences)
    m = control.draft_time
    assert m.coefficients()[1] == pytest.approx(b, rel=0.1)
    assert m.catch_up_coefficient() == pytest.approx(c, rel=0.1)
    assert m.predict(4, 32) == pytest.approx(4 * a + 32 * b, rel=0.05)
    assert m.predict(4, 8, 40) == pytest.approx(4 * a + 8 * b + 40 * c, rel=0.05)
    # rounds without a catch-up, for ever: the old ones' weight decays towards nothing, and c goes back to its
    # prior (a drafted row's, these rounds all for one sequence), through the rounds where that weight underflows
    cs = []
    for i in range(7000):
        m.observe(4 * a + 4 * b, 4, 4)
        if i >= 6500:
            cs.append(m.catch_up_coefficient())
    assert min(cs) == max(cs) == pytest.approx(m.coefficients()[1])


def _drafted_rounds_of_16_and_of_1():
    """A controller on a nearly flat verifier (0.4 s + 1 ms a token) that saw rounds of 4 tokens for 16 sequences
    (0.6 s) and for one (0.25 s) in turn, acceptance 0.7."""
    from verifier_service.goodput import DraftLengthController

    c = DraftLengthController(4, step_time=model_of(lambda n: 0.4 + 0.001 * n), probe_every=0)
    c.acceptance.default_rate = 0.7
    for _ in range(30):
        c.observe_step(80, 0.5, 0.62)
        c.observe_drafting(0.6, 4, True, 64)
        c.observe_step(68, 0.5, 0.27)
        c.observe_drafting(0.25, 4, True, 4)
    return c


def test_drafting_for_more_sequences_is_priced_by_its_rows():
    """The draft took 0.6 s for rounds of 4 tokens for 16 sequences and 0.25 s for one sequence's 4 (the probes):
    a step of about 0.057 s plus 0.0058 s a row. For 16 sequences the choice is what the longest block alone
    priced (0.15 s a token, whatever the sequences); for 64, whose rounds of 2 tokens each would take about 0.85
    s, plain decoding, where the longest block alone priced them at 0.3 s and drafted 2 for each."""
    c = _drafted_rounds_of_16_and_of_1()
    _, per_block, per_drafted, _ = c.idle_split()
    a, b = per_block / c.exposure, per_drafted / c.exposure
    assert a + 16 * b == pytest.approx(0.15, rel=0.1) and a + b == pytest.approx(0.0625, rel=0.2)
    sixteen, sixty_four = {i: 4 for i in range(16)}, {i: 4 for i in range(64)}
    by_rows = [sum(c.choose(caps).draft_lengths.values()) for caps in (sixteen, sixty_four)]
    c.draft_time.coefficients = lambda: (0.15, 0.0)  # the longest block alone
    by_block = [sum(c.choose(caps).draft_lengths.values()) for caps in (sixteen, sixty_four)]
    assert by_rows[0] == by_block[0] > 0
    assert by_rows[1] == 0 < by_block[1]


def test_a_long_wait_for_a_long_drafting_round_is_not_a_quiet_spell():
    """At 64 streams a round of 3 tokens for every sequence kept the verifier waiting 2.6 s, the draft's batch
    2.4 s of it: that wait is drafting, and counts; 2.6 s after a round the draft took 0.1 s for is a quiet spell
    (the verifier was idle), and does not."""
    from verifier_service.goodput import DraftLengthController

    c = DraftLengthController(4, step_time=model_of(lambda n: 0.5 + 0.01 * n), probe_every=0)
    c.observe_step(256, 3.0, 2.6)
    c.observe_drafting(2.4, 3, True, 192)
    assert c.draft_idle_s == pytest.approx(2.6)
    quiet = DraftLengthController(4, step_time=model_of(lambda n: 0.5 + 0.01 * n), probe_every=0)
    quiet.observe_step(256, 3.0, 2.6)
    quiet.observe_drafting(0.1, 3, True, 192)
    assert quiet.draft_idle_s is None


def test_a_probe_takes_a_few_sequences_in_turn():
    """A probe of all 64 sequences held at k = 0 made the draft catch all of them up and draft for all of them (2 s
    of the verifier waiting, at 64 streams on 2 cores). A probe takes max_probe_sequences of those below their cap,
    those probed longest ago first whatever the order the steps list them in, groups before sequences; a sequence
    at its cap is never one; a batch of at most that many is probed whole; thin groups' probes are bounded alike
    and count only for the groups they took; nothing is probed where the choice is to be plain decoding."""
    from verifier_service.goodput import DraftLengthController
    from verifier_service.types import SeqKey

    def controller(**kw):
        return DraftLengthController(4, step_time=model_of(lambda n: 0.001 * n), **kw)

    c = controller(probe_every=2, max_probe_every=2, min_evidence=0.0, max_probe_interval_s=float("inf"))
    keys = [SeqKey(1, i) for i in range(10)]
    few = {SeqKey(1, i): 4 for i in range(20, 23)}
    for key in [*keys, *few]:  # each drafted last round: none needs a catch-up
        c.observe_verification(key, 1, 0)
    picked = []
    for i in range(12):
        order = keys if i % 4 else keys[::-1]  # the steps list their sequences in another order now and then
        lengths = c.choose({**dict.fromkeys(order, 4), SeqKey(1, 99): 0}).draft_lengths
        if any(lengths.values()):
            assert set(lengths.values()) == {0, 1} and lengths[SeqKey(1, 99)] == 0
            picked.append({key for key, k in lengths.items() if k})
    assert len(picked) == 6 and all(len(p) == c.max_probe_sequences for p in picked)
    assert not picked[0] & picked[1] and len(picked[2] - picked[0] - picked[1]) == 2  # all ten by the third
    assert picked[0] | picked[1] | picked[2] == set(keys)
    assert any(set(c.choose(few).draft_lengths.values()) == {1} for _ in range(2))  # three: all of them
    mixed = {**{SeqKey(2, i): 4 for i in range(10)}, SeqKey(3, 0): 4}  # a stream of 10 and a stream of one
    for key in mixed:
        c.observe_verification(key, 1, 0)
    assert any(c.choose(mixed).draft_lengths[SeqKey(3, 0)] for _ in range(2))  # its first probe takes the one
    assert not any(any(c.choose(mixed, probe=False).draft_lengths.values()) for _ in range(8))
    c.forget(SeqKey(1, 0))
    assert SeqKey(1, 0) not in c._probed_at

    thin = controller(probe_every=32, max_probe_every=512, max_probe_interval_s=float("inf"))
    old = SeqKey(1, 0)
    for _ in range(300):  # an old group, judged often: the probes of all back off
        thin.observe_verification(old, 4, 4)
        thin.choose({old: 4})
    new = {SeqKey(g, i): 4 for g in range(2, 8) for i in range(2)}  # six new draft processes: thin
    lengths = [thin.choose({old: 4} | new).draft_lengths for _ in range(thin.first_probe_every)]
    assert [sum(p.values()) for p in lengths] == [0, 0, 0, thin.max_probe_sequences] and not lengths[3][old]
    took = {key.stream_id for key, k in lengths[3].items() if k}
    assert len(took) == thin.max_probe_sequences and set(thin._thin_probes) == took  # one each, counted so


def test_a_group_whose_acceptance_rests_on_few_verdicts_gets_probes_of_its_own():
    """One rejection of a fresh service's first, junk request held k at 0 at one stream until the second probe, 8
    choices after the first. While a group's first position has fewer than min_evidence verdicts, its own sequences
    get a probe every first_probe_every choices besides the probes of all, which back off as before; a group that
    arrives is probed within as many, alone; a sequence that may not draft (cap 0) makes no group thin, and a group
    whose probes never judge anything gets at most max_thin_probes."""
    from verifier_service.goodput import DraftLengthController
    from verifier_service.types import SeqKey

    a, new, silent, capped = SeqKey(1, 1), SeqKey(2, 1), SeqKey(3, 1), SeqKey(4, 1)  # four Verify streams
    c = DraftLengthController(4, step_time=model_of(lambda n: 0.001 * n), probe_every=32, max_probe_every=512,
                              max_probe_interval_s=float("inf"))
    c.observe_verification(a, 4, 0)
    probes = []
    for i in range(40):
        if c.choose({a: 4, capped: 0}).draft_lengths[a]:
            probes.append(i + 1)
            c.observe_verification(a, 1, 0)  # the probe's draft is rejected: k stays 0
    # all at 4, 12, 28 (twice as late each time: nothing drafted), the thin group's own at 8 and 16, until its
    # (decaying) count of verdicts passed 4
    assert probes == [4, 8, 12, 16, 28]
    for _ in range(300):
        c.choose({a: 4, capped: 0})
    assert c._probe_interval >= 128
    chosen = [c.choose({a: 4, new: 4}).draft_lengths for _ in range(4)]
    assert [lengths[new] for lengths in chosen] == [0, 0, 0, 1] and not any(lengths[a] for lengths in chosen)
    silent_probes = sum(bool(c.choose({a: 4, silent: 4}).draft_lengths[silent]) for _ in range(100))
    assert silent_probes == c.max_thin_probes == c._thin_probes[silent.stream_id]  # never judged: 8 and no more
    assert capped.stream_id not in c._thin_probes


def test_the_drafts_of_several_draft_processes_are_priced_as_drafted_side_by_side():
    """Each Verify stream is a draft process with a batch of its own: 64 sequences over four of them wait about
    as long as 16 in one, and draft as 16 would, where 64 in one process draft nothing (the rounds seen: 4 tokens
    for 16 sequences in 0.6 s, for one in 0.25 s)."""
    from verifier_service.types import SeqKey

    c = _drafted_rounds_of_16_and_of_1()
    one = {SeqKey(1, i): 4 for i in range(64)}
    four = {SeqKey(1 + i % 4, i): 4 for i in range(64)}
    sixteen = {SeqKey(1, i): 4 for i in range(16)}
    assert sum(c.choose(one).draft_lengths.values()) == 0
    per_sequence = sum(c.choose(sixteen).draft_lengths.values()) / 16
    assert per_sequence > 0 and sum(c.choose(four).draft_lengths.values()) / 64 == pytest.approx(per_sequence, abs=1)


def test_a_draft_that_gains_less_than_the_tolerance_over_plain_decoding_is_not_taken():
    """Where the best option drafts but plain decoding is within the tolerance of it (break-even under load), plain
    decoding is taken, not the longest near draft: at 32 streams that took every sequence to k = 4 at once."""
    step = model_of(lambda n: 0.02 + 0.01 * n, sizes=(1, 2, 3, 4, 8, 16, 32, 64, 128))
    cands = [Candidate(i, 4, (0.99, 0.9, 0.9, 0.9)) for i in range(32)]
    exact = choose_draft_lengths(cands, step, tolerance=0.0)
    assert 0 < exact.goodput / exact.plain_goodput < 1.03  # the best drafts, by less than 3 %
    assert sum(choose_draft_lengths(cands, step, tolerance=0.03).draft_lengths.values()) == 0
    idle = model_of(lambda n: 0.01 + 0.0001 * n, sizes=(1, 2, 3, 4, 8, 16, 32, 64, 128))  # drafting pays well
    assert min(choose_draft_lengths(cands, idle, tolerance=0.03).draft_lengths.values()) >= 3


def test_past_the_tolerance_the_choice_goes_at_most_a_token_a_sequence_beyond_the_best():
    """Where plain decoding is just outside the tolerance of a best option drafting one token a sequence, the
    choice is at most two a sequence, not the longest option within the tolerance (noise at the tolerance's edge
    would swing the batch between plain decoding and k = 4)."""
    step = model_of(lambda n: 0.03 + 0.01 * n, sizes=(1, 2, 3, 4, 8, 16, 32, 64, 128))
    cands = [Candidate(i, 4, (0.99, 0.9, 0.9, 0.9)) for i in range(32)]
    exact = choose_draft_lengths(cands, step, tolerance=0.0)
    assert 1.03 < exact.goodput / exact.plain_goodput < 1.05 and set(exact.draft_lengths.values()) == {1}
    chosen = choose_draft_lengths(cands, step, tolerance=0.03)
    assert sum(exact.draft_lengths.values()) < sum(chosen.draft_lengths.values()) <= 64


def test_a_probe_makes_the_draft_catch_up_at_most_one_sequence():
    """At 16 streams, every sequence held at k = 0, a probe of 4 made the draft feed each one's missed tokens first:
    those 4 missed 3 steps of the others, finished late in steps of 2 to 4, and auto gave 0.89x plain decoding. Of
    a probe's sequences at most max_catch_up_probes are ones that drafted nothing for more than
    catch_up_free_rounds verifications in a row (or never); the others probed drafted lately; the ones passed over
    come first next time; sequences of a group whose evidence is thin (the probe is for it) count for none."""
    from verifier_service.goodput import DraftLengthController
    from verifier_service.types import SeqKey

    c = DraftLengthController(4, step_time=model_of(lambda n: 0.001 * n), probe_every=2, max_probe_every=2,
                              min_evidence=0.0, max_probe_interval_s=float("inf"))
    stale = [SeqKey(1, i) for i in range(6)]
    fresh = [SeqKey(1, i) for i in range(6, 10)]
    for key in stale + fresh:
        c.observe_verification(key, 1, 0)
    for key in stale:
        for _ in range(c.catch_up_free_rounds + 1):
            c.observe_verification(key, 0, 0)
    c.observe_verification(fresh[0], 0, 0)  # one plain round since it drafted: still free
    assert not c._needs_catch_up(fresh[0]) and c._needs_catch_up(stale[0]) and c._needs_catch_up(SeqKey(9, 9))
    caps = dict.fromkeys(stale + fresh, 4)
    picked = [p for p in (frozenset(k for k, n in c.choose(caps).draft_lengths.items() if n) for _ in range(12)) if p]
    assert len(picked) == 6
    assert all(len(p) == c.max_probe_sequences and len(p & set(stale)) == 1 for p in picked)
    assert set().union(*picked) >= set(stale)  # in turn: every stale one within six probes
    held = {SeqKey(2, i): 4 for i in range(16)}  # a batch all held at k = 0
    for key in list(held)[8:]:  # half never judged, half judged in rounds that drafted nothing
        for _ in range(c.catch_up_free_rounds + 1):
            c.observe_verification(key, 0, 0)
    probes = [p for p in (frozenset(k for k, n in c.choose(held).draft_lengths.items() if n) for _ in range(8)) if p]
    assert [len(p) for p in probes] == [1] * 4 and len(set(probes)) == 4
    c.observe_verification(SeqKey(2, 8), 1, 1)  # it drafted: free again, and forgotten with its sequence
    assert not c._needs_catch_up(SeqKey(2, 8)) and c._needs_catch_up(SeqKey(2, 9))
    c.forget(SeqKey(2, 8))
    assert SeqKey(2, 8) not in c._plain_rounds

    thin = DraftLengthController(4, step_time=model_of(lambda n: 0.001 * n), max_probe_interval_s=float("inf"))
    new = {SeqKey(3, i): 4 for i in range(8)}  # a new draft process: thin, never drafted
    took = [k for _ in range(thin.first_probe_every) for k, n in thin.choose(new).draft_lengths.items() if n]
    assert len(took) == thin.max_probe_sequences


def test_a_switch_to_drafting_prices_the_catch_up_it_makes():
    """At 32 streams three sequences finishing turned the choice for the 29 left, all held at k = 0 for 25 rounds,
    to 2 tokens each: the draft first fed them 64 rows it had missed, that round took 2.3 s where plain ones took
    1.2, and the batch broke into fragments to its end. A sequence that would catch up carries its rows per round
    (the tokens since its last block, or its context where it never drafted, over the rounds of drafting at its cap
    that its tokens left take); they are priced as drafted tokens where it drafts, and such sequences draft only
    where that beats holding them at k = 0 by more than the tolerance."""
    from verifier_service.goodput import DraftLengthController
    from verifier_service.types import SeqKey

    step = model_of(lambda n: 0.5 + 0.004 * n)
    args = dict(tolerance=0.03, idle_per_block_token=0.05, idle_per_drafted_token=0.005)
    fresh = [Candidate(("fresh", i), 4, (0.9,) * 4) for i in range(4)]
    held = [Candidate(("held", i), 4, (0.9,) * 4, catch_up_rows=30.0) for i in range(4)]
    free = choose_draft_lengths([*fresh, *[dataclasses.replace(c, catch_up_rows=0.0) for c in held]], step, **args)
    assert set(free.draft_lengths.values()) == {4}  # without a catch-up all draft
    mixed = choose_draft_lengths([*fresh, *held], step, **args).draft_lengths
    assert [mixed[c.key] for c in fresh] == [4] * 4 and [mixed[c.key] for c in held] == [0] * 4
    cheap = [dataclasses.replace(c, catch_up_rows=0.5) for c in held]  # a little catch-up: worth it
    assert set(choose_draft_lengths([*fresh, *cheap], step, **args).draft_lengths.values()) == {4}
    dear = [dataclasses.replace(c, catch_up_rows=100.0) for c in held]
    alone = choose_draft_lengths(dear, step, **args)  # held alone: plain decoding, and the price says why
    assert set(alone.draft_lengths.values()) == {0}
    assert set(choose_draft_lengths(held, step, **args).draft_lengths.values()) == {4}
    rows = sum(c.catch_up_rows for c in dear)
    assert choose_draft_lengths(dear, step, **{**args, "tolerance": 0.0}).goodput == pytest.approx(max(
        alone.goodput, 4 * expected_tokens((0.9,) * 4, 4) / (step.predict(20) + 0.2 + 0.005 * (16 + rows))))
    # catch-up rows at a price of their own (a prompt's rows in one forward cost less than drafting's)
    assert set(choose_draft_lengths(dear, step, **args, idle_per_catch_up_row=0.0005).draft_lengths.values()) == {4}
    assert choose_draft_lengths(dear, step, **{**args, "tolerance": 0.0}, idle_per_catch_up_row=0.001).goodput \
        == pytest.approx(4 * expected_tokens((0.9,) * 4, 4) / (step.predict(20) + 0.2 + 0.005 * 16 + 0.001 * rows))
    # over draft processes side by side, each feeds its own sequences' rows: the largest batch's are waited for,
    # and so are its drafted tokens (two processes of two: half of each; four of one: one sequence's)
    for streams, priced_rows, priced_tokens in ((2, rows / 2, 8), (4, 100.0, 4)):
        spread = [dataclasses.replace(c, group=i % streams) for i, c in enumerate(dear)]
        chosen = choose_draft_lengths(spread, step, **{**args, "tolerance": 0.0}, idle_per_catch_up_row=0.001)
        assert chosen.goodput == pytest.approx(
            4 * expected_tokens((0.9,) * 4, 4) / (step.predict(20) + 0.2 + 0.005 * priced_tokens
                                                  + 0.001 * priced_rows))

    c = DraftLengthController(4, step_time=step)
    new, drafting, plain, prompt = SeqKey(1, 1), SeqKey(1, 2), SeqKey(1, 3), SeqKey(1, 4)
    for _ in range(3):  # its prompt's round and two more, none drafted
        c.observe_verification(prompt, 0, 0)
    assert c.catch_up_rows(prompt, (0.5, 0.5), 40, 35) == c.catch_up_rows(new, (0.5, 0.5), 40, 35) > 0
    c.observe_verification(drafting, 4, 4)
    c.observe_verification(plain, 4, 4)
    for _ in range(9):
        c.observe_verification(plain, 0, 0)
    rates = (0.5, 0.5)  # a round at the cap yields 1.75 tokens
    assert c.catch_up_rows(drafting, rates, 40, 35) == 0.0
    assert c.catch_up_rows(plain, rates, 40, 21) == pytest.approx(10 / (21 / 1.75))  # 9 plain rounds, 1 more
    assert c.catch_up_rows(new, rates, 40, 21) == pytest.approx(40 / (21 / 1.75))  # never drafted: its context
    assert c.catch_up_rows(plain, rates, 40, 1) == 10.0  # its last round pays it all
    assert c.catch_up_rows(plain, (), 40, 35) == 0.0  # a cap of 0: it drafts nothing
    assert c.catch_up_rows(plain, rates, 4000, 4000) == pytest.approx(10 / (64 / 1.75))  # not 4000 / 1.75
    # the horizon is the longer of 64 tokens' rounds and 16 rounds: a low estimate of acceptance spreads the rows
    # over more rounds, not over fewer, and a high one over no fewer than 16
    assert c.catch_up_rows(new, (0.1, 0.1), 40, 48) == pytest.approx(40 / (48 / 1.11))
    assert c.catch_up_rows(new, (0.1, 0.1), 40, 4000) == pytest.approx(40 / (64 / 1.11))
    assert c.catch_up_rows(new, (1.0,) * 16, 40, 4000) == pytest.approx(40 / 16)
    assert c.catch_up_rows(new, (1.0,) * 16, 40, 68) == pytest.approx(40 / 4)

    # the draft's own word (Proposal.draft_backlog_tokens) replaces the inference: a new sequence whose prompt the
    # draft fed beside its first verification has none to pay, one it did not feed pays what it said (never more
    # than its context), and one that no longer says is inferred again
    warmed, unfed = SeqKey(1, 5), SeqKey(1, 6)
    c.observe_verification(warmed, 0, 0, backlog=0)
    c.observe_verification(unfed, 0, 0, backlog=30)
    assert c.catch_up_rows(warmed, rates, 40, 21) == 0.0 and not c._needs_catch_up(warmed)
    # what it said, and the verdict's token since (the draft's catch-up counts it too)
    assert c.catch_up_rows(unfed, rates, 40, 21) == pytest.approx(31 / (21 / 1.75))
    assert c.catch_up_rows(unfed, rates, 20, 21) == pytest.approx(20 / (21 / 1.75))
    c.observe_verification(plain, 0, 0, backlog=7)  # 8 with the verdict's: what a round feeds without a catch-up
    assert c.catch_up_rows(plain, rates, 40, 21) == 0.0
    c.observe_verification(plain, 0, 0, backlog=8)
    assert c.catch_up_rows(plain, rates, 40, 21) == pytest.approx(9 / (21 / 1.75))
    c.observe_verification(warmed, 0, 0)  # unsaid: never drafted, its whole context
    assert c.catch_up_rows(warmed, rates, 40, 21) == pytest.approx(40 / (21 / 1.75))
    c.forget(unfed)
    assert unfed not in c._backlog

    import verifier_service.goodput as goodput
    seen = []
    real = goodput.choose_draft_lengths
    goodput.choose_draft_lengths = lambda cands, *a, **kw: seen.append(list(cands)) or real(cands, *a, **kw)
    try:
        sizes = {new: (40, 35), drafting: (40, 35), plain: (40, 35)}
        c.choose(dict.fromkeys(sizes, 2), sizes=sizes, away={SeqKey(1, 9): 2})
    finally:
        goodput.choose_draft_lengths = real
    rows = {cand.key: cand.catch_up_rows for cand in seen[0]}
    assert rows == {SeqKey(1, 9): 0.0, **{key: c.catch_up_rows(key, tuple(c.acceptance.rates(key, 2)), 40, 35)
                                          for key in sizes}}
    assert rows[new] > rows[plain] > rows[drafting] == 0.0


def _even_load(intercept: float) -> tuple[StepTimeModel, list[Candidate]]:
    """32 sequences on a step model under which drafting a token each gains a little over plain decoding: 5.4 %
    with an intercept of 0.04 s, 14 % with 0.1 s."""
    step = model_of(lambda n: intercept + 0.01 * n, sizes=(1, 2, 3, 4, 8, 16, 32, 64, 128))
    return step, [Candidate(i, 4, (0.99, 0.9, 0.9, 0.9)) for i in range(32)]


def test_plain_decoding_is_kept_within_the_plain_tolerance_and_no_near_draft_is_sought_past_the_tolerance():
    step, cands = _even_load(0.04)
    exact = choose_draft_lengths(cands, step)
    assert 1.03 < exact.goodput / exact.plain_goodput < 1.08
    assert sum(choose_draft_lengths(cands, step, tolerance=0.03).draft_lengths.values()) > 0
    assert sum(choose_draft_lengths(cands, step, tolerance=0.03, plain_tolerance=0.08).draft_lengths.values()) == 0
    step, cands = _even_load(0.1)
    exact = choose_draft_lengths(cands, step)
    assert exact.goodput / exact.plain_goodput > 1.08
    # past it, the choice is the tolerance's: the best, or at most a token a sequence more
    chosen = choose_draft_lengths(cands, step, tolerance=0.03, plain_tolerance=0.08)
    assert chosen.draft_lengths == choose_draft_lengths(cands, step, tolerance=0.03).draft_lengths


def test_after_a_plain_choice_drafting_must_gain_the_switch_tolerance():
    """Hysteresis: where drafting gains 5 % over plain decoding, a controller whose last choice drafted goes on
    drafting, and one whose last choice drafted nothing stays plain; a gain of 14 % takes it to drafting."""
    from verifier_service.goodput import DraftLengthController

    # acceptance 0.9 at every position: drafting a token each gains 5.6 % with an intercept of 0.08 s, 15 % with
    # 0.15 s (choose_draft_lengths alone)
    step = model_of(lambda n: 0.08 + 0.01 * n, sizes=(1, 2, 3, 4, 8, 16, 32, 64, 128))
    caps = {i: 4 for i in range(32)}

    def controller() -> DraftLengthController:
        return DraftLengthController(4, step_time=step, probe_every=0, tolerance=0.03, switch_tolerance=0.08,
                                     plain_margin=0.03, acceptance=AcceptanceTracker(4, default_rate=0.9))

    drafting = controller()
    assert sum(drafting.choose(caps).draft_lengths.values()) > 0  # no choice before: the tolerance's
    assert sum(drafting.choose(caps).draft_lengths.values()) > 0
    ended = controller()
    assert sum(ended.choose(caps).draft_lengths.values()) > 0
    # caps of 0 (the sequences' room bounds them at their requests' ends) are no choice of plain decoding
    assert sum(ended.choose(dict.fromkeys(caps, 0)).draft_lengths.values()) == 0
    assert sum(ended.choose(caps).draft_lengths.values()) > 0
    plain = controller()
    plain.step_time = model_of(lambda n: 0.01 + 0.01 * n, sizes=(1, 2, 3, 4, 8, 16, 32, 64, 128))  # plain is best
    assert sum(plain.choose(caps).draft_lengths.values()) == 0
    plain.step_time = step
    assert sum(plain.choose(caps).draft_lengths.values()) == 0
    assert sum(plain.choose(caps).draft_lengths.values()) == 0
    plain.step_time = model_of(lambda n: 0.15 + 0.01 * n, sizes=(1, 2, 3, 4, 8, 16, 32, 64, 128))
    assert sum(plain.choose(caps).draft_lengths.values()) > 0


def test_drafting_must_gain_the_plain_margin_even_where_the_last_choice_drafted():
    """The plain margin: with no plain choice before (no hysteresis), a gain of 4 % over plain decoding is
    within the default margin of 8 % and plain decoding is taken; 15 % drafts; and where the last choice was plain,
    drafting must gain the switch tolerance (12 % by default): 10 % keeps a drafting controller drafting and a
    plain one plain."""
    from verifier_service.goodput import DraftLengthController

    sizes = (1, 2, 3, 4, 8, 16, 32, 64, 128)
    small, gain_10, large = (model_of(lambda n, a=a: a + 0.01 * n, sizes=sizes) for a in (0.08, 0.13, 0.2))
    plain_best = model_of(lambda n: 0.01 + 0.01 * n, sizes=sizes)
    caps = {i: 4 for i in range(32)}

    def controller(step, **kw) -> DraftLengthController:
        return DraftLengthController(4, step_time=step, probe_every=0,
                                     acceptance=AcceptanceTracker(4, default_rate=0.9), **kw)

    def gain(step) -> float:
        chosen = choose_draft_lengths([Candidate(i, 4, (0.9,) * 4) for i in caps], step, tolerance=0.03)
        return chosen.goodput / chosen.plain_goodput  # the choice's gain, the tolerance's (the controller's 3 %)

    assert 1.03 < gain(small) < 1.06 and 1.09 < gain(gain_10) < 1.11 and gain(large) > 1.15
    assert not any(controller(small).choose(caps).draft_lengths.values())  # the default margin, 8 %
    assert any(controller(small, plain_margin=0.03).choose(caps).draft_lengths.values())
    assert any(controller(large).choose(caps).draft_lengths.values())
    drafting = controller(large)
    assert any(drafting.choose(caps).draft_lengths.values())
    drafting.step_time = gain_10
    assert any(drafting.choose(caps).draft_lengths.values())  # past the margin, within the switch tolerance
    plain = controller(plain_best)
    assert not any(plain.choose(caps).draft_lengths.values())
    plain.step_time = gain_10
    assert not any(plain.choose(caps).draft_lengths.values())  # held: 10 % is within the switch tolerance
    plain.step_time = large
    assert any(plain.choose(caps).draft_lengths.values())
    # most of the step's sequences decode plainly now (their drafts have context left to feed), whatever their
    # group's last choice: drafting for them is a switch, held to the switch tolerance; fed ones are not
    for backlog, unfed, drafts in ((8, 17, False), (8, 16, True), (0, 32, True), (None, 32, False)):
        switch = controller(large)
        assert any(switch.choose(caps).draft_lengths.values())  # the group's last choice drafted
        switch.step_time = gain_10
        for key in range(unfed):  # a round that drafted nothing: the draft says what it left to feed, or nothing
            switch.observe_verification(key, 0, 0, backlog=backlog)
        for key in range(unfed, 32):  # nor did these, but their drafts are fed (a block drafted ahead, say)
            switch.observe_verification(key, 0, 0, backlog=0)
        # the trial's plain arm (probe False) leaves drafts unfed by its own zeros: no switch there (asked first: a
        # choice made with probes records its group's plain choice, which holds by itself)
        assert any(switch.choose(caps, probe=False).draft_lengths.values())
        assert any(switch.choose(caps).draft_lengths.values()) is drafts, (backlog, unfed)


def test_the_plain_margin_counts_the_sequences_the_choice_drafts_for_and_bounds_the_hysteresis():
    """8 sequences that may draft beside 32 whose cap is 0 (their requests' last rounds, a client's k = 0): the bar
    is per sequence the choice drafts for, so the 32 neither raise it (they would, by 5x, per candidate) nor lower
    it. And a plain margin above the switch tolerance holds where the hysteresis does: it is the larger of the
    two."""
    from verifier_service.goodput import DraftLengthController
    from verifier_service.metrics import VerifierMetrics
    from verifier_service.types import StepStats

    sizes = (1, 2, 4, 8, 16, 32, 40, 64, 128, 256)
    step = model_of(lambda n: 0.3 + 0.01 * n, sizes=sizes)
    drafting = [Candidate(("d", i), 4, (0.9,) * 4) for i in range(8)]
    idle = [Candidate(("z", i), 0, ()) for i in range(32)]
    alone = choose_draft_lengths(drafting, step, tolerance=0.03)
    per_seq = (alone.goodput - alone.plain_goodput) * alone.plain_step_s / 8
    assert per_seq > 0.1
    both = choose_draft_lengths([*drafting, *idle], step, tolerance=0.03)
    gain = (both.goodput - both.plain_goodput) * both.plain_step_s / 8
    assert gain > 0.05
    kept = choose_draft_lengths([*drafting, *idle], step, tolerance=0.03, plain_tolerance=gain * 0.9)
    assert kept.declined_gain is None and any(kept.draft_lengths.values())
    turned = choose_draft_lengths([*drafting, *idle], step, tolerance=0.03, plain_tolerance=gain * 1.1)
    assert not any(turned.draft_lengths.values()) and turned.declined_gain == pytest.approx(gain)
    assert turned.goodput == pytest.approx(both.plain_goodput)
    # nor do 32 that may draft but whose drafts are all but never accepted (a hostile or a poor draft): the choice
    # drafts nothing for them, and the bar counts the sequences it drafts for
    junk = [Candidate(("j", i), 1, (0.01,)) for i in range(32)]
    mixed = choose_draft_lengths([*drafting, *junk], step)  # the best (no longer draft near it)
    assert not any(mixed.draft_lengths[c.key] for c in junk) and all(mixed.draft_lengths[c.key] for c in drafting)
    mixed_gain = (mixed.goodput - mixed.plain_goodput) * mixed.plain_step_s / 8
    assert any(choose_draft_lengths([*drafting, *junk], step,
                                    plain_tolerance=mixed_gain * 0.9).draft_lengths.values())
    assert choose_draft_lengths([*drafting, *junk], step,
                                plain_tolerance=mixed_gain * 1.1).declined_gain == pytest.approx(mixed_gain)

    metrics = VerifierMetrics()
    metrics.observe_step(StepStats(declined_gain=turned.declined_gain))
    metrics.observe_step(StepStats())
    assert metrics.registry.get_sample_value("specwire_goodput_plain_margin_declined_total") == 1

    # the hysteresis bounded below by the margin: 10 % (after the tolerance) drafts under a switch tolerance of 5 %
    # alone, not under a margin of 15 %
    caps = {i: 4 for i in range(32)}
    gain_10 = model_of(lambda n: 0.13 + 0.01 * n, sizes=sizes)
    plain_best = model_of(lambda n: 0.01 + 0.01 * n, sizes=sizes)
    for margin, drafts in ((0.03, True), (0.15, False)):
        c = DraftLengthController(4, step_time=plain_best, probe_every=0, switch_tolerance=0.05, plain_margin=margin,
                                  acceptance=AcceptanceTracker(4, default_rate=0.9))
        assert not any(c.choose(caps).draft_lengths.values())  # plain decoding chosen: held from here
        c.step_time = gain_10
        assert any(c.choose(caps).draft_lengths.values()) is drafts


def test_the_switch_tolerance_judges_the_choice_between_catching_up_and_not_once_made():
    """Half the sequences would catch up first. Drafting for the others alone gains 6.7 % over plain decoding, for
    all 8.9 %: without hysteresis the choice is the former (the catch-up's extra 2 % is within the tolerance);
    with a switch tolerance of 8 % it is plain decoding, not the catch-up's choice (the one plain decoding's
    tolerance left beating the other)."""
    step = model_of(lambda n: 0.2 + 0.01 * n, sizes=(1, 2, 3, 4, 8, 16, 32, 64, 128))
    fresh = [Candidate(("fresh", i), 4, (0.9,) * 4) for i in range(16)]
    held = [Candidate(("held", i), 4, (0.9,) * 4, catch_up_rows=0.2) for i in range(16)]
    kw = dict(idle_per_drafted_token=0.002, tolerance=0.03)
    alone = choose_draft_lengths([*fresh, *held], step, **kw).draft_lengths
    assert all(alone[c.key] for c in fresh) and not any(alone[c.key] for c in held)
    every = choose_draft_lengths([*fresh, *[dataclasses.replace(c, catch_up_rows=0.0) for c in held]], step,
                                 idle_per_drafted_token=0.002)
    assert every.goodput / every.plain_goodput > 1.08
    assert not any(choose_draft_lengths([*fresh, *held], step, plain_tolerance=0.08, **kw).draft_lengths.values())


def test_the_hysteresis_is_per_draft_process_and_the_trial_s_plain_arm_leaves_it():
    from verifier_service.goodput import DraftLengthController
    from verifier_service.types import SeqKey

    even = model_of(lambda n: 0.04 + 0.01 * n, sizes=(1, 2, 3, 4, 8, 16, 32, 64, 128))  # 16 drafting: 5.5 %
    plain_best = model_of(lambda n: 0.01 + 0.01 * n, sizes=(1, 2, 3, 4, 8, 16, 32, 64, 128))
    c = DraftLengthController(4, step_time=plain_best, probe_every=0, tolerance=0.03, switch_tolerance=0.08,
                              plain_margin=0.03, acceptance=AcceptanceTracker(4, default_rate=0.9,
                                                           group_of=lambda key: key.stream_id))
    a = {SeqKey(1, i): 4 for i in range(16)}
    b = {SeqKey(2, i): 4 for i in range(16)}
    assert not any(c.choose(a).draft_lengths.values())  # stream 1: plain decoding chosen
    c.step_time = even
    assert any(c.choose(b).draft_lengths.values())  # stream 2 never chose plain: no hysteresis
    assert not any(c.choose(a).draft_lengths.values())  # stream 1 did
    c.step_time = model_of(lambda n: 0.08 + 0.01 * n, sizes=(1, 2, 3, 4, 8, 16, 32, 64, 128))  # 32: 5.6 %
    assert any(c.choose({**a, **b}).draft_lengths.values())  # a step of both: one of them drafted last
    c.step_time = even
    # under the trial's plain arm (probe=False) the choice is overridden by zeros: what the groups last chose stays
    c.step_time = plain_best
    assert not any(c.choose(b, probe=False).draft_lengths.values())
    c.step_time = even
    assert any(c.choose(b).draft_lengths.values())



def test_draft_processes_are_priced_at_their_largest_batch():
    """Each draft process (Verify stream) drafts its sequences in a batch of its own, so the verifier waits for the
    largest batch. 63 sequences alike (acceptance 0.9, k <= 4), drafted tokens at 10 ms each in one batch: where
    32 of them share one process beside 31 of one sequence each (a client can open such streams), that process's
    batch of 32 is what a longer draft costs, and the choice keeps it far below 4 tokens each; the 63 in
    processes of their own each wait for 4 tokens at most, and draft 4. Priced at one over the number of processes
    (found in review) the 32 drafted 4 as if each token cost a 32nd; priced at the sequences over the largest
    process's (63 / 32, the review's first mend), 31 processes of one beside 32 sequences the choice gives nothing
    paid for their tokens as if in batches of 2 x 31, and drafted nothing. Tied gains take the processes in turn:
    here, listed either way, each process gets the same lengths."""
    step = model_of(lambda n: 0.5 + 0.001 * n)
    alike = [Candidate(i, 4, (0.9,) * 4, group=0 if i < 32 else i) for i in range(63)]
    shared = choose_draft_lengths(alike, step, idle_per_drafted_token=0.01).draft_lengths
    big = sum(shared[c.key] for c in alike if c.group == 0)
    assert 0 < sum(shared.values()) and big < 32 * 2
    flipped = choose_draft_lengths(alike[32:] + alike[:32], step, idle_per_drafted_token=0.01).draft_lengths

    def per_process(lengths: dict) -> dict:
        return {g: sorted(lengths[c.key] for c in alike if c.group == g) for g in {c.group for c in alike}}

    assert per_process(flipped) == per_process(shared)
    apart = [dataclasses.replace(c, group=i) for i, c in enumerate(alike)]
    assert set(choose_draft_lengths(apart, step, idle_per_drafted_token=0.01).draft_lengths.values()) == {4}
    # the 32 of one process accepted 5 % of the time: the choice gives them nothing, and the 31 alone draft
    poor = [dataclasses.replace(c, rates=(0.05,) * 4) if c.group == 0 else c for c in alike]
    lengths = choose_draft_lengths(poor, step, idle_per_drafted_token=0.02).draft_lengths
    assert [lengths[c.key] for c in poor] == [0] * 32 + [4] * 31


def test_running_group_sums_follow_the_order_within_each_group():
    """Each element's group's sum up to it, in the order given, against a plain loop (many ties of groups: an
    unstable sort would mix a group's order)."""
    from verifier_service.goodput import _running_group_sums

    rng = np.random.default_rng(0)
    groups, weights = rng.integers(0, 5, 2000), rng.random(2000)
    totals: dict[int, float] = {}
    want = []
    for g, w in zip(groups.tolist(), weights.tolist(), strict=True):
        totals[g] = totals.get(g, 0.0) + w
        want.append(totals[g])
    assert np.allclose(_running_group_sums(groups, weights), want)
    assert _running_group_sums(np.zeros(0, np.int64), np.zeros(0)).size == 0


def test_the_other_works_drafted_tokens_are_shared_alike_in_both_searches():
    """Fixed-k work drafts 10 tokens in processes the choice does not know: spread over the candidates' two
    processes, 5 in the largest batch. The search that holds the catching-up sequence at k = 0 must price them so
    too; it counted only the processes left drafting (found in review), 10, and so leaned to the other search."""
    step = model_of(lambda n: 0.5 + 0.001 * n)
    cands = [Candidate(0, 4, (0.9,) * 4, catch_up_rows=1000.0, group=0), Candidate(1, 4, (0.9,) * 4, group=1)]
    chosen = choose_draft_lengths(cands, step, idle_per_drafted_token=0.01, other_drafted=10)
    k = chosen.draft_lengths[1]
    assert chosen.draft_lengths[0] == 0 and k > 0
    assert chosen.predicted_step_s == pytest.approx(step.predict(2 + k) + 0.01 * (k + 5))


def test_plain_from_is_the_fewest_sequences_of_a_group_the_choice_decodes_plainly():
    """DraftLengthController.plain_from: for sequences like a new one of the key's group (the group's acceptance,
    the cap), the batch from which the choice drafts nothing: one sequence fewer still drafts. A group whose drafts
    fare better drafts under a heavier load, and a group held plain needs the hysteresis' gain; a verifier whose
    steps hardly grow drafts at every load (None), as does one with no step seen yet, and a cap of 0 says nothing.
    plain_from_of: one figure per group and cap, worked out at most every PLAIN_FROM_EVERY_S and at most `budget`
    a call, for groups a choice was made for."""
    from collections import namedtuple

    from verifier_service.goodput import PLAIN_FROM_EVERY_S, DraftLengthController

    key = namedtuple("Key", "stream_id seq_id")
    c = DraftLengthController(4, step_time=model_of(lambda n: 0.1 + 0.004 * n), probe_every=0)  # a CPU's step
    for _ in range(200):
        c.acceptance.observe(key(1, 0), 4, 3)  # stream 1's drafts: 3 tokens of 4 accepted
        c.acceptance.observe(key(2, 0), 4, 1)  # stream 2's, one

    def drafted(stream: int, n: int) -> int:
        caps = {key(stream, 100 + i): 4 for i in range(n)}  # new sequences: the group's rates
        return sum(c.choose(caps, probe=False).draft_lengths.values())

    good, poor = c.plain_from(key(1, 0), 4), c.plain_from(key(2, 0), 4)
    assert good is not None and poor is not None and 1 < poor < good < 256
    for stream, n in ((1, good), (2, poor)):
        assert drafted(stream, n - 1) > 0 and drafted(stream, n) == 0
    assert c.plain_from(key(1, 0), 0) is None
    assert DraftLengthController(4).plain_from(key(1, 0), 4) is None  # no step time yet
    flat = DraftLengthController(4, step_time=model_of(lambda n: 0.01), probe_every=0)
    assert flat.plain_from(key(1, 0), 4) == 257
    three = c.plain_from(key(1, 0), 3)
    assert three is not None and three != good
    c._group_drafting[2] = False  # stream 2's last choice drafted nothing: drafting must gain the hysteresis
    held = c.plain_from(key(2, 0), 4)
    assert held is not None and held < poor
    assert drafted(2, held - 1) > 0 and drafted(2, held) == 0  # as the choice, held plain, prices it
    del c._group_drafting[2]
    asked = {key(1, 5): 4, key(1, 6): 4, key(1, 7): 3, key(2, 5): 4}
    assert c.plain_from_of(asked, now=100.0) == dict.fromkeys(asked)  # no choice made for either group yet
    c._group_drafting[1] = c._group_drafting[2] = True
    assert c.plain_from_of(asked, now=100.0, budget=2) == {key(1, 5): good, key(1, 6): good, key(1, 7): three,
                                                            key(2, 5): None}  # the third figure waits its turn
    later = 100.0 + PLAIN_FROM_EVERY_S * 0.6
    assert c.plain_from_of(asked, now=later, budget=1)[key(2, 5)] == poor
    c.step_time = model_of(lambda n: 0.001 * n)  # every token costs: plain from one sequence
    assert c.plain_from_of(asked, now=100.0 + PLAIN_FROM_EVERY_S / 2)[key(1, 5)] == good  # not due yet
    # all three due: the oldest first, one a call (the figure past its age stands till its turn)
    now = later + PLAIN_FROM_EVERY_S
    assert list(c.plain_from_of(asked, now=now, budget=1).values()) == [1, 1, three, poor]
    assert list(c.plain_from_of(asked, now=now, budget=1).values()) == [1, 1, 1, poor]
    assert list(c.plain_from_of(asked, now=now, budget=1).values()) == [1, 1, 1, 1]


def test_a_switch_a_draft_process_would_defer_must_gain_the_defer_tolerance():
    """Where the switch tolerance holds and the choice would have a draft process defer some of the sequences it
    drafts for (more than 4 of them catch up first, their debts past the 64 rows its batch feeds: the draft's
    draft_model._deferred), drafting must gain the defer tolerance (20 %): a gain of 16 % stays plain, 25 %
    drafts. The same sequences fed, or spread over draft processes of 4 each, draft at 16 %."""
    from collections import namedtuple

    from verifier_service.goodput import DraftLengthController

    sizes_seen = (1, 2, 3, 4, 8, 16, 32, 64, 128)
    plain_best, gain_16, gain_25 = (model_of(lambda n, a=a: a + 0.01 * n, sizes=sizes_seen)
                                    for a in (0.01, 0.17, 0.25))
    key = namedtuple("Key", "stream_id seq_id")

    def run(step, backlog: int, processes: int = 1, last_drafted: bool = False, unfed: int = 32) -> int:
        keys = [key(i % processes, i) for i in range(32)]
        c = DraftLengthController(4, step_time=gain_25 if last_drafted else plain_best, probe_every=0,
                                  acceptance=AcceptanceTracker(4, default_rate=0.9,
                                                               group_of=lambda k: k.stream_id))
        caps = dict.fromkeys(keys, 4)
        assert any(c.choose(caps).draft_lengths.values()) is last_drafted  # the process's last choice
        c.step_time = step
        for i, k in enumerate(keys):  # a prompt's step after plain openings: the drafts have the prompts to feed
            c.observe_verification(k, 0, 0, backlog=backlog if i < unfed else 0)
        return sum(c.choose(caps, sizes=dict.fromkeys(keys, (9, 48))).draft_lengths.values())

    assert run(gain_16, backlog=8) == 0  # 32 catch-ups of 9 rows in one process: held to 20 %
    assert run(gain_16, backlog=8, last_drafted=True) == 0  # most of them unfed: a switch as well
    assert run(gain_16, backlog=8, last_drafted=True, unfed=12) > 0  # a few unfed in a drafting batch: no switch
    assert run(gain_25, backlog=8) > 0
    assert run(gain_16, backlog=0) > 0  # fed: the switch tolerance, 12 %
    assert run(gain_16, backlog=8, processes=8) > 0  # 4 catch-ups a process: each batch feeds them at once
    assert run(gain_16, backlog=8, processes=4) == 0  # 8 a process: 72 rows
    # the draft's rule at its edges: the first 4 catch-ups whatever their length, then all within 64 rows
    c = DraftLengthController(4, step_time=gain_16, acceptance=AcceptanceTracker(4, group_of=lambda k: k.stream_id))
    keys = [key(0, i) for i in range(8)]
    for k in keys:
        c.observe_verification(k, 0, 0, backlog=8)  # 9 rows each, the verdict's token with the 8 reported
    sizes = dict.fromkeys(keys, (100, 48))
    assert not c._defers(dict.fromkeys(keys[:7], 1), sizes)  # 63 rows
    assert c._defers(dict.fromkeys(keys, 1), sizes)  # 72
    assert not c._defers({**dict.fromkeys(keys[:7], 1), keys[7]: 0}, sizes)  # one the choice holds at 0
    assert not c._defers(dict.fromkeys(keys, 1), dict.fromkeys(keys, (8, 48)))  # contexts of 8: 64 rows
    long = [key(1, i) for i in range(5)]
    for k in long:
        c.observe_verification(k, 0, 0, backlog=40)
    assert not c._defers(dict.fromkeys(long[:4], 1), dict.fromkeys(long, (100, 48)))  # 4, 164 rows: fed at once
    assert c._defers(dict.fromkeys(long, 1), dict.fromkeys(long, (100, 48)))
    # from a draft that does not say (an older one): a sequence that never drafted owes its whole context
    silent = [key(2, i) for i in range(5)]
    for k in silent:
        c.observe_verification(k, 0, 0)
    assert c._defers(dict.fromkeys(silent, 1), dict.fromkeys(silent, (13, 48)))  # 65 rows
    assert not c._defers(dict.fromkeys(silent, 1), dict.fromkeys(silent, (12, 48)))


def test_the_verifier_s_catch_up_figures_are_the_draft_s():
    """The controller judges what the draft will feed and defer by the draft's own constants: a round feeds up
    to CATCH_UP_FREE_TOKENS without a catch-up (a debt past catch_up_free_rounds + 1 is one), a batch feeds
    CATCH_UP_MIN_JOBS catch-ups whatever their length and the rest within CATCH_UP_BUDGET_TOKENS."""
    from draft_service.draft_model import CATCH_UP_BUDGET_TOKENS, CATCH_UP_FREE_TOKENS, CATCH_UP_MIN_JOBS
    from verifier_service.goodput import DraftLengthController

    c = DraftLengthController(4)
    assert c.catch_up_free_rounds + 1 == CATCH_UP_FREE_TOKENS
    assert c.catch_up_min_jobs == CATCH_UP_MIN_JOBS
    assert c.max_catch_up_rows == CATCH_UP_BUDGET_TOKENS
