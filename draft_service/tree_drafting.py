"""Token trees on the draft side: what a round drafts instead of a chain when --tree-branches is above 1.

A tree grows one depth per drafting step, best first over the path probability (the product of the draft's
probabilities from the root), as EAGLE-2 does, within three limits: `depth` positions (the round's k), at most
`branches` children per node, at most `nodes` nodes. Each step feeds every node of the last depth in one query
of the sequence, each seeing the context and its own ancestors (tree attention, kernels.paged_attention), and
their rows give the next depth's candidates: the i-th best child of node f scores path(f) * (i-th largest
probability of f's distribution). The best `per_depth` candidates (and no more than the nodes left) become the
next depth's nodes. Nodes are numbered depth by depth, siblings in the order they were made.

How a node's children are made decides what the verifier may do with them (kernels.rejection_sampler):
- greedy, one-hot: the most likely tokens under q. One-hot verification takes q = delta(x), lossless for any
  children; greedy verification descends to the child that equals the target's argmax.
- coupled: the best tokens of q / E with the verifier's own noise E at that position, the target's likeliest
  samples; any children are lossless there too.
- sparse (sampled, q sent): the children are draws without replacement. The i-th is argmax q_i / E_i over q's
  support, q_i being q less the earlier children, renormalised and rounded to the float32 that travels, with
  noise E_i of its own (the first child's is the chain's draft noise), and q_i is what is sent with it: each
  child is then distributed as the q sent with it, given everything before it, which is what the verifier's
  recursive rejection sampling assumes. How many children a node gets is decided before any of them is drawn
  (from the scores above, which use the parent's distribution, not the children's tokens); what is drawn later
  only shapes deeper levels.

After the last step the draft keeps its best path (the likeliest child at each depth) in its cache at the
positions it would hold if accepted, as a chain's drafts are kept; pipelining assumes that path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.sampling import SparseProbs
from common.token_tree import ancestor_masks
from draft_service.draft_sampling import support
from draft_service.sequence import DraftSequence
from draft_service.types import DraftBlock
from kernels.philox import Purpose, exponential64_reference
from kernels.sampling_probs import compute_probs

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
        """Nodes kept per depth: the branches, or enough to spread the nodes over the depth."""
        return max(self.branches, -(-self.nodes // max(1, self.depth)))

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
    score: float  # path probability
    q: SparseProbs | None = None  # what it was drawn from (sparse)


@dataclass
class TreeGrowth:
    """One sequence's tree while it is drafted."""

    seq: DraftSequence
    shape: TreeShape
    first: int  # the cache index of node 0: the context's length (its positions start there too)
    nodes: list[Node] = field(default_factory=list)
    level: range = range(0)  # the nodes of the last depth (the next ones fed)
    fed: int = 0  # nodes fed so far: every node below the last depth

    def grow(self, rows: list[RowChoices], parents: list[int]) -> bool:
        """Add the next depth from the rows of `parents` (-1: the root). Returns whether it has nodes to feed."""
        left = self.shape.nodes - len(self.nodes)
        depth = 0 if parents == [-1] else self.nodes[parents[0]].depth + 1
        if left <= 0 or depth >= self.shape.depth:
            self.level = range(len(self.nodes), len(self.nodes))
            return False
        candidates = []
        for parent, row in zip(parents, rows, strict=True):
            base = 1.0 if parent < 0 else self.nodes[parent].score
            ranked = sorted(row.probs, reverse=True)[:self.shape.branches]
            candidates.extend((-base * p, parent, rank) for rank, p in enumerate(ranked) if p > 0)
        counts: dict[int, int] = {}
        for _, parent, _ in sorted(candidates)[:min(self.shape.per_depth, left)]:
            counts[parent] = counts.get(parent, 0) + 1
        start = len(self.nodes)
        sampling = self.seq.sampling
        for parent, row in zip(parents, rows, strict=True):
            m = counts.get(parent, 0)
            if not m:
                continue
            base = 1.0 if parent < 0 else self.nodes[parent].score
            position = self.first + depth
            if sampling.sends_draft_probs:
                children = draw_without_replacement(row, m, sampling.seed, position)
            else:
                children = [(t, p, None) for t, p in zip(row.token_ids[:m], row.probs[:m], strict=False)]
            for token, prob, q in children:
                self.nodes.append(Node(token, parent, depth, base * prob, q))
        self.level = range(start, len(self.nodes))
        return len(self.level) > 0 and depth + 1 < self.shape.depth and len(self.nodes) < self.shape.nodes

    def feed_ids(self) -> list[int]:
        """The tokens of the last depth, fed next."""
        self.fed = self.level.stop
        return [self.nodes[i].token for i in self.level]

    def ancestor_masks(self) -> list[int]:
        return ancestor_masks(n.parent for n in self.nodes)

    def best_path(self) -> list[int]:
        """From the root, the likeliest child at each depth."""
        path: list[int] = []
        parent = -1
        while True:
            children = [i for i, n in enumerate(self.nodes) if n.parent == parent]
            if not children:
                return path
            parent = max(children, key=lambda i: self.nodes[i].score)
            path.append(parent)

    def block(self) -> DraftBlock:
        sampled = not self.seq.sampling.is_greedy
        qs = tuple(n.q for n in self.nodes) if self.seq.sampling.sends_draft_probs else None
        path = tuple(self.best_path())
        return DraftBlock(tuple(n.token for n in self.nodes), qs if sampled else None,
                          parents=tuple(n.parent for n in self.nodes), path=path)


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
    copy to the host: greedy rows their `branches` likeliest tokens (scored by the softmax of the logits);
    one-hot rows those of q; coupled rows the best of q / E with the verifier's noise; sparse rows q's kept
    support, normalised as it is sent."""
    finite = torch.isfinite(logits).all(dim=1)
    params = [s.sampling for s in seqs]
    safe = torch.where(finite.unsqueeze(1), logits, 0.0)
    temperature = torch.tensor([1.0 if p.is_greedy else p.temperature for p in params], device=logits.device)
    top_k = torch.tensor([0 if p.is_greedy else p.top_k for p in params], dtype=torch.int64, device=logits.device)
    top_p = torch.tensor([1.0 if p.is_greedy else p.top_p for p in params], device=logits.device)
    probs = compute_probs(safe, temperature, top_k, top_p)
    top_probs, top_ids = probs.topk(min(q_max_support, probs.shape[1]), dim=1)
    host = torch.cat([finite.double().unsqueeze(1), top_probs.double(), top_ids.double()], dim=1).cpu()
    width = top_probs.shape[1]
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
            order = (q / noise).argsort(descending=True)[:branches]
            rows.append(RowChoices(ids[order].tolist(), q[order].tolist()))
        else:
            rows.append(RowChoices(ids[:branches].tolist(), (p[:branches] / p.sum()).tolist()))
    return rows
