"""verifier_service.speculation_trial: speculation against plain decoding on measured output, in simulation."""

from __future__ import annotations

import pytest

from verifier_service.speculation_trial import Arm, SpeculationTrial

STEP_S = 0.1


def _run(trial: SpeculationTrial, rates: dict[Arm, float], seconds: float, *, num_running: int = 4,
         predicted_gain: float | None = 1.2, lag_steps: int = 0) -> list[Arm]:
    """Steps of STEP_S: each running sequence emits rates[arm] tokens per second under the arm that was running
    `lag_steps` steps ago (a choice takes effect a round later). Returns the arm of every step."""
    arms: list[Arm] = []
    history = [trial.running] * (lag_steps + 1)
    carry = 0.0
    for _ in range(round(seconds / STEP_S)):
        effective = history[-(lag_steps + 1)]
        carry += rates[effective] * num_running * STEP_S
        emitted = int(carry)
        carry -= emitted
        running = trial.observe(STEP_S, num_running, emitted, num_running, predicted_gain)
        history.append(running)
        arms.append(running)
    return arms


def test_plain_decoding_takes_over_when_it_measures_more_and_the_model_expects_little():
    trial = SpeculationTrial()
    arms = _run(trial, {Arm.SPECULATE: 2.0, Arm.PLAIN: 3.0}, 240, lag_steps=2)
    assert trial.incumbent is Arm.PLAIN and trial.num_switches == 1
    later = arms[len(arms) // 2:]
    assert later.count(Arm.PLAIN) / len(later) > 0.85  # settled on plain, speculation challenging ever less often


def test_speculation_is_never_put_on_trial_where_the_model_expects_a_large_gain():
    trial = SpeculationTrial()
    arms = _run(trial, {Arm.SPECULATE: 2.0, Arm.PLAIN: 3.0}, 60, predicted_gain=2.0)
    assert set(arms) == {Arm.SPECULATE} and trial.num_trials == 0


def test_speculation_that_measures_more_keeps_its_place_and_is_questioned_ever_less_often():
    trial = SpeculationTrial()
    arms = _run(trial, {Arm.SPECULATE: 3.0, Arm.PLAIN: 1.5}, 300, lag_steps=2)
    assert trial.incumbent is Arm.SPECULATE and trial.num_switches == 0
    assert trial.num_trials >= 3 and trial.ratio > trial.base_ratio  # clear losses: challenges spread out
    assert arms.count(Arm.PLAIN) / len(arms) < 0.15


def test_speculation_wins_back_when_the_load_changes():
    trial = SpeculationTrial()
    _run(trial, {Arm.SPECULATE: 2.0, Arm.PLAIN: 3.0}, 60, lag_steps=1)
    assert trial.incumbent is Arm.PLAIN
    _run(trial, {Arm.SPECULATE: 4.0, Arm.PLAIN: 2.0}, 200, lag_steps=1)
    assert trial.incumbent is Arm.SPECULATE


def test_a_close_result_changes_nothing():
    trial = SpeculationTrial()
    _run(trial, {Arm.SPECULATE: 2.0, Arm.PLAIN: 2.02}, 120)
    assert trial.incumbent is Arm.SPECULATE and trial.num_trials >= 2 and trial.ratio == trial.base_ratio


def test_a_challenger_that_emits_nothing_ends_and_loses():
    trial = SpeculationTrial()
    arms = _run(trial, {Arm.SPECULATE: 3.0, Arm.PLAIN: 0.0}, 120, lag_steps=1)
    assert trial.incumbent is Arm.SPECULATE and trial.num_trials >= 2 and arms[-1] is Arm.SPECULATE


def test_the_warm_up_is_not_measured():
    """After a switch, the tokens of the first two verifications of each running sequence (still the old
    choice's, a round later) are not the new arm's."""
    trial = SpeculationTrial()
    trial._start(Arm.PLAIN, num_running=4)
    for _ in range(2):  # 4 verifications a step: two steps of warm-up
        trial.observe(STEP_S, 4, 100, 4, 1.2)
    assert trial._window.tokens == 0
    trial.observe(STEP_S, 4, 7, 4, 1.2)
    assert trial._window.tokens == 7


def test_steps_that_compute_prompts_are_not_measured():
    trial = SpeculationTrial()
    trial.observe(STEP_S, 4, 0, 4, 1.2, num_prefill_tokens=500)
    assert trial._window.seconds == 0 and trial._window.sequence_s == 0
    trial.observe(STEP_S, 4, 6, 4, 1.2)
    assert trial._window.tokens == 6 and trial._window.seconds == STEP_S


@pytest.mark.parametrize("num_running", [0])
def test_an_idle_verifier_measures_nothing(num_running):
    trial = SpeculationTrial()
    _run(trial, {Arm.SPECULATE: 1.0, Arm.PLAIN: 5.0}, 60, num_running=num_running)
    assert trial.num_trials == 0 and trial.incumbent is Arm.SPECULATE
