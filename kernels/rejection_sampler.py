"""Rejection sampling of a batch of draft blocks against the target (Leviathan et al. 2023; Chen et al. 2023).

Vocabulary, as in vLLM's sampler:
- accepted tokens: draft tokens kept, each with probability min(1, p(x) / q(x)), up to the first rejection;
- recovered token: at the first rejection, a sample of norm(max(0, p - q)) replaces the draft token;
- bonus token: when all k drafts are accepted, a sample of p at position k + 1.
Every sequence gets exactly one recovered-or-bonus token, so a round adds between 1 and k + 1 tokens.

Wire modes: greedy rows accept while the draft equals argmax p and then emit argmax p; one-hot rows use
q = delta(x) (accept with probability p(x), recover from p without x); sparse/dense rows use the q the draft
sampled from.

Coupled rows (Gumbel-max coupling; Daliri, Musco and Suresh 2024, arXiv 2408.07978) need no q: at every position
t of the block the verifier computes y_t = argmax_v p_t(v) / E_t(v), with E_t(v) = exponential64(seed, t,
TARGET_SAMPLE, v) the very noise a target-alone step at t races p against. It accepts while the draft equals y
and then emits y. Every emitted token is y_t, an exact sample of p_t, so the output is the target-alone seeded
output whatever the draft proposed; a draft that picks x_t = argmax q_t / E_t with the same noise matches with
probability at least (1 - TV(p, q)) / (1 + TV(p, q)).

Random numbers are drawn where they are used, from kernels/philox.py, keyed by each sequence's seed and by the
position each number decides: the acceptance uniform of the draft at position t is uniform64(seed, t, ACCEPT, 0),
and the recovered-or-bonus sample at position t races p against exponential64(seed, t, TARGET_SAMPLE, v) over
the vocabulary v. No [batch, vocab] noise tensor exists, and the reference draws the very same numbers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import PLACEHOLDER_TOKEN_ID
from kernels.philox import Purpose, exponential64, exponential64_reference, uniform64, uniform64_reference
from kernels.platform import VOCAB_BLOCK, reference_guard, use_triton, vocab_warps
from kernels.spec_decode import SamplingMetadata, SpecDecodeMetadata, check_inputs

ACCEPT = tl.constexpr(int(Purpose.ACCEPT))
TARGET_SAMPLE = tl.constexpr(int(Purpose.TARGET_SAMPLE))


@triton.jit
def sample_target_kernel(
    out_ptr,  # [num_target_rows] int64: the token each row would emit if the round ended there
    target_probs_ptr,  # [num_target_rows, vocab_size]
    draft_token_ids_ptr,  # [num_draft_tokens] int64
    draft_probs_ptr,  # [num_draft_tokens, vocab_size] (unused without HAS_DRAFT_PROBS)
    cu_num_draft_ptr,  # [batch + 1] int64
    is_greedy_ptr,  # [batch] bool
    is_one_hot_ptr,  # [batch] bool
    is_coupled_ptr,  # [batch] bool
    seeds_ptr,  # [batch] int64
    positions_ptr,  # [batch] int64, the position the first draft token decides
    vocab_size,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    seq = tl.program_id(0)
    j = tl.program_id(1)
    start = tl.load(cu_num_draft_ptr + seq)
    k = tl.load(cu_num_draft_ptr + seq + 1) - start
    if j > k:
        return
    if tl.load(is_greedy_ptr + seq):
        return
    row = (start + seq + j).to(tl.int64)  # int64: row * vocab overflows int32 for large batches
    one_hot = tl.load(is_one_hot_ptr + seq)
    coupled = tl.load(is_coupled_ptr + seq)
    is_bonus = j == k
    x = tl.load(draft_token_ids_ptr + start + j, mask=j < k, other=-1)
    seed = tl.load(seeds_ptr + seq)
    position = tl.load(positions_ptr + seq) + j  # the position this row's token decides
    offs = tl.arange(0, BLOCK_V)
    best_r = tl.full([], -1.0, tl.float64)
    best_p = tl.full([], -1.0, tl.float64)
    idx_r = tl.full([], 0, tl.int64)
    idx_p = tl.full([], 0, tl.int64)
    mass_r = tl.full([], 0.0, tl.float64)
    for v0 in range(0, vocab_size, BLOCK_V):
        cols = v0 + offs
        mask = cols < vocab_size
        p = tl.load(target_probs_ptr + row * vocab_size + cols, mask=mask, other=0.0).to(tl.float64)
        residual = p  # the bonus row, and every row of a coupled sequence: y = argmax p / E
        if not (is_bonus | coupled):
            if one_hot:
                residual = tl.where(cols == x, 0.0, p)
            elif HAS_DRAFT_PROBS:
                q = tl.load(draft_probs_ptr + (start + j).to(tl.int64) * vocab_size + cols, mask=mask,
                            other=0.0).to(tl.float64)
                residual = tl.maximum(p - q, 0.0)
        e = exponential64(seed, position, TARGET_SAMPLE, cols)
        score_r = tl.where(mask, residual / e, -1.0)
        score_p = tl.where(mask, p / e, -1.0)
        tile_r = tl.max(score_r, axis=0)
        tile_p = tl.max(score_p, axis=0)
        if tile_r > best_r:  # strict: the first maximum wins, as torch.argmax
            best_r = tile_r
            idx_r = v0 + tl.argmax(score_r, axis=0).to(tl.int64)
        if tile_p > best_p:
            best_p = tile_p
            idx_p = v0 + tl.argmax(score_p, axis=0).to(tl.int64)
        mass_r += tl.sum(residual, axis=0)
    tl.store(out_ptr + row, tl.where(mass_r > 0.0, idx_r, idx_p))


@triton.jit
def rejection_sample_kernel(
    out_ptr,  # [batch, max_k + 1] int64, prefilled with the placeholder
    draft_token_ids_ptr,  # [num_draft_tokens] int64
    cu_num_draft_ptr,  # [batch + 1] int64
    target_probs_ptr,  # [num_target_rows, vocab_size]
    target_argmax_ptr,  # [num_target_rows] int64
    draft_probs_ptr,  # [num_draft_tokens, vocab_size] (unused without HAS_DRAFT_PROBS)
    is_greedy_ptr,  # [batch] bool
    is_one_hot_ptr,  # [batch] bool
    is_coupled_ptr,  # [batch] bool
    seeds_ptr,  # [batch] int64
    positions_ptr,  # [batch] int64
    target_sample_ptr,  # [num_target_rows] int64 from sample_target_kernel
    vocab_size,
    out_stride,
    HAS_DRAFT_PROBS: tl.constexpr,
):
    seq = tl.program_id(0)
    start = tl.load(cu_num_draft_ptr + seq)
    k = tl.load(cu_num_draft_ptr + seq + 1) - start
    row0 = start + seq
    greedy = tl.load(is_greedy_ptr + seq)
    one_hot = tl.load(is_one_hot_ptr + seq)
    coupled = tl.load(is_coupled_ptr + seq)
    seed = tl.load(seeds_ptr + seq)
    position = tl.load(positions_ptr + seq)
    out_row = out_ptr + seq.to(tl.int64) * out_stride
    rejected = False
    for j in range(0, k):
        if not rejected:
            x = tl.load(draft_token_ids_ptr + start + j)
            row = (row0 + j).to(tl.int64)
            if greedy:
                final = tl.load(target_argmax_ptr + row)
                accept = x == final
            elif coupled:
                final = tl.load(target_sample_ptr + row)  # y = argmax p / E at this position
                accept = x == final
            else:
                p_x = tl.load(target_probs_ptr + row * vocab_size + x).to(tl.float64)
                q_x = tl.full([], 1.0, tl.float64)
                if HAS_DRAFT_PROBS:
                    if not one_hot:
                        q_x = tl.load(draft_probs_ptr + (start + j).to(tl.int64) * vocab_size + x).to(tl.float64)
                u = uniform64(seed, position + j, ACCEPT, position * 0)
                accept = u * q_x < p_x
                final = tl.load(target_sample_ptr + row)
            if accept:
                tl.store(out_row + j, x)
            else:
                tl.store(out_row + j, final)
                rejected = True
    if not rejected:
        row = (row0 + k).to(tl.int64)
        if greedy:
            tl.store(out_row + k, tl.load(target_argmax_ptr + row))
        else:
            tl.store(out_row + k, tl.load(target_sample_ptr + row))


def rejection_sample(
    target_probs: torch.Tensor,  # [num_draft_tokens + batch, vocab_size], rows laid out as SpecDecodeMetadata says
    target_argmax: torch.Tensor,  # [num_draft_tokens + batch] int64, argmax of the target logits (greedy rows)
    spec: SpecDecodeMetadata,
    sampling: SamplingMetadata,
) -> torch.Tensor:  # [batch, max_spec_len + 1] int64, padded with PLACEHOLDER_TOKEN_ID
    check_inputs(target_probs, target_argmax, spec, sampling)
    if use_triton(target_probs):
        return rejection_sample_triton(target_probs, target_argmax, spec, sampling)
    return rejection_sample_reference(target_probs, target_argmax, spec, sampling)


def rejection_sample_triton(target_probs: torch.Tensor, target_argmax: torch.Tensor, spec: SpecDecodeMetadata,
                            sampling: SamplingMetadata) -> torch.Tensor:
    batch, max_k = spec.batch_size, spec.max_spec_len
    device = target_probs.device
    out = torch.full((batch, max_k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    if batch == 0:
        return out
    vocab = target_probs.shape[1]
    target_probs = target_probs.contiguous()
    has_q = spec.draft_probs is not None
    q = spec.draft_probs.contiguous() if has_q else target_probs  # a valid pointer the kernel never reads
    # an empty tensor gets a one-element stand-in: the kernels never read it, but the pointer must be valid
    drafts = spec.draft_token_ids if spec.num_draft_tokens else torch.zeros(1, dtype=torch.int64, device=device)
    # step 1: the target's own sample at each row, the token it emits if the round ends there: the recovered token
    # at a rejection, the bonus token after the last draft, the coupled token of a coupled sequence
    target_samples = torch.zeros(target_probs.shape[0], dtype=torch.int64, device=device)  # [num_draft_tokens + batch]
    coupled = sampling.coupled_mask()
    sample_target_kernel[(batch, max_k + 1)](
        target_samples, target_probs, drafts, q, spec.cu_num_draft_tokens, sampling.is_greedy, spec.is_one_hot, coupled,
        sampling.seeds, sampling.positions, vocab, HAS_DRAFT_PROBS=has_q, BLOCK_V=VOCAB_BLOCK,
        num_warps=vocab_warps())
    # step 2: accept drafts up to the first rejection, then emit that row's target sample
    rejection_sample_kernel[(batch,)](
        out, drafts, spec.cu_num_draft_tokens, target_probs, target_argmax, q, sampling.is_greedy, spec.is_one_hot,
        coupled, sampling.seeds, sampling.positions, target_samples, vocab, out.stride(0), HAS_DRAFT_PROBS=has_q, num_warps=1)
    return out


def rejection_sample_reference(target_probs: torch.Tensor, target_argmax: torch.Tensor, spec: SpecDecodeMetadata,
                               sampling: SamplingMetadata) -> torch.Tensor:  # [batch, max_spec_len + 1] int64
    """Torch reference, vectorised over the batch (drafts padded to max_spec_len). It accepts first and then
    samples one recovered-or-bonus token per sequence, where the kernels sample every row's first."""
    reference_guard("rejection_sample_reference")
    batch, max_k = spec.batch_size, spec.max_spec_len
    out = torch.full((batch, max_k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64)
    if batch == 0:
        return out
    cu = spec.cu_num_draft_tokens
    num_draft = cu[1:] - cu[:-1]  # [batch]
    j = torch.arange(max_k).unsqueeze(0)  # [1, max_k]
    valid = j < num_draft.unsqueeze(1)  # [batch, max_k]
    last_draft = max(spec.num_draft_tokens - 1, 0)
    flat = (cu[:-1].unsqueeze(1) + j).clamp_max(last_draft)  # [batch, max_k], int64: row * vocab overflows int32
    rows0 = cu[:-1] + torch.arange(batch)  # [batch], first target row of each sequence
    target_rows = (rows0.unsqueeze(1) + j).clamp_max(target_probs.shape[0] - 1)  # [batch, max_k]
    drafts = spec.draft_token_ids[flat] if spec.num_draft_tokens else torch.zeros_like(flat)
    drafts = torch.where(valid, drafts, torch.zeros_like(drafts))  # [batch, max_k]

    # step 1: accept. Greedy: while the draft equals the target argmax. Random: iff u * q(x) < p(x), i.e. with
    # probability min(1, p(x) / q(x)).
    accept_greedy = drafts == target_argmax[target_rows]
    p_x = target_probs[target_rows, drafts].to(torch.float64)  # [batch, max_k]
    q_x = torch.ones_like(p_x)
    if spec.draft_probs is not None:
        q_x = torch.where(spec.is_one_hot.unsqueeze(1), q_x, spec.draft_probs[flat, drafts].to(torch.float64))
    u = uniform64_reference(sampling.seeds.unsqueeze(1), sampling.positions.unsqueeze(1) + j, Purpose.ACCEPT,
                            torch.zeros_like(j))  # [batch, max_k]
    accept_random = u * q_x < p_x
    coupled = sampling.coupled_mask()
    # coupled: while the draft equals y = argmax p / E; y of the first mismatch is the final token, kept
    accept_coupled, coupled_final = _coupled_accept(target_probs, target_rows, drafts, valid, sampling, coupled)
    accepted = torch.where(sampling.is_greedy.unsqueeze(1), accept_greedy,
                           torch.where(coupled.unsqueeze(1), accept_coupled, accept_random)) & valid
    num_accepted = accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [batch]
    out[:, :max_k] = torch.where(j < num_accepted.unsqueeze(1), drafts, out[:, :max_k])

    # step 2: one recovered-or-bonus token per sequence, from target row rows0 + num_accepted
    final_rows = rows0 + num_accepted  # [batch]
    p = target_probs[final_rows].to(torch.float64)  # [batch, vocab]
    rejected = num_accepted < num_draft  # [batch]
    if bool(rejected.any()):
        at = (cu[:-1] + num_accepted).clamp_max(last_draft)  # [batch], the rejected draft's flat index
        rejected_token = drafts.gather(1, num_accepted.clamp_max(max(max_k - 1, 0)).unsqueeze(1)).squeeze(1)
        residual = p.scatter(1, rejected_token.unsqueeze(1), 0.0)  # one-hot q: p without the rejected token
        if spec.draft_probs is not None:
            residual = torch.where(spec.is_one_hot.unsqueeze(1), residual,
                                   (p - spec.draft_probs[at].to(torch.float64)).clamp_min(0.0))
        # NOTE: p - q can vanish in floating point when rejection was (numerically) impossible; p and q then
        # agree, so sampling p is right.
        usable = rejected & ~sampling.is_greedy & ~coupled & (residual.sum(dim=1) > 0)
        p = torch.where(usable.unsqueeze(1), residual, p)
    # exponential race: argmax p / E with E ~ Exp(1) samples from p / sum(p) without normalising; only the
    # sampled sequences draw noise, at the position their final token decides
    final = torch.where(coupled_final >= 0, coupled_final, target_argmax[final_rows])
    sampled = (~sampling.is_greedy & (coupled_final < 0)).nonzero().squeeze(1)
    if sampled.numel():
        vocab = torch.arange(p.shape[1]).unsqueeze(0)
        noise = exponential64_reference(sampling.seeds[sampled].unsqueeze(1),
                                        (sampling.positions + num_accepted)[sampled].unsqueeze(1),
                                        Purpose.TARGET_SAMPLE, vocab)  # [num_sampled, vocab]
        final[sampled] = (p[sampled] / noise).argmax(dim=1)
    out.scatter_(1, num_accepted.unsqueeze(1), final.unsqueeze(1))
    return out


def _coupled_accept(target_probs: torch.Tensor, target_rows: torch.Tensor, drafts: torch.Tensor, valid: torch.Tensor,
                    sampling: SamplingMetadata, coupled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For the coupled sequences: which drafts equal y_t = argmax p_t / E_t ([batch, max_k] bool), and y at the
    first mismatch ([batch] int64, -1 where there was none). Position by position, only while a sequence still
    matches: a round draws noise for as many rows as it emits tokens, as target-alone decoding does."""
    batch, max_k = drafts.shape
    accept = torch.zeros((batch, max_k), dtype=torch.bool)
    final = torch.full((batch,), -1, dtype=torch.int64)
    live = coupled.nonzero().squeeze(1)
    vocab = torch.arange(target_probs.shape[1]).unsqueeze(0)
    for j in range(max_k):
        live = live[valid[live, j]]
        if live.numel() == 0:
            break
        noise = exponential64_reference(sampling.seeds[live].unsqueeze(1), (sampling.positions[live] + j).unsqueeze(1),
                                        Purpose.TARGET_SAMPLE, vocab)  # [num_live, vocab]
        y = (target_probs[target_rows[live, j]].to(torch.float64) / noise).argmax(dim=1)
        match = y == drafts[live, j]
        accept[live[match], j] = True
        final[live[~match]] = y[~match]
        live = live[match]
    return accept, final
