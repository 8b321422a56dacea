"""Token trees on the draft side: what a round drafts instead of a chain when --tree-branches is above 1.

A tree grows one depth per drafting step within three limits: `depth` positions (the round's k), at most
`branches` children per node, at most `nodes` nodes. Each step feeds the chosen nodes of the last depth in one
query of the sequence, each seeing the context and its own ancestors (tree attention, kernels.paged_attention),
at cache slots given in the order nodes are fed, and their rows give the next depth's candidates.

Greedy, one-hot and coupled trees grow as EAGLE-2's: the `per_depth` best candidates of each depth by path
probability (the product of the draft's probabilities from the root) are fed, each proposes its `branches`
likeliest children, and the tree is the `nodes` best candidates of all (a child never scores above its parent, so
they form a tree): a confident draft spends its nodes deep, an unsure one wide. These children may be anything:
- greedy, one-hot: the draft's likeliest tokens. One-hot verification takes q = delta(x), lossless for any
  children; greedy verification descends to the child that equals the target's argmax.
- coupled: the best tokens of q / E with the verifier's own noise E at that position, the target's likeliest
  samples.
Sparse trees (sampled, q sent) are draws, and a draw may not be kept or dropped by its value: each depth's
children are allotted before any is drawn, and every drawn child is kept and fed. The i-th child of node f scores
path(f) times the chance that a reached node's i-th draw is the accepted one, from the sequence's record of its
verdicts (draft_service.draw_acceptance); a depth draws as many of its best candidates as are among the nodes left
in a forecast of the tree below, where every node's children score like these (forecast_allotment): a sequence
whose first draws are accepted spends its nodes deep, one whose first draws are rejected draws second ones. The i-th
child is argmax q_i / E_i over q's support, q_i being q less the earlier children, renormalised and rounded to
the float32 that travels, with noise E_i of its own (the first child's is the chain's draft noise), and q_i is
what is sent with it: each child is then distributed as the q sent with it given everything before it, which is
what the verifier's recursive rejection sampling assumes. What is drawn later shapes only deeper levels.

After the last step the draft keeps its best path (the best-scoring child at each depth: the likeliest, or with
calibration the likeliest to be accepted) in its cache at the positions it would hold if accepted, as a chain's
drafts are kept; pipelining assumes that path, whole or up to a rejection. The verifier's token at the first
position the path loses is none of the tree's children there (it would have descended to one that matched), so the
block's alternatives per position, the guesses pipelining drafts after, are the row's best tokens outside the
tree's children of the path's node above: without them a branched tree's pipelined proposal was used only when its
whole best path was accepted (measured: 0 of 104 with a draft of noise 0.05, temperature 0.9).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch

from common.sampling import SparseProbs
from draft_service.draft_sampling import ALTERNATIVES, support
from draft_service.draw_acceptance import DrawAcceptance
from draft_service.sequence import DraftSequence
from draft_service.tree_calibration import IDENTITY, Calibration
from draft_service.types import DraftBlock
from kernels.philox import Purpose, exponential64_reference
from kernels.sampling_probs import compute_probs, finite_rows

# the noise of a later sibling's draw: its index plus this times its rank (the first child's is the chain's own);
# philox takes 32 bits of index, so vocabularies below 2^20 and ranks below 2^12 never share one
SIBLING_STRIDE = 1 << 20


@dataclass(frozen=True)
class TreeShape:
    """--num-speculative-tokens (depth), --tree-branches and --tree-nodes."""

    depth: int
    branches: int
    nodes: int

    @property
    def per_depth(self) -> int:
        """Nodes fed per depth (greedy, one-hot, coupled): the branches, or enough to spread the nodes over the
        depth."""
        return max(self.branches, -(-self.nodes // max(1, self.depth)))

    @property
    def max_fed(self) -> int:
        """The most nodes one tree feeds, and so the cache slots it writes: every depth's but the last, and never
        more than 64 (a slot is a bit of the ancestor masks)."""
        return min(64, max(self.nodes, self.per_depth * (self.depth - 1)))

    def scaled(self, k: int) -> TreeShape:
        """The shape for a round of depth k (the round's draft length: --speculation auto's or adaptive's choice, or
        a request's own). Below the configured depth the nodes shrink in proportion. NOTE: the verifier prices a
        round of k as k + 1 tokens to compute; a tree of n nodes costs n + 1, which its controller sees only
        through the step times it measures."""
        if k >= self.depth:
            return TreeShape(k, self.branches, self.nodes)
        return TreeShape(k, self.branches, max(k, self.nodes * k // max(1, self.depth)))


@dataclass(frozen=True)
class RowChoices:
    """One fed row's distribution, as the tree needs it: its candidates best first (token ids and probabilities;
    for a sparse sequence, q's whole kept support as sent), or none (non-finite logits)."""

    token_ids: list[int]
    probs: list[float]


@dataclass
class Node:
    token: int
    parent: int  # -1: the root (the context's last token)
    depth: int
    # path probability (greedy, coupled: calibrated, see draft_service.tree_calibration); sparse: the chance of the
    # path's draws being the accepted ones (draft_service.draw_acceptance)
    score: float
    q: SparseProbs | None = None  # what it was drawn from (sparse)
    rank: int = 0  # among its parent's children as proposed, best first
    prob: float = 1.0  # the draft's probability of it given its parent
    slot: int = -1  # fed: its cache index less `first` (nodes get slots in the order they are fed); -1: never fed


@dataclass(frozen=True)
class NodeFeed:
    """One step's nodes fed as one query: slots `slots` (cache indices first + slot), each at its depth's position,
    each seeing the context and its ancestors (masks: bit j = slot j)."""

    token_ids: list[int]
    slots: range
    depths: list[int]
    masks: list[int]


@dataclass
class TreeGrowth:
    """One sequence's tree while it is drafted.

    Greedy, one-hot and coupled trees grow as EAGLE-2's: each step feeds the `per_depth` best candidates of the
    last depth, each proposes its `branches` likeliest children, and at the end the `nodes` best of every candidate
    (by path probability) make the tree: a confident draft spends its nodes deep, an unsure one wide. Sparse trees
    cannot choose among drawn children by their draws: each depth's children are allotted before they are drawn
    (forecast_allotment, with the sequence's record of accepted draws), every drawn child is kept and fed."""

    seq: DraftSequence
    shape: TreeShape
    first: int  # the cache index of slot 0: the context's length (its positions start there too)
    calibration: Calibration = IDENTITY  # how a greedy or coupled tree scores a child's probability
    draws: DrawAcceptance = DrawAcceptance()  # how a sparse tree scores its i-th draw (draw_acceptance)
    nodes: list[Node] = field(default_factory=list)
    frontier: list[int] = field(default_factory=list)  # the nodes fed next
    fed: list[int] = field(default_factory=list)  # the nodes fed by the last step, in row order
    # per node fed (-1: the root), its row's best tokens, as many as its children and the guesses past them need
    rows: dict[int, list[int]] = field(default_factory=dict)

    @property
    def rerank(self) -> bool:
        return not self.seq.sampling.sends_draft_probs

    def grow(self, rows: list[RowChoices]) -> bool:
        """Add the children of the nodes the last step fed (the root first) from their rows. Returns whether there
        are nodes to feed next."""
        parents = self.fed or [-1]
        depth = 0 if parents == [-1] else self.nodes[parents[0]].depth + 1
        self.frontier = []
        if depth >= self.shape.depth:
            return False
        start = len(self.nodes)
        for parent, row in zip(parents, rows, strict=True):
            self.rows[parent] = row.token_ids[:self.shape.branches + ALTERNATIVES]
        if self.rerank:
            for parent, row in zip(parents, rows, strict=True):
                base = 1.0 if parent < 0 else self.nodes[parent].score
                for rank, (token, prob) in enumerate(zip(row.token_ids[:self.shape.branches], row.probs,
                                                         strict=False)):
                    if prob > 0:
                        score = base * self.calibration.acceptance(rank, prob)
                        self.nodes.append(Node(token, parent, depth, score, rank=rank, prob=prob))
            # only a candidate among the best `nodes` so far can end in the tree (later ones score below their
            # parents), and so can its children: the others are not fed; nor more than max_fed in all
            if len(self.nodes) > self.shape.nodes:
                cut = sorted(self._rank(i) for i in range(len(self.nodes)))[self.shape.nodes - 1]
                new_ = [i for i in range(start, len(self.nodes)) if self._rank(i) <= cut]
            else:
                new_ = list(range(start, len(self.nodes)))
            new_.sort(key=self._rank)
            room = self.shape.max_fed - sum(1 for n in self.nodes if n.slot >= 0)
            self.frontier = new_[:min(self.shape.per_depth, room)] if depth + 1 < self.shape.depth else []
            return bool(self.frontier)
        left = self.shape.nodes - len(self.nodes)
        profile = self.draws.profile(self.shape.branches)
        candidates = []
        for parent, row in zip(parents, rows, strict=True):
            base = 1.0 if parent < 0 else self.nodes[parent].score
            # a node can have as many children as its row has tokens to draw
            candidates.extend((-base * p, parent, rank) for rank, p in enumerate(profile[:len(row.probs)]) if p > 0)
        candidates.sort()
        take = forecast_allotment([-c[0] for c in candidates], profile, left, self.shape.depth - depth)
        counts: dict[int, int] = {}
        for _, parent, _ in candidates[:take]:
            counts[parent] = counts.get(parent, 0) + 1
        sampling = self.seq.sampling
        for parent, row in zip(parents, rows, strict=True):
            if counts.get(parent, 0):
                base = 1.0 if parent < 0 else self.nodes[parent].score
                draws = draw_without_replacement(row, counts[parent], sampling.seed, self.first + depth)
                for rank, (token, prob, q) in enumerate(draws):
                    self.nodes.append(Node(token, parent, depth, base * profile[rank], q, rank=rank, prob=prob))
        if depth + 1 < self.shape.depth and len(self.nodes) < self.shape.nodes:
            self.frontier = list(range(start, len(self.nodes)))
        return bool(self.frontier)

    def _rank(self, i: int) -> tuple[float, int, int]:
        """Best first: the path probability, then the shallower (a parent before its child at equal scores)."""
        return -self.nodes[i].score, self.nodes[i].depth, i

    def feed(self) -> NodeFeed:
        """The frontier, given the next slots (never more than max_fed: DraftModel reserves that many)."""
        first_slot = sum(1 for n in self.nodes if n.slot >= 0)
        assert first_slot + len(self.frontier) <= self.shape.max_fed, "a tree feeds at most max_fed nodes"
        for k, i in enumerate(self.frontier):
            self.nodes[i].slot = first_slot + k
        self.fed = self.frontier
        masks = []
        for i in self.fed:
            mask, node = 0, i
            while node >= 0:
                mask |= 1 << self.nodes[node].slot
                node = self.nodes[node].parent
            masks.append(mask - (1 << 64) if mask >= 1 << 63 else mask)
        return NodeFeed([self.nodes[i].token for i in self.fed], range(first_slot, first_slot + len(self.fed)),
                        [self.nodes[i].depth for i in self.fed], masks)

    def chosen(self) -> list[int]:
        """The nodes the tree keeps, depth by depth (a node's children in the order they were made or ranked)."""
        if not self.rerank:
            return list(range(len(self.nodes)))
        best = sorted(range(len(self.nodes)), key=self._rank)
        kept: set[int] = set()
        for i in best:  # a child scores at most its parent, which therefore comes first
            if len(kept) == self.shape.nodes:
                break
            if self.nodes[i].parent < 0 or self.nodes[i].parent in kept:
                kept.add(i)
        return sorted(kept, key=lambda i: (self.nodes[i].depth, i))

    def block(self) -> tuple[DraftBlock, list[int]]:
        """The tree as proposed, and its best path (the best-scoring child at each depth) as node indices."""
        chosen = self.chosen()
        index = {node: k for k, node in enumerate(chosen)}
        path: list[int] = []
        parent = -1
        while True:
            children = [i for i in chosen if self.nodes[i].parent == parent]
            if not children:
                break
            parent = max(children, key=lambda i: self.nodes[i].score)
            path.append(parent)
        sampling = self.seq.sampling
        qs = tuple(self.nodes[i].q for i in chosen) if sampling.sends_draft_probs else None
        alternatives = []
        for parent in [-1, *path[:-1]]:  # the guesses at each of the path's positions, should it lose there
            children = {self.nodes[i].token for i in chosen if self.nodes[i].parent == parent}
            alternatives.append(tuple(t for t in self.rows.get(parent, ()) if t not in children)[:ALTERNATIVES])
        block = DraftBlock(tuple(self.nodes[i].token for i in chosen), qs, alternatives=tuple(alternatives),
                           parents=tuple(index[p] if (p := self.nodes[i].parent) >= 0 else -1 for i in chosen),
                           path=tuple(index[i] for i in path),
                           node_ranks=tuple(self.nodes[i].rank for i in chosen) if self.rerank else None,
                           node_probs=tuple(self.nodes[i].prob for i in chosen) if self.rerank else None)
        return block, path


def forecast_allotment(scores: list[float], profile: list[float], budget: int, depths_left: int) -> int:
    """How many of a depth's candidate children (`scores`: their path probabilities, best first) a sparse tree
    draws, when `budget` nodes remain for this depth and the `depths_left - 1` below it: as many as are among the
    `budget` best nodes of a forecast tree, in which these candidates are the nodes of this depth and every node's
    i-th child scores its score times profile[i]. A confident draft then spends its nodes deep (the forecast main
    line outscores every sibling) and an unsure one wide, as a reranked tree does; the count depends on the
    scores and the rows' sizes only, never on what is drawn from them."""
    heap = [(-s, 0, i) for i, s in enumerate(scores) if s > 0]
    heapq.heapify(heap)
    serial, now = len(heap), 0
    factors = [p for p in profile if p > 0]
    for _ in range(max(0, budget)):
        if not heap:
            break
        neg, offset, _ = heapq.heappop(heap)
        now += offset == 0
        if offset + 1 < depths_left:
            for p in factors:  # a child never scores above its parent, so the best `budget` form a tree
                heapq.heappush(heap, (neg * p, offset + 1, serial))
                serial += 1
    return now


def draw_without_replacement(row: RowChoices, m: int, seed: int, position: int) -> list[tuple[int, float, SparseProbs]]:
    """Up to m children of a sparse sequence's row, each drawn from q less the earlier ones, renormalised (float32,
    as it travels): (token, its probability under q, the q it was drawn from)."""
    ids = torch.tensor(row.token_ids, dtype=torch.int64)
    if bool((ids >= SIBLING_STRIDE).any()):
        raise ValueError(f"token trees draw siblings with noise keyed below {SIBLING_STRIDE}: a vocabulary that "
                         "large needs another key")
    full = torch.tensor(row.probs, dtype=torch.float64)  # q as sent: float32 values, normalised
    q = full.clone()
    out = []
    for i in range(m):
        if i:
            q[ids == out[-1][0]] = 0.0
            if not bool((q > 0).any()):
                break
            q = (q / q.sum()).to(torch.float32).to(torch.float64)
        keep = q > 0
        noise = exponential64_reference(seed, position, Purpose.DRAFT_SAMPLE, ids[keep] + i * SIBLING_STRIDE)
        token = int(ids[keep][int(torch.argmax(q[keep] / noise))])
        prob = float(full[ids == token][0])
        out.append((token, prob, SparseProbs(tuple(ids[keep].tolist()), tuple(q[keep].tolist()))))
    return out


def tree_rows(logits: torch.Tensor, seqs: list[DraftSequence], positions: list[int], q_max_support: int,
              branches: int) -> list[RowChoices]:
    """Per row (sequence seqs[i] at positions[i], the position its children decide), what growth needs, after one
    copy to the host: greedy rows their `branches` + ALTERNATIVES likeliest tokens (scored by the softmax of the
    logits; the children come from the first `branches`, pipelining's guesses from the rest); one-hot rows those
    of q; coupled rows the best of q / E with the verifier's noise; sparse rows q's kept support, normalised as it
    is sent."""
    finite = finite_rows(logits)
    params = [s.sampling for s in seqs]
    safe = torch.where(finite.unsqueeze(1), logits, 0.0)
    temperature = torch.tensor([1.0 if p.is_greedy else p.temperature for p in params], device=logits.device)
    top_k = torch.tensor([0 if p.is_greedy else p.top_k for p in params], dtype=torch.int64, device=logits.device)
    top_p = torch.tensor([1.0 if p.is_greedy else p.top_p for p in params], device=logits.device)
    probs = compute_probs(safe, temperature, top_k, top_p)
    top_probs, top_ids = probs.topk(min(q_max_support, probs.shape[1]), dim=1)
    host = torch.cat([finite.double().unsqueeze(1), top_probs.double(), top_ids.double()], dim=1).cpu()
    width = top_probs.shape[1]
    listed = branches + ALTERNATIVES  # a greedy or one-hot row's children and the guesses past them
    rows = []
    for i, seq in enumerate(seqs):
        if not bool(host[i, 0]):
            rows.append(RowChoices([], []))
            continue
        kept = support(seq, q_max_support)
        p, ids = host[i, 1:1 + width][:kept], host[i, 1 + width:][:kept].long()
        keep = p > 0
        p, ids = p[keep], ids[keep]
        sampling = seq.sampling
        if sampling.sends_draft_probs:  # q as sent: float32 of the truncated, renormalised q
            q = (p / p.sum()).to(torch.float32).to(torch.float64)
            rows.append(RowChoices(ids.tolist(), q.tolist()))
        elif sampling.is_coupled:
            q = p / p.sum()
            noise = exponential64_reference(sampling.seed, positions[i], Purpose.TARGET_SAMPLE, ids)
            order = (q / noise).argsort(descending=True)[:listed]
            rows.append(RowChoices(ids[order].tolist(), q[order].tolist()))
        else:
            rows.append(RowChoices(ids[:listed].tolist(), (p[:listed] / p.sum()).tolist()))
    return rows
