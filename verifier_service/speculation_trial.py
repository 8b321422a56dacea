"""Speculation on trial: the goodput choice checked against plain decoding on the output the verifier measures.

The goodput controller (goodput.py) chooses draft lengths from models: its step time, each sequence's acceptance
and the share of drafting it waits for. Where those models are wrong, it is wrong with them. Measured on 2 cores
with the verifier and the draft side by side, two groups of sequences alternating steps hid the drafting from the
wait it measures (each group drafted while the other's step ran) while the draft's compute still slowed those
steps: it chose 4 tokens for drafts accepted 30 % of the time, and output fell to 0.69x of plain decoding.

So the verifier runs speculation as one arm of a trial against plain decoding (k = 0 for every sequence that lets
the verifier choose), on what it measures directly: tokens emitted per second per running sequence, over windows
of at least `window_tokens` tokens and `min_window_s` seconds.

- The arm in use (the incumbent) runs `ratio` windows in which it may be challenged (below), then the other arm
  runs one (the challenge), then the incumbent one more (A-B-A: a load that drifts moves both incumbent
  windows). A challenger that beat both by `margin` is challenged again at once, after one more incumbent window, and takes over when it wins twice in a
  row (one window's noise does not switch the arm); when it did not win, the ratio doubles (up to `max_ratio`),
  so a settled choice is questioned ever less often. A close loss counts as well: where the two arms are about
  even, each challenge costs two switches that neither arm pays when it runs alone (measured at 16 streams,
  default pair, 2 cores, 6a142c5 and 8ba705d: each level's plain challenge lost by less than 10 %, and the next,
  about 50 s later at the unchanged ratio, held the level's tail plain).
- A window covers at least `window_rounds` verifications per sequence it verified as well: a step may verify a
  fragment of the batch (sequences that came back apart), and one such step judged an arm by its part of a round
  (measured at 32 streams on 2 cores: windows of one step, rates of one arm from 0.53 to 0.78 in a row). Counted
  per sequence verified, not per sequence admitted: an idle one would stretch every window; and for at most as
  many sequences as ran in the window at once: where requests come and go, the sequences verified outnumber the
  load, and a window that waited for all of them never finished.
- A window is measured after a warm-up in which each running sequence is verified twice under its arm (a choice
  takes effect a round later). Steps that compute prompts are not measured (arrivals would judge an arm), and a
  window restarts when the number of running sequences moves by more than a quarter (a per-sequence rate depends
  on the load), after the same warm-up: arrivals' first rounds wait for their drafts to feed their prompts
  (measured at 4 streams on 2 cores: a level's first window at 2.6 tokens a second a sequence, its next ones at
  3.7 to 4.2; the first, taken as the incumbent's, called a plain challenge that lost). Such a move during plain
  decoding's challenge or the window after it ends the trial undecided, speculation running on
  (SpeculationTrial._abandon). A step's time counts at most its own time plus `max_gap_s` (a stalled client or an
  idle spell is not the arm's doing).
- Plain decoding challenges speculation only while the controller both drafts (its mean choice at least
  `min_drafted` tokens per sequence: otherwise the arms are the same and a trial only measures noise) and expects
  little of it (its predicted gain over k = 0, smoothed, at most `challenge_below_gain`): where it predicts 2x
  (one stream, a good draft) nothing is put at risk. Nor while the incumbent window just measured beat by
  `margin` a plain figure: what the controller predicts plain decoding would give a sequence over the same steps,
  or what plain decoding last measured at about the same load where that is more (a plain challenger could then
  win only where both are off by the margin). Nothing corrects a predicted plain figure while no plain step runs,
  so this exemption holds for at most `max_ratio` windows in a row, and never while a challenger's first win
  waits for its second. Measured at 4 streams (default pair, 2 cores,
  2 requests a stream): speculation gave 3.85 tokens a second a sequence, plain decoding 3.10 in its challenge,
  whose window and the catch-ups after it held 4 sequences at k = 0 for 9 s of a 35 s level (about 7 % of its
  output). Under plain decoding, speculation challenges whenever the controller would draft, and at once (the
  ratio reset) when it expects more than `challenge_below_gain`.
- A challenger's window ends at twice the incumbent's last window's time, judged by its rate then; a challenge
  that has not finished a window within `max_challenge_s` (or, where more, twice its warm-up and four times the
  incumbent's last window, at most `max_challenge_cap_s`: _challenge_limit_s) ends undecided, and a first win
  waiting for its second no longer counts (two wins in a row means no undecided challenge between them). Time here
  is the phase's steps' times, each with at most `max_gap_s` of the gap before it; steps with nothing to judge (no running sequence
  follows the choices) run the clock, and a challenge past its time ends at the next step that has one.
- A trial that cannot measure does not hold plain decoding in place: where no window finishes for
  `max_unmeasured_s` of steps that no window measured (a prompt's chunk in every step, as under a steady stream
  of arrivals; a load that keeps moving, each move a warm-up), plain decoding in place hands back to
  speculation, which follows the load through the controller's own choices and margins, and the incumbent's
  window after a challenge ends the trial undecided, speculation running. Speculation in place runs on; it has
  nothing to hand back. A challenge keeps its own limit.

Lives on the engine thread: no locks; its state is a few numbers and the set of sequences the current window
verified. Greedy and coupled outputs do not depend on k, so neither arm
changes them; seeded sparse and one-hot requests keep their fixed k and never ask.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from enum import Enum

import structlog

from verifier_service.step_time import ema

log = structlog.get_logger(__name__)


class Arm(Enum):
    SPECULATE = "speculate"  # the goodput controller's choice
    PLAIN = "plain"  # k = 0 for every sequence that lets the verifier choose


class _Phase(Enum):
    INCUMBENT = "incumbent"  # the arm in use, `ratio` windows
    CHALLENGE = "challenge"  # the other arm, one window
    CONFIRM = "confirm"  # the incumbent again, one window (A-B-A)


@dataclass
class _Window:
    """Tokens emitted and running-sequence seconds over a measured stretch, at about `num_running` sequences."""

    num_running: int = 0
    most_running: int = 0  # the most running at a step it measured (the load may grow by a quarter in it)
    tokens: float = 0.0
    sequence_s: float = 0.0
    seconds: float = 0.0
    verifications: int = 0
    verified: set = field(default_factory=set)  # the sequences it verified
    plain_tokens: float = 0.0  # what the controller predicted plain decoding would emit a sequence meanwhile
    plain_s: float = 0.0  # over the seconds of the steps that had a prediction

    @property
    def rate(self) -> float | None:
        """Tokens per second per running sequence; None before anything was measured."""
        return self.tokens / self.sequence_s if self.sequence_s > 0 else None

    @property
    def plain_rate(self) -> float | None:
        """The predicted plain rate per running sequence over the steps that had one (None: none had)."""
        return self.plain_tokens / self.plain_s if self.plain_s > 0 else None


def _same_load(num_running: int, window_running: int) -> bool:
    """Whether `num_running` sequences are about the load of a window measured at `window_running`: within a
    quarter of it (a per-sequence rate depends on the load)."""
    return abs(num_running - window_running) <= max(1, window_running // 4)


@dataclass
class SpeculationTrial:
    window_tokens: int = 32  # a window measures at least this many tokens
    window_rounds: int = 2  # and this many verifications per running sequence
    min_window_s: float = 1.0  # and seconds
    base_ratio: int = 4  # incumbent windows per challenge
    max_ratio: int = 64
    margin: float = 0.10  # the challenger wins when it beat both incumbent windows by this much
    challenge_below_gain: float = 1.5  # plain decoding challenges only while the predicted gain is at most this
    min_drafted: float = 0.5  # and the controller drafts at least this many tokens per sequence, on average
    max_gap_s: float = 1.0  # a step's time counts at most its own time plus this
    max_warmup_s: float = 5.0
    max_challenge_s: float = 60.0  # of the phase's time (the module's docstring; _challenge_limit_s)
    max_challenge_cap_s: float = 600.0  # the most _challenge_limit_s gives a long window
    max_unmeasured_s: float = 60.0  # of steps no window measured, without a window finished (_not_measured)
    decay: float = 0.9  # of the smoothed predicted gain and mean choice
    incumbent: Arm = Arm.SPECULATE
    running: Arm = Arm.SPECULATE  # the arm the next choices follow
    ratio: int = 4
    predicted_gain: float | None = None  # smoothed goodput(choice) / goodput(k = 0), as the controller predicts
    mean_drafted: float | None = None  # smoothed mean of the controller's choices (before a plain arm's zeros)
    num_trials: int = 0
    num_switches: int = 0
    _won_once: bool = field(default=False, init=False)  # the last trial's challenger won: one more decides
    _phase: _Phase = field(default=_Phase.INCUMBENT, init=False)
    _window: _Window = field(default_factory=_Window, init=False)
    _windows_done: int = field(default=0, init=False)  # incumbent windows that could be challenged, since the last
    _rates: dict[_Phase, float] = field(default_factory=dict, init=False)  # the last window's rate per phase
    _window_s: dict[_Phase, float] = field(default_factory=dict, init=False)  # and its seconds
    _warmup_left: int = field(default=0, init=False)  # verifications before measuring
    _warmup_s: float = field(default=0.0, init=False)
    _phase_s: float = field(default=0.0, init=False)  # time in this phase (steps, gaps capped)
    # the time of steps no window measured, outside challenges, since a window finished or a phase began
    _unmeasured_s: float = field(default=0.0, init=False)
    _beats_plain: bool = field(default=False, init=False)  # the last window checked was exempt (logged)
    _exempt_windows: int = field(default=0, init=False)  # windows exempt in a row
    _plain_measured: tuple[float, int] | None = field(default=None, init=False)  # the last plain window: rate, load
    _ratio_load: int = field(default=0, init=False)  # the load (running sequences) `ratio` belongs to; 0: none yet
    _ratios_elsewhere: dict[int, int] = field(default_factory=dict, init=False)  # other loads' ratios, kept

    def __post_init__(self) -> None:
        self.ratio = self.base_ratio

    def observe(self, dt_s: float, step_s: float, num_running: int, num_emitted: int, verified: Collection[object],
                num_prefill_tokens: int = 0, predicted_gain: float | None = None,
                mean_drafted: float | None = None, plain_rate: float | None = None) -> Arm:
        """One step that took `step_s`, `dt_s` after the previous one ended, with `num_running` sequences
        admitted, `num_emitted` tokens emitted, the sequences `verified` (their keys) and `num_prefill_tokens` of
        prompts computed; the controller's predicted gain of its choice over k = 0, the mean length it chose and
        its predicted tokens per second a sequence under plain decoding (None: nothing was chosen). Returns the
        arm the next choices follow."""
        num_verifications = len(verified)
        self._smooth(predicted_gain, mean_drafted)
        dt = min(dt_s, step_s + self.max_gap_s)
        self._phase_s += dt
        if num_running <= 0:  # nothing to judge: the clocks run on (a challenge past its time ends at the next)
            return self.running
        if self._phase is _Phase.CHALLENGE and self._phase_s > self._challenge_limit_s():
            log.info("speculation_trial", challenger=self.running.value, decided=False, reason="too long")
            self._won_once = False  # an undecided challenge breaks a row of wins
            self._begin(_Phase.INCUMBENT, self.incumbent, num_running)
            return self.running
        if self._phase is _Phase.INCUMBENT and self.incumbent is Arm.PLAIN and self._eager_to_speculate():
            self.ratio = self.base_ratio
            self._ratios_elsewhere.clear()
            self._windows_done = max(self._windows_done, self.ratio)
        self._follow_load(num_running)
        if (self.incumbent is Arm.SPECULATE and self._phase is not _Phase.INCUMBENT
                and not _same_load(num_running, self._window.num_running)):
            self._abandon(num_running, num_verifications, dt)
            return self.running
        if self._warmup_left > 0 and self._warmup_s < self.max_warmup_s:
            self._warmup_left -= num_verifications
            self._warmup_s += dt
            return self._not_measured(dt, num_running)
        if num_prefill_tokens > 0:
            return self._not_measured(dt, num_running)
        w = self._window
        if w.num_running == 0 or not _same_load(num_running, w.num_running):
            moved = w.num_running > 0
            w = self._window = _Window(num_running)  # the load moved: a per-sequence rate is another figure
            if moved:  # and arrivals' first rounds are not it (their drafts' own prompts first): a warm-up
                self._warmup_left, self._warmup_s = 2 * num_running - num_verifications, dt
                if self.incumbent is Arm.SPECULATE:
                    self._won_once = False  # a plain challenger's first win was at the old load (_abandon)
                return self._not_measured(dt, num_running)
        w.tokens += num_emitted
        w.verifications += num_verifications
        w.most_running = max(w.most_running, num_running)
        if len(w.verified) < w.most_running:  # _window_done counts at most that many of them (churn: bounded)
            w.verified.update(verified)
        w.sequence_s += num_running * dt
        w.seconds += dt
        if plain_rate is not None and plain_rate > 0:
            w.plain_tokens += plain_rate * dt
            w.plain_s += dt
        if self._window_done(w):
            self._window_finished(w, num_running)
        return self.running

    # -- internals ---------------------------------------------------------------------------------------------

    def _follow_load(self, num_running: int) -> None:
        """The ratio belongs to the load its trials were decided at: ties at 16 streams (each one doubling it) say
        nothing of 4, where the other arm may win by half. When the load leaves the ratio's by more than a
        quarter, the ratio is kept for that load, and the new load takes its own (the base if none): a wave's tail
        and a return to the old load give each its own back."""
        if self._ratio_load and _same_load(num_running, self._ratio_load):
            return
        if self._ratio_load:
            for load in [load for load in self._ratios_elsewhere if _same_load(self._ratio_load, load)]:
                del self._ratios_elsewhere[load]
            self._ratios_elsewhere[self._ratio_load] = self.ratio
            match = min((load for load in self._ratios_elsewhere if _same_load(num_running, load)),
                        key=lambda load: abs(load - num_running), default=None)
            self.ratio = self._ratios_elsewhere.pop(match) if match is not None else self.base_ratio
            num_running = match if match is not None else num_running
        self._ratio_load = num_running

    def _smooth(self, predicted_gain: float | None, mean_drafted: float | None) -> None:
        d = self.decay
        if predicted_gain is not None and predicted_gain > 0:
            self.predicted_gain = ema(self.predicted_gain, predicted_gain, d)
        if mean_drafted is not None:
            self.mean_drafted = ema(self.mean_drafted, mean_drafted, d)

    def _drafts(self) -> bool:
        return self.mean_drafted is not None and self.mean_drafted >= self.min_drafted

    def _eager_to_speculate(self) -> bool:
        return self._drafts() and self.predicted_gain is not None and self.predicted_gain > self.challenge_below_gain

    def _challengeable(self) -> bool:
        """Whether the incumbent may be challenged at all now (its windows count towards the ratio only then)."""
        if not self._drafts():
            return False  # the controller drafts (about) nothing: both arms are plain decoding
        if self.incumbent is Arm.PLAIN:
            return True
        return self.predicted_gain is not None and self.predicted_gain <= self.challenge_below_gain

    def _may_challenge(self, w: _Window) -> bool:
        """Whether the incumbent, its window `w` just finished, is challenged now (its ratio of windows run)."""
        if not self._challengeable():
            return False
        if self.incumbent is Arm.PLAIN:
            return True
        rate, plain = w.rate, w.plain_rate
        measured = self._plain_measured
        if plain is not None and measured is not None and _same_load(measured[1], w.num_running):
            plain = max(plain, measured[0])  # what plain decoding measured at about this load, when more
        # not while a challenger's first win waits for its second (that is a plain figure measured above the
        # model's), and not for more than max_ratio windows in a row: while it holds no plain step runs, so
        # nothing corrects a plain prediction that is too low, and a challenge must come now and then all the same
        beats = (rate is not None and plain is not None and rate > plain * (1 + self.margin)
                 and not self._won_once and self._exempt_windows < self.max_ratio)
        self._exempt_windows = self._exempt_windows + 1 if beats else 0
        if beats != self._beats_plain:  # logged when it starts or stops holding
            log.info("speculation_trial_exempt" if beats else "speculation_trial_due", rate=round(rate or 0.0, 3),
                     predicted_plain_rate=round(plain or 0.0, 3))
            self._beats_plain = beats
        return not beats  # what it measured beats the plain figure by the margin a challenger would need

    def _window_done(self, w: _Window) -> bool:
        if w.seconds < self.min_window_s:
            return False
        # twice each sequence it verified, at most the load's worth: where requests come and go (each verified
        # once or twice before its end) the distinct sequences outgrow the load, and would outgrow every window
        if (w.tokens >= self.window_tokens
                and w.verifications >= self.window_rounds * min(len(w.verified), w.most_running)):
            return True
        # a challenger's window ends at twice the incumbent's last window's time, and is judged by its rate as it
        # is then (one that emits nothing must not run for ever)
        before = self._window_s.get(_Phase.INCUMBENT)
        return self._phase is _Phase.CHALLENGE and before is not None and w.seconds >= 2 * before

    def _window_finished(self, w: _Window, num_running: int) -> None:
        self._unmeasured_s = 0.0
        self._rates[self._phase] = w.rate or 0.0
        if self.running is Arm.PLAIN:
            self._plain_measured = (w.rate or 0.0, w.num_running)
        self._window_s[self._phase] = w.seconds
        self._window = _Window(num_running)
        if self._phase is _Phase.INCUMBENT:
            # only windows in which it could be challenged count: a load at which the controller expected a large
            # gain (a stream or two) says nothing of the next, and would have its first window, at a level's
            # start, challenged at once
            self._windows_done += self._challengeable()
            if self._windows_done >= self.ratio and self._may_challenge(w):
                self._begin(_Phase.CHALLENGE, self._other(self.incumbent), num_running)
        elif self._phase is _Phase.CHALLENGE:
            self._begin(_Phase.CONFIRM, self.incumbent, num_running)
        else:
            self._decide(num_running)

    def _decide(self, num_running: int) -> None:
        challenger = self._other(self.incumbent)
        rate = self._rates[_Phase.CHALLENGE]
        before, after = self._rates.get(_Phase.INCUMBENT, 0.0), self._rates[_Phase.CONFIRM]
        self.num_trials += 1
        won = rate > max(before, after) * (1 + self.margin)
        confirm = won and not self._won_once
        if won and self._won_once:
            self._switch_to(challenger)
        elif not won:
            self.ratio = min(self.max_ratio, self.ratio * 2)
        self._won_once = confirm
        log.info("speculation_trial", challenger=challenger.value, decided=True, won=won,
                 incumbent=self.incumbent.value, challenger_rate=round(rate, 3), incumbent_before=round(before, 3),
                 incumbent_after=round(after, 3), ratio=self.ratio,
                 predicted_gain=round(self.predicted_gain or 0.0, 3),
                 mean_drafted=round(self.mean_drafted or 0.0, 2))
        self._begin(_Phase.INCUMBENT, self.incumbent, num_running)
        if confirm:  # the next challenge after one more incumbent window
            self._windows_done = self.ratio - 1

    def _abandon(self, num_running: int, num_verifications: int, dt: float) -> None:
        """The load moved by more than a quarter while plain decoding challenged speculation, or in the window of
        speculation after it: the trial ends undecided and speculation runs on, and a first win of plain
        decoding, measured at the old load, no longer counts. Speculation is the arm that follows the load (the
        controller chooses again at every step, from the batch as it is); plain decoding is the one that ignores
        it, and its challenge ran until it finished a window at the new load, which at the end of a wave of
        requests never happens: measured at 16 streams (default pair, 2 cores, 6a142c5), a plain challenge began
        as the first requests finished and held every sequence left at k = 0 for the 11 s in which the batch ran
        down from 14 to 1 (each finish that moved the load restarted its window), where fixed k = 4 ran its tail
        down in 9 s. Under plain decoding in place a load move ends nothing: speculation's challenge runs on, as
        the arm that follows the load."""
        log.info("speculation_trial", challenger=Arm.PLAIN.value, decided=False, reason="load moved",
                 num_running=num_running)
        self._won_once = False
        switched = self.running is not Arm.SPECULATE
        self._begin(_Phase.INCUMBENT, Arm.SPECULATE, num_running)
        if not switched:  # a window of speculation after the challenge: arrivals' warm-up, as for any load move
            self._warmup_left, self._warmup_s = 2 * num_running - num_verifications, dt

    def _switch_to(self, arm: Arm) -> None:
        """`arm` takes the incumbent's place, its ratio the base's: what the old incumbent's losses said no longer
        holds anywhere."""
        self.incumbent = arm
        self.ratio = self.base_ratio
        self._ratios_elsewhere.clear()
        self.num_switches += 1

    def _challenge_limit_s(self) -> float:
        """A challenge's time: max_challenge_s, or where it is more, twice what the challenger needs to be judged
        as _window_done judges it (its warm-up, then twice the incumbent's last window), at most
        max_challenge_cap_s (one slow window must not hold a challenger for an hour): at 64 sequences in steps
        of 4 s, each verifying 8, a window takes over a minute, and a challenge cut at max_challenge_s ended
        undecided every time, leaving plain decoding in place for good (found in review)."""
        before = self._window_s.get(_Phase.INCUMBENT)
        if before is None:
            return self.max_challenge_s
        return max(self.max_challenge_s, min(self.max_challenge_cap_s, 2 * (self.max_warmup_s + 2 * before)))

    def _not_measured(self, dt: float, num_running: int) -> Arm:
        """A step with something to judge that no window measures (a warm-up, a prompt's chunk, a load move):
        past max_unmeasured_s of such steps since a window finished, _unmeasurable. Steps a window measures do
        not count (a window of many slow steps is a window all the same), nor a challenge's (it has its own
        limit, _challenge_limit_s)."""
        if self._phase is not _Phase.CHALLENGE:
            self._unmeasured_s += dt
            if self._unmeasured_s > self.max_unmeasured_s:
                self._unmeasurable(num_running)
        return self.running

    def _unmeasurable(self, num_running: int) -> None:
        """No window finished for max_unmeasured_s of steps no window measured (module docstring): plain
        decoding in place hands back to speculation, and the window of the incumbent after a challenge ends the
        trial undecided (speculation running, in place of either incumbent); speculation in place runs on as it
        was (it holds nothing)."""
        self._unmeasured_s = 0.0
        if self._phase is _Phase.INCUMBENT and self.incumbent is Arm.SPECULATE:
            return
        log.info("speculation_trial", decided=False, reason="unmeasurable", phase=self._phase.value,
                 incumbent=self.incumbent.value, num_running=num_running)
        if self.incumbent is not Arm.SPECULATE:
            self._switch_to(Arm.SPECULATE)
        self._won_once = False
        self._begin(_Phase.INCUMBENT, Arm.SPECULATE, num_running)

    def _begin(self, phase: _Phase, arm: Arm, num_running: int) -> None:
        """Enter `phase` running `arm`; measure once each running sequence was verified about twice under it."""
        switched = arm is not self.running
        self._phase, self.running = phase, arm
        self._window = _Window(num_running)
        self._phase_s = 0.0
        self._unmeasured_s = 0.0
        if phase is _Phase.INCUMBENT:
            self._windows_done = 0
        self._warmup_left = 2 * num_running if switched else 0
        self._warmup_s = 0.0

    @staticmethod
    def _other(arm: Arm) -> Arm:
        return Arm.PLAIN if arm is Arm.SPECULATE else Arm.SPECULATE
