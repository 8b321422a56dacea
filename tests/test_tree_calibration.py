"""Tree calibration (draft_service.tree_calibration): which children a verdict labels, the factors it learns, and
how a calibrated tree spends its nodes; the drafter keeps one table per kind and none for sparse trees."""

from __future__ import annotations

import pytest
import torch

from common.block_manager import BlockManager
from common.kv_cache import KVCache
from common.paged_model import PagedCausalLM, kv_cache_spec
from common.sampling import SamplingParams, WireMode
from common.token_tree import tree_depths
from draft_service.draft_model import DraftJob, DraftModel
from draft_service.drafters import ModelDrafter, calibration_kind
from draft_service.sequence import DraftSequence
from draft_service.tree_calibration import (
    IDENTITY,
    MAX_FACTOR,
    MIN_FACTOR,
    PRIOR,
    Calibration,
    TreeCalibration,
    band,
    reached_children,
)
from draft_service.tree_drafting import RowChoices, TreeGrowth, TreeShape
from draft_service.types import DraftBlock

from tiny_models import build_model, model_config

#        root
#       /    \
#   0:a(5)  1:b(6)
#    /   \       \
# 2:c(7) 3:d(8)  4:e(9)
#   |
# 5:f(10)
PARENTS = (-1, -1, 0, 0, 1, 2)
TOKENS = (5, 6, 7, 8, 9, 10)


def test_a_verdict_labels_the_children_of_every_node_it_reached():
    # accepted a then d, then the verifier's token 11 under d (a leaf): the root's and a's children are labelled
    assert reached_children(PARENTS, TOKENS, (5, 8, 11)) == [(0, True), (1, False), (2, False), (3, True)]
    # accepted b, then 12 where e was drafted
    assert reached_children(PARENTS, TOKENS, (6, 12)) == [(0, False), (1, True), (4, False)]
    # nothing accepted
    assert reached_children(PARENTS, TOKENS, (4,)) == [(0, False), (1, False)]
    # the whole path a, c, f and a bonus token: f has no children to label
    assert reached_children(PARENTS, TOKENS, (5, 7, 10, 3)) == [(0, True), (1, False), (2, True), (3, False),
                                                                (5, True)]
    # a verdict cut short (max_tokens): only what it emitted
    assert reached_children(PARENTS, TOKENS, (5,)) == [(0, True), (1, False)]


def test_an_underconfident_draft_is_corrected_and_unobserved_bands_keep_the_raw_probability():
    table = TreeCalibration()
    assert table.current is IDENTITY and table.current.acceptance(0, 0.62) == pytest.approx(0.62)
    # a chain-like tree whose first child always says 0.62 and is always right, its second says 0.2 and is never
    for _ in range(60):
        table.observe((-1, -1, 0, 0), (5, 6, 7, 8), (0, 1, 0, 1), (0.62, 0.2, 0.62, 0.2), (5, 7, 3))
    assert table.current.acceptance(0, 0.62) > 0.95
    assert table.current.acceptance(1, 0.2) == pytest.approx(0.2 * MIN_FACTOR)  # (0 + 4) / (24 + 4), held at 0.25
    assert table.current.acceptance(0, 0.05) == pytest.approx(0.05)  # a band never seen
    assert table.current.acceptance(2, 0.62) == pytest.approx(0.62)  # a rank never seen
    assert table.current.acceptance(0, 0.99) < 1.0  # a child never scores above its parent


def test_old_verdicts_fade():
    """A draft that was right and then goes wrong: the table follows the recent verdicts (without the decay, the
    60 early hits would keep the factor near 0.4)."""
    table = TreeCalibration()
    for _ in range(60):
        table.observe((-1,), (5,), (0,), (0.62,), (5, 1))
    for _ in range(200):
        table.observe((-1,), (5,), (0,), (0.62,), (6,))
    assert table.current.acceptance(0, 0.62) == pytest.approx(0.62 * MIN_FACTOR)  # 0.62 * 0.117, held at the floor
    table = TreeCalibration()
    for _ in range(60):
        table.observe((-1,), (5,), (0,), (0.62,), (5, 1))
    for _ in range(40):
        table.observe((-1,), (5,), (0,), (0.62,), (6,))
    # with DECAY 0.98: 15.6 hits against 26.9 expected, a factor of 0.64 (without the decay 64 / 66 = 0.97)
    assert 0.5 < table.current.acceptance(0, 0.62) / 0.62 < 0.8


def test_no_traffic_moves_a_score_past_the_factors_bounds():
    table = TreeCalibration()
    for _ in range(100):  # the draft's second choice at 0.05 is always the target's
        table.observe((-1, -1), (5, 6), (0, 1), (0.9, 0.05), (6,))
    assert table.current.acceptance(1, 0.05) == pytest.approx(0.05 * MAX_FACTOR)
    assert table.current.acceptance(0, 0.9) == pytest.approx(0.9 * MIN_FACTOR)


def test_the_prior_weighs_a_few_verdicts_lightly():
    table = TreeCalibration()
    table.observe((-1,), (5,), (0,), (0.5,), (5, 1))  # one hit at 0.5
    factor = table.current.factors[0][band(0.5)]
    assert factor == pytest.approx((1 + PRIOR) / (0.5 + PRIOR))


def _grow(calibration) -> DraftBlock:
    """A draft that says 0.6 for its first choice and 0.3 for its second, everywhere."""
    growth = TreeGrowth(DraftSequence(SamplingParams(temperature=0.0), [1, 2, 3]), TreeShape(16, 2, 16), first=3,
                        calibration=calibration)
    more = growth.grow([RowChoices([7, 8], [0.6, 0.3])])
    while more:
        growth.feed()
        more = growth.grow([RowChoices([7, 8], [0.6, 0.3]) for _ in growth.fed])
    return growth.block()[0]


def test_a_calibrated_tree_goes_as_deep_as_the_acceptance_seen():
    raw = _grow(IDENTITY)
    table = TreeCalibration()
    for _ in range(60):  # the first choice is always accepted, the second never
        table.observe((-1, -1, 0, 0), (7, 8, 7, 8), (0, 1, 0, 1), (0.6, 0.3, 0.6, 0.3), (7, 7, 7))
    calibrated = _grow(table.current)
    assert max(tree_depths(raw.parents)) + 1 <= 6  # 0.6 per level: alternatives near the root win
    assert max(tree_depths(calibrated.parents)) + 1 >= 12  # about 0.98 per level: the tree is a long path
    assert calibrated.node_probs[0] == pytest.approx(0.6)  # what the block carries is the draft's own probability
    assert calibrated.node_ranks == tuple(0 if t == 7 else 1 for t in calibrated.token_ids)


class _Batcher:
    pass


def test_the_drafter_keeps_a_table_for_greedy_and_coupled_trees_only():
    """One-hot and sparse output depends on the tree: a seeded request must not depend on other traffic."""
    drafter = ModelDrafter(_Batcher(), tree=TreeShape(4, 2, 8))
    greedy = DraftSequence(SamplingParams(temperature=0.0), [1])
    sparse = DraftSequence(SamplingParams(temperature=1.0, seed=1, wire_mode=WireMode.SPARSE), [1])
    one_hot = DraftSequence(SamplingParams(temperature=1.0, seed=1, wire_mode=WireMode.ONE_HOT), [1])
    coupled = DraftSequence(SamplingParams(temperature=1.0, seed=1, wire_mode=WireMode.COUPLED), [1])
    block = DraftBlock((5, 6), None, parents=(-1, -1), node_ranks=(0, 1), node_probs=(0.5, 0.4))
    for seq in (greedy, sparse, one_hot, coupled):
        drafter.observe(seq, block, (5, 9))
    assert sorted(drafter.calibrations) == ["coupled", "greedy"]
    assert calibration_kind(sparse.sampling) is None and calibration_kind(one_hot.sampling) is None
    assert drafter._job(greedy, 4).calibration is drafter.calibrations["greedy"].current
    assert drafter._job(sparse, 4).calibration is IDENTITY and drafter._job(one_hot, 4).calibration is IDENTITY
    assert drafter._job(greedy, 1).tree is None  # a chain: nothing to calibrate
    off = ModelDrafter(_Batcher(), tree=TreeShape(4, 2, 8), calibrate=False)
    off.observe(greedy, block, (5, 9))
    assert off.calibrations is None and off._job(greedy, 4).calibration is IDENTITY


def test_the_draft_model_grows_its_trees_with_the_jobs_calibration():
    """Through DraftModel.draft: the same sequence drafts a deeper tree when its job says first choices are accepted
    and second ones are not."""
    model = build_model(model_config("qwen2", 64, eos_token_id=None, hidden=32), seed=3, dtype=torch.float64)
    runner = PagedCausalLM(model, KVCache(kv_cache_spec(model), 256, 4), pack_weights=False)
    sure = Calibration(((MAX_FACTOR,) * 11, (MIN_FACTOR,) * 11, (MIN_FACTOR,) * 11))
    depths = {}
    for name, calibration in (("raw", IDENTITY), ("sure", sure)):
        draft = DraftModel(runner, BlockManager(256, 4), q_max_support=8)
        seq = DraftSequence(SamplingParams(temperature=0.0), [3, 9, 4, 17, 5])
        [drafted] = draft.draft([DraftJob(seq, 16, tree=TreeShape(16, 2, 16), calibration=calibration)])
        depths[name] = drafted.block.num_positions
    assert depths["sure"] > depths["raw"], depths
