"""Rejection sampling of a batch of draft blocks against the target (Leviathan et al. 2023; Chen et al. 2023).

Vocabulary, as in vLLM's sampler:
- accepted tokens: draft tokens kept, each with probability min(1, p(x) / q(x)), up to the first rejection;
- recovered token: at the first rejection, a sample of norm(max(0, p - q)) replaces the draft token;
- bonus token: when all k drafts are accepted, a sample of p at position k + 1.
Every sequence gets exactly one recovered-or-bonus token, so a round adds between 1 and k + 1 tokens.

Wire modes: greedy rows accept while the draft equals argmax p and then emit argmax p; one-hot rows use
q = delta(x) (accept with probability p(x), recover from p without x); sparse/dense rows use the q the draft
sampled from. Randomness comes in as tensors (uniforms, exponential noise) so the caller decides how it is
seeded: the services key it by sequence seed and position (common/rng.py).
"""

from __future__ import annotations

import torch

from kernels import PLACEHOLDER_TOKEN_ID


def rejection_sample(
    target_probs: torch.Tensor,  # [num_draft_tokens + batch, vocab_size]; per sequence k_i rows then its bonus row
    target_argmax: torch.Tensor,  # [num_draft_tokens + batch] int64, argmax of the target logits (greedy rows)
    draft_token_ids: torch.Tensor,  # [num_draft_tokens] int64, flattened
    cu_num_draft: torch.Tensor,  # [batch + 1] int64, offsets of each sequence's draft tokens
    draft_probs: torch.Tensor | None,  # [num_draft_tokens, vocab_size] q densified; rows of one-hot seqs unused
    is_greedy: torch.Tensor,  # [batch] bool
    is_one_hot: torch.Tensor,  # [batch] bool, q = delta(draft token)
    uniforms: torch.Tensor,  # [num_draft_tokens] float64 in [0, 1)
    sample_noise: torch.Tensor,  # [batch, vocab_size] float64 Exp(1) noise for the recovered/bonus sample
) -> torch.Tensor:  # [batch, max_k + 1] int64, padded with PLACEHOLDER_TOKEN_ID
    """Torch reference, vectorised over the batch (drafts padded to max_k)."""
    batch = cu_num_draft.numel() - 1
    num_draft = cu_num_draft[1:] - cu_num_draft[:-1]  # [batch]
    max_k = int(num_draft.max()) if batch else 0
    out = torch.full((batch, max_k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64)
    if batch == 0:
        return out
    j = torch.arange(max_k).unsqueeze(0)  # [1, max_k]
    valid = j < num_draft.unsqueeze(1)  # [batch, max_k]
    # int64 offsets: row * vocab overflows int32 at large batch x 151936
    flat = (cu_num_draft[:-1].unsqueeze(1) + j).clamp_max(max(draft_token_ids.numel() - 1, 0))  # [batch, max_k]
    rows0 = cu_num_draft[:-1] + torch.arange(batch)  # first target row of each sequence
    target_rows = rows0.unsqueeze(1) + j  # [batch, max_k]
    drafts = draft_token_ids[flat] if draft_token_ids.numel() else torch.zeros_like(flat)
    drafts = torch.where(valid, drafts, torch.zeros_like(drafts))
    # greedy: accept while the draft equals the target argmax
    accept_greedy = drafts == target_argmax[target_rows.clamp_max(target_argmax.numel() - 1)]
    # random: accept iff u * q(x) < p(x), i.e. with probability min(1, p(x) / q(x))
    p_x = target_probs[target_rows.clamp_max(target_probs.shape[0] - 1), drafts].to(torch.float64)
    q_x = torch.ones_like(p_x)
    if draft_probs is not None:
        q_dense = draft_probs[flat, drafts].to(torch.float64)
        q_x = torch.where(is_one_hot.unsqueeze(1), q_x, q_dense)
    u = uniforms[flat] if uniforms.numel() else torch.zeros_like(p_x)
    accept_random = u * q_x < p_x
    accepted = torch.where(is_greedy.unsqueeze(1), accept_greedy, accept_random) & valid
    num_accepted = accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [batch]
    out[:, :max_k] = torch.where(j < num_accepted.unsqueeze(1), drafts, out[:, :max_k])
    # one recovered-or-bonus token per sequence, from target row rows0 + n
    final_rows = rows0 + num_accepted
    p = target_probs[final_rows].to(torch.float64)  # [batch, vocab]
    rejected = num_accepted < num_draft
    if bool(rejected.any()):
        at = (cu_num_draft[:-1] + num_accepted).clamp_max(max(draft_token_ids.numel() - 1, 0))
        rejected_token = drafts.gather(1, num_accepted.clamp_max(max(max_k - 1, 0)).unsqueeze(1)).squeeze(1)
        one_hot_residual = p.scatter(1, rejected_token.unsqueeze(1), 0.0)
        if draft_probs is not None:
            residual = torch.where(is_one_hot.unsqueeze(1), one_hot_residual,
                                   (p - draft_probs[at].to(torch.float64)).clamp_min(0.0))
        else:
            residual = one_hot_residual
        # NOTE: p - q can vanish in floating point when rejection was (numerically) impossible; p and q then
        # agree, so sampling p is right.
        usable = rejected & ~is_greedy & (residual.sum(dim=1) > 0)
        p = torch.where(usable.unsqueeze(1), residual, p)
    # exponential race: argmax p / E with E ~ Exp(1) samples from p / sum(p) without normalising
    sampled = (p / sample_noise).argmax(dim=1)
    final = torch.where(is_greedy, target_argmax[final_rows], sampled)
    out.scatter_(1, num_accepted.unsqueeze(1), final.unsqueeze(1))
    return out
