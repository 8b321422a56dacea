"""Speculation on trial: the goodput choice checked against plain decoding on the output the verifier measures.

The goodput controller (goodput.py) chooses draft lengths from models: its step time, each sequence's acceptance
and the share of drafting it waits for. Where those models are wrong, it is wrong with them. Measured on 2 cores
with the verifier and the draft side by side, two groups of sequences alternating steps hid the drafting from the
wait it measures (each group drafted while the other's step ran) while the draft's compute still slowed those
steps: it chose 4 tokens for drafts accepted 30 % of the time, and output fell to 0.69x of plain decoding.

So the verifier runs speculation as one arm of a trial against plain decoding (k = 0 for every sequence that lets
the verifier choose), on what it measures directly: tokens emitted per second per running sequence. The arm in
use (the incumbent) runs for `ratio` times as long as a challenge of the other arm; each period is measured after
a warm-up in which every running sequence is verified about twice under it (a choice takes effect one round
later). The challenger replaces the incumbent when it measured `margin` more. A challenger that loses clearly
(by more than `clear_loss`) doubles the ratio, up to `max_ratio`, so a settled choice is questioned ever less
often; a close result keeps the ratio.

Plain decoding challenges speculation only while the controller itself expects little of it (its predicted gain
over k = 0, smoothed, at most `challenge_below_gain`): where it predicts 2x (one stream, a good draft) nothing is
put at risk. Speculation challenges plain decoding always, ever less often while it loses.

Lives on the engine thread: no locks. Greedy and coupled outputs do not depend on k, so neither arm changes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import structlog

log = structlog.get_logger(__name__)


class Arm(Enum):
    SPECULATE = "speculate"  # the goodput controller's choice
    PLAIN = "plain"  # k = 0 for every sequence that lets the verifier choose


@dataclass
class _Window:
    """Tokens emitted and running-sequence seconds over a measured period."""

    tokens: float = 0.0
    sequence_s: float = 0.0
    seconds: float = 0.0

    @property
    def rate(self) -> float | None:
        """Tokens per second per running sequence; None before anything was measured."""
        return self.tokens / self.sequence_s if self.sequence_s > 0 else None


@dataclass
class SpeculationTrial:
    challenge_tokens: int = 32  # tokens a challenge measures (after its warm-up), at the least
    min_challenge_s: float = 1.0  # and seconds
    base_ratio: float = 4.0  # the incumbent's period against a challenge's
    max_ratio: float = 64.0
    margin: float = 0.05  # the challenger wins with this much more
    clear_loss: float = 0.15  # loses by more than this: challenge half as often
    challenge_below_gain: float = 1.5  # plain decoding challenges only while the predicted gain is at most this
    max_warmup_s: float = 5.0
    gain_decay: float = 0.9
    incumbent: Arm = Arm.SPECULATE
    running: Arm = Arm.SPECULATE  # the arm the next choice follows
    ratio: float = 4.0
    predicted_gain: float | None = None  # smoothed goodput(choice) / goodput(k = 0), as the controller predicts
    num_trials: int = 0
    num_switches: int = 0
    _incumbent_rate: float | None = field(default=None, init=False)
    _window: _Window = field(default_factory=_Window, init=False)
    _warmup_left: int = field(default=0, init=False)  # verifications before the period is measured
    _warmup_s: float = field(default=0.0, init=False)
    _challenge_s: float = field(default=0.0, init=False)  # the last challenge's measured length

    def __post_init__(self) -> None:
        self.ratio = self.base_ratio

    @property
    def challenging(self) -> bool:
        return self.running is not self.incumbent

    def observe(self, dt_s: float, num_running: int, num_emitted: int, num_verifications: int,
                predicted_gain: float | None, num_prefill_tokens: int = 0) -> Arm:
        """One step: `dt_s` since the previous one ended (its step and the wait before it), with `num_running`
        sequences admitted, `num_emitted` tokens emitted, `num_verifications` verifications and
        `num_prefill_tokens` of prompts computed; the controller's predicted gain of its choice over k = 0 (None:
        nothing was chosen). A step that computes prompts is not measured: prefill costs both arms the same, and
        new requests arrive at any time, so counting it would judge an arm by its arrivals. Returns the arm the
        next choices follow."""
        if predicted_gain is not None and predicted_gain > 0:
            d = self.gain_decay
            self.predicted_gain = predicted_gain if self.predicted_gain is None else (
                d * self.predicted_gain + (1 - d) * predicted_gain)
        if num_running <= 0:
            return self.running
        if num_prefill_tokens > 0:
            self._warmup_left -= num_verifications
            return self.running
        if self._warmup_left > 0 and self._warmup_s < self.max_warmup_s:
            self._warmup_left -= num_verifications
            self._warmup_s += dt_s
            return self.running
        w = self._window
        w.tokens += num_emitted
        w.sequence_s += num_running * dt_s
        w.seconds += dt_s
        if self.challenging:
            # done once it measured enough tokens, or ran twice as long as the incumbent takes for them (clearly
            # worse: a challenger that emits nothing must not run for ever)
            rate = self._incumbent_rate
            slow = rate is not None and rate > 0 and w.seconds >= 2 * self.challenge_tokens / (rate * num_running)
            if w.seconds >= self.min_challenge_s and (w.tokens >= self.challenge_tokens or slow):
                self._decide(num_running)
        elif w.seconds >= max(self.min_challenge_s, self._challenge_s) * self.ratio and w.tokens >= self.challenge_tokens:
            self._incumbent_rate = w.rate
            if self._may_challenge():
                self._start(self._other(self.incumbent), num_running)
            else:  # measured again from here: a fresher figure for the next challenge
                self._window = _Window()
        return self.running

    def _may_challenge(self) -> bool:
        if self.incumbent is Arm.PLAIN:
            return True
        return self.predicted_gain is not None and self.predicted_gain <= self.challenge_below_gain

    def _decide(self, num_running: int) -> None:
        challenger, rate, incumbent_rate = self.running, self._window.rate, self._incumbent_rate
        self._challenge_s = self._window.seconds
        self.num_trials += 1
        won = rate is not None and incumbent_rate is not None and rate > incumbent_rate * (1 + self.margin)
        if won:
            self.incumbent = challenger
            self.ratio = self.base_ratio
            self.num_switches += 1
        elif rate is not None and incumbent_rate is not None and rate < incumbent_rate * (1 - self.clear_loss):
            self.ratio = min(self.max_ratio, self.ratio * 2)
        log.info("speculation_trial", challenger=challenger.value, won=won, incumbent=self.incumbent.value,
                 challenger_rate=round(rate or 0.0, 3), incumbent_rate=round(incumbent_rate or 0.0, 3),
                 ratio=self.ratio, predicted_gain=round(self.predicted_gain or 0.0, 3))
        self._start(self.incumbent, num_running)

    def _start(self, arm: Arm, num_running: int) -> None:
        """Run `arm` from the next choice; measure it once each running sequence was verified about twice."""
        switched = arm is not self.running
        self.running = arm
        self._window = _Window()
        self._warmup_left = 2 * num_running if switched else 0
        self._warmup_s = 0.0

    @staticmethod
    def _other(arm: Arm) -> Arm:
        return Arm.PLAIN if arm is Arm.SPECULATE else Arm.SPECULATE
