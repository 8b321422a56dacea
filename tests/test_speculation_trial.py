"""verifier_service.speculation_trial: speculation against plain decoding on measured output, in simulation."""

from __future__ import annotations

import random

from verifier_service.speculation_trial import Arm, SpeculationTrial

STEP_S = 0.1


def _run(trial: SpeculationTrial, rates: dict[Arm, float], seconds: float, *, num_running: int = 4,
         predicted_gain: float | None = 1.2, mean_drafted: float = 3.0, lag_steps: int = 1, noise: float = 0.0,
         rng: random.Random | None = None, gap_every: int = 0, gap_s: float = 30.0,
         plain_rate: float | None = None) -> list[Arm]:
    """Steps of STEP_S: each running sequence emits rates[arm] tokens per second (times 1 + noise * N(0, 1), per
    step) under the arm that was running `lag_steps` steps ago (a choice takes effect a round later); every
    `gap_every`-th step comes after a gap of `gap_s` (a stalled client) in which nothing is emitted;
    `plain_rate`: the controller's predicted plain rate a sequence, given with every step. Returns the arm of
    every step."""
    rng = rng or random.Random(0)
    arms: list[Arm] = []
    history = [trial.running] * (lag_steps + 1)
    carry = 0.0
    for i in range(round(seconds / STEP_S)):
        effective = history[-(lag_steps + 1)]
        carry += max(0.0, rates[effective] * (1 + noise * rng.gauss(0, 1))) * num_running * STEP_S
        emitted = int(carry)
        carry -= emitted
        dt = STEP_S + (gap_s if gap_every and i % gap_every == gap_every - 1 else 0.0)
        running = trial.observe(dt, STEP_S, num_running, emitted, range(num_running),
                                predicted_gain=predicted_gain, mean_drafted=mean_drafted, plain_rate=plain_rate)
        history.append(running)
        arms.append(running)
    return arms


def test_plain_decoding_takes_over_when_it_measures_more_and_the_model_expects_little():
    trial = SpeculationTrial()
    arms = _run(trial, {Arm.SPECULATE: 2.0, Arm.PLAIN: 3.0}, 240)
    assert trial.incumbent is Arm.PLAIN and trial.num_switches == 1
    later = arms[len(arms) // 2:]
    assert later.count(Arm.PLAIN) / len(later) > 0.85  # settled on plain, speculation challenging ever less often


def test_speculation_is_never_put_on_trial_where_the_model_expects_a_large_gain():
    trial = SpeculationTrial()
    arms = _run(trial, {Arm.SPECULATE: 2.0, Arm.PLAIN: 3.0}, 60, predicted_gain=2.0)
    assert set(arms) == {Arm.SPECULATE} and trial.num_trials == 0


def test_no_challenge_while_speculation_measures_more_than_the_plain_model_predicts():
    """The 4-stream case (default pair, 2 cores): speculation measured 3.85 tokens a second a sequence, plain
    decoding 3.10, which the controller predicted; its predicted gain (1.28) is below challenge_below_gain, so
    without the check every 4th window would run plain decoding."""
    trial = SpeculationTrial()
    arms = _run(trial, {Arm.SPECULATE: 3.85, Arm.PLAIN: 3.10}, 120, predicted_gain=1.28, plain_rate=3.10)
    assert set(arms) == {Arm.SPECULATE} and trial.num_trials == 0


def test_speculation_near_the_plain_model_is_still_challenged():
    """Within the margin of the predicted plain rate, or below it (the model's plain steps slowed by the
    drafting beside them: it predicts 2.5 where plain decoding gives 3.0), the trial runs, and plain decoding
    takes over where it measures more."""
    trial = SpeculationTrial()
    _run(trial, {Arm.SPECULATE: 3.3, Arm.PLAIN: 3.1}, 60, predicted_gain=1.28, plain_rate=3.1)
    assert trial.num_trials >= 1 and trial.incumbent is Arm.SPECULATE
    trial = SpeculationTrial()
    _run(trial, {Arm.SPECULATE: 2.0, Arm.PLAIN: 3.0}, 240, plain_rate=2.5)
    assert trial.incumbent is Arm.PLAIN and trial.num_switches == 1


def test_a_plain_prediction_that_is_too_low_holds_off_a_challenge_for_max_ratio_windows_at_most():
    """The case the trial is for, with the exemption fooled: the controller predicts plain decoding at 1.7 tokens a
    second a sequence (its plain figure learnt from slower steps), speculation measures 2.0, plain decoding
    would give 3.0. After max_ratio exempt windows a challenge runs all the same; what plain decoding measured
    there (and its first win) lift the figure, and plain decoding takes over."""
    trial = SpeculationTrial()
    arms = _run(trial, {Arm.SPECULATE: 2.0, Arm.PLAIN: 3.0}, 200, plain_rate=1.7)
    assert set(arms) == {Arm.SPECULATE}  # 4 s windows: exempt meanwhile
    _run(trial, {Arm.SPECULATE: 2.0, Arm.PLAIN: 3.0}, 200, plain_rate=1.7)
    assert trial.incumbent is Arm.PLAIN and trial.num_switches == 1


def test_what_plain_decoding_measured_at_the_same_load_overrides_a_lower_prediction():
    trial = SpeculationTrial()
    trial._plain_measured = (3.0, 4)
    arms = _run(trial, {Arm.SPECULATE: 2.0, Arm.PLAIN: 3.0}, 30, plain_rate=1.7)
    assert Arm.PLAIN in arms
    trial = SpeculationTrial()
    trial._plain_measured = (3.0, 16)  # at another load it says nothing
    arms = _run(trial, {Arm.SPECULATE: 2.0, Arm.PLAIN: 3.0}, 30, plain_rate=1.7)
    assert set(arms) == {Arm.SPECULATE}


def test_a_first_win_waiting_for_its_second_is_never_exempted():
    trial = SpeculationTrial()
    trial._won_once = True
    arms = _run(trial, {Arm.SPECULATE: 2.0, Arm.PLAIN: 3.0}, 30, plain_rate=1.7)
    assert Arm.PLAIN in arms


def test_plain_decoding_in_place_is_challenged_whatever_the_plain_figure():
    """The exemption is speculation's: plain decoding that measures more than its predicted figure is still
    challenged by speculation, which wins here."""
    trial = SpeculationTrial(incumbent=Arm.PLAIN, running=Arm.PLAIN)
    _run(trial, {Arm.SPECULATE: 3.0, Arm.PLAIN: 2.0}, 120, plain_rate=1.0)
    assert trial.incumbent is Arm.SPECULATE


def test_windows_at_a_load_that_expected_a_large_gain_do_not_count_towards_a_challenge():
    """A level of 1 or 2 streams (predicted gain 2x: no challenge) ran many windows; at the next level the
    controller expects 1.2x: the incumbent runs its 4 windows there (4 s each here) before plain decoding
    challenges it, not its first one, which a level's start holds down."""
    trial = SpeculationTrial()
    _run(trial, {Arm.SPECULATE: 2.0, Arm.PLAIN: 2.0}, 60, predicted_gain=2.0)
    assert trial.num_trials == 0
    arms = _run(trial, {Arm.SPECULATE: 2.0, Arm.PLAIN: 2.0}, 14, predicted_gain=1.2)
    assert set(arms) == {Arm.SPECULATE}
    arms = _run(trial, {Arm.SPECULATE: 2.0, Arm.PLAIN: 2.0}, 30, predicted_gain=1.2)
    assert Arm.PLAIN in arms


def test_a_load_move_restarts_the_window_after_a_warm_up():
    """From 2 running sequences to 4: the new window measures after each of the 4 was verified twice (the
    arrivals' first rounds wait for their drafts' prompts), not from the first step at the new load."""
    trial = SpeculationTrial()
    _run(trial, {Arm.SPECULATE: 2.0, Arm.PLAIN: 2.0}, 10, num_running=2)
    assert trial._window.num_running == 2
    trial.observe(0.1, 0.1, 4, 4, range(4))  # the move: a warm-up starts, these 4 verifications its first
    assert trial._window.num_running == 4 and trial._window.tokens == 0
    trial.observe(0.1, 0.1, 4, 4, range(4))
    assert trial._window.tokens == 0
    trial.observe(0.1, 0.1, 4, 4, range(4))
    assert trial._window.tokens == 4


def test_no_trial_while_the_controller_drafts_nothing():
    """Both arms are then plain decoding: a trial would only measure noise."""
    trial = SpeculationTrial()
    arms = _run(trial, {Arm.SPECULATE: 2.0, Arm.PLAIN: 3.0}, 60, mean_drafted=0.1)
    assert set(arms) == {Arm.SPECULATE} and trial.num_trials == 0


def test_speculation_that_measures_more_keeps_its_place_and_is_questioned_ever_less_often():
    trial = SpeculationTrial()
    arms = _run(trial, {Arm.SPECULATE: 3.0, Arm.PLAIN: 1.5}, 300)
    assert trial.incumbent is Arm.SPECULATE and trial.num_switches == 0
    assert trial.num_trials >= 3 and trial.ratio > trial.base_ratio  # clear losses: challenges spread out
    assert arms.count(Arm.PLAIN) / len(arms) < 0.15


def test_speculation_wins_back_when_the_load_changes():
    trial = SpeculationTrial()
    _run(trial, {Arm.SPECULATE: 2.0, Arm.PLAIN: 3.0}, 120)
    assert trial.incumbent is Arm.PLAIN
    _run(trial, {Arm.SPECULATE: 4.0, Arm.PLAIN: 2.0}, 200)
    assert trial.incumbent is Arm.SPECULATE


def test_after_plain_settled_a_model_that_expects_a_large_gain_gets_a_challenge_at_once():
    """Plain decoding won clearly for a long time (ratio up to its maximum); then the load drops and the
    controller expects 2x: speculation is challenged within a few windows, not 64."""
    trial = SpeculationTrial()
    _run(trial, {Arm.SPECULATE: 1.0, Arm.PLAIN: 3.0}, 600)
    assert trial.incumbent is Arm.PLAIN and trial.ratio >= 16
    _run(trial, {Arm.SPECULATE: 6.0, Arm.PLAIN: 3.0}, 40, predicted_gain=2.0)
    assert trial.incumbent is Arm.SPECULATE


def test_a_close_result_keeps_the_arm_and_spreads_the_challenges_out():
    """Arms about even (plain decoding 5 % better, within the margin): speculation stays, and each lost challenge
    doubles the ratio, so that switches that cost both arms come ever less often."""
    trial = SpeculationTrial()
    arms = _run(trial, {Arm.SPECULATE: 2.0, Arm.PLAIN: 2.1}, 240)
    assert trial.incumbent is Arm.SPECULATE and trial.num_trials >= 2
    assert trial.ratio == trial.base_ratio * 2 ** trial.num_trials
    switches = sum(a is not b for a, b in zip(arms, arms[1:], strict=False))
    assert switches == 2 * trial.num_trials


def test_equal_arms_under_noise_rarely_switch():
    """A-B-A and the margin: arms that differ by nothing, with 40 % noise per step, over 20 minutes (the ratio held
    at its base, so that the lost challenges' doubling does not make the trials few)."""
    switches = 0
    for seed in range(5):
        trial = SpeculationTrial(max_ratio=4)
        _run(trial, {Arm.SPECULATE: 2.0, Arm.PLAIN: 2.0}, 1200, noise=0.4, rng=random.Random(seed))
        assert trial.num_trials >= 10
        switches += trial.num_switches
    assert switches <= 2, switches


def test_a_stalled_client_decides_nothing():
    """Gaps of 30 s between steps (a client that stalls) count as at most a second each: speculation, the better
    arm, keeps its place."""
    trial = SpeculationTrial()
    _run(trial, {Arm.SPECULATE: 3.0, Arm.PLAIN: 2.0}, 200, gap_every=37)
    assert trial.incumbent is Arm.SPECULATE and trial.num_switches == 0
    fresh = SpeculationTrial()
    fresh.observe(30.0, STEP_S, 4, 2, range(4))
    assert fresh._window.seconds == STEP_S + fresh.max_gap_s


def test_a_challenger_that_emits_nothing_ends_and_loses():
    trial = SpeculationTrial()
    arms = _run(trial, {Arm.SPECULATE: 3.0, Arm.PLAIN: 0.0}, 120)
    assert trial.incumbent is Arm.SPECULATE and trial.num_trials >= 2 and arms[-1] is Arm.SPECULATE


def test_the_warm_up_is_not_measured():
    """After a switch, the tokens of the first two verifications of each running sequence (still the old
    choice's, a round later) are not the new arm's."""
    trial = SpeculationTrial()
    trial._begin(trial._phase, Arm.PLAIN, num_running=4)
    for _ in range(2):  # 4 verifications a step: two steps of warm-up
        trial.observe(STEP_S, STEP_S, 4, 100, range(4))
    assert trial._window.tokens == 0
    trial.observe(STEP_S, STEP_S, 4, 7, range(4))
    assert trial._window.tokens == 7


def test_steps_that_compute_prompts_and_load_changes_are_not_measured():
    trial = SpeculationTrial()
    trial.observe(STEP_S, STEP_S, 4, 0, range(4), num_prefill_tokens=500)
    assert trial._window.seconds == 0 and trial._window.sequence_s == 0
    trial.observe(STEP_S, STEP_S, 4, 6, range(4))
    assert trial._window.tokens == 6 and trial._window.seconds == STEP_S
    trial.observe(STEP_S, STEP_S, 9, 5, range(9))  # 4 -> 9 sequences: a new window, after a warm-up
    assert trial._window.tokens == 0 and trial._window.num_running == 9


def test_a_window_covers_every_sequence_it_verifies_twice():
    """32 sequences, steps of 8 of them in turn (fragments of the batch), each step long and rich enough for a
    window's seconds and tokens: a window still takes 8 steps, two verifications per sequence. Sequences admitted
    but idle (here 8 more) do not stretch it."""
    trial = SpeculationTrial()
    for i in range(8):
        assert trial._windows_done == 0, i
        trial.observe(1.0, 1.0, 40, 40, range(8 * (i % 4), 8 * (i % 4) + 8), predicted_gain=1.2, mean_drafted=3.0)
    assert trial._windows_done == 1 and trial._rates[trial._phase] == 8 * 40 / (8 * 40 * 1.0)


def test_an_idle_verifier_measures_nothing():
    trial = SpeculationTrial()
    _run(trial, {Arm.SPECULATE: 1.0, Arm.PLAIN: 5.0}, 60, num_running=0)
    assert trial.num_trials == 0 and trial.incumbent is Arm.SPECULATE


def test_a_challenger_is_given_as_long_as_the_incumbents_window_took_twice_over():
    """Windows of fragments take 8 steps of 1 s: a challenger that emits as much gets its whole window (the
    cut for one that emits nothing is twice the incumbent's last window, not twice a window's tokens at the
    incumbent's rate, which here is under two steps)."""
    from verifier_service.speculation_trial import _Phase
    trial = SpeculationTrial()
    for i in range(80):
        trial.observe(1.0, 1.0, 32, 40, range(8 * (i % 4), 8 * (i % 4) + 8), predicted_gain=1.2, mean_drafted=3.0)
        if _Phase.CHALLENGE in trial._window_s:
            break
    assert trial._window_s[_Phase.INCUMBENT] == 8.0
    assert trial._window_s[_Phase.CHALLENGE] == 8.0


def _into_challenge(trial: SpeculationTrial, num_running: int) -> None:
    """Steps at `num_running` sequences, each emitting a token a step under either arm, until the other arm's
    challenge runs."""
    challenger = Arm.PLAIN if trial.incumbent is Arm.SPECULATE else Arm.SPECULATE
    for _ in range(2000):
        if trial.running is challenger:
            return
        trial.observe(STEP_S, STEP_S, num_running, num_running, range(num_running), predicted_gain=1.2,
                      mean_drafted=3.0)
    raise AssertionError("no challenge")


def _until(trial: SpeculationTrial, phase, num_running: int, plain_tokens: int) -> None:
    """Steps at `num_running` sequences (plain decoding emitting `plain_tokens` a step, speculation one token a
    sequence) until the trial is in `phase`."""
    for _ in range(2000):
        if trial._phase is phase:
            return
        emitted = plain_tokens if trial.running is Arm.PLAIN else num_running
        trial.observe(STEP_S, STEP_S, num_running, emitted, range(num_running), predicted_gain=1.2,
                      mean_drafted=3.0)
    raise AssertionError(f"never in {phase}")


def test_a_plain_challenge_whose_load_moves_ends_undecided():
    """The tail of a wave of requests (16 streams, 6a142c5): a plain challenge began as the first requests
    finished, and each later finish moved the load and restarted its window, so plain decoding ran the whole tail.
    A move of more than a quarter ends the challenge at once, speculation running on after the warm-up of a
    switch; a smaller one does not."""
    trial = SpeculationTrial()
    _into_challenge(trial, 16)
    trial.observe(STEP_S, STEP_S, 13, 13, range(13))  # within a quarter of 16: the challenge goes on
    assert trial.running is Arm.PLAIN
    trial.observe(STEP_S, STEP_S, 11, 11, range(11))  # 16 -> 11: ended, nothing decided
    assert trial.running is Arm.SPECULATE and trial.incumbent is Arm.SPECULATE
    assert trial.num_trials == 0 and trial.ratio == trial.base_ratio and trial._windows_done == 0
    for _ in range(2):  # the switch's warm-up: each of the 11 verified twice under speculation
        trial.observe(STEP_S, STEP_S, 11, 50, range(11))
        assert trial._window.tokens == 0
    trial.observe(STEP_S, STEP_S, 11, 11, range(11))
    assert trial._window.tokens == 11


def test_plain_decodings_window_after_its_challenge_decides_nothing_at_another_load():
    """A-B-A: speculation's window after plain decoding's challenge, at another load, is not compared with the
    challenge's (plain decoding emitted twice as much, a first win); arrivals get their warm-up."""
    from verifier_service.speculation_trial import _Phase
    trial = SpeculationTrial()
    _into_challenge(trial, 16)
    _until(trial, _Phase.CONFIRM, 16, 32)
    trial.observe(STEP_S, STEP_S, 24, 24, range(24))
    assert trial._phase is _Phase.INCUMBENT and trial.num_trials == 0 and trial.running is Arm.SPECULATE
    trial.observe(STEP_S, STEP_S, 24, 24, range(24))
    assert trial._window.tokens == 0  # 48 verifications of warm-up, 24 of them taken by the move's own step


def test_a_first_plain_win_does_not_count_at_another_load():
    """Plain decoding won a trial at 16 sequences (once: one more decides); the load then fell to 8 before the
    next. Winning that one at 8 is a first win again, not the second of a pair."""
    from verifier_service.speculation_trial import _Phase
    trial = SpeculationTrial()
    _into_challenge(trial, 16)
    _until(trial, _Phase.INCUMBENT, 16, 32)
    assert trial.num_trials == 1 and trial._won_once and trial.incumbent is Arm.SPECULATE
    trial.observe(STEP_S, STEP_S, 8, 8, range(8))  # the load moves in the incumbent's window
    _into_challenge(trial, 8)
    _until(trial, _Phase.INCUMBENT, 8, 16)
    assert trial.num_trials == 2 and trial.incumbent is Arm.SPECULATE and trial.num_switches == 0
    # the move in the second challenge itself: that one ends undecided, and the next win is a first again
    moved = SpeculationTrial()
    _into_challenge(moved, 16)
    _until(moved, _Phase.INCUMBENT, 16, 32)
    _into_challenge(moved, 16)
    moved.observe(STEP_S, STEP_S, 8, 8, range(8))
    assert moved.running is Arm.SPECULATE and moved.num_trials == 1
    _into_challenge(moved, 8)
    _until(moved, _Phase.INCUMBENT, 8, 16)
    assert moved.num_trials == 2 and moved.incumbent is Arm.SPECULATE
    # the same at one load: the second win switches
    same = SpeculationTrial()
    _into_challenge(same, 16)
    _until(same, _Phase.INCUMBENT, 16, 32)
    _into_challenge(same, 16)
    _until(same, _Phase.INCUMBENT, 16, 32)
    assert same.num_trials == 2 and same.incumbent is Arm.PLAIN


def test_speculations_challenge_of_plain_decoding_goes_on_when_the_load_moves():
    """Under plain decoding in place, speculation (the arm that follows the load) keeps its challenge through a
    load move."""
    from verifier_service.speculation_trial import _Phase
    trial = SpeculationTrial()
    _run(trial, {Arm.SPECULATE: 2.0, Arm.PLAIN: 3.0}, 120)
    assert trial.incumbent is Arm.PLAIN
    _into_challenge(trial, 16)
    trial.observe(STEP_S, STEP_S, 8, 8, range(8))
    assert trial.running is Arm.SPECULATE and trial._phase is _Phase.CHALLENGE


def test_a_ratio_raised_at_one_load_is_that_loads_alone():
    """Close results at 16 running sequences double the ratio trial after trial; at 4 the trial starts from the
    base ratio (the other arm may win there by half), and back at 16 the ratio raised there holds again."""
    trial = SpeculationTrial()
    _run(trial, {Arm.SPECULATE: 2.0, Arm.PLAIN: 2.1}, 240, num_running=16)
    raised, trials_at_16 = trial.ratio, trial.num_trials
    assert trial.incumbent is Arm.SPECULATE and trials_at_16 >= 2 and raised == min(trial.max_ratio,
                                                                         trial.base_ratio * 2 ** trials_at_16)
    _run(trial, {Arm.SPECULATE: 2.0, Arm.PLAIN: 2.1}, 0.2, num_running=4)
    assert trial.ratio == trial.base_ratio
    _run(trial, {Arm.SPECULATE: 2.0, Arm.PLAIN: 3.0}, 60, num_running=4)  # plain decoding wins by half at 4
    assert trial.incumbent is Arm.PLAIN
    # back at 16 (plain decoding now in place; a switch forgets what losses said at every load) from the base
    _run(trial, {Arm.SPECULATE: 2.0, Arm.PLAIN: 2.1}, 0.2, num_running=16)
    assert trial.ratio == trial.base_ratio


def test_a_wave_tail_keeps_the_ratio_of_the_load_it_left():
    trial = SpeculationTrial()
    _run(trial, {Arm.SPECULATE: 2.0, Arm.PLAIN: 2.1}, 240, num_running=16)
    raised = trial.ratio
    assert raised > trial.base_ratio
    _run(trial, {Arm.SPECULATE: 2.0, Arm.PLAIN: 2.1}, 5, num_running=3)  # a tail: nothing decided there
    assert trial.ratio == trial.base_ratio
    _run(trial, {Arm.SPECULATE: 2.0, Arm.PLAIN: 2.1}, 0.2, num_running=15)  # about 16 again: its own ratio
    assert trial.ratio == raised


def test_requests_that_come_and_go_still_finish_windows_and_keep_the_set_bounded():
    """A steady 4 sequences, each request verified once outside its prompt's step (max_tokens of 2, say): the
    distinct sequences outgrow the load. A window that waited for two verifications of each of them never
    finished, and its set grew by a key a request (found in review); at most the load's worth is waited for."""
    import itertools

    trial = SpeculationTrial()
    keys = itertools.count()
    for _ in range(25):
        trial.observe(STEP_S, STEP_S, 4, 4, [next(keys) for _ in range(4)], predicted_gain=1.2, mean_drafted=3.0)
        assert len(trial._window.verified) <= 4
    assert trial._windows_done == 2
    # a step may verify more sequences than run after it (some ended in it): still the load's worth
    after = SpeculationTrial()
    after.observe(0.5, 0.5, 4, 20, range(6), predicted_gain=1.2, mean_drafted=3.0)
    after.observe(0.5, 0.5, 4, 20, range(4), predicted_gain=1.2, mean_drafted=3.0)
    assert after._windows_done == 1


def _prompt_steps(trial: SpeculationTrial, seconds: float, num_running: int = 4) -> None:
    """Steps of STEP_S that each compute a prompt's chunk besides verifying every running sequence (a steady stream
    of arrivals): none is measured."""
    for _ in range(round(seconds / STEP_S)):
        trial.observe(STEP_S, STEP_S, num_running, num_running, range(num_running), num_prefill_tokens=50,
                      predicted_gain=1.2, mean_drafted=3.0)


def test_a_trial_that_cannot_measure_hands_plain_decoding_back_to_speculation():
    """Where every step computes a prompt's chunk no window is measured, so plain decoding in place would hold
    every sequence that lets the verifier choose at k = 0 for good (found in review); after max_unmeasured_s of
    such steps it hands back to speculation. Speculation in place stays, and switches nothing."""
    trial = SpeculationTrial()
    trial.incumbent = Arm.PLAIN
    trial._begin(trial._phase, Arm.PLAIN, 4)
    _prompt_steps(trial, trial.max_unmeasured_s - 0.5)
    assert trial.incumbent is Arm.PLAIN and trial.running is Arm.PLAIN
    _prompt_steps(trial, 1.0)
    assert trial.incumbent is Arm.SPECULATE and trial.running is Arm.SPECULATE and trial.num_switches == 1
    held = SpeculationTrial()
    held._windows_done = 2
    _prompt_steps(held, 3 * held.max_unmeasured_s)
    assert held.incumbent is Arm.SPECULATE and held.running is Arm.SPECULATE and held.num_switches == 0
    assert held._windows_done == 2  # its count towards the next challenge kept


def test_an_undecided_challenge_breaks_a_row_of_wins():
    """A challenger takes over when it wins twice in a row: a challenge that ran out of time in between ends the
    row (found in review: the first win outlived it)."""
    from verifier_service.speculation_trial import _Phase

    trial = SpeculationTrial()
    trial._won_once = True
    trial._begin(_Phase.CHALLENGE, Arm.PLAIN, 4)
    _prompt_steps(trial, trial.max_challenge_s + 0.5)
    assert trial._phase is _Phase.INCUMBENT and trial.running is Arm.SPECULATE and not trial._won_once
    # a challenge keeps its own limit, whatever max_unmeasured_s is: it is not handed back on the other clock
    short = SpeculationTrial(max_unmeasured_s=30.0)
    short.incumbent = Arm.PLAIN
    short._begin(_Phase.CHALLENGE, Arm.SPECULATE, 4)
    _prompt_steps(short, 40.0)
    assert short._phase is _Phase.CHALLENGE and short.incumbent is Arm.PLAIN and short.num_switches == 0


def test_a_challenge_out_of_time_while_nothing_runs_ends_at_the_next_step_after_a_warm_up():
    """A challenge whose time ran out in steps with nothing to judge ends at the next step that has something:
    the incumbent's window then waits for each running sequence's two verifications (found in review: ended in
    an idle step, it warmed up for none, and measured rounds still drafted under the challenger's choices)."""
    from verifier_service.speculation_trial import _Phase

    trial = SpeculationTrial()
    trial._begin(_Phase.CHALLENGE, Arm.PLAIN, 4)
    for _ in range(round((trial.max_challenge_s + 0.5) / STEP_S)):
        trial.observe(STEP_S, STEP_S, 0, 0, ())
    assert trial._phase is _Phase.CHALLENGE and trial.running is Arm.PLAIN
    trial.observe(STEP_S, STEP_S, 4, 100, range(4))
    assert trial.running is Arm.SPECULATE and trial._warmup_left == 8 and trial._window.tokens == 0


def test_a_long_window_at_a_heavy_load_is_measured_not_handed_back():
    """64 sequences in steps of 4 s, each verifying 8 of them (fragments of the batch): a window takes 16 steps,
    over a minute. Its steps are measured, so plain decoding in place is not handed back on a timer (the review's
    case against a clock of every step)."""
    trial = SpeculationTrial()
    trial.incumbent = Arm.PLAIN
    trial._begin(trial._phase, Arm.PLAIN, 64)
    for i in range(60):
        trial.observe(4.0, 4.0, 64, 8, range(8 * (i % 8), 8 * (i % 8) + 8), predicted_gain=1.2, mean_drafted=3.0)
    assert trial._windows_done >= 2
    assert trial.incumbent is Arm.PLAIN and trial.running is Arm.PLAIN and trial.num_switches == 0


def test_the_window_after_a_challenge_that_cannot_measure_ends_the_trial_undecided():
    """Plain decoding's window after speculation's challenge hands back to speculation, a switch like a decided
    one (the ratio back to its base); speculation's window after plain decoding's challenge ends the trial
    undecided and keeps its ratio."""
    from verifier_service.speculation_trial import _Phase

    plain = SpeculationTrial()
    plain.incumbent, plain.ratio = Arm.PLAIN, 16
    plain._begin(_Phase.CONFIRM, Arm.PLAIN, 4)
    _prompt_steps(plain, plain.max_unmeasured_s + 0.5)
    assert (plain.incumbent, plain.running, plain._phase) == (Arm.SPECULATE, Arm.SPECULATE, _Phase.INCUMBENT)
    assert plain.num_switches == 1 and plain.ratio == plain.base_ratio
    spec = SpeculationTrial()
    spec.ratio, spec._won_once = 16, True
    spec._begin(_Phase.CONFIRM, Arm.SPECULATE, 4)
    _prompt_steps(spec, spec.max_unmeasured_s + 0.5)
    assert (spec.incumbent, spec.running, spec._phase) == (Arm.SPECULATE, Arm.SPECULATE, _Phase.INCUMBENT)
    assert spec.num_switches == 0 and spec.ratio == 16 and not spec._won_once


def test_a_load_that_grows_within_a_window_is_waited_for_whole():
    """A window begun at 32 sequences whose load grew to 40 (still about the same): steps of 8 verify 40 in
    turn, and the window waits for two verifications of each of the 40, not of the first 32 (found in review)."""
    trial = SpeculationTrial()
    trial.observe(1.0, 1.0, 32, 40, range(8), predicted_gain=1.2, mean_drafted=3.0)
    steps = 1
    while trial._windows_done == 0:
        trial.observe(1.0, 1.0, 40, 40, range(8 * (steps % 5), 8 * (steps % 5) + 8), predicted_gain=1.2,
                      mean_drafted=3.0)
        steps += 1
        assert steps <= 20
    assert steps == 10


def test_a_challenge_gets_the_time_a_long_window_needs():
    """64 sequences in steps of 4 s, each verifying 8: plain decoding's windows take over a minute, so a
    speculation challenge (a warm-up, then a window as long) cut at max_challenge_s ended undecided every time and
    plain decoding stayed in place for good (found in review). Given twice its warm-up and twice that window, it is
    decided, and speculation, here three times plain decoding's output, takes over."""
    trial = SpeculationTrial()
    trial.incumbent = Arm.PLAIN
    trial._begin(trial._phase, Arm.PLAIN, 64)
    for i in range(400):
        emitted = 24 if trial.running is Arm.SPECULATE else 8
        trial.observe(4.0, 4.0, 64, emitted, range(8 * (i % 8), 8 * (i % 8) + 8), predicted_gain=1.2,
                      mean_drafted=3.0)
    assert trial.num_trials >= 2 and trial.incumbent is Arm.SPECULATE


def test_one_slow_window_does_not_hold_a_challenger_for_an_hour():
    """A challenge's limit grows with the incumbent's last window, up to max_challenge_cap_s (found in review: a
    window of an hour made a challenge of four)."""
    trial = SpeculationTrial()
    from verifier_service.speculation_trial import _Phase

    trial._window_s[_Phase.INCUMBENT] = 30.0
    assert trial._challenge_limit_s() == 2 * (trial.max_warmup_s + 60.0)
    trial._window_s[_Phase.INCUMBENT] = 3600.0
    assert trial._challenge_limit_s() == trial.max_challenge_cap_s
