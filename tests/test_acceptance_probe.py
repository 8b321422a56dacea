"""bench/acceptance_probe.py's replay of best-first greedy trees and its AUC (the models are not loaded here)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent / "bench"))  # last: bench/kernels.py must not shadow

from acceptance_probe import auc, oracle_scores, paired_interval, tree_rounds  # noqa: E402
from tree_ceiling import chain_rounds, oracle_tree_rounds  # noqa: E402


def test_a_tree_whose_second_children_score_nothing_is_the_chain():
    labels = [0, 0, 1, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 1, 0]
    ranks = [0 if v == 0 else 1 for v in labels]
    for n in (2, 4, 8, 16):
        assert tree_rounds(labels, [0.9] * len(labels), [0.0] * len(labels), n, n, off=(0.9, 0.0)) == \
            chain_rounds(ranks, n)


def test_the_oracle_head_takes_at_least_what_the_ceiling_does_where_the_true_token_is_first_or_second():
    labels = [0, 0, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0]
    for n in (4, 8, 16):
        # the replay's tree may hold a second child without its first sibling; the ceiling pays for that sibling
        assert tree_rounds(labels, *oracle_scores(labels), n, n) <= oracle_tree_rounds(labels, n, 2)
    assert tree_rounds(labels, *oracle_scores(labels), 16, 16) == 1  # 16 accepted + the verifier's token: all 17
    assert tree_rounds(labels, *oracle_scores(labels), 8, 8) == 2 < chain_rounds([min(v, 1) for v in labels], 8)


def test_a_branch_pays_off_where_the_scores_put_it_at_the_misses_and_not_elsewhere():
    # every fifth target token is the draft's second choice
    labels = [0, 0, 0, 0, 1] * 4
    misses = {i for i, v in enumerate(labels) if v == 1}

    def unsure_at(positions: set[int]) -> tuple[list[float], list[float]]:
        return ([0.5 if i in positions else 0.99 for i in range(len(labels))],
                [0.45 if i in positions else 0.005 for i in range(len(labels))])

    chain = chain_rounds([min(v, 1) for v in labels], 8)
    assert chain == 4
    assert tree_rounds(labels, *unsure_at(misses), 8, 8) == 3
    assert tree_rounds(labels, *unsure_at({i - 2 for i in misses}), 8, 8) == chain  # unsure where it is right


def test_a_tree_goes_no_deeper_than_its_depth_whatever_nodes_are_left():
    labels = [0] * 12
    sure = ([0.99] * 12, [0.005] * 12)
    assert tree_rounds(labels, *sure, 8, 4) == 3  # 4 accepted + 1 a round
    assert tree_rounds(labels, *sure, 8, 8) == 2


def test_auc_counts_ties_half_and_orders_by_score():
    assert auc([0.9, 0.8, 0.1], [True, True, False]) == 1.0
    assert auc([0.1, 0.8, 0.9], [True, False, False]) == 0.0
    assert auc([0.5, 0.5], [True, False]) == 0.5
    assert auc([0.9, 0.2, 0.5, 0.4], [True, True, False, False]) == 0.5


def test_the_paired_interval_is_zero_for_the_same_scores_and_above_zero_for_a_better_ranking():
    positive = [True, False, True, True, False, False, True, False] * 3
    # ranks some misses above hits, differently in each group (a resample's AUC depends on the groups it draws)
    baseline = [0.6, 0.7, 0.4, 0.8, 0.5, 0.3, 0.45, 0.55] + [0.9, 0.1, 0.8, 0.7, 0.2, 0.3, 0.4, 0.6] + \
        [0.2, 0.9, 0.3, 0.1, 0.8, 0.7, 0.4, 0.6]
    better = [0.9 if p else 0.1 for p in positive]  # ranks every hit above every miss
    groups = [8, 8, 8]
    assert paired_interval(baseline, baseline, positive, groups, rounds=50) == (0.0, 0.0)
    low, high = paired_interval(better, baseline, positive, groups, rounds=50)
    assert 0.0 < low <= high
    low, high = paired_interval(baseline, better, positive, groups, rounds=50)
    assert low <= high < 0.0
    # no resample with both hits and misses: no interval
    low, high = paired_interval([0.5, 0.6], [0.4, 0.7], [True, True], [1, 1], rounds=10)
    assert low != low and high != high
