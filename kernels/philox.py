"""Counter-based random numbers shared by the Triton kernels and their torch references: Philox4x32-10 (Salmon et
al. 2011, the generator behind `tl.rand`), keyed by a request's full 64-bit seed.

One number is addressed by (seed, position, purpose, index): the key is the seed (low and high 32 bits), the
counter is (index, position, purpose, 0). Philox is a bijection of the counter under a fixed key, so distinct
addresses never share a draw, and nothing depends on call order, batch composition or device.

- uniform64: a float64 in [0, 1) with 53 random bits, from the first two 32-bit outputs;
- exponential64: Exp(1) as -log(1 - u), which is exact to compute (1 - u is representable) up to the last bit of
  the platform's log; clamped away from 0 so p / E is always finite.

The torch twin works on int64 tensors that hold uint32 values. A 32x32-bit product is one int64 multiply, relied
on to wrap modulo 2^64 (two's complement; what torch's integer multiply does in practice on every device, though
C++ leaves signed overflow undefined, so tests/test_philox.py checks it on vectors against Python's integers and
the known answers): its low 32 bits are exact and its high 32 bits are the arithmetic shift's, masked. It runs on
any device, so a GPU draft can use it as is. On a CPU verifier it is what a sampled sequence's recovered or bonus
token costs: one number per vocabulary entry. Measured on one core of a 2-core Intel Xeon, 4 rows of a
151,936-token vocabulary: 54 ms, where splitting each product into 16-bit halves (so that nothing wrapped) took
277 ms, a quarter of a 4-stream plain step.
"""

from __future__ import annotations

import enum

import torch
import triton
import triton.language as tl


class Purpose(enum.IntEnum):
    """What a random number decides; part of its address, so the streams of one position never overlap."""

    DRAFT_SAMPLE = 1  # the draft's sample of a draft token
    ACCEPT = 2  # the verifier's acceptance test of a draft token
    TARGET_SAMPLE = 3  # the verifier's recovered or bonus token


ROUND_A = 0xD2511F53
ROUND_B = 0xCD9E8D57
KEY_A = 0x9E3779B9
KEY_B = 0xBB67AE85
N_ROUNDS = 10
_MASK32 = 0xFFFFFFFF
_TWO_POW_MINUS_53 = 1.0 / 9007199254740992.0
EXP_MIN = 1e-300


# -- Triton --------------------------------------------------------------------------------------------------

@triton.jit
def uniform64(seed, position, purpose, index):
    """float64 in [0, 1) for each element of `index` (a tensor: a block, or a scalar such as `position * 0`);
    seed is an int64 scalar, position an integer tensor, purpose an integer."""
    c0 = index.to(tl.uint32)
    zero = c0 * 0
    c1 = zero + position.to(tl.uint32)
    c2 = zero + purpose
    r0, r1, _, _ = tl.philox(seed, c0, c1, c2, zero)
    bits = ((r0 >> 5).to(tl.uint64) << 26) | (r1 >> 6).to(tl.uint64)
    return bits.to(tl.float64) * 1.1102230246251565e-16  # 2^-53


@triton.jit
def exponential64(seed, position, purpose, index):
    u = uniform64(seed, position, purpose, index)
    return tl.maximum(-tl.log(1.0 - u), 1e-300)


@triton.jit
def uniform64_kernel(out_ptr, seeds_ptr, positions_ptr, purpose, n, BLOCK: tl.constexpr):
    """out[row, i] = uniform64(seeds[row], positions[row], purpose, i) for i < n; one program per row and tile."""
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    seed = tl.load(seeds_ptr + row)
    position = tl.load(positions_ptr + row)
    u = uniform64(seed, position, purpose, offs)
    tl.store(out_ptr + row.to(tl.int64) * n + offs, u, mask=offs < n)


def uniform64_triton(seeds: torch.Tensor, positions: torch.Tensor, purpose: int, n: int) -> torch.Tensor:
    """[rows, n] float64 through the Triton kernel (seeds and positions: [rows] int64)."""
    out = torch.empty((seeds.numel(), n), dtype=torch.float64, device=seeds.device)
    block = 128
    if seeds.numel():
        uniform64_kernel[(seeds.numel(), triton.cdiv(n, block))](out, seeds, positions, purpose, n, BLOCK=block)
    return out


# -- torch twin ----------------------------------------------------------------------------------------------

def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32 bits of a * b for a < 2^32 and int64 b holding uint32 values: the product wraps modulo
    2^64, which keeps both halves (the high one comes out of the shift sign-extended, hence the mask)."""
    product = b * a
    return (product >> 32) & _MASK32, product & _MASK32


def philox4x32(key: tuple[torch.Tensor, torch.Tensor], counter: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 on int64 tensors holding uint32 values (broadcast together)."""
    k0, k1 = key
    c0, c1, c2, c3 = counter
    for _ in range(N_ROUNDS):
        hi_b, lo_b = _mulhilo(ROUND_B, c2)
        hi_a, lo_a = _mulhilo(ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + KEY_A) & _MASK32
        k1 = (k1 + KEY_B) & _MASK32
    return c0, c1, c2, c3


def uniform64_reference(seed: torch.Tensor | int, position: torch.Tensor | int, purpose: int,
                        index: torch.Tensor) -> torch.Tensor:
    """float64 in [0, 1), broadcast over seed, position and index (int64; seed in [0, 2^63))."""
    device = index.device
    seed = torch.as_tensor(seed, dtype=torch.int64, device=device)
    position = torch.as_tensor(position, dtype=torch.int64, device=device)
    zero = torch.zeros((), dtype=torch.int64, device=device)
    r0, r1, _, _ = philox4x32((seed & _MASK32, (seed >> 32) & _MASK32),
                              (index & _MASK32, position & _MASK32, zero + purpose, zero))
    bits = ((r0 >> 5) << 26) | (r1 >> 6)
    return bits.to(torch.float64) * _TWO_POW_MINUS_53


def exponential64_reference(seed: torch.Tensor | int, position: torch.Tensor | int, purpose: int,
                            index: torch.Tensor) -> torch.Tensor:
    u = uniform64_reference(seed, position, purpose, index)
    return (-torch.log(1.0 - u)).clamp_min_(EXP_MIN)


# elements of one chunk of a race on the CPU (exponential_race_reference), per thread torch runs: its int64
# temporaries (256 KiB a thread) stay in the cores' caches, where a [rows, vocabulary] pass streams every one of its
# some 40 through memory. Measured on one core of a 2-core Intel Xeon, 4 rows of a 151,936-token vocabulary: 32 ms
# in chunks of 8,192 columns against 61 ms in one pass (where 64 rows in one pass held 78 MB per temporary). A chunk
# is at least 1,024 columns wide.
RACE_CHUNK_ELEMENTS = 1 << 15


def exponential_race_reference(weights: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                               purpose: int) -> torch.Tensor:
    """[rows] int64: argmax over v of weights[r, v] / exponential64(seeds[r], positions[r], purpose, v), the first
    such v on a tie, as torch.argmax would give it over the whole row (weights: [rows, n], n > 0, non-negative and
    finite: a NaN never wins, as in the Triton kernel's race; seeds and positions: [rows] int64). The race samples v
    with probability weights[r, v] / sum(weights[r]). On the CPU it runs in column chunks (RACE_CHUNK_ELEMENTS),
    without a [rows, n] noise tensor; on a GPU in one pass."""
    rows, n = weights.shape
    if n == 0:
        raise ValueError("a race over no tokens")
    device = weights.device
    best = torch.full((rows,), -1.0, dtype=torch.float64, device=device)
    best_at = torch.zeros(rows, dtype=torch.int64, device=device)
    if rows == 0:
        return best_at
    seed, position = seeds.reshape(rows, 1), positions.reshape(rows, 1)
    width = max(1024, RACE_CHUNK_ELEMENTS * torch.get_num_threads() // rows) if device.type == "cpu" else n
    for start in range(0, n, width):
        index = torch.arange(start, min(n, start + width), dtype=torch.int64, device=device)
        scores = weights[:, start:start + width].to(torch.float64) / exponential64_reference(
            seed, position, purpose, index.unsqueeze(0))
        top, at = scores.max(dim=1)
        wins = top > best  # strictly: an earlier chunk keeps a tie, as argmax keeps the first
        best = torch.where(wins, top, best)
        best_at = torch.where(wins, at + start, best_at)
    return best_at
