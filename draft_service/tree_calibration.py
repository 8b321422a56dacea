"""How far a token tree's growth may trust the draft's probabilities.

EAGLE-2 grows a tree by path probability, the product of the draft's probabilities from the root, on the premise
that the draft's confidence tracks acceptance. A small draft is seldom calibrated: on code the default pair's draft
says 0.6 where the target agrees nine times in ten, so a tree ranked by raw probabilities spends its nodes on
alternatives near the root where a chain would have gone deeper (docs/benchmarks.md, "Token trees").

This module learns the correction from the verdicts, per draft service and per kind of tree (greedy, one-hot,
coupled): for each child of every node the verification reached, whether it was the verifier's token at its
position (for these kinds, that is exactly whether it was accepted: greedy and coupled accept the child equal to
the verifier's token, and under one-hot recursive rejection the output is always an accepted child or a token
outside them). Children are counted by their rank among their siblings and their probability's band; a band's
factor is its hits over the probabilities' sum (what an exact draft would score), with a prior of PRIOR expected
hits at a factor of 1, so that an unobserved band keeps the raw probability. Counts decay by DECAY per verdict:
the service follows its recent traffic.

What growth reads (TreeGrowth, on the drafting thread) is an immutable snapshot, replaced after each verdict on the
event loop. Calibration only reorders which nodes a tree keeps: what is verified is still each node's token, and
every rule of verification stays exact whatever the tree holds. Sparse trees (q sent, children drawn) keep their
allotment by raw probabilities.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

# bands of the draft's probability of a child (the last edge above 1 so that 1.0 falls in the top band)
BANDS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
MAX_RANK = 2  # siblings ranked 2 and beyond share counts
PRIOR = 4.0  # expected hits' worth of belief in the raw probability
DECAY = 0.98  # per verdict: half the weight after about 35 verdicts (some hundreds of labels)
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
        self.current = Calibration(tuple(tuple((h + PRIOR) / (e + PRIOR) for h, e in zip(row_h, row_e, strict=True))
                                         for row_h, row_e in zip(self.hits, self.expected, strict=True)))
        hits = sum(1 for _, hit in labels if hit)
        return hits, len(labels) - hits
