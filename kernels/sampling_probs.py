"""Temperature / top-k / top-p applied to logits rows, giving the probabilities a request samples from."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.platform import VOCAB_BLOCK, reference_guard, use_triton, vocab_warps


@triton.jit
def _sort_key(x):
    """An int64 that orders like the float32 x (IEEE bits, negative range flipped)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def sampling_probs_kernel(
    out_ptr,  # [num_rows, vocab_size] float32
    logits_ptr,  # [num_rows, vocab_size]
    temperature_ptr,  # [num_rows] float32
    top_k_ptr,  # [num_rows] int64
    top_p_ptr,  # [num_rows] float32
    vocab_size,
    BLOCK_V: tl.constexpr,
):
    """Row-wise: the k-th largest logit and then the top-p threshold are found by bisection over the float
    order (32 exact steps on the sortable integer key), each step one pass over the row; no sort."""
    row = tl.program_id(0).to(tl.int64)
    base = row * vocab_size
    t = tl.load(temperature_ptr + row)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    offs = tl.arange(0, BLOCK_V)
    m = tl.full([], float("-inf"), tl.float32)
    lo_val = tl.full([], float("inf"), tl.float32)
    for v0 in range(0, vocab_size, BLOCK_V):
        mask = v0 + offs < vocab_size
        x = tl.load(logits_ptr + base + v0 + offs, mask=mask, other=float("-inf")).to(tl.float32) / t
        m = tl.maximum(m, tl.max(x, axis=0))
        lo_val = tl.minimum(lo_val, tl.min(tl.where(mask, x, float("inf")), axis=0))
    threshold = _sort_key(lo_val)
    if (top_k > 0) & (top_k < vocab_size):
        lo = threshold
        hi = _sort_key(m)
        while lo < hi:  # largest key T with count(key >= T) >= top_k: the k-th largest value
            mid = lo + (hi - lo + 1) // 2
            count = tl.full([], 0, tl.int64)
            for v0 in range(0, vocab_size, BLOCK_V):
                mask = v0 + offs < vocab_size
                x = tl.load(logits_ptr + base + v0 + offs, mask=mask, other=float("-inf")).to(tl.float32) / t
                count += tl.sum(((_sort_key(x) >= mid) & mask).to(tl.int64), axis=0)
            if count >= top_k:
                lo = mid
            else:
                hi = mid - 1
        threshold = lo
    if top_p < 1.0:
        total = tl.full([], 0.0, tl.float32)
        for v0 in range(0, vocab_size, BLOCK_V):
            mask = v0 + offs < vocab_size
            x = tl.load(logits_ptr + base + v0 + offs, mask=mask, other=float("-inf")).to(tl.float32) / t
            keep = mask & (_sort_key(x) >= threshold)
            total += tl.sum(tl.where(keep, tl.exp(x - m), 0.0), axis=0)
        lo = threshold
        hi = _sort_key(m)
        while lo < hi:  # largest key T whose tokens at or above it hold at least top_p of the mass
            mid = lo + (hi - lo + 1) // 2
            mass = tl.full([], 0.0, tl.float32)
            for v0 in range(0, vocab_size, BLOCK_V):
                mask = v0 + offs < vocab_size
                x = tl.load(logits_ptr + base + v0 + offs, mask=mask, other=float("-inf")).to(tl.float32) / t
                mass += tl.sum(tl.where(mask & (_sort_key(x) >= mid), tl.exp(x - m), 0.0), axis=0)
            if mass >= top_p * total:
                lo = mid
            else:
                hi = mid - 1
        threshold = lo
    z = tl.full([], 0.0, tl.float32)
    for v0 in range(0, vocab_size, BLOCK_V):
        mask = v0 + offs < vocab_size
        x = tl.load(logits_ptr + base + v0 + offs, mask=mask, other=float("-inf")).to(tl.float32) / t
        z += tl.sum(tl.where(mask & (_sort_key(x) >= threshold), tl.exp(x - m), 0.0), axis=0)
    for v0 in range(0, vocab_size, BLOCK_V):
        mask = v0 + offs < vocab_size
        x = tl.load(logits_ptr + base + v0 + offs, mask=mask, other=float("-inf")).to(tl.float32) / t
        e = tl.where(_sort_key(x) >= threshold, tl.exp(x - m), 0.0)
        tl.store(out_ptr + base + v0 + offs, e / z, mask=mask)


def compute_probs(
    logits: torch.Tensor,  # [num_rows, vocab_size]
    temperature: torch.Tensor,  # [num_rows] float, > 0 (greedy rows are handled by the caller)
    top_k: torch.Tensor,  # [num_rows] int64, 0 = off
    top_p: torch.Tensor,  # [num_rows] float in (0, 1], 1 = off
) -> torch.Tensor:  # [num_rows, vocab_size], float32 or float64 (the wider of logits' dtype and float32)
    """Softmax of logits / temperature restricted to the top-k tokens and then to the smallest set of most
    probable tokens whose mass reaches top_p. Ties at a boundary keep every tied token, and top-p is decided over
    every token top-k kept, which may be more than k (a rule both ends of the wire and both paths, kernel and
    reference, share, so the draft's q and the target's p are defined the same way on any device)."""
    if use_triton(logits) and logits.dtype != torch.float64 and logits.shape[0] > 0:
        return compute_probs_triton(logits, temperature, top_k, top_p)
    return compute_probs_reference(logits, temperature, top_k, top_p)


def compute_probs_triton(logits, temperature, top_k, top_p) -> torch.Tensor:  # [num_rows, vocab_size] float32
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    sampling_probs_kernel[(logits.shape[0],)](
        out, logits.contiguous(), temperature.to(torch.float32), top_k.to(torch.int64), top_p.to(torch.float32),
        logits.shape[1], BLOCK_V=VOCAB_BLOCK, num_warps=vocab_warps())
    return out


def compute_probs_reference(
    logits: torch.Tensor,  # [num_rows, vocab_size]
    temperature: torch.Tensor,  # [num_rows]
    top_k: torch.Tensor,  # [num_rows] int64
    top_p: torch.Tensor,  # [num_rows]
) -> torch.Tensor:  # [num_rows, vocab_size]
    reference_guard("compute_probs_reference")
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
            # by value, not by position: the tokens tied with the k-th are kept, so top-p is decided over the same
            # set (possibly more than k tokens) that the kernel and the rest of the row keep
            sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
        if need_p:
            sorted_probs = sorted_x.softmax(dim=1)
            mass_before = sorted_probs.cumsum(dim=1) - sorted_probs
            keep = mass_before < top_p.to(dtype).unsqueeze(1)
            # rows without top-p keep everything: the rounded cumsum can reach 1 before the last token
            keep |= (top_p >= 1.0).unsqueeze(1)
            keep[:, 0] = True
            # the smallest kept logit is the threshold; ties with it are kept
            threshold = sorted_x.masked_fill(~keep, float("inf")).min(dim=1, keepdim=True).values
            x = x.masked_fill(x < threshold, float("-inf"))
    return x.softmax(dim=1)


def finite_rows(logits: torch.Tensor) -> torch.Tensor:  # [num_rows] bool
    """Whether each row of `logits` is all finite. On the CPU the extremes of the whole matrix come first (NaN
    propagates into both, an infinity is one of them): one reduction, and only a matrix that is not all finite
    pays for a [rows, vocab] mask. Measured on one core of a 2-core machine, vocabulary 151,936: 0.7 ms for 32
    rows and 4 ms for 160, where the mask took 15 and 90 ms (a third of a verification step's sampling at 32
    streams). On a GPU the mask stays: it costs little there, and the shortcut would cost a sync."""
    if logits.device.type == "cpu" and logits.numel():
        low, high = torch.aminmax(logits)
        if bool(torch.isfinite(low) & torch.isfinite(high)):
            return torch.ones(logits.shape[0], dtype=torch.bool)
    return torch.isfinite(logits).all(dim=1)
