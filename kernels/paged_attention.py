"""Attention of variable-length multi-token queries against a paged KV cache (GQA, causal within the new
tokens, full over the cached prefix), with what the architectures transformers has need per layer: a sliding
window, a logit softcap (Gemma 2: s = c * tanh(s / c) after scaling), attention sinks (gpt-oss: one learned logit
per head that joins the softmax's denominator and attends to nothing), any head dim (80, 96, 256: tiles are the
next power of two, masked) and a value head dim other than the key's (MLA).

Token trees (speculative decoding): a sequence's last queries may be the nodes of a tree, cached from index
`start` on in node order. A node sees the keys before `start` (the verified prefix, by its own position: causal
and windowed) and the nodes of its own path from the root: its row's 64-bit ancestor mask (bit j: node j, itself
included) selects them, so no [nodes, nodes] mask exists per head. Its position (RoPE, the window) is the prefix's
length plus its depth, not its index in the cache. A tree's depth must stay below the sliding window.

The Triton kernel runs one program per (sequence, tile of BLOCK_M query rows, query head). It walks the keys
in BLOCK_N steps, gathering each key's slot through the block table, with an online softmax in fp32: no score
matrix larger than a [BLOCK_M, BLOCK_N] tile exists. Prefill chunks and verification blocks go through the same
kernel; a verification block of k + 1 <= 16 rows is one tile.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.platform import (
    ATTENTION_AUTOTUNE,
    ATTENTION_TILES,
    attention_warps,
    is_rocm,
    reference_guard,
    use_triton,
)


@triton.jit
def paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim_v]
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim_v]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    query_start_ptr,  # [num_seqs + 1] int32
    context_lens_ptr,  # [num_seqs] int32
    scale,
    max_blocks_per_seq,
    sliding_window,  # 0: none
    softcap,  # 0.0: none
    sinks_ptr,  # [num_heads] fp32 (read only with HAS_SINKS)
    tree_starts_ptr,  # [num_seqs] int32: a sequence's first tree node's index (its context length: no tree)
    tree_masks_ptr,  # [num_tokens] int64: per query row, bit j = may see tree node j (-1: every key, causally)
    positions_ptr,  # [num_tokens] int64: per query row, its position (the window's reference)
    HAS_TREE: tl.constexpr,  # the three above are read
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,  # upcast tl.dot inputs (CPU interpreter only: its bf16 dot is wrong)
):
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // (NUM_HEADS // NUM_KV_HEADS)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    ctx = tl.load(context_lens_ptr + seq)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q_pos = ctx - q_len + offs_m  # absolute positions of the query rows
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * (NUM_HEADS * HEAD_DIM) + head * HEAD_DIM + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_mask = offs_dv < HEAD_DIM_V
    if HAS_SINKS:  # the sink is one more logit in every row's softmax, with no value: start the running max there
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(sinks_ptr + head).to(tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    last = tl.minimum(ctx, ctx - q_len + tile * BLOCK_M + BLOCK_M)  # no key past the tile's last query
    first = 0
    if HAS_TREE:
        tree_start = tl.load(tree_starts_ptr + seq)
        row_mask = tl.load(tree_masks_ptr + rows, mask=m_mask, other=-1)
        q_true = tl.load(positions_ptr + rows, mask=m_mask, other=0).to(tl.int32)
        if sliding_window > 0:  # from the tile's first position (a node's ancestors are all within the window)
            lowest = tl.min(tl.where(m_mask, q_true, 2147483647), axis=0)
            first = tl.maximum(0, (lowest - sliding_window + 1) // BLOCK_N * BLOCK_N)
    elif sliding_window > 0:
        first = tl.maximum(0, (ctx - q_len + tile * BLOCK_M - sliding_window + 1) // BLOCK_N * BLOCK_N)
    # NOTE: BLOCK_N spans BLOCK_N // PAGE_SIZE whole pages. Each page is contiguous, so its K/V tile is a scalar
    # int64 base plus a loop-invariant int32 offset tile; a [BLOCK_N, BLOCK_D] tensor of 64-bit gather pointers
    # instead cost Hopper 255 registers and spills.
    PAGES: tl.constexpr = BLOCK_N // PAGE_SIZE
    offs_t = tl.arange(0, PAGE_SIZE)
    tile_off = offs_t[:, None] * (NUM_KV_HEADS * HEAD_DIM) + offs_d[None, :]  # int32 [PAGE_SIZE, BLOCK_D]
    tile_off_v = offs_t[:, None] * (NUM_KV_HEADS * HEAD_DIM_V) + offs_dv[None, :]
    table = block_tables_ptr + seq.to(tl.int64) * max_blocks_per_seq
    for start in range(first, last, BLOCK_N):
        for j in tl.static_range(PAGES):
            page_start = start + j * PAGE_SIZE
            k_pos = page_start + offs_t
            n_mask = k_pos < last
            page = tl.load(table + page_start // PAGE_SIZE, mask=page_start < last, other=0).to(tl.int64)
            base = page * (PAGE_SIZE * NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM
            base_v = page * (PAGE_SIZE * NUM_KV_HEADS * HEAD_DIM_V) + kv_head * HEAD_DIM_V
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(k_cache_ptr + base + tile_off, mask=kv_mask, other=0.0)
            if DOT_FP32:
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32))) * scale
            else:
                s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale  # [BLOCK_M, PAGE_SIZE]
            if softcap > 0:  # c * tanh(s / c); tanh(x) = 1 - 2 / (exp(2x) + 1), which saturates cleanly at +-1
                s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
            allowed = (k_pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
            if HAS_TREE:
                rel = k_pos - tree_start
                in_tree = rel >= 0
                bit = (row_mask[:, None] >> tl.where(in_tree, rel, 0).to(tl.int64)[None, :]) & 1
                allowed = allowed & ((rel < 0)[None, :] | (bit != 0))
                if sliding_window > 0:  # by position; a node's ancestors are all within the window
                    allowed = allowed & (in_tree[None, :] | (k_pos[None, :] > q_true[:, None] - sliding_window))
            elif sliding_window > 0:
                allowed = allowed & (k_pos[None, :] > q_pos[:, None] - sliding_window)
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_cache_ptr + base_v + tile_off_v, mask=n_mask[:, None] & dv_mask[None, :], other=0.0)
            if DOT_FP32:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32))
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + rows[:, None] * (NUM_HEADS * HEAD_DIM_V) + head * HEAD_DIM_V + offs_dv[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & dv_mask[None, :])


@functools.cache
def _autotuned_kernel():
    configs = [triton.Config({"BLOCK_M": t.block_m, "BLOCK_N": t.block_n}, num_warps=t.num_warps)
               for t in ATTENTION_AUTOTUNE["hip" if is_rocm() else "cuda"]]
    return triton.autotune(configs, key=["NUM_HEADS", "NUM_KV_HEADS", "HEAD_DIM", "HEAD_DIM_V", "HAS_SINKS", "HAS_TREE"])(paged_attention_kernel)


# NOTE: blocks of at most this many queries (decoding steps, verification blocks, drafts' catch-up) are computed
# one query at a time, each over exactly the keys it sees, so a token's attention does not depend on the block it
# arrives in. One masked call over the block sums over a different number of keys (the masked ones included), in
# another order: measured on the default target in bfloat16, the first row of a 5-token block differed from the
# same token computed alone, and once in 64 greedy tokens that flipped two logits one bfloat16 step apart (k = 2
# against k = 0). Longer blocks (prefill) take one call; they are chunked the same way whatever k is. The price,
# measured on the int4 default target: a 5-token verification step took 116 ms against 108 ms in one call.
ROW_INVARIANT_MAX_QUERIES = 16


_CHUNK = 128  # queries per score matrix of the softcap / sinks reference path


def _attend(q, k, v, scale, allowed, softcap, sinks) -> torch.Tensor:
    """Attention with a logit softcap and/or sinks, which scaled_dot_product_attention has no terms for: q [1, H,
    n, D], k [1, KVH, ctx, D], v [1, KVH, ctx, Dv], allowed [n, ctx] bool; scores in
    float32 at least. Returns [1, H, n, Dv]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    dt = torch.promote_types(q.dtype, torch.float32)
    s = torch.matmul(q.to(dt), k.to(dt).transpose(-1, -2)) * scale  # [1, H, n, ctx]
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.to(dt).view(1, -1, 1, 1).expand(1, s.shape[1], s.shape[2], 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    return torch.matmul(p, v.to(dt)).to(q.dtype)


@dataclass(frozen=True)
class TreeMask:
    """The token trees of a batch (see the module's docstring), on the host for the reference or on the device
    for the kernel."""

    starts: torch.Tensor  # [num_seqs] int32: the index of a sequence's first tree node; its context length: no tree
    masks: torch.Tensor  # [num_tokens] int64: per query row, bit j set = it sees tree node j; -1 outside trees
    positions: torch.Tensor  # [num_tokens] int64: per query row, its position
    # the reference's keys per (row, window), computed once per forward (every layer asks again)
    _keys: dict = field(default_factory=dict, compare=False, repr=False)

    def to(self, device: torch.device) -> TreeMask:
        return TreeMask(self.starts.to(device), self.masks.to(device), self.positions.to(device))

    def keys(self, row: int, index: int, tree_start: int, window: int | None,
             device: torch.device) -> tuple[int, int, torch.Tensor]:
        """The keys query row `row` (at `index` in its sequence's cache) sees: the prefix before the tree, causally
        and within the window by its position ([low, end)), then the tree nodes its mask selects (their indices)."""
        found = self._keys.get((row, window))
        if found is None:
            mask, position = int(self.masks[row]), int(self.positions[row])
            low = max(0, position - window + 1) if window is not None else 0
            nodes = [tree_start + j for j in range(max(0, index + 1 - tree_start)) if (mask >> j) & 1]
            found = self._keys[(row, window)] = (low, min(index + 1, tree_start),
                                                 torch.tensor(nodes, dtype=torch.long, device=device))
        return found


def _one_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query row q [1, H, 1, D] over k, v [1, KVH, L, D]: the heads that share a KV head are that head's
    queries, so K and V are not repeated per head. Every row of a block of at most ROW_INVARIANT_MAX_QUERIES, and
    every tree node, is computed this way. Returns [1, H, 1, Dv]."""
    heads, kv_heads = q.shape[1], k.shape[1]
    o = F.scaled_dot_product_attention(q.reshape(1, kv_heads, heads // kv_heads, q.shape[3]), k, v, scale=scale)
    return o.reshape(1, heads, 1, v.shape[3])


def paged_attention_reference(query, key_cache, value_cache, block_tables, query_start, context_lens, scale,
                              sliding_window=None, softcap=None, sinks=None, tree=None) -> torch.Tensor:
    reference_guard("paged_attention_reference")
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    head_dim_v = value_cache.shape[3]
    gqa = num_kv_heads != num_heads
    plain = not softcap and sinks is None
    out = query.new_empty((num_tokens, num_heads, head_dim_v))
    for i, table in enumerate(block_tables):
        q0, q1 = query_start[i], query_start[i + 1]
        n, ctx = q1 - q0, context_lens[i]
        if n == 0:
            continue
        blocks = torch.tensor(table[: (ctx + block_size - 1) // block_size], dtype=torch.long,
                              device=key_cache.device)
        k = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx].transpose(0, 1).unsqueeze(0)  # [1,KVH,ctx,D]
        v = value_cache[blocks].reshape(-1, num_kv_heads, head_dim_v)[:ctx].transpose(0, 1).unsqueeze(0)
        q = query[q0:q1].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        tree_start = int(tree.starts[i]) if tree is not None else ctx
        if tree_start < ctx:  # a token tree: each row over the keys it sees (the prefix, then its ancestors)
            for j in range(n):
                low, end, nodes = tree.keys(q0 + j, ctx - n + j, tree_start, sliding_window, query.device)
                kj = torch.cat([k[:, :, low:end], k.index_select(2, nodes)], dim=2)
                vj = torch.cat([v[:, :, low:end], v.index_select(2, nodes)], dim=2)
                if plain:
                    o = _one_query(q[:, :, j:j + 1], kj, vj, scale)
                else:
                    everything = torch.ones((1, kj.shape[2]), dtype=torch.bool, device=query.device)
                    o = _attend(q[:, :, j:j + 1], kj, vj, scale, everything, softcap, sinks)
                out[q0 + j] = o[0, :, 0]
            continue
        if n <= ROW_INVARIANT_MAX_QUERIES:
            for j in range(n):
                end = ctx - n + j + 1  # keys 0 .. this query's position
                start = max(0, end - sliding_window) if sliding_window is not None else 0
                if plain:
                    o = _one_query(q[:, :, j:j + 1], k[:, :, start:end], v[:, :, start:end], scale)
                else:
                    everything = torch.ones((1, end - start), dtype=torch.bool, device=query.device)
                    o = _attend(q[:, :, j:j + 1], k[:, :, start:end], v[:, :, start:end], scale, everything,
                                softcap, sinks)
                out[q0 + j] = o[0, :, 0]
            continue
        q_pos = torch.arange(ctx - n, ctx, device=query.device).unsqueeze(1)  # [n, 1]
        k_pos = torch.arange(ctx, device=query.device).unsqueeze(0)  # [1, ctx]
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        if plain:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)
        else:  # a score matrix per chunk of queries: [H, chunk, ctx], never [H, n, ctx] for a long prefill
            o = torch.cat([_attend(q[:, :, a:a + _CHUNK], k, v, scale, allowed[a:a + _CHUNK], softcap, sinks)
                           for a in range(0, n, _CHUNK)], dim=2)
        out[q0:q1] = o.squeeze(0).transpose(0, 1)
    return out


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: list[list[int]],  # per sequence, its blocks in order
    query_start: list[int],  # [num_seqs + 1] offsets of each sequence's queries in `query`
    context_lens: list[int],  # [num_seqs] cached tokens of each sequence, its new tokens included
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]
    tree: TreeMask | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim_v]
    """The new tokens of sequence i sit at cache indices context_lens[i] - n_i .. context_lens[i] - 1 and their
    K/V must already be written into the cache."""
    if not use_triton(query, key_cache) or query.dtype == torch.float64:
        return paged_attention_reference(query, key_cache, value_cache, block_tables, query_start, context_lens,
                                         scale, sliding_window, softcap, sinks, tree)
    meta = attention_metadata(block_tables, query_start, context_lens, query.device, tree)
    return paged_attention_tensors(query, key_cache, value_cache, meta.block_tables, meta.query_start,
                                   meta.context_lens, meta.max_query_len, scale, sliding_window, softcap=softcap,
                                   sinks=sinks, tree=meta.tree)


@dataclass(frozen=True)
class AttentionMetadata:
    """The Triton launch's metadata on the device, built once per forward pass (or held in static buffers)."""

    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32; entries past a sequence's blocks unread
    query_start: torch.Tensor  # [num_seqs + 1] int32
    context_lens: torch.Tensor  # [num_seqs] int32; 0 with an empty query: a padding sequence, skipped
    max_query_len: int  # sets the launch grid's query tiles
    tree: TreeMask | None = None  # on the device; None: no token tree in the batch


def longest_query(query_start: list[int]) -> int:
    return max(b - a for a, b in zip(query_start, query_start[1:], strict=False))


def attention_metadata(block_tables: list[list[int]], query_start: list[int], context_lens: list[int],
                       device: torch.device, tree: TreeMask | None = None) -> AttentionMetadata:
    """From host lists, in one host-to-device copy: block tables zero-padded to the longest, query_start,
    context_lens, and the longest query."""
    width = max(1, max(len(t) for t in block_tables))
    num_seqs = len(block_tables)
    flat = [b for t in block_tables for b in (*t, *[0] * (width - len(t)))]  # zero-padded rows
    packed = torch.tensor(flat + list(query_start) + list(context_lens), dtype=torch.int32).to(device)
    tables, qs, ctx = packed.split([num_seqs * width, len(query_start), len(context_lens)])
    return AttentionMetadata(tables.view(num_seqs, width), qs, ctx, longest_query(query_start),
                             tree.to(device) if tree is not None else None)


def paged_attention_tensors(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start: torch.Tensor,  # [num_seqs + 1] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]
    tree: TreeMask | None = None,  # on the device
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim_v]
    """The Triton launch with device-side metadata (what a CUDA-graph-friendly runner passes)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, page_size = key_cache.shape[2], key_cache.shape[1]
    head_dim_v = value_cache.shape[3]
    if page_size < 16 or page_size & (page_size - 1):
        raise ValueError(f"the Triton paged attention needs a power-of-two block size >= 16, got {page_size}")
    out = query.new_empty((num_tokens, num_heads, head_dim_v))
    query = query.contiguous()
    sinks = sinks.float().contiguous() if sinks is not None else out  # never read without HAS_SINKS
    # tiles of at least 16 along the head dims: tl.dot's smallest edge
    common = dict(NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
                  BLOCK_D=max(16, triton.next_power_of_2(head_dim)), HEAD_DIM_V=head_dim_v,
                  BLOCK_DV=max(16, triton.next_power_of_2(head_dim_v)), HAS_SINKS=sinks is not out,
                  PAGE_SIZE=key_cache.shape[1], DOT_FP32=not query.is_cuda, HAS_TREE=tree is not None)
    # never read without HAS_TREE
    tree_args = (tree.starts, tree.masks, tree.positions) if tree is not None else (context_lens, block_tables, block_tables)
    args = (out, query, key_cache, value_cache, block_tables, query_start, context_lens, scale, block_tables.stride(0),
            sliding_window or 0, float(softcap or 0.0), sinks, *tree_args)
    if os.environ.get("SPECWIRE_AUTOTUNE") == "1" and query.is_cuda:  # opt-in: the first launch per shape tunes
        grid = lambda meta: (block_tables.shape[0], triton.cdiv(max_query_len, meta["BLOCK_M"]), num_heads)  # noqa: E731
        _autotuned_kernel()[grid](*args, **common)
        return out
    tiles = ATTENTION_TILES
    tiles = type(tiles)(tiles.block_m, max(tiles.block_n, page_size),
                        attention_warps(max(common["BLOCK_D"], common["BLOCK_DV"])))
    grid = (block_tables.shape[0], triton.cdiv(max_query_len, tiles.block_m), num_heads)
    paged_attention_kernel[grid](
        *args, **common, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, num_warps=tiles.num_warps)
    return out
