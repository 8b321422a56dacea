"""Rejection sampling: fixed greedy cases, agreement with the plain loop, and a statistical test per wire mode
with a negative control that the same test must reject."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kernels import PLACEHOLDER_TOKEN_ID
from kernels.philox import Purpose, exponential64_reference
from kernels.rejection_sampler import rejection_sample
from kernels.spec_decode import SamplingMetadata, SpecDecodeMetadata

from sampler_reference import coupled_match_probability, rejection_sample_loop


def _greedy_case(drafts: list[int], target_argmax: list[int]) -> list[int]:
    k, vocab = len(drafts), 16
    logits = torch.full((k + 1, vocab), -10.0)
    logits[torch.arange(k + 1), torch.tensor(target_argmax)] = 10.0
    spec = SpecDecodeMetadata(torch.tensor(drafts, dtype=torch.int64), torch.tensor([0, k]), None,
                              torch.tensor([True]))
    sampling = SamplingMetadata(torch.tensor([True]), torch.tensor([0]), torch.tensor([0]))
    out = rejection_sample(logits, logits.argmax(1), spec, sampling)
    return out[0].tolist()


def test_greedy_all_accepted_plus_bonus():
    assert _greedy_case([3, 4, 5], [3, 4, 5, 9]) == [3, 4, 5, 9]


def test_greedy_early_mismatch_gets_target_token_and_padding():
    assert _greedy_case([3, 7, 5], [3, 4, 5, 9]) == [3, 4, PLACEHOLDER_TOKEN_ID, PLACEHOLDER_TOKEN_ID]


def test_empty_draft_gives_one_target_token():
    assert _greedy_case([], [6]) == [6]


def _random_inputs(gen: torch.Generator, num_draft: list[int], vocab: int, *, greedy_mask, one_hot_mask,
                   coupled_mask=None):
    batch = len(num_draft)
    cu = torch.tensor([0, *torch.tensor(num_draft).cumsum(0).tolist()], dtype=torch.int64)
    total = int(cu[-1])
    target_probs = torch.rand(total + batch, vocab, generator=gen, dtype=torch.float64).pow(4)
    target_probs /= target_probs.sum(1, keepdim=True)
    draft_probs = torch.rand(total, vocab, generator=gen, dtype=torch.float64).pow(4)
    draft_probs[:, : vocab // 3] = 0.0  # sparse support
    draft_probs /= draft_probs.sum(1, keepdim=True)
    drafts = torch.multinomial(draft_probs, 1, generator=gen).squeeze(1) if total else torch.zeros(0, dtype=torch.int64)
    seeds = torch.randint(0, 2**62, (batch,), generator=gen)
    positions = torch.randint(0, 1000, (batch,), generator=gen)
    coupled = None if coupled_mask is None else torch.tensor(coupled_mask)
    for i in range(batch) if coupled_mask else ():
        if not coupled_mask[i]:
            continue
        # a coupled draft that matches the target's own samples for a random number of positions, then differs
        matches = int(torch.randint(0, num_draft[i] + 1, (), generator=gen))
        for j in range(min(matches + 1, num_draft[i])):
            noise = exponential64_reference(int(seeds[i]), int(positions[i]) + j, Purpose.TARGET_SAMPLE,
                                            torch.arange(vocab))
            y = int(torch.argmax(target_probs[int(cu[i]) + i + j] / noise))
            drafts[int(cu[i]) + j] = y if j < matches else (y + 1) % vocab
    return dict(
        target_probs=target_probs, target_argmax=target_probs.argmax(1),
        spec=SpecDecodeMetadata(drafts, cu, draft_probs, torch.tensor(one_hot_mask)),
        sampling=SamplingMetadata(torch.tensor(greedy_mask), seeds, positions, coupled),
    )


@pytest.mark.parametrize("vocab", [100, 8193, 151936])
def test_vectorised_matches_plain_loop(vocab):
    gen = torch.Generator().manual_seed(vocab)
    num_draft = [0, 1, 4, 3, 8, 2, 5, 0, 3, 6]
    # the last four sequences are coupled (one of them greedy, where coupling changes nothing)
    inputs = _random_inputs(gen, num_draft, vocab,
                            greedy_mask=[False, True, False, False, True, False, False, False, True, False],
                            one_hot_mask=[False, False, True, False, False, True, True, True, True, True],
                            coupled_mask=[False] * 6 + [True] * 4)
    out = rejection_sample(**inputs)
    assert out.shape == (len(num_draft), max(num_draft) + 1)
    expected = rejection_sample_loop(**inputs)
    assert [[t for t in row if t != PLACEHOLDER_TOKEN_ID] for row in out.tolist()] == expected
    assert int(out.max()) < vocab


# --- statistics -----------------------------------------------------------------------------------------------

VOCAB, N, K, POSITIONS = 10, 100_000, 3, 3
# E[TV] <= 0.5 sqrt(V/N) = 0.005 and P(TV > 0.005 + t) <= exp(-2 N t^2): 0.015 fails a correct sampler < 3e-9.
TV_BOUND = 0.015


def _position_dists(seed: int, sharp: float) -> torch.Tensor:  # [POSITIONS + K + 1, VOCAB]
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(POSITIONS + K + 1, VOCAB, generator=g, dtype=torch.float64) * sharp).softmax(1)


def simulate(mode: str, *, lie_about_q: bool = False, emit_draft: bool = False, seed: int = 0,
             matches: torch.Tensor | None = None) -> torch.Tensor:
    """N independent generations of POSITIONS tokens where the target at position t is p[t] and the draft
    samples from q[t] (context-free, so the exact answer is known). Returns tokens [N, POSITIONS].

    coupled: the draft picks argmax q / E with the verifier's noise, and the verifier couples. emit_draft breaks
    that verifier: at a mismatch it emits the draft token x instead of its own y. `matches` ([2, POSITIONS]),
    when given, counts the drafts at each position and how many were accepted."""
    p, q = _position_dists(1, 1.5), _position_dists(2, 1.5)
    if mode == "sparse":  # the draft truncates its distribution to the top 4 tokens and sends exactly that
        cut = q.topk(4, dim=1).values[:, -1:]
        q = torch.where(q >= cut, q, torch.zeros_like(q))
        q /= q.sum(1, keepdim=True)
    gen = torch.Generator().manual_seed(seed)
    out = torch.full((N, POSITIONS), -1, dtype=torch.int64)
    pos = torch.zeros(N, dtype=torch.int64)
    while bool((pos < POSITIONS).any()):
        live = (pos < POSITIONS).nonzero().squeeze(1)
        b = live.numel()
        t = pos[live].unsqueeze(1) + torch.arange(K + 1)  # [b, K + 1] positions of the draft rows + bonus row
        q_rows = q[t[:, :K]].reshape(b * K, VOCAB)
        drafts = torch.multinomial(q_rows, 1, generator=gen).squeeze(1)
        seeds = live + seed * N
        if mode == "coupled":  # the draft races q against the verifier's own noise at each position
            noise = exponential64_reference(seeds.repeat_interleave(K).unsqueeze(1), t[:, :K].reshape(-1, 1),
                                            Purpose.TARGET_SAMPLE, torch.arange(VOCAB).unsqueeze(0))
            drafts = (q_rows / noise).argmax(dim=1)
        sent_q = q_rows
        if lie_about_q:  # the classic bug: telling the verifier a q other than the one sampled from
            sent_q = torch.full_like(q_rows, 1.0 / VOCAB)
        target_probs = p[t].reshape(b * (K + 1), VOCAB)
        ids_only = mode in ("one-hot", "coupled")
        spec = SpecDecodeMetadata(drafts, torch.arange(b + 1) * K, None if ids_only else sent_q,
                                  torch.full((b,), ids_only))
        # each generation has its own seed and decides each position once, as a service would
        sampling = SamplingMetadata(torch.zeros(b, dtype=torch.bool), seeds, pos[live],
                                    torch.full((b,), mode == "coupled"))
        res = rejection_sample(target_probs, target_probs.argmax(1), spec, sampling)
        drafts = drafts.view(b, K)
        accepted = (res[:, :K] == drafts).to(torch.int64).cumprod(dim=1).sum(dim=1)  # [b]
        if emit_draft:  # the broken verifier: x instead of y at the first mismatch
            rejected = (accepted < K).nonzero().squeeze(1)
            res[rejected, accepted[rejected]] = drafts[rejected, accepted[rejected]]
        if matches is not None:  # positions decided by a draft (a mismatch included), and the accepted ones
            for j in range(K):
                cur = pos[live] + j
                drafted = (accepted >= j) & (cur < POSITIONS)
                matches[0].index_add_(0, cur[drafted], torch.ones_like(cur[drafted]))
                ok = drafted & (accepted > j)
                matches[1].index_add_(0, cur[ok], torch.ones_like(cur[ok]))
        for j in range(K + 1):
            cur = pos[live]
            ok = (res[:, j] >= 0) & (cur < POSITIONS)
            out[live[ok], cur[ok]] = res[ok, j]
            pos[live[ok]] += 1
    return out


def tv_per_position(tokens: torch.Tensor) -> list[float]:
    p = _position_dists(1, 1.5)
    return [0.5 * float((torch.bincount(tokens[:, t], minlength=VOCAB) / N - p[t]).abs().sum())
            for t in range(POSITIONS)]


@pytest.mark.parametrize("mode", ["one-hot", "sparse", "dense", "coupled"])
def test_output_follows_target_distribution(mode):
    tvs = tv_per_position(simulate(mode))
    assert max(tvs) <= TV_BOUND, tvs


def test_negative_control_wrong_q_is_rejected():
    tvs = tv_per_position(simulate("dense", lie_about_q=True))
    assert max(tvs) > TV_BOUND, f"the test cannot tell a biased sampler apart: {tvs}"


def test_negative_control_coupled_verifier_emitting_the_draft_token_is_rejected():
    """A coupled verifier that emits x instead of y at a mismatch outputs the draft's q wherever a draft decided."""
    tvs = tv_per_position(simulate("coupled", emit_draft=True))
    assert max(tvs) > TV_BOUND, f"the test cannot tell a broken coupled verifier apart: {tvs}"


def test_coupled_acceptance_per_position_meets_the_bound():
    """Each position's measured match rate agrees with the exact coupling probability (within 4 sigma), and that
    probability is at least (1 - TV) / (1 + TV) (Daliri et al. 2024, Theorem 3)."""
    p, q = _position_dists(1, 1.5), _position_dists(2, 1.5)
    matches = torch.zeros(2, POSITIONS, dtype=torch.int64)
    simulate("coupled", seed=3, matches=matches)
    for t in range(POSITIONS):
        tv = 0.5 * float((p[t] - q[t]).abs().sum())
        exact = coupled_match_probability(p[t], q[t])
        assert exact >= (1 - tv) / (1 + tv) - 1e-12
        n, hits = int(matches[0, t]), int(matches[1, t])
        rate, sigma = hits / n, math.sqrt(exact * (1 - exact) / n)
        assert abs(rate - exact) < 4 * sigma, (t, rate, exact, n)
        assert rate >= (1 - tv) / (1 + tv) - 4 * sigma, (t, rate, tv)
        assert exact < 1 - tv, "coupling trades acceptance for invariance: it cannot beat rejection sampling here"


def test_bound_derivation():
    expected_tv = 0.5 * math.sqrt(VOCAB / N)
    assert math.exp(-2 * N * (TV_BOUND - expected_tv) ** 2) < 1e-8


def test_acceptance_rate_matches_theory():
    """A one-position check of alpha = sum min(p, q) for the dense mode."""
    p, q = _position_dists(1, 1.5)[0], _position_dists(2, 1.5)[0]
    gen = torch.Generator().manual_seed(5)
    n = 50_000
    drafts = torch.multinomial(q.expand(n, VOCAB), 1, replacement=True, generator=gen).squeeze(1)
    target = torch.stack([p, p], 0).repeat(n, 1)
    spec = SpecDecodeMetadata(drafts, torch.arange(n + 1), q.expand(n, VOCAB), torch.zeros(n, dtype=torch.bool))
    sampling = SamplingMetadata(torch.zeros(n, dtype=torch.bool), torch.arange(n), torch.zeros(n, dtype=torch.int64))
    res = rejection_sample(target, target.argmax(1), spec, sampling)
    rate = float((res[:, 1] >= 0).double().mean())
    assert abs(rate - float(torch.minimum(p, q).sum())) < 0.01


def test_launcher_checks_shapes_and_dtypes():
    gen = torch.Generator().manual_seed(3)
    inputs = _random_inputs(gen, [2, 3], 20, greedy_mask=[False, False], one_hot_mask=[False, True])
    spec, sampling = inputs["spec"], inputs["sampling"]
    bad = {
        "is_greedy": dict(sampling=dataclasses.replace(sampling, is_greedy=torch.tensor([False]))),
        "seeds": dict(sampling=dataclasses.replace(sampling, seeds=sampling.seeds.int())),
        "positions": dict(sampling=dataclasses.replace(sampling, positions=sampling.positions[:1])),
        "draft_probs": dict(spec=dataclasses.replace(spec, draft_probs=spec.draft_probs[:, :10])),
        "target_probs": dict(target_probs=inputs["target_probs"][:-1]),
        "cu_num_draft_tokens": dict(spec=dataclasses.replace(spec, cu_num_draft_tokens=spec.cu_num_draft_tokens + 1)),
    }
    for name, change in bad.items():
        with pytest.raises(ValueError, match=name):
            rejection_sample(**{**inputs, **change})
    rejection_sample(**inputs)  # the unchanged inputs pass
