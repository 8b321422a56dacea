"""Counter-based random streams: one generator per (sequence seed, position, purpose).

Keying the random numbers by position, not by call order, makes a seeded generation independent of batch
composition, of how many tokens were drafted per round and of the round structure itself. Each position is
decided once by the verifier, so no key is ever used for two decisions.
"""

from __future__ import annotations

import enum

import torch

_MASK64 = (1 << 64) - 1


class Stream(enum.IntEnum):
    DRAFT_SAMPLE = 1
    ACCEPT = 2
    TARGET_SAMPLE = 3


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(seed: int, position: int, stream: Stream) -> int:
    return _splitmix64(_splitmix64(_splitmix64(seed) ^ position) ^ int(stream)) >> 1


def generator(seed: int, position: int, stream: Stream) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(derive_seed(seed, position, stream))
    return g


def uniform(seed: int, position: int, stream: Stream) -> float:
    """A float64 uniform in [0, 1)."""
    return float(torch.rand((), generator=generator(seed, position, stream), dtype=torch.float64))


def exponential(seed: int, position: int, stream: Stream, n: int) -> torch.Tensor:
    """n i.i.d. Exp(1) float64 variates, clamped away from 0 so p / E is always finite."""
    e = torch.empty(n, dtype=torch.float64).exponential_(generator=generator(seed, position, stream))
    return e.clamp_min_(1e-300)
