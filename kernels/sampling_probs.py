"""Temperature / top-k / top-p applied to logits rows, giving the probabilities a request samples from."""

from __future__ import annotations

import torch


def compute_probs(
    logits: torch.Tensor,  # [num_rows, vocab_size]
    temperature: torch.Tensor,  # [num_rows] float, > 0 (greedy rows are handled by the caller)
    top_k: torch.Tensor,  # [num_rows] int64, 0 = off
    top_p: torch.Tensor,  # [num_rows] float in (0, 1], 1 = off
) -> torch.Tensor:  # [num_rows, vocab_size], float32 or float64 (the wider of logits' dtype and float32)
    """Softmax of logits / temperature restricted to the top-k tokens and then to the smallest set of most
    probable tokens whose mass reaches top_p. Ties at a boundary keep every tied token (a rule both ends of the
    wire share, so the draft's q and the target's p are defined the same way)."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(dtype) / temperature.to(dtype).unsqueeze(1)
    vocab = x.shape[1]
    need_k = bool(((top_k > 0) & (top_k < vocab)).any())
    need_p = bool((top_p < 1.0).any())
    if need_k or need_p:
        sorted_x, _ = x.sort(dim=1, descending=True)
        if need_k:
            k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
            kth = sorted_x.gather(1, (k - 1).unsqueeze(1))  # [num_rows, 1]
            x = x.masked_fill(x < kth, float("-inf"))
            sorted_x = sorted_x.masked_fill(torch.arange(vocab).unsqueeze(0) >= k.unsqueeze(1), float("-inf"))
        if need_p:
            sorted_probs = sorted_x.softmax(dim=1)
            mass_before = sorted_probs.cumsum(dim=1) - sorted_probs
            keep = mass_before < top_p.to(dtype).unsqueeze(1)
            keep[:, 0] = True
            # the smallest kept logit is the threshold; ties with it are kept
            threshold = sorted_x.masked_fill(~keep, float("inf")).min(dim=1, keepdim=True).values
            x = x.masked_fill(x < threshold, float("-inf"))
    return x.softmax(dim=1)
