"""Rejection sampling: fixed greedy cases, agreement with the plain loop, and a statistical test per wire mode
with a negative control that the same test must reject."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kernels import PLACEHOLDER_TOKEN_ID
from kernels.rejection_sampler import SamplingMetadata, SpecDecodeMetadata, rejection_sample

from sampler_reference import rejection_sample_loop


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


def _random_inputs(gen: torch.Generator, num_draft: list[int], vocab: int, *, greedy_mask, one_hot_mask):
    batch = len(num_draft)
    cu = torch.tensor([0, *torch.tensor(num_draft).cumsum(0).tolist()], dtype=torch.int64)
    total = int(cu[-1])
    target_probs = torch.rand(total + batch, vocab, generator=gen, dtype=torch.float64).pow(4)
    target_probs /= target_probs.sum(1, keepdim=True)
    draft_probs = torch.rand(total, vocab, generator=gen, dtype=torch.float64).pow(4)
    draft_probs[:, : vocab // 3] = 0.0  # sparse support
    draft_probs /= draft_probs.sum(1, keepdim=True)
    drafts = torch.multinomial(draft_probs, 1, generator=gen).squeeze(1) if total else torch.zeros(0, dtype=torch.int64)
    return dict(
        target_probs=target_probs, target_argmax=target_probs.argmax(1),
        spec=SpecDecodeMetadata(drafts, cu, draft_probs, torch.tensor(one_hot_mask)),
        sampling=SamplingMetadata(torch.tensor(greedy_mask), torch.randint(0, 2**62, (batch,), generator=gen),
                                  torch.randint(0, 1000, (batch,), generator=gen)),
    )


@pytest.mark.parametrize("vocab", [100, 8193, 151936])
def test_vectorised_matches_plain_loop(vocab):
    gen = torch.Generator().manual_seed(vocab)
    num_draft = [0, 1, 4, 3, 8, 2]
    inputs = _random_inputs(gen, num_draft, vocab, greedy_mask=[False, True, False, False, True, False],
                            one_hot_mask=[False, False, True, False, False, True])
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


def simulate(mode: str, *, lie_about_q: bool = False, seed: int = 0) -> torch.Tensor:
    """N independent generations of POSITIONS tokens where the target at position t is p[t] and the draft
    samples from q[t] (context-free, so the exact answer is known). Returns tokens [N, POSITIONS]."""
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
        sent_q = q_rows
        if lie_about_q:  # the classic bug: telling the verifier a q other than the one sampled from
            sent_q = torch.full_like(q_rows, 1.0 / VOCAB)
        target_probs = p[t].reshape(b * (K + 1), VOCAB)
        spec = SpecDecodeMetadata(drafts, torch.arange(b + 1) * K, None if mode == "one-hot" else sent_q,
                                  torch.full((b,), mode == "one-hot"))
        # each generation has its own seed and decides each position once, as a service would
        sampling = SamplingMetadata(torch.zeros(b, dtype=torch.bool), live + seed * N, pos[live])
        res = rejection_sample(target_probs, target_probs.argmax(1), spec, sampling)
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


@pytest.mark.parametrize("mode", ["one-hot", "sparse", "dense"])
def test_output_follows_target_distribution(mode):
    tvs = tv_per_position(simulate(mode))
    assert max(tvs) <= TV_BOUND, tvs


def test_negative_control_wrong_q_is_rejected():
    tvs = tv_per_position(simulate("dense", lie_about_q=True))
    assert max(tvs) > TV_BOUND, f"the test cannot tell a biased sampler apart: {tvs}"


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
