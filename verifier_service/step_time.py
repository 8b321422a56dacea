"""What the goodput controller (verifier_service.goodput) learns from the verifier's own steps: the step's time
as a function of its tokens (StepTimeModel), the draft's time for a round as a function of its longest block,
the tokens it drafted and the rows of context it fed first (DraftTimeModel), and each sequence's acceptance per
draft position, conditional on the positions before it having been accepted, shrunk towards the rates of all
sequences (AcceptanceTracker)."""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

# Token counts of the step-time model's buckets: dense where decode batches live, then geometric.
_BUCKETS: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024,
                             1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384)


def ema(old: float | None, new: float, decay: float) -> float:
    """An exponential moving average's next value, decay * old + (1 - decay) * new; `new` where none is kept yet."""
    return new if old is None else decay * old + (1 - decay) * new


def _bucket(num_tokens: int) -> int:
    return min(bisect.bisect_left(_BUCKETS, num_tokens), len(_BUCKETS) - 1)


@dataclass
class StepTimeModel:
    """t(n): the verifier's step time for a step of n tokens, from the steps it ran.

    Each bucket of token counts keeps an exponential moving average of the (tokens, seconds) of its steps.
    Between observed buckets t is interpolated linearly; outside them it is scaled in proportion to the tokens
    (t(n) = t(n0) * n / n0), the compute-bound guess: it makes untried smaller steps look cheap and untried
    larger ones dear, so the controller tries plain decoding under load and learns what it really costs, and
    never bets on a long draft being free before it has seen one.

    The curve is made non-decreasing by pooling adjacent buckets that violate it (isotonic regression), each
    weighted by how many of the recent steps it saw: a step size seen rarely, and slowed by what else ran on the
    host then, does not lift the time of every larger step above what the verifier sees them take. (A running
    maximum did: on 2 shared cores a few 2-token steps at 0.9 s priced the 6-token steps, measured at 0.4 s, at
    0.6 s, so that longer drafts looked nearly free.)

    A bucket starts from the faster of its first two steps, and averages from the third: the first step of a size
    may run cold (a fresh service's first forwards; measured on 2 cores, a first 5-token verification took 450 to
    550 ms against 350 to 400 after), and a step beside other work only runs slower, so the faster of two survives
    one of either. Averaged in, a cold step held its bucket up for many steps: through guidellm at 4 streams
    (default pair, 2 cores, ca8fe23) the gateway's warm-up request, the service's first step, computed a 4-token
    prompt in 783 ms; two 4-token verifications of 514 and 484 ms left the bucket at about 730 ms (the controller's
    decay, 0.9), the pooled curve priced a plain step of the 4 sequences at 0.66 s where it took 0.49, and the
    verifier drafted a token each (6.9 tokens/s predicted and measured) where plain steps gave 7.5 (predicted 6.0):
    guidellm's figure for that level was 0.84x k = 0's. The faster of two is biased low; the average climbs back
    from the third step. A bucket spans several sizes past 4 tokens: a new size's first step in a bucket seen twice
    already is averaged in (at its second, the faster of the two sizes' steps is kept)."""

    decay: float = 0.8  # weight of a bucket's past in its average
    weight_decay: float = 0.99  # per step, of every bucket's count of the steps it saw
    _tokens: list[float | None] = field(default_factory=lambda: [None] * len(_BUCKETS))
    _seconds: list[float | None] = field(default_factory=lambda: [None] * len(_BUCKETS))
    _weights: list[float] = field(default_factory=lambda: [0.0] * len(_BUCKETS))
    # steps each bucket saw: 0, 1, or 2 for two or more
    _counts: list[int] = field(default_factory=lambda: [0] * len(_BUCKETS))
    # points() until the next observation: predict() runs once per drafted token a choice considers
    _points: list[tuple[float, float]] | None = None
    _xs: list[float] = field(default_factory=list)

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or not seconds > 0:
            return
        self._points = None
        b = _bucket(num_tokens)
        self._weights = [w * self.weight_decay for w in self._weights]
        self._weights[b] += 1.0
        seen, self._counts[b] = self._counts[b], min(2, self._counts[b] + 1)
        if seen == 0 or (seen == 1 and seconds < self._seconds[b]):  # the faster of its first two (see above)
            self._tokens[b], self._seconds[b] = float(num_tokens), seconds
        elif seen == 2:
            self._tokens[b] = ema(self._tokens[b], num_tokens, self.decay)
            self._seconds[b] = ema(self._seconds[b], seconds, self.decay)

    @property
    def ready(self) -> bool:
        return any(t is not None for t in self._tokens)

    def has_seen(self, num_tokens: int) -> bool:
        """Whether two steps of about this size were seen: predict() is then from its own bucket, not a guess (nor
        a lone first step, which may have run cold: the controller's calibration, which compares a step with this
        prediction, would correct the bucket a second time)."""
        return self._counts[_bucket(num_tokens)] == 2

    def points(self) -> list[tuple[float, float]]:
        """The observed (tokens, seconds) points, by tokens, made non-decreasing in seconds (pool adjacent
        violators, weighted by the buckets' recent counts)."""
        if self._points is None:
            pts = [(n, s, w) for n, s, w in zip(self._tokens, self._seconds, self._weights, strict=True)
                   if n is not None]
            blocks: list[list[float]] = []  # [mean seconds, weight, number of points] per pooled run
            for _, s, w in pts:
                blocks.append([s, max(w, 1e-6), 1])
                while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                    s1, w1, c1 = blocks.pop()
                    s0, w0, c0 = blocks[-1]
                    blocks[-1] = [(s0 * w0 + s1 * w1) / (w0 + w1), w0 + w1, c0 + c1]
            seconds = [b[0] for b in blocks for _ in range(int(b[2]))]
            out = [(n, s) for (n, _, _), s in zip(pts, seconds, strict=True)]
            self._points, self._xs = out, [n for n, _ in out]
        return self._points

    def predict_many(self, num_tokens: np.ndarray) -> np.ndarray:
        """predict() of every element of an array of token counts."""
        pts = self.points()
        if not pts:
            raise ValueError("no step observed yet")
        (n0, s0), (n1, s1) = pts[0], pts[-1]
        n = np.asarray(num_tokens, dtype=np.float64)
        inside = np.interp(n, self._xs, [s for _, s in pts])
        return np.where(n <= n0, s0 * n / n0, np.where(n >= n1, s1 * n / n1, inside))

    def predict(self, num_tokens: int, *, marginal_beyond: bool = False) -> float:
        """t(num_tokens). Past the largest step seen, in proportion to the tokens; `marginal_beyond`: at the
        marginal cost per token seen over the larger half of the steps seen instead (the slope from the largest
        step to the largest one of at most half its tokens; in proportion where no step that small was seen),
        between a tenth of the proportional cost per token and all of it. That is the estimate of what two
        steps merged would cost: in proportion a step has no fixed cost, so merging two never saves anything,
        and a batch split in two (whose merged size is then never seen) would stay split for good."""
        pts = self.points()
        if not pts:
            raise ValueError("no step observed yet")
        n = float(num_tokens)
        if n <= pts[0][0]:
            return pts[0][1] * n / pts[0][0]
        if n >= pts[-1][0]:
            n1, s1 = pts[-1]
            below = next((p for p in reversed(pts) if p[0] <= n1 / 2), None)
            if not marginal_beyond or below is None:
                return s1 * n / n1
            n0, s0 = below
            # never dearer per token than in proportion, and never below a tenth of that: no token is free (the
            # isotonic pooling can flatten the largest points)
            slope = min(max((s1 - s0) / (n1 - n0), 0.1 * s1 / n1), s1 / n1)
            return s1 + (n - n1) * slope
        i = bisect.bisect_left(self._xs, n)
        (n0, s0), (n1, s1) = pts[i - 1], pts[i]
        return s0 + (s1 - s0) * (n - n0) / (n1 - n0)


@dataclass
class DraftTimeModel:
    """The draft's time for a round, a * L + b * M + c * C: L its longest block (the draft steps one token of every
    sequence at a time, so it runs L steps, each with a cost that does not depend on how many sequences it drafts
    for: the weights read once), M the tokens it drafted (the rows of those steps) and C the rows of context it
    fed first (a catch-up: a prompt, or the tokens verified while a sequence drafted nothing). On a CPU rows
    count: measured on this project's 2-core machine for the default draft's matrices (fp32, 2 threads), a step
    over 1, 16, 32 and 64 rows took 70, 215, 284 and 440 ms. The longest block alone (b = 0) priced a round for 32
    sequences at what rounds for 16 had taken, half of what it took (default pair, 32 streams: 1.0 to 1.8 s of
    waiting where 0.45 s was priced, for 4 drafted tokens a sequence).

    A catch-up's rows have a term of their own: they are one sequence's context in one forward, like a prompt's,
    and cost a fraction of a drafted row, which is one more sequence in every step. Learnt as drafted rows, the
    catch-ups of one stream's requests (each new request's first round feeds its prompt) set b at about 4.5 ms,
    and a round of 4 tokens for 8 sequences was priced at about 0.45 s where it took about 0.67 s (default pair, 2
    cores, 0b586a1, a level of 8 streams after one of 1: auto went from 1 token a sequence to 4, at a loss).

    Least squares over the rounds, weighted by `decay` per round, shrunk by `shrink` of each coefficient's own
    weight towards a prior that prices a row at `row_cost` of a step's fixed part (the figures above, read as
    a (1 + r rows), give r = 0.16 at 16 rows, 0.11 at 32 and 0.09 at 64), a catch-up row as a drafted one, and a
    step as a recent one took. While every round drafts for the same number of sequences (M = r L) a and b cannot
    be told apart, and the fit stays at the prior, which prices those rounds as they took; rounds for more or fewer
    sequences (fragments of the batch, probes, a load that changes) move it."""

    decay: float = 0.9
    shrink: float = 0.02
    row_cost: float = 0.1
    _sxx: np.ndarray = field(default_factory=lambda: np.zeros((3, 3)))
    _sxy: np.ndarray = field(default_factory=lambda: np.zeros(3))
    _step_s: float | None = None  # recent seconds per draft step (per token of the longest block)
    _rows: float = 1.0  # recent rows (drafted and caught up) per draft step
    _fit: tuple[float, float, float] | None = None

    def observe(self, seconds: float, longest_block: int, drafted_tokens: int, catch_up_rows: int = 0) -> None:
        """A round drafted `drafted_tokens` in all, at most `longest_block` for one sequence, in `seconds`, after
        feeding `catch_up_rows` rows of context."""
        if not (0 < seconds < float("inf") and longest_block > 0):
            return
        drafted = max(drafted_tokens, longest_block)
        fed = max(0, catch_up_rows)
        x = np.array([float(longest_block), float(drafted), float(fed)])
        d = self.decay
        self._sxx = d * self._sxx + np.outer(x, x)
        self._sxy = d * self._sxy + x * seconds
        step, rows = seconds / longest_block, (drafted + fed) / longest_block
        if self._step_s is None:
            self._step_s, self._rows = step, rows
        else:
            self._step_s = ema(self._step_s, step, d)
            self._rows = ema(self._rows, rows, d)
        self._fit = None

    @property
    def ready(self) -> bool:
        return self._step_s is not None

    def _coefficients(self) -> tuple[float, float, float]:
        if self._step_s is None:
            return 0.0, 0.0, 0.0
        if self._fit is None:
            fixed = self._step_s / (1.0 + self.row_cost * self._rows)
            prior = np.array([fixed, self.row_cost * fixed, self.row_cost * fixed])
            # a term never seen (no catch-up yet), or not for so long that its weight decayed to nothing, keeps its
            # prior: its row and column are dropped, and any ridge holds it there
            own = np.diag(self._sxx)
            unseen = own <= 1e-12 * max(float(own.max()), 1e-300)
            sxx, sxy = self._sxx.copy(), self._sxy.copy()
            sxx[unseen, :] = 0.0
            sxx[:, unseen] = 0.0
            sxy[unseen] = 0.0
            ridge = self.shrink * np.diag(np.where(unseen, 1.0, own))
            lhs, rhs = sxx + ridge, sxy + ridge @ prior
            free = [0, 1, 2]
            fit = np.zeros(3)
            while free:  # never a negative term: the most negative goes to 0 and the others are fitted again
                fit[:] = 0.0
                fit[free] = np.linalg.solve(lhs[np.ix_(free, free)], rhs[free])
                if fit.min() >= 0:
                    break
                free.remove(int(np.argmin(fit)))
            fit = np.maximum(fit, 0.0)
            self._fit = (float(fit[0]), float(fit[1]), float(fit[2]))
        return self._fit

    def coefficients(self) -> tuple[float, float]:
        """(a, b): seconds per token of the longest block, and per drafted token; (0, 0) before any round."""
        a, b, _ = self._coefficients()
        return a, b

    def catch_up_coefficient(self) -> float:
        """c: seconds per row of context a round feeds before it drafts; 0 before any round."""
        return self._coefficients()[2]

    def predict(self, longest_block: int, drafted_tokens: int, catch_up_rows: float = 0.0) -> float:
        a, b, c = self._coefficients()
        return a * longest_block + b * drafted_tokens + c * catch_up_rows


@dataclass
class AcceptanceTracker:
    """Acceptance per draft position, alpha_j = P(draft j accepted | drafts 1..j-1 accepted), per sequence and
    over the sequences of its group (`group_of`: the engine groups by Verify stream, i.e. by draft process and so
    by draft model, so that one client's drafts never set another's prior). A sequence's counts decay at every
    verdict, drafted or not, so a sequence whose drafts stopped (k = 0 for low acceptance) drifts back to its
    group's rates; the group's decay only at verdicts that judged a draft, so a group none of whose sequences
    drafts keeps the rates that stopped it (decayed without evidence they would drift to `default_rate`, a
    figure nobody measured): the controller's probes judge it again. At most `max_groups` groups are kept, the least recently seen go."""

    max_positions: int
    decay: float = 0.9  # per verdict, for a sequence's own counts
    global_decay: float = 0.995  # per verdict that judged a draft, for the shared counts
    prior_strength: float = 2.0  # pseudo-counts of the shared rates in a sequence's estimate
    default_rate: float = 0.7  # the shared rate before anything is observed
    # pseudo-counts of the group's rate over all its positions in one position's shared rate: a position that is
    # rarely judged (drafts seldom reach it) leans on how the group's drafts fare in general, not on a few old
    # verdicts, and so is tried again
    position_strength: float = 2.0
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

    def evidence(self, key: object) -> float:
        """How many verdicts (decayed) judged the first position of `key`'s group: what its shared rates rest on."""
        counts = self._shared(key, touch=False)
        return 0.0 if counts is None else counts[0][0]

    def shared_rate(self, j: int, key: object = None) -> float:
        """alpha_j over `key`'s group (the default rate for a group not seen yet)."""
        return self._shared_rates(key)[j]

    def _shared_rates(self, key: object) -> list[float]:
        """alpha_j over `key`'s group for every position: the position's own counts with `position_strength`
        pseudo-counts of the group's rate over the other positions (with the default rate as their prior; leaving
        the position's own counts out of it, so that a verdict is not counted twice: after one rejection at the
        first position and nothing else, its rate is the default's pull on one rejection, as before).

        Drafts are judged only up to the first rejection and never past their length, so the counts of a deep
        position are censored: when the draft lengths chosen are short, the last verdicts that reached a deep
        position may be a few old ones (a first request's rejections), which then would hold it down for
        hundreds of verdicts however well the shallower positions do. Drawn towards the group's overall rate
        instead, it is judged again as soon as that rate makes it worth drafting."""
        counts = self._shared(key, touch=False)
        if counts is None:
            return [self.default_rate] * self.max_positions
        g_tried, g_accepted = counts
        all_tried, all_accepted = sum(g_tried), sum(g_accepted)
        s = self.position_strength
        return [(a + s * (all_accepted - a + self.default_rate) / (all_tried - t + 1.0)) / (t + s)
                for t, a in zip(g_tried, g_accepted, strict=True)]

    def group_rates(self, key: object, k: int) -> list[float]:
        """alpha_1..alpha_k of a new sequence of `key`'s group (its prior)."""
        return self._shared_rates(key)[:k]

    def rates(self, key: object, k: int) -> list[float]:
        """alpha_1..alpha_k for `key`."""
        tried = self._tried.get(key)
        accepted = self._accepted.get(key)
        m = self.prior_strength
        shared = self._shared_rates(key)
        out = []
        for j in range(min(k, self.max_positions)):
            prior = shared[j]
            if tried is None:
                out.append(prior)
            else:
                out.append((accepted[j] + m * prior) / (tried[j] + m))
        return out
