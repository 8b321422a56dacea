"""Where kernel launch choices live: Triton or torch, and tile / warp sizes per GPU family.

Dispatch: a wrapper launches Triton when its tensors are on a GPU (CUDA or ROCm: both appear as device type
"cuda" in torch); on CPU tensors it runs the torch reference, which is the CPU product path. Each module also
exposes its `*_triton` launcher, which the tests call on CPU tensors under TRITON_INTERPRET=1.

Tiles: AMD CDNA GPUs (MI250X gfx90a, MI300X gfx942) execute 64-lane wavefronts and NVIDIA 32-lane warps. A
Triton `num_warps` counts hardware warps, so the same value means twice the threads on CDNA. We keep the *thread
count* per program comparable: half the num_warps on ROCm. `tl.dot` tiles stay multiples of 16, which map to MFMA
32x32x8 / 16x16x16 on CDNA and to mma/wgmma on Hopper. Registers: CDNA has 512 VGPRs per lane (for one wave per
SIMD), so a 64x64 fp32 accumulator tile costs 64 VGPRs per lane and leaves room for the K/V tiles without spills.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def use_triton(*tensors: torch.Tensor) -> bool:
    return all(t.is_cuda for t in tensors)


def is_rocm() -> bool:
    return torch.version.hip is not None


@dataclass(frozen=True)
class LaunchConfig:
    num_warps: int
    num_stages: int = 1


def warps(nvidia: int) -> int:
    """num_warps for a kernel tuned with `nvidia` 32-lane warps: the same thread count on a 64-lane wavefront GPU."""
    return max(1, nvidia // 2) if is_rocm() else nvidia


# Serving configurations, shared by the launch wrappers and the ahead-of-time compile report.
ATTENTION_BLOCK_M = 16  # query rows per program: a verification block (k + 1 <= 16) fits in one tile
ATTENTION_BLOCK_N = 64  # keys per inner step
ATTENTION_WARPS = 4
VOCAB_BLOCK = 1024  # vocabulary tile of the row-wise sampling kernels
VOCAB_WARPS = 8
