"""The counter-based generator: known-answer Philox, the Triton kernel bit for bit against the torch twin, the
full 64-bit key, distinct purposes, and uniformity with a negative control."""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch

from kernels.philox import (
    RACE_CHUNK_ELEMENTS,
    Purpose,
    exponential64_reference,
    exponential_race_reference,
    philox4x32,
    uniform64_reference,
    uniform64_triton,
)


def _t(*values):
    return tuple(torch.tensor(v, dtype=torch.int64) for v in values)


@pytest.mark.parametrize("size", [None, 1000])
def test_philox4x32_10_known_answers(size):
    """The Random123 known-answer vectors for Philox4x32-10 (kat_vectors), as scalars and as vectors of 1,000
    (torch's vectorised integer multiply, whose wrap the twin relies on)."""
    def t(*values):
        return tuple(x if size is None else x.expand(size) for x in _t(*values))

    def words(out):
        assert all(bool((x == x.flatten()[0]).all()) for x in out)
        return [int(x.flatten()[0]) for x in out]

    zero = philox4x32(t(0, 0), t(0, 0, 0, 0))
    assert words(zero) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    ones = philox4x32(t(0xFFFFFFFF, 0xFFFFFFFF), t(0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF))
    assert words(ones) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    pi = philox4x32(t(0xA4093822, 0x299F31D0), t(0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344))
    assert words(pi) == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def test_the_32_bit_products_are_exact_on_vectors():
    """_mulhilo's halves against Python's integers, for factors across the whole uint32 range (2^31 and past it
    included, where the int64 product wraps)."""
    from kernels.philox import ROUND_A, ROUND_B, _mulhilo

    b = torch.cat([torch.randint(0, 1 << 32, (4096,), generator=torch.Generator().manual_seed(1)),
                   torch.tensor([0, 1, (1 << 31) - 1, 1 << 31, (1 << 32) - 1])])
    for a in (ROUND_A, ROUND_B):
        high, low = _mulhilo(a, b)
        exact = [a * int(x) for x in b]
        assert high.tolist() == [p >> 32 for p in exact] and low.tolist() == [p & 0xFFFFFFFF for p in exact]


SEEDS = torch.tensor([0, 1, 2**32 + 1, 2**63 - 1, 123456789012345], dtype=torch.int64)
POSITIONS = torch.tensor([0, 5, 5, 2**31, 77], dtype=torch.int64)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter on CPU")
@pytest.mark.parametrize("purpose", list(Purpose))
def test_triton_and_reference_draw_identical_bits(purpose):
    n = 300  # more than two tiles, with a ragged end
    got = uniform64_triton(SEEDS, POSITIONS, int(purpose), n)
    ref = uniform64_reference(SEEDS.unsqueeze(1), POSITIONS.unsqueeze(1), purpose, torch.arange(n).unsqueeze(0))
    assert torch.equal(got, ref)


def test_the_high_32_bits_of_the_seed_matter():
    index = torch.arange(64)
    low = uniform64_reference(5, 3, Purpose.ACCEPT, index)
    assert not torch.equal(low, uniform64_reference(5 + (1 << 32), 3, Purpose.ACCEPT, index))
    assert not torch.equal(low, uniform64_reference(5 + (1 << 62), 3, Purpose.ACCEPT, index))
    # the position's high bits are not part of the key: positions stay below 2^32
    assert torch.equal(low, uniform64_reference(5, 3, Purpose.ACCEPT, index))


def test_every_pair_of_addresses_differs():
    index = torch.arange(16)
    streams = {(s, pos, p): uniform64_reference(s, pos, p, index) for s in (1, 2) for pos in (0, 1) for p in Purpose}
    for (a, x), (b, y) in itertools.combinations(streams.items(), 2):
        assert not torch.equal(x, y), (a, b)


def test_values_are_in_range():
    u = uniform64_reference(SEEDS.unsqueeze(1), POSITIONS.unsqueeze(1), Purpose.ACCEPT, torch.arange(4096))
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    e = exponential64_reference(9, 4, Purpose.TARGET_SAMPLE, torch.arange(4096))
    assert bool((e > 0).all()) and bool(torch.isfinite(e).all())


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_the_chunked_race_is_the_whole_rows_argmax(rows):
    """Chunk by chunk, the race picks what argmax over the whole row of weights / noise picks: across chunk
    boundaries, on a last chunk shorter than the others, and on ties (an all-zero row: its first token)."""
    # three whole chunks and a short one (a chunk's width depends on the threads torch runs)
    n = 3 * max(1024, RACE_CHUNK_ELEMENTS * torch.get_num_threads() // rows) + 17
    generator = torch.Generator().manual_seed(rows)
    weights = torch.rand(rows, n, generator=generator) ** 8
    weights[0, :-5] = 0.0  # only the last chunk can win
    if rows > 1:
        weights[1] = 0.0  # every score ties at 0
    seeds = torch.randint(0, 1 << 62, (rows,), generator=generator)
    positions = torch.randint(0, 4096, (rows,), generator=generator)
    noise = exponential64_reference(seeds.unsqueeze(1), positions.unsqueeze(1), Purpose.TARGET_SAMPLE,
                                    torch.arange(n).unsqueeze(0))
    won = exponential_race_reference(weights, seeds, positions, Purpose.TARGET_SAMPLE)
    assert torch.equal(won, (weights.double() / noise).argmax(dim=1))
    assert int(won[0]) >= n - 5
    if rows > 1:
        assert int(won[1]) == 0


def _ks_statistic(samples: torch.Tensor) -> float:
    """Kolmogorov-Smirnov distance of the samples to U[0, 1)."""
    x = samples.sort().values
    n = x.numel()
    i = torch.arange(1, n + 1, dtype=torch.float64)
    return float(torch.maximum(i / n - x, x - (i - 1) / n).max())


N = 200_000
# P(D_n > t) <= 2 exp(-2 n t^2) (Dvoretzky-Kiefer-Wolfowitz-Massart): 0.01 fails a correct generator < 1e-17.
KS_BOUND = 0.01


def test_uniformity_across_positions_and_seeds():
    positions = torch.arange(N) % 1000
    seeds = torch.arange(N) // 1000
    u = uniform64_reference(seeds, positions, Purpose.ACCEPT, torch.zeros(N, dtype=torch.int64))
    assert _ks_statistic(u) < KS_BOUND
    e = exponential64_reference(seeds, positions, Purpose.TARGET_SAMPLE, torch.zeros(N, dtype=torch.int64))
    assert _ks_statistic(1.0 - torch.exp(-e)) < KS_BOUND  # Exp(1) through its CDF is U[0, 1)


def test_negative_control_a_biased_generator_is_caught():
    positions = torch.arange(N) % 1000
    u = uniform64_reference(torch.arange(N) // 1000, positions, Purpose.ACCEPT, torch.zeros(N, dtype=torch.int64))
    assert _ks_statistic(u.sqrt()) > KS_BOUND  # a plausible bug: a skewed transform of the bits
    assert 2 * math.exp(-2 * N * KS_BOUND**2) < 1e-15
