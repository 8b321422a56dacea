"""bench/capacity.py's run order: with --order level every level runs all modes back to back, alternating their
order, so a drift of the host's speed over a 40-minute run does not fall on one mode."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent / "bench"))  # last: bench/kernels.py must not shadow kernels/

from capacity import schedule  # noqa: E402

MODES = ["0", "4", "auto"]
LEVELS = [1, 2, 4, 8]


def test_level_order_runs_each_levels_modes_together_in_alternating_order():
    runs = schedule(MODES, LEVELS, "level")
    assert sorted(runs) == sorted((m, c) for m in MODES for c in LEVELS)  # each pair once
    assert [c for _, c in runs] == [c for c in LEVELS for _ in MODES]  # a level's modes back to back
    assert [m for m, _ in runs[:3]] == MODES
    assert [m for m, _ in runs[3:6]] == MODES[::-1]
    assert [m for m, _ in runs[6:9]] == MODES
    # over two levels each mode's mean position in the level is the same: no mode is always measured last
    positions = {m: [i % 3 for i, (mm, c) in enumerate(runs) if mm == m and c in LEVELS[:2]] for m in MODES}
    assert len({sum(p) for p in positions.values()}) == 1


def test_mode_order_runs_one_modes_levels_after_another():
    assert schedule(MODES, LEVELS, "mode") == [(m, c) for m in MODES for c in LEVELS]
