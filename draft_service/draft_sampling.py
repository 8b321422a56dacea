"""Sampling a drafting step's tokens from the draft model's logits, on the host after one device copy.

Each draft token is sampled from q = the request's temperature/top-k/top-p applied to the draft logits, further
truncated to the sequence's most probable tokens (`support`) and renormalised; that truncated q is exactly what
is sent (sparse-q mode), so the verifier's rejection sampling stays lossless. A coupled sequence picks argmax
q / E with E the verifier's own noise at that position (TARGET_SAMPLE): the draft token is then the target's
sample whenever q and p agree closely enough, and a mismatch costs only acceptance, never losslessness.
"""

from __future__ import annotations

import torch

from common.sampling import SparseProbs
from draft_service.sequence import DraftSequence
from kernels.philox import Purpose, exponential64_reference
from kernels.sampling_probs import compute_probs, finite_rows

# the guesses of a correction kept per drafted position: pipelining drafts a branch after each
# (draft_service.pipelining)
ALTERNATIVES = 2

# (token, the q it was sampled from or None for greedy, the draft's confidence, its guesses of a correction)
Sample = tuple[int | None, SparseProbs | None, float, tuple[int, ...]]
NOT_FINITE: Sample = (None, None, 0.0, ())


def support(seq: DraftSequence, q_max_support: int) -> int:
    """How many of the most probable tokens of q a sequence keeps: --q-max-support, or its own smaller limit."""
    own = seq.q_max_support
    return q_max_support if own is None else max(1, min(own, q_max_support))


def sample_drafts(logits: torch.Tensor, seqs: list[DraftSequence], positions: list[int], q_max_support: int, *,
                  need_confidence: bool = False) -> list[Sample]:
    """Per row: (token, q it was sampled from or None for greedy, the draft's confidence: max of its
    distribution; 1.0 unless need_confidence, which costs a softmax over the vocabulary per row, and the
    ALTERNATIVES most likely tokens other than the drafted one, best first). A row whose logits are not all
    finite gives NOT_FINITE: that sequence's block ends there, and the verifier, which decides every token, is
    not misled (a draft's numerics cannot change the output, only its speed)."""
    sampled = [i for i, s in enumerate(seqs) if not s.sampling.is_greedy]
    host, head_numel = _to_host(logits, seqs, sampled, q_max_support, need_confidence)
    head = host[:head_numel].view(logits.shape[0], -1)
    finite = head[:, 0].bool().tolist()
    confidence = head[:, 1].tolist()
    top = head[:, 3:].long().tolist()

    def other_than(token: int, row: int) -> tuple[int, ...]:
        return tuple(t for t in top[row] if t != token)[:ALTERNATIVES]

    out: list[Sample] = [(t, None, c, other_than(t, row))
                         for row, (t, c) in enumerate(zip(head[:, 2].long().tolist(), confidence, strict=True))]
    for i, ok in enumerate(finite):
        if not ok:
            out[i] = NOT_FINITE
    if not sampled:
        return out
    tail = host[head_numel:]
    top_probs = tail[:tail.numel() // 2].view(len(sampled), -1)
    top_ids = tail[tail.numel() // 2:].view(len(sampled), -1).long()
    for row, i in enumerate(sampled):
        if finite[i]:
            out[i] = _sample_row(top_probs[row], top_ids[row], seqs[i], positions[i], q_max_support,
                                 lambda token, i=i: other_than(token, i))
    return out


def _to_host(logits: torch.Tensor, seqs: list[DraftSequence], sampled: list[int], q_max_support: int,
             need_confidence: bool) -> tuple[torch.Tensor, int]:
    """Everything the host needs from this step, in one copy, as float64 (token ids and float32 probabilities are
    exact in it): per row finite, confidence, argmax and the runners-up, then the sampled rows' q,
    [num_sampled, q_max_support] probabilities and ids. One sync per drafting step. (the copy, the head's size)"""
    num_rows, vocab_size = logits.shape
    finite_t = finite_rows(logits)
    confidence_t = (logits.float().softmax(dim=1).max(dim=1).values if need_confidence
                    else logits.new_ones(num_rows, dtype=torch.float32))
    # temperature and top-k/p keep the logits' order
    top_t = logits.topk(min(ALTERNATIVES + 1, vocab_size), dim=1).indices
    head = torch.cat([t.double() for t in (finite_t.unsqueeze(1), confidence_t.unsqueeze(1),
                                           logits.argmax(dim=1, keepdim=True), top_t)], dim=1)
    parts = [head.flatten()]
    if sampled:
        params = [seqs[i].sampling for i in sampled]
        device = logits.device
        rows = torch.tensor(sampled, device=device)
        # a non-finite row's q is never used; zeros keep its probabilities finite
        safe = torch.where(finite_t[rows].unsqueeze(1), logits[rows], 0.0)
        probs = compute_probs(safe, torch.tensor([p.temperature for p in params], device=device),
                              torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
                              torch.tensor([p.top_p for p in params], device=device))
        # NOTE: always the model's --q-max-support, whatever the batch: a row's kept tokens (ties at its cut
        # included) then never depend on the other rows; a sequence with a smaller limit keeps its first ones
        top_probs_t, top_ids_t = probs.topk(min(q_max_support, probs.shape[1]), dim=1)
        parts += [top_probs_t.double().flatten(), top_ids_t.double().flatten()]
    return torch.cat(parts).cpu(), head.numel()


def _sample_row(top_probs: torch.Tensor, top_ids: torch.Tensor, seq: DraftSequence, position: int,
                q_max_support: int, other_than) -> Sample:
    # the sequence's own limit (the verifier's for a q that is sent) cuts q before it is sampled from: the token
    # is drawn from exactly the truncated, renormalised q that travels
    row_probs = top_probs[:support(seq, q_max_support)]
    keep = row_probs > 0
    q_ids = top_ids[:row_probs.numel()][keep]
    # NOTE: the wire carries float32. The draft samples from exactly the float32 values that travel: the
    # exponential race argmax q / E draws from q / sum(q) without normalising, and the verifier divides the same
    # values by their exactly rounded sum (math.fsum), so both sides hold the same q.
    q_sent = (row_probs[keep] / row_probs[keep].sum()).to(torch.float32).to(torch.float64)
    coupled = seq.sampling.is_coupled
    noise = exponential64_reference(seq.sampling.seed, position,
                                    Purpose.TARGET_SAMPLE if coupled else Purpose.DRAFT_SAMPLE, q_ids)
    scores = q_sent / noise
    ranked = scores.topk(min(ALTERNATIVES + 1, scores.numel())).indices
    token = int(q_ids[ranked[0]])
    # coupled: at a mismatch the verifier emits argmax p / E, best guessed by the runners-up of q / E
    alternatives = tuple(q_ids[ranked[1:]].tolist()) if coupled else other_than(token)
    return token, SparseProbs(tuple(q_ids.tolist()), tuple(q_sent.tolist())), float(q_sent.max()), alternatives
