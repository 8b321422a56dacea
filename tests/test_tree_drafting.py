"""The draft's tree growth (draft_service.tree_drafting): the shape limits, node numbering, best path, and the
sparse children's draws: each child distributed as the q sent with it."""

from __future__ import annotations

import math

import torch

from common.sampling import SamplingParams, WireMode
from common.token_tree import tree_depths
from draft_service.sequence import DraftSequence
from draft_service.tree_drafting import RowChoices, TreeGrowth, TreeShape, draw_without_replacement


def _seq(mode: WireMode | None, seed: int = 1) -> DraftSequence:
    temperature = 0.0 if mode is None else 1.0
    return DraftSequence(SamplingParams(temperature=temperature, seed=seed, wire_mode=mode), [1, 2, 3])


def _rows(n: int, gen: torch.Generator) -> list[RowChoices]:
    rows = []
    for _ in range(n):
        p = torch.rand(6, generator=gen, dtype=torch.float64).pow(2)
        p = (p / p.sum()).sort(descending=True).values
        rows.append(RowChoices(list(range(10, 16)), p.tolist()))
    return rows


def _grow(growth: TreeGrowth, gen: torch.Generator):
    more = growth.grow(_rows(1, gen))
    while more:
        feed = growth.feed()
        assert list(feed.slots) == [growth.nodes[i].slot for i in growth.fed]  # fed in slot order, contiguous
        more = growth.grow(_rows(len(growth.fed), gen))
    return growth.block()


def test_growth_keeps_the_shape_and_numbers_nodes_depth_by_depth():
    gen = torch.Generator().manual_seed(0)
    for mode in (None, WireMode.ONE_HOT, WireMode.COUPLED, WireMode.SPARSE):
        for shape in (TreeShape(4, 2, 8), TreeShape(4, 3, 16), TreeShape(16, 2, 16), TreeShape(3, 4, 5),
                      TreeShape(16, 16, 64)):
            growth = TreeGrowth(_seq(mode), shape, first=3)
            block, path = _grow(growth, gen)
            depths = tree_depths(block.parents)
            assert 0 < block.num_draft_tokens <= shape.nodes
            assert max(depths) < shape.depth
            assert depths == sorted(depths)  # depth by depth
            for i, parent in enumerate(block.parents):
                assert parent < i and (parent < 0 or depths[parent] == depths[i] - 1)
            children = [sum(1 for p in block.parents if p == q) for q in range(-1, block.num_draft_tokens)]
            assert max(children) <= shape.branches
            assert [block.parents[i] for i in block.path] == [-1, *block.path[:-1]]
            assert [block.token_ids[i] for i in block.path] == [growth.nodes[n].token for n in path]
            # a fed node's ancestors were fed before it: the path's fed nodes come first
            fed = [growth.nodes[n].slot >= 0 for n in path]
            assert fed == sorted(fed, reverse=True)
            slots = sorted(n.slot for n in growth.nodes if n.slot >= 0)
            assert slots == list(range(len(slots))) and len(slots) <= shape.max_fed <= 64
            assert (block.draft_probs is not None) == (mode is WireMode.SPARSE)


def test_a_confident_greedy_draft_spends_its_nodes_deep():
    """EAGLE-2's rerank: one likely token per position makes a deep chain-like tree; an unsure one branches."""
    growth = TreeGrowth(_seq(None), TreeShape(16, 2, 16), first=0)
    more = growth.grow([RowChoices([7, 8], [0.95, 0.02])])
    while more:
        growth.feed()
        more = growth.grow([RowChoices([5, 6], [0.95, 0.02]) for _ in growth.fed])
    block, _ = growth.block()
    assert max(tree_depths(block.parents)) >= 12
    assert len(block.path) >= 12


def test_the_best_path_follows_the_likeliest_child():
    growth = TreeGrowth(_seq(None), TreeShape(3, 2, 6), first=0)
    growth.grow([RowChoices([7, 8], [0.6, 0.3])])
    growth.feed()
    growth.grow([RowChoices([1, 2], [0.5, 0.4]), RowChoices([3, 4], [0.9, 0.1])])
    block, _ = growth.block()
    # 0.6 * 0.5 = 0.30 under 7 against 0.3 * 0.9 = 0.27 under 8: the path is 7, 1
    assert [block.token_ids[i] for i in block.path] == [7, 1]


def test_sparse_children_are_distributed_as_the_q_sent_with_them():
    """Over many seeds: the first child ~ q, the second ~ the q sent with it, whose entries are q less the first
    child, renormalised (so its marginal is sum_x q(x) q(v) / (1 - q(x)))."""
    q = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05], dtype=torch.float64)
    row = RowChoices([20, 21, 22, 23, 24], q.tolist())
    n = 5000
    first, second = torch.zeros(5), torch.zeros(5)
    for seed in range(n):
        children = draw_without_replacement(row, 2, seed, position=7)
        (x1, p1, q1), (x2, _, q2) = children
        assert p1 == float(q[x1 - 20]) and q1.token_ids == tuple(row.token_ids)
        assert x2 != x1 and x1 not in q2.token_ids
        assert math.isclose(sum(q2.probs), 1.0, rel_tol=1e-6)
        expected_q2 = q.clone()
        expected_q2[x1 - 20] = 0
        expected_q2 /= expected_q2.sum()
        assert torch.allclose(torch.tensor(q2.probs, dtype=torch.float64), expected_q2[expected_q2 > 0], atol=1e-7)
        first[x1 - 20] += 1
        second[x2 - 20] += 1
    marginal2 = torch.stack([q[x] * q / (1 - q[x]) for x in range(5)]).sum(0)
    for v in range(5):
        marginal2[v] -= q[v] * q[v] / (1 - q[v])  # the second child is never the first
    bound = 4 * math.sqrt(0.25 / n)
    assert (first / n - q.float()).abs().max() < bound
    assert (second / n - marginal2.float()).abs().max() < bound
