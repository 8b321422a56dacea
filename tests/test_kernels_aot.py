"""Every kernel compiles ahead of time for AMD gfx942 (MI300X), gfx90a (MI250X) and NVIDIA sm_90 at its serving
configuration, with no spills; tl.dot lowers to MFMA on CDNA. The full table: python bench/kernels_compile.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

TARGETS = ("gfx942", "gfx90a", "sm_90")
# the test process runs Triton's interpreter (conftest.py); compiling needs real @triton.jit functions
_COMPILE = ("import dataclasses, json; from kernels.aot import compile_all; "
            "print(json.dumps([dataclasses.asdict(r) for r in compile_all()]))")


@pytest.fixture(scope="module")
def reports():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return {(r["kernel"], r["target"]): SimpleNamespace(**r) for r in json.loads(out.stdout.splitlines()[-1])}


@pytest.mark.parametrize("target", TARGETS)
def test_every_kernel_compiles_without_spills(reports, target):
    mine = [r for (_, t), r in reports.items() if t == target]
    # 7 kernels at their serving shapes, int32 slots, fp16 twins of attention and KV writes, attention with token
    # trees in both, and the layer shapes beyond Llama's (kernels.aot.ATTENTION_VARIANTS) with MLA's KV write
    from kernels.aot import ATTENTION_VARIANTS

    assert len(mine) == 11 + len(ATTENTION_VARIANTS) + 1
    for r in mine:
        assert r.ok, f"{r.kernel} does not compile for {target}: {r.error}"
        assert r.spills == 0 and r.scratch_bytes == 0, f"{r.kernel} spills on {target}: {r}"
        assert r.registers and r.registers > 0


@pytest.mark.parametrize("target", ["gfx942", "gfx90a"])
def test_attention_uses_mfma_on_cdna(reports, target):
    from kernels.aot import ATTENTION_VARIANTS

    for name in ["bf16", "fp16", "bf16,tree", "fp16,tree", *(f"bf16,{label}" for label in ATTENTION_VARIANTS)]:
        r = reports[(f"paged_attention[{name}]", target)]
        assert r.mfma and r.mfma > 0, f"no v_mfma_* in {r.kernel} for {target}"
        assert r.occupancy and r.occupancy >= 2
