"""Ahead-of-time compilation of every kernel at its serving configurations for AMD CDNA (gfx942 MI300X,
gfx90a MI250X) and NVIDIA Hopper (sm_90), with no GPU: the Triton wheel carries the LLVM AMDGPU backend and
ptxas. Reads the compilers' own resource lines: MFMA count, VGPRs, SGPRs, spills, scratch, LDS and occupancy for
AMD; registers, spill bytes and shared memory (ptxas -v) for NVIDIA."""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.kv_cache_write import write_kv_kernel
from kernels.paged_attention import paged_attention_kernel
from kernels.philox import uniform64_kernel
from kernels.platform import ATTENTION_TILES, VOCAB_BLOCK, attention_warps, elementwise_warps, vocab_warps
from kernels.rejection_sampler import decide_rows_kernel, descend_kernel
from kernels.sampling_probs import sampling_probs_kernel

TARGETS = {
    "gfx942": GPUTarget("hip", "gfx942", 64),
    "gfx90a": GPUTarget("hip", "gfx90a", 64),
    "sm_90": GPUTarget("cuda", 90, 32),
}


@dataclass(frozen=True)
class KernelSpec:
    name: str
    fn: object
    signature: dict[str, str]
    constexprs: dict[str, object]
    uses_dot: bool


@dataclass
class CompileReport:
    kernel: str
    target: str
    ok: bool
    error: str = ""
    mfma: int | None = None  # v_mfma_* instructions (AMD)
    registers: int | None = None  # VGPRs (AMD) or registers per thread (NVIDIA)
    sgprs: int | None = None
    spills: int = 0  # VGPR spills (AMD) or spill-store bytes (NVIDIA): the failure condition
    sgpr_spills: int = 0  # SGPRs spilled into VGPR lanes (AMD; no memory traffic)
    scratch_bytes: int = 0
    lds_bytes: int | None = None  # LDS (AMD) or shared memory (NVIDIA)
    occupancy: int | None = None  # waves per SIMD (AMD)


# head counts and dims of real models: Gemma 2/3 (256, softcap at runtime), gpt-oss (64, sinks), Phi-2 (80),
# Phi-3-mini (96), DeepSeek-V3's MLA as transformers computes it (keys 192 = 128 nope + 64 rope, values 128)
ATTENTION_VARIANTS = {
    "d256 gemma": dict(NUM_HEADS=8, NUM_KV_HEADS=4, HEAD_DIM=256, BLOCK_D=256, HEAD_DIM_V=256, BLOCK_DV=256),
    "d64 sinks gpt-oss": dict(NUM_HEADS=64, NUM_KV_HEADS=8, HEAD_DIM=64, BLOCK_D=64, HEAD_DIM_V=64, BLOCK_DV=64,
                              HAS_SINKS=True),
    "d80": dict(NUM_HEADS=32, NUM_KV_HEADS=32, HEAD_DIM=80, BLOCK_D=128, HEAD_DIM_V=80, BLOCK_DV=128),
    "d96": dict(NUM_HEADS=32, NUM_KV_HEADS=32, HEAD_DIM=96, BLOCK_D=128, HEAD_DIM_V=96, BLOCK_DV=128),
    "k192 v128 MLA": dict(NUM_HEADS=16, NUM_KV_HEADS=16, HEAD_DIM=192, BLOCK_D=256, HEAD_DIM_V=128, BLOCK_DV=128),
}


def serving_specs(rocm: bool) -> list[tuple[KernelSpec, int]]:
    """(spec, num_warps) at serving shapes: 32 heads, 8 KV heads, head_dim 128, 16-token pages."""
    tiles = ATTENTION_TILES
    specs: list[tuple[KernelSpec, int]] = []
    for dt in ("bf16", "fp16"):
        attn_sig = {"out_ptr": f"*{dt}", "q_ptr": f"*{dt}", "k_cache_ptr": f"*{dt}", "v_cache_ptr": f"*{dt}",
                    "block_tables_ptr": "*i32", "query_start_ptr": "*i32", "context_lens_ptr": "*i32",
                    "scale": "fp32", "max_blocks_per_seq": "i32", "sliding_window": "i32", "softcap": "fp32",
                    "sinks_ptr": "*fp32", "tree_starts_ptr": "*i32", "tree_masks_ptr": "*i64", "positions_ptr": "*i64"}
        attn_const = dict(NUM_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_D=128, HEAD_DIM_V=128, BLOCK_DV=128,
                          HAS_SINKS=False, PAGE_SIZE=16, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                          DOT_FP32=False, HAS_TREE=False)
        specs.append((KernelSpec(f"paged_attention[{dt}]", paged_attention_kernel, attn_sig, attn_const, True),
                      tiles.num_warps))
        specs.append((KernelSpec(f"paged_attention[{dt},tree]", paged_attention_kernel, attn_sig,
                                 {**attn_const, "HAS_TREE": True}, True), tiles.num_warps))
        if dt == "bf16":  # the layer shapes of the architectures beyond Llama (softcap and window are runtime)
            for label, shape in ATTENTION_VARIANTS.items():
                const = {**attn_const, **shape}
                specs.append((KernelSpec(f"paged_attention[{dt},{label}]", paged_attention_kernel, attn_sig, const,
                                         True), attention_warps(max(const["BLOCK_D"], const["BLOCK_DV"]), rocm)))
        kv_sig = {"key_ptr": f"*{dt}", "value_ptr": f"*{dt}", "key_cache_ptr": f"*{dt}", "value_cache_ptr": f"*{dt}",
                  "slot_ptr": "*i64"}
        specs.append((KernelSpec(f"write_kv[{dt}]", write_kv_kernel, kv_sig, {"ROW": 1024, "BLOCK": 1024, "ROW_V": 0}, False),
                      elementwise_warps(rocm)))
        if dt == "bf16":  # MLA: a value row of its own size
            specs.append((KernelSpec(f"write_kv[{dt},k192 v128]", write_kv_kernel, kv_sig,
                                     {"ROW": 16 * 192, "BLOCK": 1024, "ROW_V": 16 * 128}, False),
                          elementwise_warps(rocm)))
        if dt == "bf16":  # the static buffers (common.static_forward) carry int32 slots, -1 for padding
            specs.append((KernelSpec(f"write_kv[{dt},i32 slots]", write_kv_kernel, {**kv_sig, "slot_ptr": "*i32"},
                                     {"ROW": 1024, "BLOCK": 1024, "ROW_V": 0}, False), elementwise_warps(rocm)))
    decide_sig = {"choice_ptr": "*i64", "final_ptr": "*i64", "target_probs_ptr": "*fp32", "target_argmax_ptr": "*i64",
                  "draft_token_ids_ptr": "*i64", "draft_probs_ptr": "*fp32", "cu_num_draft_ptr": "*i64",
                  "child_offsets_ptr": "*i64", "child_ids_ptr": "*i64", "row_depth_ptr": "*i64",
                  "z_ptr": "*fp64", "is_greedy_ptr": "*i1", "is_one_hot_ptr": "*i1",
                  "is_coupled_ptr": "*i1", "seeds_ptr": "*i64", "positions_ptr": "*i64", "vocab_size": "i32"}
    specs.append((KernelSpec("decide_rows", decide_rows_kernel, decide_sig,
                             {"HAS_DRAFT_PROBS": True, "BLOCK_V": VOCAB_BLOCK}, False), vocab_warps(rocm)))
    descend_sig = {"out_ptr": "*i64", "path_ptr": "*i64", "draft_token_ids_ptr": "*i64", "cu_num_draft_ptr": "*i64",
                   "choice_ptr": "*i64", "final_ptr": "*i64", "out_stride": "i32", "path_stride": "i32"}
    specs.append((KernelSpec("descend", descend_kernel, descend_sig, {}, False), 1))
    ph_sig = {"out_ptr": "*fp64", "seeds_ptr": "*i64", "positions_ptr": "*i64", "purpose": "i32", "n": "i32"}
    specs.append((KernelSpec("uniform64", uniform64_kernel, ph_sig, {"BLOCK": 128}, False), elementwise_warps(rocm)))
    sp_sig = {"out_ptr": "*fp32", "logits_ptr": "*bf16", "temperature_ptr": "*fp32", "top_k_ptr": "*i64",
              "top_p_ptr": "*fp32", "vocab_size": "i32"}
    specs.append((KernelSpec("sampling_probs", sampling_probs_kernel, sp_sig, {"BLOCK_V": VOCAB_BLOCK}, False),
                  vocab_warps(rocm)))
    return specs


def _amd_report(report: CompileReport, asm: str) -> None:
    def field(pattern: str) -> int:
        m = re.search(pattern + r"\s*:?\s+(\d+)", asm)
        return int(m.group(1)) if m else 0

    report.mfma = len(re.findall(r"\bv_mfma_\w+", asm))
    report.registers = field(r"\.vgpr_count")
    report.sgprs = field(r"\.sgpr_count")
    report.spills = field(r"\.vgpr_spill_count")
    report.sgpr_spills = field(r"\.sgpr_spill_count")
    report.scratch_bytes = field(r"; ScratchSize")
    report.lds_bytes = field(r"\.group_segment_fixed_size")
    report.occupancy = field(r"; Occupancy")


def _nvidia_report(report: CompileReport, ptx: str, shared: int) -> None:
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        out = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", str(src), "-o", str(Path(tmp) / "k.cubin")],
                             capture_output=True, text=True, check=True)
    text = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores", text)
    report.registers = int(regs.group(1)) if regs else None
    report.spills = int(spill.group(1)) if spill else 0
    report.lds_bytes = shared


def compile_kernel(spec: KernelSpec, num_warps: int, target_name: str) -> CompileReport:
    target = TARGETS[target_name]
    report = CompileReport(spec.name, target_name, ok=False)
    try:
        compiled = triton.compile(ASTSource(spec.fn, spec.signature, constexprs=spec.constexprs), target=target,
                                  options={"num_warps": num_warps})
    except Exception as err:  # noqa: BLE001 - the report carries the compiler's message
        report.error = f"{type(err).__name__}: {err}"[:2000]
        return report
    report.ok = True
    if target.backend == "hip":
        _amd_report(report, compiled.asm["amdgcn"])
    else:
        _nvidia_report(report, compiled.asm["ptx"], compiled.metadata.shared)
    return report


def compile_all(targets: list[str] | None = None) -> list[CompileReport]:
    reports = []
    for name in targets or list(TARGETS):
        rocm = TARGETS[name].backend == "hip"
        for spec, num_warps in serving_specs(rocm):
            reports.append(compile_kernel(spec, num_warps, name))
    return reports


def format_table(reports: list[CompileReport]) -> str:
    head = "| kernel | target | ok | MFMA | VGPR/regs | SGPR | spills | SGPR→VGPR spills | scratch B | LDS/smem B | occupancy |"
    rows = [head, "|" + "---|" * 11]
    for r in reports:
        def cell(v):
            return "-" if v is None else str(v)
        rows.append(f"| {r.kernel} | {r.target} | {'yes' if r.ok else 'NO'} | {cell(r.mfma)} | {cell(r.registers)} | "
                    f"{cell(r.sgprs)} | {r.spills} | {r.sgpr_spills} | {r.scratch_bytes} | {cell(r.lds_bytes)} | "
                    f"{cell(r.occupancy)} |")
    return "\n".join(rows)
