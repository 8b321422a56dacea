"""Compile every Triton kernel ahead of time for gfx942 (MI300X), gfx90a (MI250X) and sm_90 (H100/H200) on this
CPU-only machine and print the compilers' resource table (kernels/aot.py). Usage: python bench/kernels_compile.py"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.aot import compile_all, format_table  # noqa: E402


def main() -> int:
    t0 = time.perf_counter()
    reports = compile_all()
    print(format_table(reports))
    print(f"\n{len(reports)} compilations in {time.perf_counter() - t0:.1f}s; "
          f"failed: {sum(not r.ok for r in reports)}; with spills: {sum(r.spills > 0 or r.scratch_bytes > 0 for r in reports)}")
    for r in reports:
        if not r.ok:
            print(f"{r.kernel} on {r.target}: {r.error}")
    return 0 if all(r.ok for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
