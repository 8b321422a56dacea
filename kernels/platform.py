"""Where kernel launch choices live: Triton or torch, and tile / warp sizes per GPU family.

Dispatch: a wrapper launches Triton when its tensors are on a GPU (CUDA or ROCm: both appear as device type
"cuda" in torch); on CPU tensors it runs the torch reference, which is the CPU product path. Each module also
exposes its `*_triton` launcher, which the tests call on CPU tensors under TRITON_INTERPRET=1.

SPECWIRE_KERNELS=triton forces the GPU path onto CPU tensors and makes every torch reference raise: with
TRITON_INTERPRET=1 (set before anything imports triton) the services then run exactly the code a GPU runs, and
the end-to-end tests prove it on CPU. `reference` forces the references on every device; `auto` is the default.

Tiles. AMD CDNA GPUs (MI250X gfx90a, MI300X gfx942) execute 64-lane wavefronts, NVIDIA GPUs 32-lane warps, and
Triton's `num_warps` counts hardware warps/wavefronts. Choices, from the compiler's own resource lines
(bench/kernels_compile.py; bf16, 32 heads, 8 KV heads, head_dim 128, 16-token pages):
- paged attention walks the cache one page at a time, so each K/V tile is a scalar int64 base plus a
  loop-invariant int32 offset tile. An earlier version gathered [BLOCK_N, head_dim] 64-bit pointers and needed
  255 registers with 240 bytes of spill stores on sm_90, and hundreds of SGPR spills on gfx942. With pages, at
  BLOCK_M 16 / BLOCK_N 64 / 4 warps: sm_90 185 registers, no spill; gfx942 114 VGPRs, occupancy 4; gfx90a 106
  VGPRs, occupancy 4; 40 v_mfma per kernel on both CDNA targets, no spill, no scratch. 4 warps are 128 threads on
  Hopper and 256 on CDNA: the 64-lane wavefront halves the VGPRs each lane needs for the same tiles, which is why
  CDNA gets away with the same num_warps. BLOCK_M = 16: a verification block (k + 1 <= 16 rows) is one tile, and
  16 is the smallest MFMA / MMA edge.
- row-wise vocabulary kernels (sampling probs, recovered tokens): reductions, no tl.dot; the same 256 threads
  per program on both, i.e. 8 warps of 32 or 4 wavefronts of 64.
No CUDA-only intrinsics are used anywhere (no inline PTX, no tl.inline_asm_elementwise).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

KERNEL_MODES = ("auto", "triton", "reference")
KERNEL_MODE = os.environ.get("SPECWIRE_KERNELS", "auto")
if KERNEL_MODE not in KERNEL_MODES:
    raise ValueError(f"SPECWIRE_KERNELS must be one of {', '.join(KERNEL_MODES)}, got {KERNEL_MODE!r}")


def use_triton(*tensors: torch.Tensor) -> bool:
    if KERNEL_MODE != "auto":
        return KERNEL_MODE == "triton"
    return all(t.is_cuda for t in tensors)


def reference_guard(name: str) -> None:
    """Called first by every torch reference of a kernel: under SPECWIRE_KERNELS=triton none may run."""
    if KERNEL_MODE == "triton":
        raise RuntimeError(f"SPECWIRE_KERNELS=triton: the torch reference {name} must not run")


def is_rocm() -> bool:
    return torch.version.hip is not None


@dataclass(frozen=True)
class AttentionTiles:
    block_m: int
    block_n: int
    num_warps: int


ATTENTION_TILES = AttentionTiles(block_m=16, block_n=64, num_warps=4)  # the same on both vendors, see above


def attention_warps(block_d: int, rocm: bool | None = None) -> int:
    """Warps of the paged attention for a head-dim tile: ATTENTION_TILES' 4, except 8 on NVIDIA for tiles of 256
    (Gemma's head dim, MLA's 192-dim keys): at 4 warps sm_90 needs 255 registers and spills 40 bytes there
    (bench/kernels_compile.py); CDNA's 64-lane wavefronts hold the same tiles at 4 without spilling."""
    rocm = is_rocm() if rocm is None else rocm
    return ATTENTION_TILES.num_warps if rocm or block_d < 256 else 2 * ATTENTION_TILES.num_warps


def vocab_warps(rocm: bool | None = None) -> int:
    rocm = is_rocm() if rocm is None else rocm
    return 4 if rocm else 8


def elementwise_warps(rocm: bool | None = None) -> int:
    rocm = is_rocm() if rocm is None else rocm
    return 2 if rocm else 4


VOCAB_BLOCK = 1024  # vocabulary tile of the row-wise kernels

# Candidate tiles for `SPECWIRE_AUTOTUNE=1` (see paged_attention.py): the defaults above are the first entry.
ATTENTION_AUTOTUNE = {
    "cuda": [AttentionTiles(16, 64, 4), AttentionTiles(16, 128, 4), AttentionTiles(32, 64, 4), AttentionTiles(16, 64, 8)],
    "hip": [AttentionTiles(16, 64, 4), AttentionTiles(16, 64, 8), AttentionTiles(16, 128, 4), AttentionTiles(32, 64, 4)],
}
