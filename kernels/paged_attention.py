"""Attention of variable-length multi-token queries against a paged KV cache (GQA, causal within the new
tokens, full over the cached prefix, optional sliding window)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: list[list[int]],  # per sequence, its blocks in order
    query_start: list[int],  # [num_seqs + 1] offsets of each sequence's queries in `query`
    context_lens: list[int],  # [num_seqs] cached tokens of each sequence, its new tokens included
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """The new tokens of sequence i sit at positions context_lens[i] - n_i .. context_lens[i] - 1 and their
    K/V must already be written into the cache."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    out = torch.empty_like(query)
    for i, table in enumerate(block_tables):
        q0, q1 = query_start[i], query_start[i + 1]
        n, ctx = q1 - q0, context_lens[i]
        if n == 0:
            continue
        blocks = torch.tensor(table[: (ctx + block_size - 1) // block_size], dtype=torch.long)
        k = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx]
        v = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx]
        q_pos = torch.arange(ctx - n, ctx).unsqueeze(1)  # [n, 1]
        k_pos = torch.arange(ctx).unsqueeze(0)  # [1, ctx]
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        o = F.scaled_dot_product_attention(
            query[q0:q1].transpose(0, 1).unsqueeze(0),  # [1, H, n, D]
            k.transpose(0, 1).unsqueeze(0),  # [1, KVH, ctx, D]
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=allowed,
            scale=scale,
            enable_gqa=num_kv_heads != num_heads,
        )
        out[q0:q1] = o.squeeze(0).transpose(0, 1)
    return out
