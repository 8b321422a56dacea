"""Goodput-driven draft length: the verifier decides how many tokens each sequence drafts next.

Only the verifier sees the whole batch. A longer draft for one sequence makes the step slower for every other
sequence in it, so the draft length that is best for one sequence alone (draft_service.adaptive) is not best for
the batch. Here the verifier keeps

- a model of its own step time as a function of the tokens in the step (StepTimeModel), learned online from
  the steps it runs, and
- each sequence's acceptance per draft position (AcceptanceTracker), conditional on the positions before it
  having been accepted, shrunk towards the rates of all sequences,

and after every step chooses the draft lengths k_i of the sequences that got a verdict so as to maximise the
expected verified tokens per second of the next step (goodput, as in SmartSpec, Liu et al. 2024):

    goodput(k) = sum_i E_i(k_i) / t(sum_i (1 + k_i))      E_i(k) = 1 + sum_{j<=k} prod_{m<=j} alpha_{i,m}

For a fixed number of drafted tokens M the numerator is largest when it takes the M largest marginal gains
prod_{m<=j} alpha_{i,m} over all sequences (each sequence's gains fall with j), so the search runs over M only:
the best prefix of the merged, sorted marginal gains. Under heavy load t grows with every token and the choice
falls to k = 0 (plain decoding through the same path); when the verifier is idle t hardly grows and the choice
rises to each sequence's cap. Low acceptance lowers k at any load.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

# Token counts of the step-time model's buckets: dense where decode batches live, then geometric.
_BUCKETS: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024,
                             1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384)


def _bucket(num_tokens: int) -> int:
    return min(bisect.bisect_left(_BUCKETS, num_tokens), len(_BUCKETS) - 1)


@dataclass
class StepTimeModel:
    """t(n): the verifier's step time for a step of n tokens, from the steps it ran.

    Each bucket of token counts keeps an exponential moving average of the (tokens, seconds) of its steps.
    Between observed buckets t is interpolated linearly; outside them it is scaled in proportion to the tokens
    (t(n) = t(n0) * n / n0), the compute-bound guess: it makes untried smaller steps look cheap and untried
    larger ones dear, so the controller tries plain decoding under load and learns what it really costs, and
    never bets on a long draft being free before it has seen one. The curve is made non-decreasing."""

    decay: float = 0.8  # weight of a bucket's past in its average
    _tokens: list[float | None] = field(default_factory=lambda: [None] * len(_BUCKETS))
    _seconds: list[float | None] = field(default_factory=lambda: [None] * len(_BUCKETS))
    # points() until the next observation: predict() runs once per drafted token a choice considers
    _points: list[tuple[float, float]] | None = None
    _xs: list[float] = field(default_factory=list)

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or not seconds > 0:
            return
        self._points = None
        b = _bucket(num_tokens)
        if self._tokens[b] is None:
            self._tokens[b], self._seconds[b] = float(num_tokens), seconds
        else:
            d = self.decay
            self._tokens[b] = d * self._tokens[b] + (1 - d) * num_tokens
            self._seconds[b] = d * self._seconds[b] + (1 - d) * seconds

    @property
    def ready(self) -> bool:
        return any(t is not None for t in self._tokens)

    def points(self) -> list[tuple[float, float]]:
        """The observed (tokens, seconds) points, by tokens, made non-decreasing in seconds."""
        if self._points is None:
            pts = sorted((n, s) for n, s in zip(self._tokens, self._seconds, strict=True) if n is not None)
            out: list[tuple[float, float]] = []
            for n, s in pts:
                if out and s < out[-1][1]:
                    s = out[-1][1]
                out.append((n, s))
            self._points, self._xs = out, [n for n, _ in out]
        return self._points

    def predict(self, num_tokens: int) -> float:
        pts = self.points()
        if not pts:
            raise ValueError("no step observed yet")
        n = float(num_tokens)
        if n <= pts[0][0]:
            return pts[0][1] * n / pts[0][0]
        if n >= pts[-1][0]:
            return pts[-1][1] * n / pts[-1][0]
        i = bisect.bisect_left(self._xs, n)
        (n0, s0), (n1, s1) = pts[i - 1], pts[i]
        return s0 + (s1 - s0) * (n - n0) / (n1 - n0)


@dataclass
class AcceptanceTracker:
    """Acceptance per draft position, alpha_j = P(draft j accepted | drafts 1..j-1 accepted), per sequence and
    over the sequences of its group (`group_of`: the engine groups by Verify stream, i.e. by draft process and so
    by draft model, so that one client's drafts never set another's prior). Counts decay at every verdict,
    drafted or not, so a sequence whose drafts stopped (k = 0 for low acceptance) drifts back to its group's rates;
    the controller's probes judge it again. At most `max_groups` groups are kept, the least recently seen go."""

    max_positions: int
    decay: float = 0.9  # per verdict, for a sequence's own counts
    global_decay: float = 0.995  # per verdict, for the shared counts
    prior_strength: float = 2.0  # pseudo-counts of the shared rates in a sequence's estimate
    default_rate: float = 0.7  # the shared rate before anything is observed
    group_of: Callable[[object], object] = lambda key: None
    max_groups: int = 1024
    _groups: OrderedDict = field(default_factory=OrderedDict)  # group -> (tried, accepted) per position
    _tried: dict[object, list[float]] = field(default_factory=dict)
    _accepted: dict[object, list[float]] = field(default_factory=dict)

    def _shared(self, key: object, *, touch: bool) -> tuple[list[float], list[float]] | None:
        group = self.group_of(key)
        counts = self._groups.get(group)
        if counts is None and touch:
            counts = self._groups[group] = ([0.0] * self.max_positions, [0.0] * self.max_positions)
            while len(self._groups) > self.max_groups:
                self._groups.popitem(last=False)
        if counts is not None and touch:
            self._groups.move_to_end(group)
        return counts

    def observe(self, key: object, num_drafted: int, num_accepted: int) -> None:
        """One verdict: drafts 1..num_accepted were accepted and, if fewer than drafted, the next was rejected;
        later positions were never judged."""
        tried = self._tried.setdefault(key, [0.0] * self.max_positions)
        accepted = self._accepted.setdefault(key, [0.0] * self.max_positions)
        for j in range(self.max_positions):
            tried[j] *= self.decay
            accepted[j] *= self.decay
        judged = min(num_drafted, num_accepted + 1, self.max_positions)
        if not judged:
            return
        g_tried, g_accepted = self._shared(key, touch=True)
        g = self.global_decay
        g_tried[:] = [t * g for t in g_tried]
        g_accepted[:] = [a * g for a in g_accepted]
        for j in range(judged):
            hit = 1.0 if j < num_accepted else 0.0
            tried[j] += 1.0
            accepted[j] += hit
            g_tried[j] += 1.0
            g_accepted[j] += hit

    def forget(self, key: object) -> None:
        self._tried.pop(key, None)
        self._accepted.pop(key, None)

    def shared_rate(self, j: int, key: object = None) -> float:
        """alpha_j over `key`'s group (the default rate for a group not seen yet)."""
        counts = self._shared(key, touch=False)
        if counts is None:
            return self.default_rate
        g_tried, g_accepted = counts
        return (g_accepted[j] + self.default_rate) / (g_tried[j] + 1.0)

    def rates(self, key: object, k: int) -> list[float]:
        """alpha_1..alpha_k for `key`."""
        tried = self._tried.get(key)
        accepted = self._accepted.get(key)
        m = self.prior_strength
        out = []
        for j in range(min(k, self.max_positions)):
            prior = self.shared_rate(j, key)
            if tried is None:
                out.append(prior)
            else:
                out.append((accepted[j] + m * prior) / (tried[j] + m))
        return out


@dataclass(frozen=True)
class Candidate:
    """A sequence that will propose again: its key, its cap on k and its acceptance per position."""

    key: object
    max_k: int
    rates: tuple[float, ...]


@dataclass(frozen=True)
class Allocation:
    draft_lengths: dict[object, int]
    expected_tokens: float  # expected verified tokens of the step, the other work's included
    step_tokens: int  # tokens of the step that verifies them, the other work included
    predicted_step_s: float  # the step's predicted time plus the verifier's idle time per step

    @property
    def goodput(self) -> float:
        """Expected verified tokens per second of that step."""
        return self.expected_tokens / self.predicted_step_s if self.predicted_step_s > 0 else 0.0


def choose_draft_lengths(candidates: Iterable[Candidate], step_time: StepTimeModel, other_tokens: int = 0,
                         other_output: float = 0.0, idle_s: float = 0.0, tolerance: float = 0.0,
                         idle_per_draft_token: float = 0.0) -> Allocation:
    """The draft length per candidate that maximises expected verified tokens per second of a step that
    verifies all of them (each feeds 1 + k tokens) beside `other_tokens` of other work (prefill chunks, fixed-k
    verifications), which yields `other_output` tokens whatever is chosen: a longer draft slows that work too.
    `idle_s`: the verifier's time between steps (waiting for proposals), which a step's tokens do not lengthen;
    `idle_per_draft_token`: what each drafted token adds to it (the draft's time to draft it, where the verifier
    waits for that).
    `tolerance`: of the totals whose goodput is within this fraction of the best, the largest is taken.
    Without a step observed yet every candidate gets its cap."""
    cands = list(candidates)
    base = len(cands)
    if not step_time.ready:
        lengths = {c.key: c.max_k for c in cands}
        return Allocation(lengths, float(base), base + other_tokens + sum(lengths.values()), 0.0)

    def cost(n: int, m: int) -> float:
        return step_time.predict(n) + idle_s + idle_per_draft_token * m if n else 0.0

    # every candidate's marginal gains, merged largest first: gain j of c is prod_{m<=j} alpha_{c,m}
    heap: list[tuple[float, int, int, float]] = []  # (-gain, candidate index, j, running product)
    for i, c in enumerate(cands):
        if c.max_k > 0 and c.rates:
            heapq.heappush(heap, (-c.rates[0], i, 0, c.rates[0]))
    counts = [0] * base
    best_m, best_goodput = 0, 0.0
    expected = float(base) + other_output
    taken: list[int] = []
    expected_at = [expected]
    m = 0
    goodputs: list[float] = []
    while True:
        n = base + other_tokens + m
        goodput = expected / cost(n, m) if n else 0.0
        goodputs.append(goodput)
        if goodput > best_goodput * (1 + 1e-9):
            best_m, best_goodput = m, goodput
        if not heap:
            break
        neg_gain, i, j, prod = heapq.heappop(heap)
        expected -= neg_gain
        taken.append(i)
        expected_at.append(expected)
        m += 1
        c = cands[i]
        if j + 1 < min(c.max_k, len(c.rates)):
            nxt = prod * c.rates[j + 1]
            heapq.heappush(heap, (-nxt, i, j + 1, nxt))
    if tolerance > 0:
        best_m = max(m for m, g in enumerate(goodputs) if g >= best_goodput * (1 - tolerance))
    for i in taken[:best_m]:
        counts[i] += 1
    lengths = {c.key: counts[i] for i, c in enumerate(cands)}
    n = base + other_tokens + best_m
    return Allocation(lengths, expected_at[best_m], n, cost(n, best_m))


@dataclass
class DraftLengthController:
    """The verifier's side of `--speculation auto`: learns from every step it runs and every verdict it gives,
    and after a step chooses the next draft length of each sequence that asked for one (Proposal.max_draft_tokens)
    by choose_draft_lengths. Every `probe_every`-th choice gives each sequence one draft token more than chosen:
    a step size the model has not seen lately gets measured again, and a sequence held at k = 0 gets judged
    again, so neither a stale step time nor a stale acceptance can hold k at 0 for good. Lives on the engine
    thread: no locks."""

    max_draft_tokens: int
    # smoother than the defaults: a step's time on a shared CPU is noisy, and one rejection is not a trend
    step_time: StepTimeModel = field(default_factory=lambda: StepTimeModel(decay=0.9))
    acceptance: AcceptanceTracker | None = None
    probe_every: int = 32
    # the step-time model and the acceptance are estimates: when a longer draft is within 3 % of the best
    # goodput, it is taken (measured on 2 cores, the noise alone otherwise cut k = 4 to 2 or 3 on an idle verifier)
    tolerance: float = 0.03
    idle_decay: float = 0.8
    max_idle_s: float = 1.0  # a long quiet spell says the verifier is idle, not by how much
    idle_s: float = 0.0  # moving average of the time between steps
    # the drafts' seconds per drafted token (Proposal.draft_seconds over the longest block of its step), and the
    # mean draft length chosen: the share of idle_s that is the verifier waiting for drafting (see choose)
    draft_decay: float = 0.8
    draft_s_per_token: float | None = None
    mean_chosen_k: float = 0.0
    exposure: float = 0.0  # e, below
    _choices: int = 0

    def __post_init__(self) -> None:
        if self.acceptance is None:
            # the prior of a sequence is its Verify stream's (one draft process, one draft model)
            self.acceptance = AcceptanceTracker(max(1, self.max_draft_tokens), decay=0.95, prior_strength=4.0,
                                                group_of=lambda key: getattr(key, "stream_id", None))

    def observe_step(self, num_tokens: int, seconds: float, idle_s: float | None = None) -> None:
        """A step of `num_tokens` took `seconds`; `idle_s`: how long the verifier waited before it (None: the
        first step)."""
        self.step_time.observe(num_tokens, seconds)
        if idle_s is not None:
            idle = min(max(0.0, idle_s), self.max_idle_s)
            self.idle_s = self.idle_decay * self.idle_s + (1 - self.idle_decay) * idle

    def observe_drafting(self, seconds: float, seconds_per_token: float) -> None:
        """The drafting of the blocks the step just verified took `seconds` (the slowest stream's batch),
        `seconds_per_token` per drafted token. Call it after observe_step: the share e of drafting the verifier
        waited for is its wait before the step against `seconds` (both capped at max_idle_s)."""
        if not (seconds > 0.0 and seconds_per_token > 0.0):
            return
        d = self.draft_decay
        if self.draft_s_per_token is None:
            self.draft_s_per_token = seconds_per_token
        else:
            self.draft_s_per_token = d * self.draft_s_per_token + (1 - d) * seconds_per_token
        waited = min(1.0, self.idle_s / min(seconds, self.max_idle_s))
        self.exposure = d * self.exposure + (1 - d) * waited

    def idle_split(self, num_candidates: int) -> tuple[float, float]:
        """(idle seconds per step that no draft length changes, seconds each drafted token adds). The verifier
        waits idle_s before each step, of which drafting at the mean length chosen takes s * k; it waits for a
        share e of the drafting (observe_drafting: 1 in one phase, where it waits for every draft; 0 where
        drafting hides behind other work; kept while nothing is drafted). A block of k tokens adds e * s * k to
        the wait, and a total of M drafted tokens over the candidates e * s * M / candidates (a batch takes as
        long as its longest block, about the mean length when lengths are alike)."""
        s = self.draft_s_per_token
        if not s or num_candidates <= 0:
            return self.idle_s, 0.0
        return (max(0.0, self.idle_s - self.exposure * s * self.mean_chosen_k),
                self.exposure * s / num_candidates)

    def observe_verification(self, key: object, num_drafted: int, num_accepted: int) -> None:
        self.acceptance.observe(key, num_drafted, num_accepted)

    def forget(self, key: object) -> None:
        self.acceptance.forget(key)

    def choose(self, caps: dict[object, int], other_tokens: int = 0, other_output: float = 0.0) -> Allocation:
        """The next draft length of each key in `caps` (its cap on k), for a step that also carries
        `other_tokens` of work that follows no choice (prefill, fixed-k verifications) and yields `other_output`
        tokens."""
        candidates = [Candidate(key, cap, tuple(self.acceptance.rates(key, cap))) for key, cap in caps.items()]
        fixed_idle, per_token = self.idle_split(len(candidates))
        chosen = choose_draft_lengths(candidates, self.step_time, other_tokens, other_output, fixed_idle,
                                      self.tolerance, per_token)
        if chosen.draft_lengths:
            mean_k = sum(chosen.draft_lengths.values()) / len(chosen.draft_lengths)
            self.mean_chosen_k = self.draft_decay * self.mean_chosen_k + (1 - self.draft_decay) * mean_k
        self._choices += 1
        if self.probe_every and self._choices % self.probe_every == 0:
            lengths = {key: min(caps[key], k + 1) for key, k in chosen.draft_lengths.items()}
            chosen = dataclasses.replace(chosen, draft_lengths=lengths)
        return chosen
