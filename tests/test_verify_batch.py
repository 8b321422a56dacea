"""verify_batch: a verification whose target logits are not all finite fails alone, whichever the non-finite
value; the others get their verdicts."""

from __future__ import annotations

import math

import pytest
import torch

from common.sampling import SamplingParams
from verifier_service.types import ProposeCmd
from verifier_service.verification import verify_batch

VOCAB = 50


def _items(num_drafts: list[int]):
    return [(SamplingParams(temperature=0.0, seed=i, max_tokens=16), ProposeCmd(i, 10, tuple(range(3, 3 + k)), None))
            for i, k in enumerate(num_drafts)]


def _logits(num_drafts: list[int], favourite: int = 3) -> torch.Tensor:
    logits = torch.zeros(sum(num_drafts) + len(num_drafts), VOCAB)
    logits[:, favourite] = 5.0
    return logits


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_row_fails_only_its_own_item(value: float) -> None:
    num_drafts = [2, 3, 0]
    logits = _logits(num_drafts)
    logits[3 + 2, 7] = value  # item 1's third row (items' rows: 0-2, 3-6, 7)
    verified = verify_batch(logits, _items(num_drafts))
    assert verified[1] is None
    assert verified[0] is not None and verified[0].token_ids == [3, 3]  # drafts 3, 4: 3 accepted, 4 not
    assert verified[2] is not None and verified[2].token_ids == [3]


def test_finite_logits_give_every_item_a_verdict() -> None:
    num_drafts = [2, 3, 0]
    logits = _logits(num_drafts, favourite=4) * 1e30  # large, finite
    verified = verify_batch(logits, _items(num_drafts))
    assert [v.token_ids for v in verified] == [[4], [4], [4]]  # each rejects its first draft (3) for 4
