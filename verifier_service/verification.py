"""Turning target logits into verdicts: target probabilities per row, the sequences' random numbers, and
kernels.rejection_sampler."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common import rng
from common.sampling import SamplingParams
from kernels.rejection_sampler import rejection_sample
from kernels.sampling_probs import compute_probs
from verifier_service.types import SparseQ


@dataclass(frozen=True)
class VerifyItem:
    sampling: SamplingParams  # with a seed
    start_position: int  # position of the first draft token (= verified tokens so far)
    draft_token_ids: tuple[int, ...]
    draft_q: tuple[SparseQ, ...] | None


def verify_batch(
    logits: torch.Tensor,  # [sum(k_i + 1), vocab_size]: per item its k_i draft rows then its bonus row
    items: list[VerifyItem],
) -> list[list[int]]:
    """For each item, its accepted draft tokens followed by the recovered or bonus token."""
    vocab = logits.shape[1]
    rows_per_item = [len(it.draft_token_ids) + 1 for it in items]
    row_sampling = [it.sampling for it, n in zip(items, rows_per_item, strict=True) for _ in range(n)]
    is_greedy = torch.tensor([it.sampling.is_greedy for it in items], dtype=torch.bool)
    target_argmax = logits.argmax(dim=1)
    probs = logits  # rows of greedy items are never read as probabilities
    sampled_rows = [i for i, s in enumerate(row_sampling) if not s.is_greedy]
    if sampled_rows:
        idx = torch.tensor(sampled_rows)
        params = [row_sampling[i] for i in sampled_rows]
        probs = torch.zeros(logits.shape, dtype=torch.float64 if logits.dtype == torch.float64 else torch.float32)
        probs[idx] = compute_probs(
            logits[idx],
            torch.tensor([s.temperature for s in params]),
            torch.tensor([s.top_k for s in params], dtype=torch.int64),
            torch.tensor([s.top_p for s in params]),
        )
    draft_ids = torch.tensor([t for it in items for t in it.draft_token_ids], dtype=torch.int64)
    cu = torch.zeros(len(items) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor([len(it.draft_token_ids) for it in items], dtype=torch.int64).cumsum(0)
    is_one_hot = torch.tensor([it.draft_q is None for it in items], dtype=torch.bool)
    draft_probs = None
    if any(it.draft_q is not None and not it.sampling.is_greedy for it in items):
        draft_probs = torch.zeros((draft_ids.numel(), vocab), dtype=probs.dtype)
        row = 0
        for it in items:
            for q in it.draft_q or ():
                if not it.sampling.is_greedy:
                    draft_probs[row, list(q.token_ids)] = torch.tensor(q.probs, dtype=probs.dtype)
                row += 1
            if it.draft_q is None:
                row += len(it.draft_token_ids)
    uniforms = torch.tensor(
        [rng.uniform(it.sampling.seed, it.start_position + j, rng.Stream.ACCEPT) if not it.sampling.is_greedy else 0.0
         for it in items for j in range(len(it.draft_token_ids))], dtype=torch.float64)
    # greedy rows never read the noise: an all-greedy step needs none of [batch, vocab]
    noise = torch.ones((len(items), vocab if sampled_rows else 1), dtype=torch.float64)
    for i, it in enumerate(items):
        if not it.sampling.is_greedy:
            noise[i] = rng.exponential(it.sampling.seed, it.start_position, rng.Stream.TARGET_SAMPLE, vocab)
    out = rejection_sample(probs, target_argmax, draft_ids, cu, draft_probs, is_greedy, is_one_hot, uniforms, noise)
    return [[t for t in row if t >= 0] for row in out.tolist()]
