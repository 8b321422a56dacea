"""From target logits to verdict tokens, in named steps: lay out the drafts and their q, compute the target
probabilities, draw each sequence's random numbers, then kernels.rejection_sampler."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common import rng
from common.sampling import SamplingParams, SparseProbs
from kernels import PLACEHOLDER_TOKEN_ID
from kernels.rejection_sampler import SamplingMetadata, SpecDecodeMetadata, rejection_sample
from kernels.sampling_probs import compute_probs


@dataclass(frozen=True)
class VerifyItem:
    sampling: SamplingParams  # with a seed
    start_position: int  # position of the first draft token (= verified tokens so far)
    draft_token_ids: tuple[int, ...]
    draft_probs: tuple[SparseProbs, ...] | None  # None: one-hot (or greedy)

    @property
    def is_one_hot(self) -> bool:
        return self.draft_probs is None


def verify_batch(
    logits: torch.Tensor,  # [num_draft_tokens + batch, vocab_size]: per item its k_i draft rows then its bonus row
    items: list[VerifyItem],
) -> list[list[int]]:
    """For each item, its accepted draft tokens followed by the recovered or bonus token."""
    target_probs = compute_target_probs(logits, items)  # [num_draft_tokens + batch, vocab_size]
    spec = spec_decode_metadata(items, logits.shape[1], target_probs.dtype)
    sampling = sampling_metadata(items, logits.shape[1])
    out = rejection_sample(target_probs, logits.argmax(dim=1), spec, sampling)  # [batch, max_spec_len + 1]
    return [[t for t in row if t != PLACEHOLDER_TOKEN_ID] for row in out.tolist()]


def compute_target_probs(
    logits: torch.Tensor,  # [num_draft_tokens + batch, vocab_size]
    items: list[VerifyItem],
) -> torch.Tensor:  # [num_draft_tokens + batch, vocab_size]; the rows of greedy items are never read
    """p: the target distribution after each item's temperature, top-k and top-p, in float32 (float64 logits
    stay float64). An all-greedy step returns the logits themselves."""
    row_sampling = [it.sampling for it in items for _ in range(len(it.draft_token_ids) + 1)]
    sampled_rows = [i for i, s in enumerate(row_sampling) if not s.is_greedy]
    if not sampled_rows:
        return logits
    params = [row_sampling[i] for i in sampled_rows]
    idx = torch.tensor(sampled_rows)
    probs = torch.zeros(logits.shape, dtype=torch.float64 if logits.dtype == torch.float64 else torch.float32)
    probs[idx] = compute_probs(
        logits[idx],
        torch.tensor([s.temperature for s in params]),
        torch.tensor([s.top_k for s in params], dtype=torch.int64),
        torch.tensor([s.top_p for s in params]),
    )
    return probs


def spec_decode_metadata(items: list[VerifyItem], vocab_size: int, probs_dtype: torch.dtype) -> SpecDecodeMetadata:
    """The drafts flattened, and q densified from its (row, token id, prob) triples for the sampled items that
    sent it (greedy items never read q, one-hot items have none)."""
    draft_token_ids = torch.tensor([t for it in items for t in it.draft_token_ids], dtype=torch.int64)
    cu_num_draft_tokens = torch.zeros(len(items) + 1, dtype=torch.int64)
    cu_num_draft_tokens[1:] = torch.tensor([len(it.draft_token_ids) for it in items], dtype=torch.int64).cumsum(0)
    rows: list[int] = []
    token_ids: list[int] = []
    probs: list[float] = []
    for it, first_row in zip(items, cu_num_draft_tokens.tolist(), strict=False):
        if it.is_one_hot or it.sampling.is_greedy:
            continue
        for j, q in enumerate(it.draft_probs):
            rows.extend([first_row + j] * len(q.token_ids))
            token_ids.extend(q.token_ids)
            probs.extend(q.probs)
    draft_probs = None
    if rows:
        draft_probs = torch.zeros((draft_token_ids.numel(), vocab_size), dtype=probs_dtype)
        draft_probs[torch.tensor(rows), torch.tensor(token_ids)] = torch.tensor(probs, dtype=probs_dtype)
    is_one_hot = torch.tensor([it.is_one_hot for it in items], dtype=torch.bool)
    return SpecDecodeMetadata(draft_token_ids, cu_num_draft_tokens, draft_probs, is_one_hot)


def sampling_metadata(items: list[VerifyItem], vocab_size: int) -> SamplingMetadata:
    """Each sampled item's random numbers, keyed by (seed, position, purpose) so they do not depend on the rest of
    the batch: a uniform per draft token, and one Exp(1) vector for the recovered-or-bonus sample."""
    is_greedy = torch.tensor([it.sampling.is_greedy for it in items], dtype=torch.bool)
    uniforms = torch.tensor(
        [rng.uniform(it.sampling.seed, it.start_position + j, rng.Stream.ACCEPT) if not it.sampling.is_greedy else 0.0
         for it in items for j in range(len(it.draft_token_ids))], dtype=torch.float64)
    # greedy rows never read the noise: an all-greedy step needs none of [batch, vocab]
    any_sampled = not bool(is_greedy.all())
    noise = torch.ones((len(items), vocab_size if any_sampled else 1), dtype=torch.float64)
    for i, it in enumerate(items):
        if not it.sampling.is_greedy:
            noise[i] = rng.exponential(it.sampling.seed, it.start_position, rng.Stream.TARGET_SAMPLE, vocab_size)
    return SamplingMetadata(is_greedy, uniforms, noise)
