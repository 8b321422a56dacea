"""bench/contention.py's window order and its estimator (the bench itself needs the models and 2 cores)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parent.parent / "bench"))  # last: bench/kernels.py must not shadow kernels/

from contention import paired_ratios, schedule  # noqa: E402


def test_schedule_pairs_abc_with_cba() -> None:
    assert schedule(2) == ["idle", "python", "draft", "draft", "python", "idle"]
    order = schedule(4)
    assert order[6:] == order[:6]
    # a drift linear over a pair of rounds falls on every condition alike: the same mean position
    for pair in (order[:6], order[6:]):
        means = {kind: sum(i for i, k in enumerate(pair) if k == kind) / 2 for kind in set(pair)}
        assert len(set(means.values())) == 1


@pytest.mark.parametrize("rounds", [0, 1, 3])
def test_schedule_refuses_rounds_that_do_not_pair(rounds: int) -> None:
    with pytest.raises(ValueError, match="even"):
        schedule(rounds)


def test_paired_ratios_cancel_a_linear_drift() -> None:
    # steps slow by 10 ms a window; the draft neighbour adds 50 ms, the Python loop nothing
    order = schedule(4)
    windows: dict[str, list[float]] = {"idle": [], "python": [], "draft": []}
    for i, kind in enumerate(order):
        windows[kind].append(1.0 + 0.01 * i + (0.05 if kind == "draft" else 0.0))
    python = paired_ratios(windows, "python")
    draft = paired_ratios(windows, "draft")
    assert python == pytest.approx([1.0, 1.0])
    first_idle = (windows["idle"][0] + windows["idle"][1]) / 2
    assert draft[0] == pytest.approx(1 + 0.05 / first_idle)
    assert draft[1] == pytest.approx(1 + 0.1 / (windows["idle"][2] + windows["idle"][3]))


def test_paired_ratios_refuse_unpaired_windows() -> None:
    with pytest.raises(ValueError):
        paired_ratios({"idle": [1.0, 1.0, 1.0], "draft": [1.0, 1.0, 1.0]}, "draft")
    with pytest.raises(ValueError):
        paired_ratios({"idle": [1.0, 1.0], "draft": [1.0, 1.0, 1.0, 1.0]}, "draft")
