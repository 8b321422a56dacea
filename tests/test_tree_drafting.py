"""The draft's tree growth (draft_service.tree_drafting): the shape limits, node numbering, best path, and the
sparse children's draws: each child distributed as the q sent with it."""

from __future__ import annotations

import math

import pytest
import torch

from common.sampling import SamplingParams, WireMode
from common.token_tree import tree_depths
from draft_service.drafters import ModelDrafter
from draft_service.draw_acceptance import DrawAcceptance, DrawRecord
from draft_service.sequence import DraftSequence
from draft_service.tree_drafting import (
    RowChoices,
    TreeGrowth,
    TreeShape,
    draw_without_replacement,
    forecast_allotment,
)
from draft_service.types import DraftBlock


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
            assert len(block.alternatives) == len(block.path)
            for j, guesses in enumerate(block.alternatives):
                parent = block.path[j - 1] if j else -1
                children = {block.token_ids[i] for i, p in enumerate(block.parents) if p == parent}
                row = growth.rows[path[j - 1] if j else -1]
                assert guesses == tuple(t for t in row if t not in children)[:2], (mode, shape, j)


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


def test_the_guesses_at_each_position_of_the_path_are_the_best_tokens_outside_the_trees_children():
    """Pipelining's guesses of the verifier's token where the best path loses: never a child of the tree there
    (the verifier would have descended to it), the row's best others, in order."""
    growth = TreeGrowth(_seq(None), TreeShape(3, 2, 6), first=0)
    growth.grow([RowChoices([7, 8, 9, 10], [0.6, 0.3, 0.05, 0.03])])
    growth.feed()
    growth.grow([RowChoices([1, 2, 11, 12], [0.5, 0.4, 0.05, 0.01]), RowChoices([3, 4, 13, 14], [0.9, 0.1, 0.0, 0.0])])
    block, _ = growth.block()
    assert [block.token_ids[i] for i in block.path] == [7, 1]
    assert block.alternatives == ((9, 10), (11, 12))
    # 3 nodes: 7 keeps one child, so its row's second best is a guess
    small = TreeGrowth(_seq(None), TreeShape(3, 2, 3), first=0)
    small.grow([RowChoices([7, 8, 9, 10], [0.6, 0.3, 0.05, 0.03])])
    small.feed()
    small.grow([RowChoices([1, 2, 11, 12], [0.5, 0.4, 0.05, 0.01]), RowChoices([3, 4, 13, 14], [0.9, 0.1, 0, 0])])
    block, _ = small.block()
    assert [block.token_ids[i] for i in block.path] == [7, 1] and block.num_draft_tokens == 3
    assert block.alternatives == ((9, 10), (2, 11))


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


def _sparse_tree(first_row: RowChoices, row_of, shape: TreeShape, draws: DrawAcceptance, seed: int = 3):
    growth = TreeGrowth(_seq(WireMode.SPARSE, seed), shape, first=0, draws=draws)
    more = growth.grow([first_row])
    while more:
        growth.feed()
        more = growth.grow([row_of(growth.nodes[i]) for i in growth.fed])
    return growth.block()[0]


ACCEPTED = DrawAcceptance(first_tried=40.0, first_accepted=39.0)  # a = 0.95
REJECTED = DrawAcceptance(first_tried=40.0, first_accepted=12.0, later_tried=20.0, later_accepted=10.0)  # 0.3, 0.5


def test_a_sparse_tree_spends_its_nodes_deep_when_its_first_draws_are_accepted_and_wide_when_not():
    """A sparse tree's counts are allotted before its draws, from the sequence's record of which draws were
    accepted and a forecast of the depths below: a sequence whose first draws are accepted makes a chain of all N
    nodes, as deep as a chain of N (a fixed two per depth made it half as deep); one whose first draws are often
    rejected draws second children near the root, however sure q is."""
    row = RowChoices([5, 6, 7], [0.5, 0.3, 0.2])
    block = _sparse_tree(row, lambda node: row, TreeShape(16, 2, 16), ACCEPTED)
    assert block.num_draft_tokens == 16 and max(tree_depths(block.parents)) == 15
    sure = RowChoices([5, 6, 7], [0.95, 0.03, 0.02])
    block = _sparse_tree(sure, lambda node: sure, TreeShape(16, 2, 16), REJECTED)
    depths = tree_depths(block.parents)
    assert block.num_draft_tokens == 16 and depths.count(0) == 2 and max(depths) < 8


def test_sparse_counts_do_not_depend_on_the_draws():
    """Other seeds draw other tokens into the same shape: how many children a node gets is fixed before they are
    drawn."""
    row = RowChoices([5, 6, 7, 8], [0.5, 0.3, 0.15, 0.05])
    shapes, tokens = set(), set()
    for seed in range(8):
        block = _sparse_tree(row, lambda node: row, TreeShape(6, 3, 10), DrawAcceptance(), seed=seed)
        shapes.add(block.parents)
        tokens.add(block.token_ids)
    assert len(shapes) == 1 and len(tokens) > 1


def test_the_forecast_allotment():
    # budget 3 for 3 depths, main line 0.9 a step: the chain (one now) beats a sibling of 0.05
    assert forecast_allotment([0.9, 0.05], [0.9, 0.05], 3, 3) == 1
    # a sibling of 0.45 beats the third main-line node (0.9 * 0.5 * 0.5 = 0.225)
    assert forecast_allotment([0.9, 0.45], [0.5, 0.45], 3, 3) == 2
    # the last depth: everything that fits is drawn now
    assert forecast_allotment([0.5, 0.3, 0.2], [0.5, 0.3], 2, 1) == 2
    assert forecast_allotment([], [0.5], 4, 3) == 0


def test_the_record_of_draws_counts_what_the_verifier_tried():
    # root: children 0, 1; node 0: children 2, 3; node 3: child 4
    parents, tokens = [-1, -1, 0, 0, 3], [10, 11, 12, 13, 14]
    # the root's first child accepted, node 0's second, node 3's child rejected (the correction 99)
    counts = DrawAcceptance().observe(parents, tokens, [10, 13, 99])
    assert (counts.first_tried, counts.first_accepted, counts.later_tried, counts.later_accepted) == (3, 1, 1, 1)
    # every child of the root rejected: both were tried
    counts = DrawAcceptance().observe(parents, tokens, [98])
    assert (counts.first_tried, counts.first_accepted, counts.later_tried, counts.later_accepted) == (1, 0, 1, 0)
    # a node whose children all got accepted down to a leaf: the bonus token tries nothing
    counts = DrawAcceptance().observe([-1, 0], [10, 12], [10, 12, 50])
    assert (counts.first_tried, counts.first_accepted, counts.later_tried) == (2, 2, 0)
    profile = DrawAcceptance(first_tried=8.0, first_accepted=8.0, later_tried=8.0, later_accepted=0.0).profile(3)
    a, b = (8 + 2 * 0.85) / 10, 0.6 / 10
    assert profile == pytest.approx([a, (1 - a) * b, (1 - a) * (1 - b) * b])
    # first draws mostly rejected, later ones often accepted: a second draw never scores above the first, which is
    # always drawn before it
    low = DrawAcceptance(first_tried=40.0, first_accepted=2.0, later_tried=20.0, later_accepted=10.0).profile(3)
    assert low == sorted(low, reverse=True) and low[0] == pytest.approx(low[1])


def test_a_round_is_shaped_by_every_verdict_but_the_last_one_before_it():
    """What a pipelined branch knows when it drafts (the verdicts before the one in flight) is what a round drafted
    after that verdict reads: a seeded tree is the same either way."""
    record = DrawRecord()
    record.observe([-1, -1], [10, 11], [11, 5])
    first = record.latest
    record.observe(None, [10, 12], [10, 12, 7])  # a chain: first children
    assert record.before_last == first and record.latest.first_tried > first.first_tried


def test_the_drafter_gives_a_round_after_a_verdict_and_a_pipelined_branch_the_same_record():
    drafter = ModelDrafter(batcher=None, tree=TreeShape(8, 2, 8))
    seq = _seq(WireMode.SPARSE)
    first_job = drafter._job(seq, 8)
    drafter.observe(seq, first_job_block := DraftBlock((10, 11), None, parents=(-1, -1)), (11, 5))
    branch_job = drafter._job(seq.branch([11, 5]), 8)  # drafted while the next round is in flight
    drafter.observe(seq, DraftBlock((12,), None), (12, 6))
    after_job = drafter._job(seq, 8)  # that round's verdict came first
    assert first_job.draws == DrawAcceptance()
    assert branch_job.draws == after_job.draws == DrawAcceptance().observe(first_job_block.parents,
                                                                            first_job_block.token_ids, (11, 5))


def test_greedy_and_coupled_rows_hold_the_children_and_the_guesses_past_them():
    """tree_rows: a greedy row's `branches` likeliest tokens (the children) and ALTERNATIVES more (pipelining's
    guesses), best first; a coupled row as many, best of q / E first."""
    from draft_service.draft_sampling import ALTERNATIVES
    from draft_service.tree_drafting import tree_rows
    logits = torch.randn(2, 12, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    greedy, coupled = _seq(None), _seq(WireMode.COUPLED)
    rows = tree_rows(logits, [greedy, coupled], [3, 3], q_max_support=12, branches=2)
    assert rows[0].token_ids == logits[0].topk(2 + ALTERNATIVES).indices.tolist()
    assert len(rows[1].token_ids) == 2 + ALTERNATIVES == len(set(rows[1].token_ids))
