"""What the services of a running stack used over a level: each process's CPU seconds and what the draft's model
computed (its token positions by kind), read before and after the level (bench/capacity.py,
bench/external_clients.py). On a host the services share with each other, and with the benchmark client, the
CPU one service spends is time the verifier's forward may not get."""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specwire.launch import scrape_samples  # noqa: E402

DRAFT_ROW_KINDS = ("prompt", "catch_up", "round", "draft")  # draft_model.RowCounts' fields


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of the process so far, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def draft_rows(url: str) -> dict[str, float]:
    """specwire_draft_model_rows_total per `kind/when` that the draft has counted (an older draft: none)."""
    return {f"{labels['kind']}/{labels['when']}": value
            for labels, value in scrape_samples(url, "specwire_draft_model_rows_total")
            if labels.get("kind") in DRAFT_ROW_KINDS and labels.get("when") in ("drafting", "warming")}


def rows_between(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The rows counted between two draft_rows() readings, kinds that did not move left out."""
    return {key: after[key] - before.get(key, 0.0) for key in sorted(after) if after[key] - before.get(key, 0.0)}


def summed(first: dict[str, float], second: dict[str, float]) -> dict[str, float]:
    """Two runs' counters (draft rows, CPU seconds) as one: each key's sum, keys in order."""
    return {key: first.get(key, 0.0) + second.get(key, 0.0) for key in sorted({*first, *second})}


def rows_cell(rows: dict[str, float] | None) -> str:
    """A level's draft rows as prompt / catch-up / round / draft, warming's share after a +."""
    rows = rows or {}
    cells = []
    for kind in DRAFT_ROW_KINDS:
        drafting, warming = rows.get(f"{kind}/drafting", 0.0), rows.get(f"{kind}/warming", 0.0)
        cells.append(f"{drafting:.0f}" + (f"+{warming:.0f}" if warming else ""))
    return " / ".join(cells)


def children_cpu_seconds() -> float:
    """User and system CPU seconds of this process's children that ended and were waited for, theirs that they
    waited for included (a client run to its end: the services, still running, are not in it)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime
