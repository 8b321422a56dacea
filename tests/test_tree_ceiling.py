"""bench/tree_ceiling.py's replay of rounds over a known continuation (the draft's rank of each true token)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent / "bench"))  # last: bench/kernels.py must not shadow

from tree_ceiling import chain_rounds, lookup_tree_rounds, oracle_tree_rounds  # noqa: E402


def test_a_draft_that_is_always_right_takes_n_plus_one_tokens_a_round_either_way():
    ranks = [0] * 34
    assert chain_rounds(ranks, 16) == 2 and oracle_tree_rounds(ranks, 16, 2) == 2
    assert chain_rounds(ranks, 4) == 7  # 5 tokens a round, the last round short


def test_a_chain_stops_at_the_first_wrong_guess_and_a_tree_goes_on_through_a_second_choice():
    ranks = [0, 0, 1, 0, 0, 0]
    # chain: 2 drafts + the target's token (3), then 3 drafts past the end: 2 rounds
    assert chain_rounds(ranks, 16) == 2
    # the tree holds the second choice (and its first-ranked sibling): the whole continuation in one round
    assert oracle_tree_rounds(ranks, 16, 2) == 1
    # with one branch a tree is the chain
    assert oracle_tree_rounds(ranks, 16, 1) == chain_rounds(ranks, 16)


def test_the_oracle_pays_for_the_siblings_ranked_above_the_true_token():
    # every true token is the draft's second choice: 2 nodes a depth, so 4 nodes reach depth 2
    ranks = [1] * 9
    assert oracle_tree_rounds(ranks, 4, 2) == 3  # 2 accepted + 1 a round
    assert oracle_tree_rounds([1, 1, 0], 3, 2) == 2  # the second depth's 2 nodes do not fit beside the first's
    assert chain_rounds(ranks, 4) == 9  # the chain never gets a draft accepted
    # a third choice is out of reach of two branches, in reach of three (3 nodes for its depth)
    assert oracle_tree_rounds([2, 0, 0], 4, 2) == 2
    assert oracle_tree_rounds([2, 0, 0], 4, 3) == 1


def test_a_lookup_branch_takes_over_where_the_chain_is_wrong_and_costs_the_chain_its_nodes():
    # the context ends "... 5 6" and "5 6 7 8 9" came earlier: lookup proposes 7 8 9 (at most 3)
    prompt, continuation = [5, 6, 7, 8, 9, 1, 5, 6], [7, 8, 9, 2, 2, 2]
    # the draft's argmax is wrong at the first token: the chain's first round takes only the target's token, the
    # branch's its 3 and the target's next
    ranks = [1, 0, 0, 0, 0, 0]
    assert chain_rounds(ranks, 4) == 2
    assert lookup_tree_rounds(prompt, continuation, ranks, 4, 3) == 2  # 4 tokens, then the last 2 in one round
    assert lookup_tree_rounds(prompt, continuation, ranks, 4, 0) == chain_rounds(ranks, 4)  # no branch: the chain
    # a wrong branch costs the chain its depth: 3 nodes of 4 go to it, one is left to the chain (2 tokens), and
    # later contexts find no earlier occurrence (5 tokens, then the last 3)
    wrong = list(range(30, 40))
    assert lookup_tree_rounds(prompt, wrong, [0] * 10, 4, 3) == 3
    assert chain_rounds([0] * 10, 4) == 2
