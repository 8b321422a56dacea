"""What a sparse (sampled) sequence's verdicts say about its tree's draws, and so how its next tree is shaped.

In the sparse mode the verifier tries a node's children in the order they were drawn: the first against p, each
later one against the residual the earlier rejections leave (multi-draft recursive rejection sampling). How likely
a child is to be the one accepted is not the draft's probability of it: when q is close to p the first draw is
accepted almost always, however flat q is, and the later draws only matter when it is not. So a sparse tree scores
its children by the sequence's own record:

- a: how often the first child of a node the verification reached was accepted;
- b: how often a later child was, given that the children before it were not;

and the i-th child of a node scores a (i = 0) or (1 - a)(1 - b)^(i - 1) b (the chance that it is the accepted one).
A sequence whose drafts are accepted spends its nodes deep, like the chain; one whose first draws are often
rejected spends them on second draws near the root.

A seeded request's sampled tokens depend on the tree, and must not depend on whether it was drafted ahead
(pipelining) or after the verdict. A round drafted ahead, while the previous round's verdict is in flight, knows
the verdicts before that one; so every round is shaped by the verdicts of all rounds but the last one before it:
a round drafted after a verdict reads `before_last`, a pipelined branch reads its sequence's `latest` (all
verdicts it has, which are the same ones). Both are immutable snapshots that a job keeps while it drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from draft_service.tree_calibration import reached_children

# a before any verdict: high, because the two ways of being wrong differ. Taking a for higher than it is makes the
# tree a chain, which yields what the chain yields; taking it for lower spends nodes on second draws that a
# sequence whose first draws are accepted never reaches, and costs it the chain's depth.
PRIOR_FIRST = 0.85
PRIOR_LATER = 0.3  # b before any verdict
PRIOR_STRENGTH = 2.0  # pseudo-counts of each prior
DECAY = 0.9  # per verdict: the sequence follows its text


@dataclass(frozen=True)
class DrawAcceptance:
    """Decayed counts of first and later children tried and accepted."""

    first_tried: float = 0.0
    first_accepted: float = 0.0
    later_tried: float = 0.0
    later_accepted: float = 0.0

    @property
    def first(self) -> float:
        """a: the first child's chance, given its parent was reached."""
        return (self.first_accepted + PRIOR_STRENGTH * PRIOR_FIRST) / (self.first_tried + PRIOR_STRENGTH)

    @property
    def later(self) -> float:
        """b: a later child's chance, given its parent was reached and its earlier siblings were rejected."""
        return (self.later_accepted + PRIOR_STRENGTH * PRIOR_LATER) / (self.later_tried + PRIOR_STRENGTH)

    def profile(self, branches: int) -> list[float]:
        """The chance that a reached node's i-th child (i < branches) is the accepted one, kept non-increasing:
        children are drawn in order, so a later one is never allotted where an earlier one is not (where a is
        below (1 - a) b the second draw would otherwise outscore the first)."""
        a, b = self.first, self.later
        out: list[float] = []
        for i in range(branches):
            p = a if i == 0 else (1 - a) * (1 - b) ** (i - 1) * b
            out.append(min(p, out[-1]) if out else p)
        return out

    def observe(self, parents: Sequence[int], token_ids: Sequence[int], verified: Sequence[int]) -> DrawAcceptance:
        """After a verdict on a sparse tree (its nodes' parents and tokens, a node's children in the order they were
        drawn; the verdict's tokens): these counts decayed, plus the children the verification tried. A child is
        accepted exactly when it is the verdict's token at its position (a rejected child has no mass left in the
        residual that the correction is drawn from)."""
        first_tried, first_accepted = self.first_tried * DECAY, self.first_accepted * DECAY
        later_tried, later_accepted = self.later_tried * DECAY, self.later_accepted * DECAY
        # per reached node, its children's labels in draw order; tried up to the accepted one
        siblings: dict[int, list[bool]] = {}
        for i, hit in reached_children(parents, token_ids, verified):
            siblings.setdefault(parents[i], []).append(hit)
        for hits in siblings.values():
            hit = hits.index(True) if True in hits else None
            first_tried += 1.0
            first_accepted += float(hit == 0)
            later_tried += float((len(hits) if hit is None else hit + 1) - 1)
            later_accepted += float(hit is not None and hit > 0)
        return DrawAcceptance(first_tried, first_accepted, later_tried, later_accepted)


@dataclass
class DrawRecord:
    """One sequence's record: `latest` (every verdict so far) and `before_last` (all but the last one)."""

    latest: DrawAcceptance = DrawAcceptance()
    before_last: DrawAcceptance = DrawAcceptance()

    def observe(self, parents: Sequence[int] | None, token_ids: Sequence[int], verified: Sequence[int]) -> None:
        """Every verdict of the sequence, in order (`parents` None: a chain, whose drafts are first children)."""
        if parents is None:
            parents = range(-1, len(token_ids) - 1)
        self.before_last = self.latest
        self.latest = self.latest.observe(parents, token_ids, verified)
