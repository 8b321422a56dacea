"""Several runs of one bench pooled (bench/capacity.py --pool, bench/external_clients.py --pool): a ratio per run
and cell of the table (a level, a client's level), summarised over the runs as its mean, median and lowest (and
which run), and how many runs reached a goal. A goal set per run ("0.95x at every level in one run") is met or
missed partly at random where a cell's mean sits near it: these say how near."""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Hashable
from pathlib import Path


def run_labels(paths: list[Path]) -> list[str]:
    """Each run's label: its file's stem less the prefix all the stems share, cut at a "-" (whole words of the
    names; the stem where that leaves nothing, or where there is one file). Where two labels would be the same
    (summary.json under two --out folders) each is its path as given."""
    stems = [p.stem for p in paths]
    cut = os.path.commonprefix(stems).rfind("-") + 1 if len(stems) > 1 else 0
    labels = [s[cut:] or s for s in stems]
    return labels if len(set(labels)) == len(labels) else [str(p) for p in paths]


def load_runs(paths: list[Path], row_keys: tuple[str, ...]) -> list[tuple[str, dict]]:
    """(label, run) for each file, in the order given; ValueError naming a file that cannot be read or is not a
    run's JSON of this bench: a {"title", "rows": [...]} object whose every row has `row_keys` (a bench's extracted
    steps are not, nor is the other bench's run)."""
    runs = []
    for label, path in zip(run_labels(paths), paths, strict=True):
        try:
            run = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"{path}: {err}") from err
        if not isinstance(run, dict) or not isinstance(run.get("rows"), list):
            raise ValueError(f"{path}: not a run's JSON (no list of rows)")
        if not all(isinstance(row, dict) and all(key in row for key in row_keys) for row in run["rows"]):
            raise ValueError(f"{path}: not this bench's run (a row without {', '.join(row_keys)})")
        runs.append((label, run))
    return runs


def positive(value: object) -> bool:
    """A figure that measured something: a number above 0 (not None, 0, a negative or NaN)."""
    return isinstance(value, int | float) and value > 0


def summary_cells(got: list[tuple[float, str]], goal: float) -> str:
    """A cell's ratios over the runs ((ratio, run label)) as table cells: runs, mean, median, lowest (run), runs
    at `goal` or more (by the ratio itself: 0.9496 is a miss, though it prints as 0.950)."""
    values = [v for v, _ in got]
    low, label = min(got)
    return (f"{len(got)} | {statistics.fmean(values):.3f}x | {statistics.median(values):.3f}x | {low:.3f}x ({label}) "
            f"| {sum(v >= goal for v in values)} of {len(got)}")


def summary_line(got: list[tuple[float, str]], goal: float) -> str:
    """The same in words, to two places: mean, lowest (run), runs at `goal` or more."""
    values = [v for v, _ in got]
    low, label = min(got)
    return (f"mean {statistics.fmean(values):.2f}x, lowest {low:.2f}x ({label}), {sum(v >= goal for v in values)} of "
            f"{len(got)} runs at {goal:g}x or more")


def everywhere_line(ratios: list[tuple[str, dict[Hashable, float]]], goal: float, cells_named: str) -> str:
    """Which runs reached `goal` in every cell any run has (`cells_named`: those cells in words), of the runs that
    measured every one; the others (a run cut short, a failed cell, a run of fewer cells) are named as not counted,
    and a run that measured nothing at all as such. "" for no runs."""
    cells = set().union(*(r for _, r in ratios)) if ratios else set()
    if not cells:
        return ""
    whole = [(label, r) for label, r in ratios if cells <= set(r)]
    met = [label for label, r in whole if all(r[c] >= goal for c in cells)]
    text = (f"{cells_named} at {goal:g}x or more: {len(met)} of {len(whole)} runs that measured them all"
            + (f" ({', '.join(met)})" if met else ""))
    partial = [label for label, r in ratios if r and not cells <= set(r)]
    empty = [label for label, r in ratios if not r]
    text += f"; not counted there, measured in part: {', '.join(partial)}" if partial else ""
    text += f"; nothing measured: {', '.join(empty)}" if empty else ""
    return text
