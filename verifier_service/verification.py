"""From target logits to verdict tokens, in named steps: pack the step's inputs on the host and copy them to the
logits' device at once, compute the target probabilities, lay out the drafts and densify their q, then
kernels.rejection_sampler, which draws its own random numbers. One copy of the [batch, k + 1] token matrix comes
back. No Python loop runs over rows of the vocabulary, nor over the vocabulary."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from common.sampling import SamplingParams
from kernels import PLACEHOLDER_TOKEN_ID
from kernels.rejection_sampler import rejection_sample
from kernels.sampling_probs import compute_probs, finite_rows
from kernels.spec_decode import SamplingMetadata, SpecDecodeMetadata
from verifier_service.types import ProposeCmd

# One verification: a sequence's sampling parameters (seeded) and its proposal, which starts at the sequence's
# end (its start_position is the position of the first draft token). A proposal without draft_probs is verified
# against q = delta(draft token) (one-hot; greedy and coupled sequences never read q).
Verification = tuple[SamplingParams, ProposeCmd]


@dataclass(frozen=True)
class VerifyInputs:
    """Everything a verification step needs besides the logits, on the logits' device."""

    spec: SpecDecodeMetadata
    sampling: SamplingMetadata
    sampled_rows: torch.Tensor  # [num_sampled_rows] int64, target rows of the non-greedy items
    temperature: torch.Tensor  # [num_sampled_rows] float32
    top_k: torch.Tensor  # [num_sampled_rows] int64
    top_p: torch.Tensor  # [num_sampled_rows] float32
    q_rows: torch.Tensor  # [num_q_entries] int64: (row, token id, prob) triples of the sparse q sent
    q_token_ids: torch.Tensor  # [num_q_entries] int64
    q_probs: torch.Tensor  # [num_q_entries] float64


@dataclass(frozen=True)
class Verified:
    """One item's verdict: its accepted draft tokens then the recovered or bonus token, and the indices of the
    accepted drafts among the proposal's (a chain's 0, 1, ...; a tree's path from its root)."""

    token_ids: list[int]
    path: list[int]


def verify_batch(
    logits: torch.Tensor,  # [num_draft_tokens + batch, vocab_size]: per item its root row then a row per draft
    items: list[Verification],
    inputs: VerifyInputs | None = None,  # already on the device (see HostInputs); None: packed and copied here
) -> list[Verified | None]:
    """For each item, its verdict; None for an item whose target logits are not all finite (its sequence fails
    alone)."""
    if inputs is None:
        inputs = pack_inputs(items, logits.device)
    target_probs = compute_target_probs(logits, inputs)  # [num_draft_tokens + batch, vocab_size]
    spec = densify_draft_probs(inputs, logits.shape[1], target_probs.dtype)
    out, path = rejection_sample(target_probs, logits.argmax(dim=1), spec, inputs.sampling, return_path=True)
    rows = torch.cat([out, path], dim=1).tolist()  # one copy back: [batch, max_path + 1 + max(max_path, 1)]
    width = out.shape[1]
    finite = finite_rows(logits)  # [num_draft_tokens + batch]
    if not bool(finite.all()):  # rare: find the items with a non-finite row
        finite = finite.tolist()
        first = 0
        for i, (_, proposal) in enumerate(items):
            if not all(finite[first:first + proposal.num_draft_tokens + 1]):
                rows[i] = None
            first += proposal.num_draft_tokens + 1
    return [None if row is None else Verified([t for t in row[:width] if t != PLACEHOLDER_TOKEN_ID],
                                              [n for n in row[width:] if n >= 0]) for row in rows]


@dataclass(frozen=True)
class HostInputs:
    """The step's verification inputs on the host: integers, then the reals as their float64 bit patterns, in one
    int64 array, so one host-to-device copy moves them (alone, or behind the forward batch's static buffers)."""

    flat: np.ndarray  # int64
    int_sizes: tuple[int, ...]
    real_sizes: tuple[int, ...]

    def to(self, device: torch.device) -> VerifyInputs:
        """On `device`, in one host-to-device copy."""
        return self.on_device(torch.from_numpy(self.flat).to(device))

    def on_device(self, flat: torch.Tensor) -> VerifyInputs:
        """`flat`: this array's copy on the device."""
        num_ints = sum(self.int_sizes)
        (draft_ids, cu_t, one_hot, greedy, coupled, seeds, positions, rows_t, top_k_t, q_rows_t,
         q_ids_t, parents) = flat[:num_ints].split(self.int_sizes)
        temperature_t, top_p_t, q_probs_t = flat[num_ints:].view(torch.float64).split(self.real_sizes)
        return VerifyInputs(
            spec=SpecDecodeMetadata(draft_ids, cu_t, None, one_hot.bool(), parents if parents.numel() else None),
            sampling=SamplingMetadata(greedy.bool(), seeds, positions, coupled.bool()),
            sampled_rows=rows_t, temperature=temperature_t.float(), top_k=top_k_t, top_p=top_p_t.float(),
            q_rows=q_rows_t, q_token_ids=q_ids_t, q_probs=q_probs_t,
        )


def pack_inputs(items: list[Verification], device: torch.device) -> VerifyInputs:
    """The step's verification inputs on `device`, from one host-to-device copy."""
    return pack_host(items).to(device)


def pack_host(items: list[Verification]) -> HostInputs:
    ints: list[list[int]] = []
    reals: list[list[float]] = []
    ints.append([t for _, p in items for t in p.draft_token_ids])  # draft token ids
    cu = [0]
    for _, p in items:
        cu.append(cu[-1] + p.num_draft_tokens)
    ints.append(cu)  # cu_num_draft_tokens
    ints.append([int(p.draft_probs is None) for _, p in items])  # one-hot
    ints.append([int(s.is_greedy) for s, _ in items])
    ints.append([int(s.is_coupled) for s, _ in items])
    ints.append([s.seed for s, _ in items])
    ints.append([p.start_position for _, p in items])
    sampled_rows, temperature, top_k, top_p = [], [], [], []
    q_rows, q_token_ids, q_probs = [], [], []
    for i, (sampling, proposal) in enumerate(items):
        if sampling.is_greedy:
            continue
        first_row = cu[i] + i
        for j in range(proposal.num_draft_tokens + 1):
            sampled_rows.append(first_row + j)
            temperature.append(sampling.temperature)
            top_k.append(sampling.top_k)
            top_p.append(sampling.top_p)
        for j, q in enumerate(proposal.draft_probs or ()):  # q rows are indexed by flat draft token
            q_rows.extend([cu[i] + j] * len(q.token_ids))
            q_token_ids.extend(q.token_ids)
            # the float32 values the draft sampled from, divided by their exactly rounded sum (see draft_service.draft_sampling)
            total = math.fsum(q.probs)
            q_probs.extend(p / total for p in q.probs)
    ints += [sampled_rows, top_k, q_rows, q_token_ids]
    # token trees: every item's parents (a chain's -1, 0, 1, ...) when any item is a tree; none when all are chains
    any_tree = any(p.draft_parents is not None for _, p in items)
    ints.append([parent for _, p in items for parent in (p.draft_parents or range(-1, p.num_draft_tokens - 1))]
                if any_tree else [])
    reals += [temperature, top_p, q_probs]
    flat = np.concatenate([np.array([x for part in ints for x in part], dtype=np.int64),
                           np.array([x for part in reals for x in part], dtype=np.float64).view(np.int64)])
    return HostInputs(flat, tuple(len(p) for p in ints), tuple(len(p) for p in reals))


def compute_target_probs(
    logits: torch.Tensor,  # [num_draft_tokens + batch, vocab_size]
    inputs: VerifyInputs,
) -> torch.Tensor:  # [num_draft_tokens + batch, vocab_size]; the rows of greedy items are never read
    """p: the target distribution after each item's temperature, top-k and top-p, in float32 (float64 logits
    stay float64). An all-greedy step returns the logits themselves."""
    if inputs.sampled_rows.numel() == 0:
        return logits
    probs = torch.zeros(logits.shape, dtype=torch.float64 if logits.dtype == torch.float64 else torch.float32,
                        device=logits.device)
    probs[inputs.sampled_rows] = compute_probs(logits[inputs.sampled_rows], inputs.temperature, inputs.top_k,
                                               inputs.top_p).to(probs.dtype)
    return probs


def densify_draft_probs(inputs: VerifyInputs, vocab_size: int, probs_dtype: torch.dtype) -> SpecDecodeMetadata:
    """q as [num_draft_tokens, vocab_size], scattered from its (row, token id, prob) triples; None when no
    sampled item sent one (greedy items never read q, one-hot items have none)."""
    spec = inputs.spec
    if inputs.q_rows.numel() == 0:
        return spec
    draft_probs = torch.zeros((spec.num_draft_tokens, vocab_size), dtype=probs_dtype, device=inputs.q_rows.device)
    draft_probs[inputs.q_rows, inputs.q_token_ids] = inputs.q_probs.to(probs_dtype)
    return SpecDecodeMetadata(spec.draft_token_ids, spec.cu_num_draft_tokens, draft_probs, spec.is_one_hot,
                              spec.draft_parents)
