"""Goodput-driven draft length: the verifier decides how many tokens each sequence drafts next.

Only the verifier sees the whole batch. A longer draft for one sequence makes the step slower for every other
sequence in it, so the draft length that is best for one sequence alone (draft_service.adaptive) is not best for
the batch. Here the verifier keeps

- a model of its own step time as a function of the tokens in the step (StepTimeModel), learned online from
  the steps it runs, and
- each sequence's acceptance per draft position (AcceptanceTracker), conditional on the positions before it
  having been accepted, shrunk towards the rates of all sequences,

and after every step chooses the draft lengths k_i of the sequences that got a verdict (with --whole-batch-goodput
also those of the batch away at their drafts, whose choices apply at their next verdicts) so as to
maximise the expected verified tokens per second of the next step (goodput, as in SmartSpec, Liu et al. 2024):

    goodput(k) = sum_i E_i(k_i) / t(sum_i (1 + k_i))      E_i(k) = 1 + sum_{j<=k} prod_{m<=j} alpha_{i,m}

t also holds the verifier's wait for the next proposals, of which drafting is the part that k changes: the
draft drafts its sequences' blocks in one batch, one step per token of the longest block L, each step over the
sequences still drafting, M tokens in all, after C rows of catch-up (DraftTimeModel: a L + b M + c C). For a
fixed number of drafted tokens M and a bound L on the block length the numerator is largest when it takes the M
largest marginal gains prod_{m<=j} alpha_{i,m}, j <= L, over all sequences (each sequence's gains fall with j),
so the search runs over L and M: the best prefix of the merged, sorted marginal gains under each bound. Under
heavy load t grows with every token and the choice falls to k = 0 (plain decoding through the same path); when the
verifier is idle t hardly grows and the choice rises to each sequence's cap. Low acceptance lowers k at any load.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from verifier_service.step_time import AcceptanceTracker, DraftTimeModel, StepTimeModel, ema


@dataclass(frozen=True)
class Candidate:
    """A sequence that will propose again: its key, its cap on k and its acceptance per position."""

    key: object
    max_k: int
    rates: tuple[float, ...]
    # rows the draft must feed before this sequence's first drafted token if it drafts (its catch-up), per round
    # of drafting it has left (DraftLengthController.catch_up_rows): priced when k > 0 (choose_draft_lengths)
    catch_up_rows: float = 0.0
    # the draft process (Verify stream) that drafts it, as an index: each drafts its own sequences' blocks in one
    # batch, beside the others, so a drafted token or a catch-up row costs the wait only in the largest batch
    group: int = 0


@dataclass(frozen=True)
class Allocation:
    draft_lengths: dict[object, int]
    expected_tokens: float  # expected verified tokens of the step, the other work's included
    step_tokens: int  # tokens of the step that verifies them, the other work included
    predicted_step_s: float  # the step's predicted time plus the verifier's idle time per step
    plain_goodput: float = 0.0  # what the same step would yield per second with k = 0 for every candidate
    plain_step_s: float = 0.0  # and that step's predicted time, the idle time included (0: no model yet)
    # where `plain_tolerance` turned a choice that drafted to plain decoding: that choice's predicted gain over it,
    # per sequence it drafted for, in expected tokens a plain step (None: nothing was turned)
    declined_gain: float | None = None

    @property
    def goodput(self) -> float:
        """Expected verified tokens per second of that step."""
        return self.expected_tokens / self.predicted_step_s if self.predicted_step_s > 0 else 0.0


def _sorted_gains(cands: list[Candidate]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every candidate's marginal gains, largest first, as arrays (gain, candidate index, position j): gain j of c
    is prod_{m<=j} alpha_{c,m}, which falls with j, and ties keep position order, so every prefix of the order
    (and of its positions below any bound) takes each candidate's positions in order. Between candidates, ties
    take the draft processes in turn (each one's first candidate, then each one's second, Candidate.group), then
    candidate order (in one process, candidate order alone): tied gains of several candidates spread over the
    processes' batches instead of filling the first-listed process's first."""
    gains: list[float] = []
    index: list[int] = []
    position: list[int] = []
    slots: list[int] = []
    seen: dict[int, int] = {}
    for i, c in enumerate(cands):
        slot = seen[c.group] = seen.get(c.group, -1) + 1
        prod = 1.0
        for j in range(min(c.max_k, len(c.rates))):
            prod *= c.rates[j]
            gains.append(prod)
            index.append(i)
            position.append(j)
            slots.append(slot)
    g, i, j = np.asarray(gains, dtype=np.float64), np.asarray(index, dtype=np.int64), np.asarray(position)
    order = np.lexsort((j, i, np.asarray(slots), -g))
    return g[order], i[order], j[order]


def choose_draft_lengths(candidates: Iterable[Candidate], step_time: StepTimeModel, other_tokens: int = 0,
                         other_output: float = 0.0, idle_s: float = 0.0, tolerance: float = 0.0,
                         idle_per_block_token: float = 0.0, other_longest_block: int = 0,
                         plain_idle_s: float | None = None, step_ratios: tuple[float, float] = (1.0, 1.0),
                         idle_per_drafted_token: float = 0.0, other_drafted: int = 0,
                         plain_tolerance: float | None = None,
                         idle_per_catch_up_row: float | None = None) -> Allocation:
    """The draft length per candidate that maximises expected verified tokens per second of a step that
    verifies all of them (each feeds 1 + k tokens) beside `other_tokens` of other work (prefill chunks, fixed-k
    verifications), which yields `other_output` tokens whatever is chosen: a longer draft slows that work too.
    `idle_s`: the verifier's time between steps (waiting for proposals), which a step's tokens do not lengthen;
    `idle_per_block_token`: what each token of the longest block adds to it (the draft drafts its sequences'
    blocks in one batch, one token of each per draft step, so the verifier, where it waits for that, waits as
    long as the longest block takes); `other_longest_block`: the longest block of the other work (fixed k), which
    is drafted whatever is chosen. `idle_per_drafted_token`: what each drafted token adds to the wait besides (the
    draft's step over more rows: a CPU draft's time grows with the sequences it drafts for), counted in the
    largest draft process's batch (Candidate.group): the candidates' tokens in their processes' batches as each
    option places them, the other work's `other_drafted` tokens spread evenly over the candidates' processes.
    `plain_idle_s`: the wait where nothing at all is drafted (no candidate drafts
    and the other work's blocks draft nothing), in place of `idle_s` (None: the same). `step_ratios`: what a step
    that verifies nothing drafted, and one that verifies drafted tokens, takes against `step_time`'s prediction.
    `tolerance`: of the choices that lose at most this fraction of the candidates' expected tokens against the
    best goodput, plain decoding if it is one of them, else the one with the most drafted tokens, at most one a
    candidate more than the best's, is taken. `plain_tolerance` (None: `tolerance`): plain decoding is then taken
    where that choice gains at most this fraction over it, in expected tokens a plain step per sequence it drafts
    for (the caller's plain margin or hysteresis, DraftLengthController.plain_margin and
    switch_tolerance; no near draft is looked for past `tolerance`). Without a step observed yet every candidate
    gets its cap.

    For a given total M of drafted tokens the step's tokens are fixed and the expected output is largest when it
    takes the M largest marginal gains; with the longest block priced as well, that holds for each bound L on
    the block length, so the search runs over L and M. Under bound L only the totals whose longest block is L
    are new (the others are the same prefixes as under a smaller bound), and each bound is one pass of array
    arithmetic: the engine thread runs this after every step.

    Over several draft processes each option's drafted tokens and catch-up rows are priced at its largest
    process's (what the verifier waits for), beside the longest block anywhere: about a bound on the wait, as those
    may be different processes' (one drafting 4 tokens for one sequence, another 1 for each of eight, is priced 4
    blocks' steps and 8 tokens' rows where either batch takes less). The prefixes of the gains are then the best
    allocations of each total only in one process (over several, a total placed otherwise may wait less: smaller
    processes' tokens cost nothing while under the largest's), so the search drafts at most what it finds worth
    it, and may find less.

    A candidate's catch-up rows (Candidate.catch_up_rows) are priced at `idle_per_catch_up_row` each (None: as
    drafted tokens) once it drafts at all, in its process's batch: the rows of the largest such batch. The
    search over prefixes of the gains then no longer finds the best of every allocation (a sequence's first gain
    carries its rows), so it runs twice, once with the candidates that would catch up held at k = 0, and the
    choice that lets them draft is taken only where it beats the other by more than `tolerance`: drafting for
    them buys little over the others' drafting, and their catch-up is a cost the estimates may well get wrong."""
    cands = list(candidates)
    base = len(cands)
    if not step_time.ready:
        lengths = {c.key: c.max_k for c in cands}
        return Allocation(lengths, float(base), base + other_tokens + sum(lengths.values()), 0.0)
    # the other work's drafted tokens, whose processes are not known: spread over those of the candidates that may
    # draft (counted once: the catch-up's second search below holds some at 0, and must not price it otherwise)
    other_share = other_drafted / max(1, len({c.group for c in cands if c.max_k > 0}))
    args = (step_time, other_tokens, other_output, idle_s, tolerance, idle_per_block_token, other_longest_block,
            plain_idle_s, step_ratios, idle_per_drafted_token, other_share,
            idle_per_drafted_token if idle_per_catch_up_row is None else idle_per_catch_up_row)
    if not any(c.catch_up_rows > 0 and c.max_k > 0 for c in cands):
        chosen = _search(cands, *args)
    else:
        every = _search(cands, *args)
        fresh = _search([dataclasses.replace(c, max_k=0) if c.catch_up_rows > 0 else c for c in cands], *args)
        chosen = every if every.goodput > fresh.goodput * (1 + tolerance) else fresh
    if plain_tolerance is None or plain_tolerance <= tolerance:
        return chosen
    return decline_below(chosen, plain_tolerance, other_tokens, other_output)


def decline_below(chosen: Allocation, plain_tolerance: float, other_tokens: int = 0,
                  other_output: float = 0.0) -> Allocation:
    """`chosen` (choose_draft_lengths', whose step carries `other_tokens` of other work yielding `other_output`),
    or plain decoding where it drafts and gains at most `plain_tolerance` over it: the choice against plain
    decoding (every search's first option) once more, by the expected tokens of the sequences it drafts for. The
    others (a request's last rounds, a client's k = 0, a draft the choice gives nothing for its acceptance, those
    the catch-up's search held at 0) neither gain nor cost what the margin stands for, and must not raise the bar
    for the rest."""
    drafting = sum(1 for k in chosen.draft_lengths.values() if k > 0)
    if not drafting or chosen.plain_step_s <= 0:  # nothing drafted, or no step-time model: nothing to judge
        return chosen
    gain = (chosen.goodput - chosen.plain_goodput) * chosen.plain_step_s / drafting
    if gain > plain_tolerance:
        return chosen
    base = len(chosen.draft_lengths)
    return Allocation(dict.fromkeys(chosen.draft_lengths, 0), base + other_output, base + other_tokens,
                      chosen.plain_step_s, chosen.plain_goodput, chosen.plain_step_s, declined_gain=gain)


def _running_group_sums(groups: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """For each element, in order, the sum of `weights` over its group's elements up to it (itself included);
    `weights` may hold several columns (one sort for all of them). Weights are not negative, so a group's sums
    rise along the order, and the largest group's at each prefix is the running maximum of these."""
    if not len(groups):
        return np.zeros(weights.shape)
    order = np.argsort(groups, kind="stable")
    sorted_groups, sorted_weights = groups[order], weights[order]
    totals = np.cumsum(sorted_weights, axis=0)
    starts = np.flatnonzero(np.r_[True, sorted_groups[1:] != sorted_groups[:-1]])
    before = np.repeat(totals[starts] - sorted_weights[starts], np.diff(np.r_[starts, len(order)]), axis=0)
    sums = np.empty_like(totals)
    sums[order] = totals - before
    return sums


def _search(cands: list[Candidate], step_time: StepTimeModel, other_tokens: int, other_output: float,
            idle_s: float, tolerance: float, idle_per_block_token: float, other_longest_block: int,
            plain_idle_s: float | None, step_ratios: tuple[float, float], idle_per_drafted_token: float,
            other_share: float, idle_per_catch_up_row: float) -> Allocation:
    """choose_draft_lengths' search over the prefixes of the candidates' sorted gains (a model that is ready);
    `other_share`: the other work's drafted tokens counted in the largest process's batch."""
    base = len(cands)
    catch_up = np.asarray([c.catch_up_rows for c in cands], dtype=np.float64)
    group = np.asarray([c.group for c in cands], dtype=np.int64)
    one_process = len({c.group for c in cands}) <= 1  # its batch is every option's whole: no per-process sums
    fixed_n = base + other_tokens
    start = float(base) + other_output

    def cost(n: np.ndarray, longest: np.ndarray, drafted: np.ndarray, rows: np.ndarray) -> np.ndarray:
        block = np.maximum(longest, other_longest_block)
        idle = np.full(len(n), idle_s) if plain_idle_s is None else np.where(block > 0, idle_s, plain_idle_s)
        ratio = np.where(block > 0, step_ratios[1], step_ratios[0])
        drafting = idle_per_block_token * block + np.where(
            block > 0, idle_per_drafted_token * (drafted + other_share) + idle_per_catch_up_row * rows, 0.0)
        return np.where(n > 0, step_time.predict_many(n) * ratio + idle + drafting, 0.0)

    gains, index, position = _sorted_gains(cands)
    top = int(position.max()) + 1 if position.size else 0
    limits = range(1, top + 1) if idle_per_block_token > 0 else ([top] if top else [])
    # per option: goodput, drafted tokens M, bound L, expected tokens, longest block; the first is M = 0
    ms, bounds, expected, longest = [np.zeros(1, np.int64)], [np.zeros(1, np.int64)], [np.full(1, start)], \
        [np.zeros(1, np.int64)]
    # per option, the drafted tokens and the catch-up rows of its largest process's batch
    drafted, rows = [np.zeros(1)], [np.zeros(1)]
    for limit in limits:
        under = position < limit
        g, j = gains[under], position[under]
        run_longest = np.maximum.accumulate(j + 1)
        new = run_longest == limit if idle_per_block_token > 0 else np.ones(len(g), dtype=bool)
        m = np.arange(1, len(g) + 1)
        ms.append(m[new])
        bounds.append(np.full(int(new.sum()), limit))
        expected.append((start + np.cumsum(g))[new])
        longest.append(run_longest[new])
        first = np.where(j == 0, catch_up[index[under]], 0.0)
        if one_process:
            drafted.append(m[new].astype(np.float64))
            rows.append(np.cumsum(first)[new])
        else:
            groups = group[index[under]]
            largest = np.maximum.accumulate(_running_group_sums(groups, np.column_stack((np.ones(len(g)), first))),
                                            axis=0)[new]
            drafted.append(largest[:, 0])
            rows.append(largest[:, 1])
    m_all, bound_all = np.concatenate(ms), np.concatenate(bounds)
    expected_all, longest_all = np.concatenate(expected), np.concatenate(longest)
    costs = cost(fixed_n + m_all, longest_all, np.concatenate(drafted), np.concatenate(rows))
    goodputs = np.divide(expected_all, costs, out=np.zeros_like(expected_all), where=costs > 0)
    best = goodputs.max()
    if tolerance > 0 and goodputs[0] < best:
        # near the best: losing at most `tolerance` of the candidates' own expected tokens over the option's step
        # (of all the step's tokens, the other work's included, a prefill-heavy step let any draft through). Only
        # where the best drafts: where plain decoding is best, a draft that comes near it is priced at break-even,
        # and the tolerance took the longest such draft (measured at 64 streams, default pair, 2 cores: every
        # sequence went from k = 0 to 3 or 4 at once, and such a round took 6 to 7 s for 4 to 4.6 tokens a
        # sequence, which plain rounds of 1.1 s give in 4.3 to 5 s)
        near = np.flatnonzero((best - goodputs) * costs <= tolerance * (expected_all - other_output) + 1e-12)
        # and where plain decoding is itself near the best, it is taken: a gain within the estimates' noise is no
        # reason to draft (measured at 32 streams, default pair, 2 cores: a best option drafting a little made
        # the longest near one, 4 tokens for each of 32 sequences, the choice; that round took 4.0 s for 149
        # tokens that plain rounds of 0.68 s give in 3.2 s)
        # Otherwise the longest near option, at most one token a sequence past the best: noise around the
        # tolerance's edge then moves the batch a token at a time, not from plain decoding to the longest draft
        if near[0] == 0:
            pick = 0
        else:
            m_best = m_all[int(np.argmax(goodputs))]
            near = near[m_all[near] <= m_best + base]
            pick = int(near[np.lexsort((goodputs[near], m_all[near]))[-1]])
    else:
        pick = int(np.flatnonzero(goodputs >= best * (1 - 1e-9))[0])
    m, limit = int(m_all[pick]), int(bound_all[pick])
    counts = np.bincount(index[position < limit][:m], minlength=base)
    lengths = {c.key: int(counts[i]) for i, c in enumerate(cands)}
    return Allocation(lengths, float(expected_all[pick]), fixed_n + m, float(costs[pick]), float(goodputs[0]),
                      float(costs[0]))


# per step of the other kind, what is left of a step-time ratio's distance from 1 (DraftLengthController.calibrate)
RATIO_DRIFT = 0.98
# a kind's step-time ratio follows the median of its last this many steps' (DraftLengthController.calibrate)
RATIO_WINDOW = 5
# steps of the other kind after which a kind's recent ratios are stale (RATIO_DRIFT has taken 0.98^16, about a
# quarter, of their distance from 1 off its average by then)
STALE_RATIO_STEPS = 16
# steps verifying drafted blocks after which the last plain rounds' wait is taken as stale (idle_split)
STALE_PLAIN_STEPS = 16
MAX_THIN_GROUPS = 1024  # groups whose probes while thin are counted (the most recent)
MAX_CAUGHT_UP_BATCHES = 256  # catch-up batches remembered as learnt (the most recent)
# plain_from: the largest batch it looks at, how long a group's figure stands before it is worked out again, and
# how many figures a step may work out: each is 9 choices over up to 256 candidates, 3.5 to 4.5 ms on one core of
# a 2-core Intel Xeon (a step-time model of 0.1 s + 4 ms a token, caps of 4 and 8), on the engine thread between
# two steps, which on a GPU take tens of ms
PLAIN_FROM_MOST = 256
PLAIN_FROM_EVERY_S = 0.5
PLAIN_FROM_PER_STEP = 1


@dataclass
class DraftLengthController:
    """The verifier's side of `--speculation auto`: learns from every step it runs and every verdict it gives,
    and after a step chooses the next draft length of each sequence that asked for one (Proposal.max_draft_tokens)
    by choose_draft_lengths. A probe (every `probe_every`-th choice, sooner at first: below) gives a sequence one
    draft token more than chosen: a drafting round gets measured again, and a sequence held at k = 0 gets judged
    again, so neither a stale price nor a stale acceptance can hold k at 0 for good. A probe takes at most
    `max_probe_sequences` of the sequences the choice left below their cap: the groups (draft processes) probed
    longest ago first, and in a group its sequences probed longest ago, so every group and every sequence gets its
    turn whatever the order of the steps' sequences. At 16 and 64 streams (default pair, 2 cores) a probe of every
    sequence made the draft catch all of them up and draft for all of them, and the verifier waited 0.5 and 2 s
    where plain rounds wait 10 and 40 ms (a 6 % loss at 64 streams, 3 % at 16), to learn what a few sequences'
    round measures as well: each drafted token's price, and the group's acceptance. Under the speculation
    trial's plain arm nothing is probed (its zeros would erase the probe, and use up the turns).

    A probe is dear where it matters least: under a load that holds every sequence at k = 0, the draft has not
    fed the tokens verified since its last block, and a probe makes it catch its sequences up (measured at 32
    streams on 2 cores, when a probe took every sequence: 2 to 4 s of the verifier waiting every 32 steps, 15 % of
    the output; a probe of at most max_probe_sequences costs less, and is still a wait). So when no
    choice between two probes drafted anything, the next probe comes twice as late, up to `max_probe_every`
    choices and `max_probe_interval_s` seconds; a choice that drafts brings the interval back to `probe_every`.

    A fresh controller knows little: its first steps of each size ran cold (measured on 2 cores: a first 5-token
    verification 450 to 550 ms against 350 to 400 after, a first 2-token step 0.9 to 1.2 s), and the first verdict
    may be a short request's rejection. Such a start held k at 0 for a whole first request at one stream, until the
    32nd choice probed. So the first probe comes after `first_probe_every` choices, and the interval doubles at
    each probe up to `probe_every` (further, up to `max_probe_every`, while nothing is drafted).

    A group (one Verify stream's sequences) whose acceptance rests on fewer than `min_evidence` verdicts of its
    first position gets probes of its own besides, its sequences only (at most `max_probe_sequences` of them, one
    group's first where several are thin), every `first_probe_every` choices, at most `max_thin_probes` (measured at one stream, default pair: one rejection of a fresh service's first, junk request
    held k at 0 for 15 steps, until the second probe 8 choices after the first). A group whose probes never judge
    anything (its drafts come back empty) stops getting them after those.
    Lives on the engine thread: no locks."""

    max_draft_tokens: int
    # smoother than the defaults: a step's time on a shared CPU is noisy, and one rejection is not a trend
    step_time: StepTimeModel = field(default_factory=lambda: StepTimeModel(decay=0.9))
    acceptance: AcceptanceTracker | None = None
    probe_every: int = 32
    first_probe_every: int = 4
    min_evidence: float = 4.0  # a group's verdicts on its first position, below which it gets probes of its own
    max_thin_probes: int = 8  # per group
    max_probe_sequences: int = 4
    # of a probe's sequences (not a thin group's), at most this many may be ones the draft must catch up first (see
    # _probed): one that drafted nothing in more than `catch_up_free_rounds` verifications in a row, or never (7: a
    # debt of at most 8 tokens, the last drafted round's correction included, is what the draft feeds without
    # calling it a catch-up, draft_model.CATCH_UP_FREE_TOKENS)
    max_catch_up_probes: int = 1
    catch_up_free_rounds: int = 7
    # the rounds of drafting a catch-up's rows are spread over (catch_up_rows) are at most those of this many tokens
    # ahead, or catch_up_horizon_rounds where those are more: the choice is made again every step, and a request's
    # max_tokens (4096, say) says little of how long it runs or keeps drafting. A cap of 16 rounds alone (dbd2b56)
    # bound where a sequence's first estimate of its acceptance was low: a new sequence's prompt was priced over
    # fewer rounds than its 48 tokens take (no effect on throughput was measured; docs/benchmarks.md)
    catch_up_horizon: float = 64.0
    catch_up_horizon_rounds: float = 16.0
    max_probe_every: int = 512
    max_probe_interval_s: float = 30.0
    # the step-time model and the acceptance are estimates: when plain decoding is within 3 % of the best goodput
    # it is taken, else a longer draft within 3 % of the best (measured on 2 cores, the noise alone otherwise cut
    # k = 4 to 2 or 3 on an idle verifier; see choose_draft_lengths)
    tolerance: float = 0.03
    # and where the last choice for every group (draft process) of the step drafted nothing, or most of the step's
    # sequences decode plainly now (choose, _unfed), plain decoding is kept while drafting gains at most this much
    # more (hysteresis): a switch to drafting costs what the price holds only in part (a catch-up is priced past
    # catch_up_free_rounds plain rounds only; the switch's first round comes back later than plain rounds do, and
    # the estimates are least sure where the two are even). Where they were about even (8 streams, default pair, 2
    # cores, 5a8f981: k = 0 15.9 tok/s, k = 4 14.8), the choice went from plain, before the trial's plain window, to
    # 3 tokens a sequence after it, on a predicted goodput of 19.4 tokens/s where plain steps had predicted 19.0 to
    # 19.2, and that round took 1.98 s for 23 tokens where plain steps gave 8 every 0.42 s
    switch_tolerance: float = 0.12
    # and where that switch would have a draft process defer some of the sequences it drafts for (_defers: their
    # prompts or missed tokens are more than its batch feeds in one round), drafting must gain more than this: the
    # switch then takes several rounds, in which the sequences fed draft and the deferred ones come back with empty
    # blocks, are fed on the draft's thread meanwhile, and draft later, so that the batch's proposals come back at
    # different times and the batch runs in groups that each pay a step's fixed cost. None of that is priced (a
    # catch-up is priced as spread over the rounds it buys). Measured at 64 streams (default pair, 2 cores, 28dbc76):
    # after a wave's 64 prompts opened plain, the choice drafted a token for each on a predicted gain of 12.7 %; the
    # next step verified 4 drafted tokens (4 fed), the choice swung between 0, 4, 60 and 64 tokens for the next 6
    # steps, then the batch ran in steps of 45, 64, 20, then 27 and 37, then 55 and 9 sequences, with holds of up to
    # 1.8 s, and the half gave 0.81x k = 0 (at 744ae9a and 89b44c4 the same followed choices on +10 and 11 %, where
    # the process's last choice had drafted and no hysteresis held). Where the same switch paid, at 8 streams (the
    # same sweep: 8 prompts opened plain, the choice drafted 4 tokens each on +28.6 %, 4 fed first, the batch stayed
    # whole; k = 4 gave 1.21x k = 0 there), it gained more than this. Not measured against other values (where a
    # draft agrees well, drafting gains 100 % and more). Once the verifier runs plain, the drafts' backlogs grow a
    # token a round (a draft warms no sequence while its rounds hardly draft), so after about 8 plain rounds a process
    # of more than 4 sequences would defer some, and this is the bar for a switch there, not switch_tolerance
    defer_tolerance: float = 0.2
    # and elsewhere drafting must gain more than this over plain decoding (in expected tokens a plain step per sequence
    # the choice drafts for; choose_draft_lengths): drafting costs what the price does not hold. Sequences that draft
    # finish apart, as their acceptance differs, where plain decoding keeps a batch of equal requests in step:
    # closed-loop clients then send the next wave's requests one by one, and that wave starts in steps of a few
    # sequences, each new one a round apart from the rest. Measured at 8 streams (default pair, 2 cores, 2161d25):
    # drafting on a predicted gain of 6 to 15 % gave 17.6 tokens/s within the first wave against plain steps' 16.7, and
    # the turn between the waves (10 s of steps of 1 to 7 sequences, holds of up to 0.7 s) took that and more: 0.946x k
    # = 0 over the level, 0.90 to 0.96x in four runs. Below 1 / 0.95 - 1 = 5 % of true gain plain decoding is within the
    # 0.95x of the better that auto is held to anyway. (It does not price those edges: the gains it judges are the
    # waves'. The next two runs gave that level 0.85x, drafting on 11 to 20 %, and 0.96x; see docs/benchmarks.md.)
    plain_margin: float = 0.08
    idle_decay: float = 0.8
    max_idle_s: float = 1.0  # a long quiet spell says the verifier is idle, not by how much
    # a draft batch's claimed time counts at most this much, and a wait before a step that verifies drafted blocks
    # is a quiet spell only past max_idle_s plus twice the drafting it waited for (measured at 64 streams on 2
    # cores: waits of 2.6 s for rounds of 3 drafted tokens a sequence, which, taken for quiet spells, never
    # priced drafting)
    max_draft_s: float = 5.0
    # a batch that fed a catch-up first is learnt as a round of that many rows more only up to this many (the
    # draft's own budget for a drafting batch's catch-ups, draft_service.draft_model.CATCH_UP_BUDGET_TOKENS): a
    # round of hundreds of rows is a prompt's, whose cost per row is not a drafting step's (a step over 1, 16, 32
    # and 64 rows of the default draft, 2 cores: 70, 215, 284, 440 ms), and would outweigh the usual rounds in the
    # fit; and the figure is the draft's own claim, which must not set every stream's price
    max_catch_up_rows: int = 64
    # and a drafting batch feeds the catch-ups of this many of its sequences whatever their length (the draft's
    # draft_model.CATCH_UP_MIN_JOBS), the others only while all fit in max_catch_up_rows (the same budget; see
    # _defers)
    catch_up_min_jobs: int = 4
    idle_s: float = 0.0  # moving average of the time between steps
    # the same, kept apart for steps whose blocks drafted something and steps whose blocks drafted nothing (None:
    # none seen yet); see idle_split
    draft_idle_s: float | None = None
    draft_longest_k: float = 0.0  # the longest block of the steps draft_idle_s averages, on average
    draft_drafted_m: float = 0.0  # and their drafted tokens
    plain_idle_s: float | None = None
    _step_idle_s: float | None = None  # the wait before the step observed last
    _step_held_s: float = 0.0  # and the part of it the phase plan held the step for
    _steps_since_plain: int = 0  # steps that verified drafted blocks since the last that verified none
    # The step-time model learns from every step, prompt chunks included, by its tokens alone; a verification
    # step's tokens cost more (its attention reads each sequence's context, its sampling is per position, and a
    # drafted position's costs more than a plain one's). Measured at 32 and 64 streams (default pair, 2 cores):
    # 128-token steps that verified one drafted token per sequence took 2.1 s where the model, which had seen
    # prompt chunks of 13 ms a token, priced about 1.6 s, and drafting looked 10 % better than plain decoding
    # where it was 30 % worse. So the price of a step is the model's times what steps of its kind (verifying
    # drafted tokens or not, no prompt chunk) took against their prediction lately (observe_drafting): an average
    # of the median of the kind's last RATIO_WINDOW ratios, so that a step or two slowed by something else does not
    # move it. At 16 streams (default pair, 2 cores, 180ca42) two plain steps that ran beside the draft's warming
    # forwards took 0.98 and 0.92 s where plain steps took 0.61; averaged in as they came, they raised plain
    # decoding's price until drafting, about 21 tokens/s against plain decoding's 26, won for 15 s.
    calibrate: bool = True
    plain_step_ratio: float = 1.0
    draft_step_ratio: float = 1.0
    # each kind's last RATIO_WINDOW ratios (drafting steps' under True), and the steps of the other kind since its
    # last: past STALE_RATIO_STEPS its drift back to 1 has set them aside, and the next one starts the window again
    _ratios: dict[bool, deque[float]] = field(
        default_factory=lambda: {kind: deque(maxlen=RATIO_WINDOW) for kind in (True, False)}, repr=False,
        compare=False)
    _ratio_age: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0}, repr=False, compare=False)
    _step_predicted: tuple[float, float] | None = None  # (predicted, taken) of the step observed last
    # the drafts' time for a round (Proposal.draft_seconds) against its longest block and its drafted tokens, and
    # the longest block and the drafted tokens of the steps, on average: the share of idle_s that is the verifier
    # waiting for drafting (see idle_split)
    draft_decay: float = 0.8
    draft_time: DraftTimeModel = field(default_factory=DraftTimeModel)
    mean_longest_k: float = 0.0
    mean_drafted_m: float = 0.0
    # e, below; before any drafting is seen, 1: the verifier waits for every draft in one phase (--phases hold)
    exposure: float = 1.0
    # the idle_split() the last choice priced with, and its price of a catch-up row
    last_price: tuple[float, float, float, float | None, float] | None = None
    _until_probe: int = 0  # choices before the next probe; 0: not started (set from first_probe_every)
    _probe_interval: int = 0
    _drafted_since_probe: bool = False
    _last_probe: float | None = None  # time.monotonic() of the last probe
    _until_thin_probe: int = 0  # choices before thin groups' next probe
    _probes: int = 0  # probes so far (regular and thin): the stamps below
    _probed_at: dict = field(default_factory=dict)  # key -> the probe that took it last
    _group_probed_at: OrderedDict = field(default_factory=OrderedDict)  # group -> the probe that took it last
    _thin_probes: OrderedDict = field(default_factory=OrderedDict)  # group -> its probes while thin (the recent)
    _caught_up_batches: OrderedDict = field(default_factory=OrderedDict)  # catch-up batches learnt (the recent)
    # key -> its verifications in a row that drafted nothing since one that drafted (None: none drafted yet)
    _plain_rounds: dict = field(default_factory=dict)
    # key -> the draft's own word on what its next drafting round must feed first (Proposal.draft_backlog_tokens,
    # with the key's latest verification); a key without one (an older draft) is priced from _plain_rounds
    _backlog: dict = field(default_factory=dict)
    # group -> whether the last choice with a cap above 0 for its sequences drafted for any (probes aside; the
    # trial's plain arm, whose zeros are not the choice's, leaves it as it was)
    _group_drafting: OrderedDict = field(default_factory=OrderedDict)
    # (group, cap) -> (time.monotonic() when worked out, plain_from's figure) for plain_from_of (the recent)
    _plain_from: OrderedDict = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if self.probe_every < 0 or (self.probe_every and self.max_probe_every < self.probe_every):
            raise ValueError(f"probe_every ({self.probe_every}) must be >= 0 and at most max_probe_every "
                             f"({self.max_probe_every})")
        if self.first_probe_every < 1:
            raise ValueError(f"first_probe_every must be >= 1, got {self.first_probe_every}")
        if self.max_probe_sequences < 1:
            raise ValueError(f"max_probe_sequences must be >= 1, got {self.max_probe_sequences}")
        if self.max_catch_up_probes < 1:
            raise ValueError(f"max_catch_up_probes must be >= 1, got {self.max_catch_up_probes}")
        self._until_thin_probe = self.first_probe_every
        if self.acceptance is None:
            # the prior of a sequence is its Verify stream's (one draft process, one draft model)
            self.acceptance = AcceptanceTracker(max(1, self.max_draft_tokens), decay=0.95, prior_strength=4.0,
                                                group_of=lambda key: getattr(key, "stream_id", None))

    def observe_step(self, num_tokens: int, seconds: float, idle_s: float | None = None,
                     held_s: float = 0.0) -> None:
        """A step of `num_tokens` took `seconds`; `idle_s`: how long the verifier waited before it (None: the
        first step), `held_s` of it held by the phase plan for sequences still away drafting (a hold for plain
        proposals alone is plain decoding's own wait, and not passed): a wait a plain round's proposal did not make (measured at 16 streams, default pair: a step of the 2 sequences
        decoding plainly held 0.8 s for the 14 drafting, counted as plain decoding's wait it priced plain rounds
        at 173 ms where they wait 10, and the batch drafted 4 tokens a sequence at a loss until the speculation
        trial stopped it)."""
        # only a prediction from steps of its size says how the kind's steps differ (outside them it is a guess)
        self._step_predicted = (self.step_time.predict(num_tokens), seconds) \
            if self.step_time.ready and self.step_time.has_seen(num_tokens) else None
        self.step_time.observe(num_tokens, seconds)
        self._step_idle_s = None
        self._step_held_s = max(0.0, held_s)
        if idle_s is not None:
            self._step_idle_s = max(0.0, idle_s)  # observe_drafting tells a wait for drafting from a quiet spell
            idle = min(self._step_idle_s, self.max_idle_s)
            self.idle_s = ema(self.idle_s, idle, self.idle_decay)

    def observe_drafting(self, seconds: float, longest_block: int, drafted: bool | None = None,
                         drafted_tokens: int | None = None, *, catch_up_tokens: int = 0,
                         batch: object = None) -> None:
        """The drafting of the blocks the step just verified took `seconds` (the slowest stream's batch, at most
        max_draft_s), its longest model-drafted block was `longest_block` tokens and it drafted `drafted_tokens`
        in all (None: `longest_block`; 0 and 0: nothing drafted, and the seconds are 0 too). Call it after
        observe_step: the share e of drafting the verifier waited for is its wait before the step against
        `seconds`. `drafted`: whether any block the step verified drafted anything, by a model or not (None: it
        verified none, or it computed prompt chunks too); the wait before it goes to the plain or the drafting
        rounds' average (idle_split), unless it was a quiet spell (past max_idle_s, and for a drafting round past
        that plus twice `seconds`: the verifier was idle, not waiting), and its time against the step-time
        model's prediction to that kind's ratio (see `calibrate`). `catch_up_tokens`: the batch fed the draft that
        many tokens of context first (Proposal.catch_up_tokens), in its first step's rows: its time is learnt as a
        round that fed `catch_up_tokens` rows before it drafted (DraftTimeModel's own term), once (`batch`: its identity; a batch
        whose blocks several steps verify carries its whole catch-up on each) and only up to max_catch_up_rows;
        the wait for it says nothing of a usual round's (nor of the share of drafting the verifier waits for).

        Measured at 4 streams (default pair, 2 cores, b8ba51b): with such rounds left out altogether, the verifier's
        only drafting rounds after the prompts were its probes, each a catch-up, so the price of drafting stayed
        what the service's first, cold round had taken (89 ms a block token and 89 ms a drafted token, 1.8 s for
        4 tokens of 4 sequences), and auto drafted 0.09 tokens a verification where fixed k = 4 gave 1.20x plain
        decoding."""
        d = self.draft_decay
        seconds = min(seconds, self.max_draft_s)
        drafted_tokens = longest_block if drafted_tokens is None else drafted_tokens
        predicted, self._step_predicted = self._step_predicted, None
        if self.calibrate and drafted is not None and predicted is not None and predicted[0] > 0:
            recent = self._ratios[drafted]
            if self._ratio_age[drafted] > STALE_RATIO_STEPS:
                recent.clear()
            self._ratio_age[drafted] = 0
            self._ratio_age[not drafted] += 1
            recent.append(min(2.0, max(0.5, predicted[1] / predicted[0])))
            ratio = float(np.median(recent))
            a = self.idle_decay
            # the kind not seen drifts back to the model's own figure: its ratio may be stale
            if drafted:
                self.draft_step_ratio = ema(self.draft_step_ratio, ratio, a)
                self.plain_step_ratio = 1.0 + RATIO_DRIFT * (self.plain_step_ratio - 1.0)
            else:
                self.plain_step_ratio = ema(self.plain_step_ratio, ratio, a)
                self.draft_step_ratio = 1.0 + RATIO_DRIFT * (self.draft_step_ratio - 1.0)
        idle, self._step_idle_s = self._step_idle_s, None
        if catch_up_tokens:
            if catch_up_tokens <= self.max_catch_up_rows and (batch is None or batch not in self._caught_up_batches):
                self.draft_time.observe(seconds, longest_block, drafted_tokens, catch_up_tokens)
            if batch is not None:
                self._caught_up_batches[batch] = None
                while len(self._caught_up_batches) > MAX_CAUGHT_UP_BATCHES:
                    self._caught_up_batches.popitem(last=False)
            return
        self.mean_longest_k = ema(self.mean_longest_k, longest_block, d)
        self.mean_drafted_m = ema(self.mean_drafted_m, drafted_tokens, d)
        if idle is not None and drafted is False:  # a plain step's own wait: without the hold for drafting others
            idle = max(0.0, idle - self._step_held_s)
        quiet = self.max_idle_s + (2 * seconds if drafted else 0.0)
        if drafted is not None and idle is not None and idle < quiet:
            self._steps_since_plain = 0 if not drafted else self._steps_since_plain + 1
            if not drafted:
                self.plain_idle_s = ema(self.plain_idle_s, idle, self.idle_decay)
            elif self.draft_idle_s is None:
                self.draft_idle_s, self.draft_longest_k = idle, float(longest_block)
                self.draft_drafted_m = float(drafted_tokens)
            else:
                self.draft_idle_s = ema(self.draft_idle_s, idle, self.idle_decay)
                self.draft_longest_k = ema(self.draft_longest_k, longest_block, d)
                self.draft_drafted_m = ema(self.draft_drafted_m, drafted_tokens, d)
        if not (seconds > 0.0 and longest_block > 0):
            return
        self.draft_time.observe(seconds, longest_block, drafted_tokens)
        idle = self.idle_s if self.draft_idle_s is None else self.draft_idle_s
        waited = min(1.0, idle / seconds)
        self.exposure = ema(self.exposure, waited, d)

    def idle_split(self) -> tuple[float, float, float, float | None]:
        """(idle seconds per step that no draft length changes, seconds each token of the longest block adds,
        seconds each drafted token adds, idle seconds per step where nothing is drafted at all, at most the first,
        or None: the first). The verifier waits before each step that verifies drafted blocks draft_idle_s on
        average, of which drafting, a longest block of L̄ tokens and M̄ tokens in all on average, takes
        a L̄ + b M̄ (DraftTimeModel); it waits for a share e of the drafting (observe_drafting: 1 in one phase,
        where it waits for every draft; 0 where drafting hides behind other work; kept while nothing is drafted).
        A round with a longest block of L tokens and M in all then adds e (a L + b M) to the wait.
        Steps after rounds that drafted nothing wait plain_idle_s on average, and that is what plain decoding is
        priced with: there each sequence proposes as soon as its verdict is handled, where a drafting round's
        proposals leave the draft together after its batch, which waits for every verdict of the step (measured at
        32 and 64 streams, default pair, 2 cores: 30 to 45 ms between plain steps, against a fixed part of 130 to
        330 ms priced for drafting rounds, which, charged to plain decoding too, made drafting 1 to 3 tokens look
        better than plain decoding, which the speculation trial measured 11 to 20 % better)."""
        if not self.draft_time.ready:
            return self.idle_s, 0.0, 0.0, None
        a, b = self.draft_time.coefficients()
        e = self.exposure
        if self.draft_idle_s is None:
            return max(0.0, self.idle_s - e * (a * self.mean_longest_k + b * self.mean_drafted_m)), e * a, e * b, None
        fixed = max(0.0, self.draft_idle_s - e * (a * self.draft_longest_k + b * self.draft_drafted_m))
        # plain rounds can be rare (one sequence drafting makes every round a drafting one), and the last ones'
        # wait may be a client's pause between requests (measured through aiperf at 4 streams: plain priced at
        # 42 ms where plain rounds then waited 7 to 9): when none came for STALE_PLAIN_STEPS steps, plain decoding
        # is priced with at most a drafting round's fixed wait (not always: pipelining hides a drafting round's
        # round trip, and a plain round's is not hidden)
        plain = self.plain_idle_s
        if plain is not None and self._steps_since_plain >= STALE_PLAIN_STEPS:
            plain = min(plain, fixed)
        return fixed, e * a, e * b, plain

    def observe_verification(self, key: object, num_drafted: int, num_accepted: int,
                             backlog: int | None = None) -> None:
        """`backlog`: the context the draft said, with this verification's proposal, it would still have to feed
        before its next drafted token (None: it did not say)."""
        self.acceptance.observe(key, num_drafted, num_accepted)
        if backlog is None:
            self._backlog.pop(key, None)
        else:
            self._backlog[key] = backlog
        if num_drafted:
            self._plain_rounds[key] = 0
        elif key not in self._plain_rounds:
            self._plain_rounds[key] = None  # never drafted: the draft has not fed its prompt
        elif self._plain_rounds[key] is not None:
            self._plain_rounds[key] += 1

    def forget(self, key: object) -> None:
        self.acceptance.forget(key)
        self._probed_at.pop(key, None)
        self._plain_rounds.pop(key, None)
        self._backlog.pop(key, None)

    def _owed(self, key: object) -> float:
        """The tokens of `key`'s context the draft has not fed, the verdict's token included: what the draft said
        it would still have to feed (Proposal.draft_backlog_tokens) and that token, or, where it did not say, the
        tokens verified since its last drafted round, or all of them (inf) where it never drafted (an older draft
        warms no sequence while its rounds draft nothing). _debt, _needs_catch_up and _unfed read it."""
        reported = self._backlog.get(key)
        if reported is not None:
            return reported + 1
        rounds = self._plain_rounds.get(key)
        return math.inf if rounds is None else rounds + 1

    def _needs_catch_up(self, key: object) -> bool:
        """Whether a draft for `key` now would first feed the draft more than catch_up_free_rounds + 1 tokens of
        context (what a round may feed without calling it a catch-up, draft_service.draft_model.CATCH_UP_FREE_TOKENS;
        _owed)."""
        return self._owed(key) > self.catch_up_free_rounds + 1

    def _unfed(self, key: object) -> bool:
        """Whether `key`'s last round drafted nothing and left its draft context to feed (_owed past the verdict's
        token: the draft said so, or its last verification drafted nothing; a key not verified yet: no)."""
        return key in self._plain_rounds and self._owed(key) > 1

    def catch_up_rows(self, key: object, rates: tuple[float, ...], context: int, left: int) -> float:
        """The rows the draft would feed before drafting for `key` (0 unless _needs_catch_up: what the draft said
        it would still have to feed, or, where it did not, the tokens verified since its last block, or its whole
        context where it never drafted), spread over the rounds of drafting at its cap (acceptance `rates`) that the
        `left` tokens it may still emit take (at most those of catch_up_horizon tokens, or catch_up_horizon_rounds):
        paid once, it buys those rounds. Measured at 32 streams (default pair, 2 cores), three sequences finishing
        turned the choice for the 29 left, every one held at k = 0 for 25 rounds, to 2 tokens each: the draft fed
        them 64 rows of catch-up first (deferring the rest), the round took 2.3 s where plain ones took 1.2, and the
        batch broke into steps of 1 to 27 sequences to its end."""
        if not rates or not self._needs_catch_up(key):
            return 0.0
        debt = self._debt(key, context)
        per_round = 1.0 + float(np.sum(np.cumprod(rates)))
        horizon = max(self.catch_up_horizon / per_round, self.catch_up_horizon_rounds)
        return debt / max(1.0, min(left / per_round, horizon))

    def _debt(self, key: object, context: int) -> int:
        """The tokens of `key`'s context (`context` tokens in all) the draft has not fed (_owed)."""
        return int(min(context, self._owed(key)))

    def _defers(self, lengths: dict[object, int], sizes: dict[object, tuple[int, int]]) -> bool:
        """Whether a draft process would defer some of the sequences `lengths` drafts for, as the draft's
        drafting batch does (draft_model._deferred): more than catch_up_min_jobs of its sequences with a catch-up
        (_needs_catch_up), whose debts (_debt) sum past max_catch_up_rows. Only the sequences with `sizes` (their
        contexts) count: not those away at their drafts, nor the other work (an opening that drafts, a fixed k's
        round), whose catch-ups the draft feeds first and never defers; so a batch beside those may defer where
        this says not."""
        group_of = self.acceptance.group_of
        debts: dict[object, list[int]] = {}
        for key, k in lengths.items():
            if k and key in sizes and self._needs_catch_up(key):
                debts.setdefault(group_of(key), []).append(self._debt(key, sizes[key][0]))
        return any(len(d) > self.catch_up_min_jobs and sum(d) > self.max_catch_up_rows for d in debts.values())

    def _costs_catch_up(self, key: object) -> bool:
        """Whether a probe of `key` counts against max_catch_up_probes: it needs a catch-up, and its group's
        acceptance rests on at least min_evidence verdicts (a thin group's is what a probe is for)."""
        return self._needs_catch_up(key) and self.acceptance.evidence(key) >= self.min_evidence

    def choose(self, caps: dict[object, int], other_tokens: int = 0, other_output: float = 0.0,
               other_longest_block: int = 0, away: dict[object, int] | None = None,
               other_drafted: int = 0, probe: bool = True,
               sizes: dict[object, tuple[int, int]] | None = None) -> Allocation:
        """The next draft length of each key in `caps` (its cap on k), for a step that also carries
        `other_tokens` of work that follows no choice (prefill, fixed-k verifications) and yields `other_output`
        tokens, and whose drafts draft a block of `other_longest_block` tokens, `other_drafted` in all, whatever is
        chosen (fixed k).
        `away`: sequences of the same batch away at their drafts (key: cap), chosen for with these, so that the
        price is the whole batch's; only `caps`' lengths are returned, and only they count for the probes. The
        allocation's goodput and expected tokens are the whole batch's. `probe`: False where the choice will be
        overridden by plain decoding (the speculation trial's plain arm): no probe is taken or counted.
        `sizes`: per key of `caps`, (its context's tokens, the tokens it may still emit), whence its catch-up's rows
        per round (catch_up_rows; a key without them has none)."""
        pool = {**(away or {}), **caps}
        sizes = sizes or {}
        group_of = self.acceptance.group_of
        # each draft process (Verify stream) drafts its own sequences in a batch of its own, beside the others:
        # the wait is the largest batch's (choose_draft_lengths prices each option's; priced as one over the number
        # of processes, a stream of 32 sequences beside 31 of one each drafted as if at a 32nd of its cost)
        index_of: dict[object, int] = {}
        candidates = []
        for key, cap in pool.items():
            rates = tuple(self.acceptance.rates(key, cap))
            size = sizes.get(key) if key in caps else None
            candidates.append(Candidate(key, cap, rates, self.catch_up_rows(key, rates, *size) if size else 0.0,
                                        index_of.setdefault(group_of(key), len(index_of))))
        fixed_idle, per_block_token, per_drafted_token, plain_idle = self.idle_split()
        # a catch-up's rows at their own price (DraftTimeModel's c), a share e of it waited for like drafting's,
        # in the batch of the draft process that feeds them (choose_draft_lengths)
        per_catch_up_row = self.exposure * self.draft_time.catch_up_coefficient()
        self.last_price = fixed_idle, per_block_token, per_drafted_token, plain_idle, per_catch_up_row
        # (caps of 0, a request's last rounds, which its room bounds, choose nothing: their groups are not counted,
        # nor held by the hysteresis below, nor recorded by it)
        groups: dict[object, bool] = {group_of(key): False for key, cap in pool.items() if cap > 0}
        held = bool(groups) and all(self._group_drafting.get(group) is False for group in groups)
        # and where most of the step's sequences decode plainly now, whatever their groups' last choice (_unfed):
        # drafting for them is a switch too, each draft fed its missed context first. Measured at 64 streams
        # (default pair, 2 cores, 744ae9a, and the same in 89b44c4's sweep): a wave's 62 prompts opened plain,
        # its first 3 sequences' choice had drafted, and the choice after the prompts' step drafted a token for
        # 61 on a predicted gain of 10 % (11 % in 89b44c4's); the draft fed their prompts first, the next step
        # waited 0.5 s for 12 drafted tokens, and the batch ran in groups for 30 s before it went plain again.
        # Not under the trial's plain arm (`probe` False), whose zeros leave its drafts unfed but are no choice of
        # plain decoding: judged against the hysteresis, its choices (which the trial reads) would lean plain. A
        # backlog of a token counts (a sequence the last choice held at 0), though a catch-up is priced only past
        # catch_up_free_rounds; and over all draft processes, as the tolerance is one for the whole choice
        eligible = [key for key, cap in pool.items() if cap > 0]
        held = held or (probe and 2 * sum(map(self._unfed, eligible)) > len(eligible))
        margin = max(self.switch_tolerance, self.plain_margin) if held else self.plain_margin
        chosen = choose_draft_lengths(candidates, self.step_time, other_tokens, other_output, fixed_idle,
                                      self.tolerance, per_block_token, other_longest_block, plain_idle,
                                      (self.plain_step_ratio, self.draft_step_ratio), per_drafted_token,
                                      other_drafted, plain_tolerance=margin,
                                      idle_per_catch_up_row=per_catch_up_row)
        # a switch that a draft process cannot feed in one round (defer_tolerance): the same choice, judged again
        if (held and self.defer_tolerance > max(margin, self.tolerance)
                and self._defers(chosen.draft_lengths, sizes)):
            chosen = decline_below(chosen, self.defer_tolerance, other_tokens, other_output)
        if probe:
            for key, k in chosen.draft_lengths.items():
                if k:
                    groups[group_of(key)] = True
            for group, drafted in groups.items():
                self._group_drafting[group] = drafted
                self._group_drafting.move_to_end(group)
            while len(self._group_drafting) > MAX_THIN_GROUPS:
                self._group_drafting.popitem(last=False)
        lengths = {key: chosen.draft_lengths[key] for key in caps}
        probed: set[object] = set()
        if probe:
            probed = (self._probed(caps, lengths) if self._probes_now(any(lengths.values()))
                      else self._thin_probe(caps, lengths))
        if probed or len(pool) > len(caps):
            lengths = {key: min(caps[key], k + 1) if key in probed else k for key, k in lengths.items()}
            chosen = dataclasses.replace(chosen, draft_lengths=lengths)
        return chosen

    def plain_from(self, key: object, cap: int, most: int = PLAIN_FROM_MOST) -> int | None:
        """A batch of sequences like a new one of `key`'s group (the group's acceptance per position, a cap of
        `cap`), verified alone and drafted by one draft process, from which choose_draft_lengths, priced as the
        choices are (the step-time model, the wait's split, plain_margin, or the hysteresis where the group's last
        choice drafted nothing), drafts nothing: the load from which this verifier would decode such a group's
        sequences plainly; `most` + 1 where drafting pays at `most` sequences. None: nothing is known yet (no
        step-time model, a cap of 0).

        A draft process sends a new sequence's first block before any choice of the verifier's for it (Verdict's
        plain_from): at a load it has not run at yet, the choices on its record are a lighter load's, and a
        burst's openings drafted those where the verifier then ran plain (bench/capacity.py at 16 streams after
        8, default pair, 2 cores, f307590: a step held 1.4 s for the openings' drafts, the batch whole and plain
        3 s after k = 0's). The batch of such sequences alone leaves out other work and catch-ups (a new
        sequence's prompt, which the opening feeds when it drafts): the figure is where even a warm batch's
        drafting stops paying, as the model prices it (a load no step has run at is the model's extrapolation).
        Drafting's gain per sequence mostly falls as the batch grows (each drafted token lengthens every
        sequence's step, and the draft's step grows with its rows), so the search halves the range from 1 to
        `most`, 9 choices for 256: where the model's kinks make the choice switch more than once, the figure is
        one of the switches, not surely the first."""
        if cap <= 0 or not self.step_time.ready:
            return None
        rates = tuple(self.acceptance.group_rates(key, cap))
        fixed_idle, per_block_token, per_drafted_token, plain_idle = self.idle_split()
        held = self._group_drafting.get(self.acceptance.group_of(key)) is False
        margin = max(self.switch_tolerance, self.plain_margin) if held else self.plain_margin

        def plain(n: int) -> bool:
            chosen = choose_draft_lengths([Candidate(i, cap, rates) for i in range(n)], self.step_time, 0, 0.0,
                                          fixed_idle, self.tolerance, per_block_token, 0, plain_idle,
                                          (self.plain_step_ratio, self.draft_step_ratio), per_drafted_token,
                                          plain_tolerance=margin)
            return not any(chosen.draft_lengths.values())

        if not plain(most):
            return most + 1
        drafts, plain_at = 0, most  # the search's bounds: drafting pays at `drafts` sequences (0: none tried)
        while plain_at - drafts > 1:
            middle = (drafts + plain_at) // 2
            if plain(middle):
                plain_at = middle
            else:
                drafts = middle
        return plain_at

    def plain_from_of(self, asked: dict[object, int], now: float | None = None,
                      budget: int = PLAIN_FROM_PER_STEP) -> dict[object, int | None]:
        """plain_from for each key of `asked` (key: its cap), one figure per group and cap, worked out again once
        PLAIN_FROM_EVERY_S old: at most `budget` of them per call, those never worked out first, then the oldest
        (the engine thread asks after every step; one never worked out is None till its turn). Only groups with
        a choice made for them lately (a Verify stream with sequences under --speculation auto) get one: a draft
        of fixed k alone never reads it."""
        now = time.monotonic() if now is None else now
        group_of, cache = self.acceptance.group_of, self._plain_from
        at_of = {key: (group_of(key), cap) for key, cap in asked.items()}
        pairs = {at: key for key, at in at_of.items() if at[0] in self._group_drafting}
        due = sorted((at for at in pairs if at not in cache or now - cache[at][0] >= PLAIN_FROM_EVERY_S),
                     key=lambda at: cache[at][0] if at in cache else -float("inf"))
        for at in due[:max(0, budget)]:
            cache[at] = (now, self.plain_from(pairs[at], at[1]))
        for at in pairs:
            if at in cache:
                cache.move_to_end(at)
        while len(cache) > MAX_THIN_GROUPS:
            cache.popitem(last=False)
        return {key: cache[at][1] if at in pairs and at in cache else None for key, at in at_of.items()}

    def _probed(self, caps: dict[object, int], chosen: dict[object, int]) -> set[object]:
        """A probe's keys: at most max_probe_sequences of those the choice left below their cap, the groups probed
        longest ago first, and in a group the sequences probed longest ago (never: first). At most
        max_catch_up_probes of them are sequences the draft must catch up first (_needs_catch_up), the others being
        passed over, unless their group's evidence is thin (then the probe is for that evidence): such a sequence's proposal comes late (the draft
        feeds its missed tokens first), misses the steps the others run meanwhile, and then lags them. Measured
        at 16 streams (default pair, 2 cores, ae2b257), every sequence held at k = 0: a probe of 4 kept those 4
        away for 3 steps of the 12 others (2.4 s) for a token each, they finished late, in steps of 2 to 4
        sequences, and auto ran 56 steps and 45 s of forward passes where k = 0 ran 52 and 41 s (0.89x)."""
        below = [key for key, cap in caps.items() if chosen[key] < cap]
        group_of, groups, keys = self.acceptance.group_of, self._group_probed_at, self._probed_at
        self._probes += 1
        picked: list[object] = []
        catch_ups = 0

        def costs(k: object) -> bool:  # one the choice drafts for catches up whether probed or not
            return not chosen[k] and self._costs_catch_up(k)

        for _ in range(min(len(below), self.max_probe_sequences)):
            fits = [k for k in below if k not in picked and (catch_ups < self.max_catch_up_probes or not costs(k))]
            if not fits:
                break
            key = min(fits, key=lambda k: (groups.get(group_of(k), -1), keys.get(k, -1)))
            catch_ups += costs(key)
            picked.append(key)
            keys[key] = groups[group_of(key)] = self._probes
            groups.move_to_end(group_of(key))
        while len(groups) > MAX_THIN_GROUPS:
            groups.popitem(last=False)
        return set(picked)

    def _thin_probe(self, caps: dict[object, int], chosen: dict[object, int]) -> set[object]:
        """The keys a probe of the thin groups gives a token more now (none: not now): groups with a sequence
        the choice left below its cap (a probe changes nothing for the others, and is not counted), at most
        max_probe_sequences of their sequences."""
        if not self.probe_every:
            return set()
        group_of = self.acceptance.group_of
        thin = {group_of(key) for key, cap in caps.items()
                if chosen[key] < cap and self.acceptance.evidence(key) < self.min_evidence
                and self._thin_probes.get(group_of(key), 0) < self.max_thin_probes}
        if not thin:
            return set()
        self._until_thin_probe -= 1
        if self._until_thin_probe > 0:
            return set()
        self._until_thin_probe = self.first_probe_every
        probed = self._probed({key: cap for key, cap in caps.items() if group_of(key) in thin}, chosen)
        for group in {group_of(key) for key in probed}:  # only the groups a probe took count one more
            self._thin_probes[group] = self._thin_probes.pop(group, 0) + 1
        while len(self._thin_probes) > MAX_THIN_GROUPS:
            self._thin_probes.popitem(last=False)
        return probed

    def _probes_now(self, drafts: bool) -> bool:
        """Counts a choice (`drafts`: it drafts anything); whether it is a probe."""
        if not self.probe_every:
            return False
        if not self._probe_interval:
            self._probe_interval = self._until_probe = min(self.first_probe_every, self.probe_every)
        if drafts:
            self._drafted_since_probe = True
            if self._probe_interval > self.probe_every:  # drafting again: probe at the usual rate from here
                self._probe_interval = self.probe_every
                self._until_probe = min(self._until_probe, self.probe_every)
        self._until_probe -= 1
        now = time.monotonic()
        if self._last_probe is None:
            self._last_probe = now
        if self._until_probe > 0 and now - self._last_probe < self.max_probe_interval_s:
            return False
        self._last_probe = now
        self._until_thin_probe = self.first_probe_every  # a probe judged the thin groups too
        if not self._drafted_since_probe:
            self._probe_interval = min(self.max_probe_every, 2 * self._probe_interval)
        elif self._probe_interval < self.probe_every:  # the first probes: towards the usual rate
            self._probe_interval = min(self.probe_every, 2 * self._probe_interval)
        self._until_probe = self._probe_interval
        self._drafted_since_probe = False
        return True
