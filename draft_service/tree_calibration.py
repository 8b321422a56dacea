"""How far a token tree's growth may trust the draft's probabilities.

EAGLE-2 grows a tree by path probability, the product of the draft's probabilities from the root, on the premise
that the draft's confidence tracks acceptance. A small draft need not be calibrated: where it is underconfident, a
tree ranked by raw probabilities spends its nodes on alternatives near the root where a chain would have gone
deeper; where it is overconfident, the other way round.

This module learns the correction from the verdicts, per draft service and per kind of tree (greedy, coupled): for
each child of every node the verification reached, whether it was the verifier's token at its position (for these
kinds, exactly whether it was accepted: both accept the child equal to the verifier's token). Children are counted
by their rank among their siblings and their probability's band; a band's factor is its hits over the sum of its
probabilities (what an exact draft would score), with a prior of PRIOR expected hits at a factor of 1, so that an
unobserved band keeps the raw probability, and kept within [MIN_FACTOR, MAX_FACTOR], so that no traffic moves a
child's score by more than that. Counts decay by DECAY per verdict that labels a child: the service follows its
recent traffic.

Only greedy and coupled trees are calibrated, because their output does not depend on the tree at all (greedy:
the target's argmax; coupled: argmax p / E with the seed's noise). A one-hot or sparse tree's sampled output
depends on which children it holds, so calibrating them would make a seeded output depend on what else the
service verified before; they keep the raw probabilities. Calibration changes which nodes a tree holds and its best
path (what the draft keeps in its cache and pipelining assumes), never what the verifier accepts.

What growth reads (TreeGrowth, on the drafting thread) is an immutable snapshot, replaced after each verdict on the
event loop.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

# the edges of the bands of the draft's probability of a child: band i holds [BANDS[i-1], BANDS[i])
BANDS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
MAX_RANK = 2  # siblings ranked 2 and beyond share counts
PRIOR = 4.0  # expected hits' worth of belief in the raw probability
DECAY = 0.98  # per verdict: half the weight after about 35 verdicts (some hundreds of labels)
MIN_FACTOR, MAX_FACTOR = 0.25, 4.0  # how far calibration may move a child's probability, either way
MAX_ACCEPTANCE = 0.999  # a child's calibrated acceptance stays below 1: it never scores above its parent


def band(prob: float) -> int:
    return bisect.bisect_right(BANDS, prob)


@dataclass(frozen=True)
class Calibration:
    """Per sibling rank and band, the factor from the draft's probability to the acceptance seen."""

    factors: tuple[tuple[float, ...], ...]

    def acceptance(self, rank: int, prob: float) -> float:
        """The calibrated chance that a child of this rank and draft probability is accepted, given its parent
        is."""
        return min(MAX_ACCEPTANCE, prob * self.factors[min(rank, MAX_RANK)][band(prob)])


IDENTITY = Calibration(tuple((1.0,) * (len(BANDS) + 1) for _ in range(MAX_RANK + 1)))


def reached_children(parents: Sequence[int], token_ids: Sequence[int], verified: Sequence[int]) -> list[tuple[int, bool]]:
    """(node, whether it was the verifier's token at its position) for every child of a node the verification
    reached: the root's, then each accepted node's, while the verdict's tokens (the accepted path, then the
    corrected or bonus token) go on."""
    out: list[tuple[int, bool]] = []
    node = -1
    for token in verified:
        accepted = -1
        for i, parent in enumerate(parents):
            if parent == node:
                hit = token_ids[i] == token
                out.append((i, hit))
                if hit:
                    accepted = i
        if accepted < 0:
            break
        node = accepted
    return out


class TreeCalibration:
    """Running counts for one kind of tree. observe() runs on the event loop; `current` is what growth reads."""

    def __init__(self) -> None:
        shape = (MAX_RANK + 1, len(BANDS) + 1)
        self.hits = [[0.0] * shape[1] for _ in range(shape[0])]
        self.expected = [[0.0] * shape[1] for _ in range(shape[0])]
        self.current = IDENTITY

    def observe(self, parents: Sequence[int], token_ids: Sequence[int], ranks: Sequence[int],
                probs: Sequence[float], verified: Sequence[int]) -> tuple[int, int]:
        """One verdict on a tree: its nodes' parents, tokens, sibling ranks and draft probabilities, and the
        verdict's tokens. Returns the children labelled: (accepted, rejected)."""
        labels = reached_children(parents, token_ids, verified)
        if not labels:
            return 0, 0
        for row_h, row_e in zip(self.hits, self.expected, strict=True):
            for b in range(len(row_h)):
                row_h[b] *= DECAY
                row_e[b] *= DECAY
        for i, hit in labels:
            r, b = min(ranks[i], MAX_RANK), band(probs[i])
            self.hits[r][b] += float(hit)
            self.expected[r][b] += probs[i]
        self.current = Calibration(tuple(tuple(min(MAX_FACTOR, max(MIN_FACTOR, (h + PRIOR) / (e + PRIOR)))
                                               for h, e in zip(row_h, row_e, strict=True))
                                         for row_h, row_e in zip(self.hits, self.expected, strict=True)))
        hits = sum(1 for _, hit in labels if hit)
        return hits, len(labels) - hits
