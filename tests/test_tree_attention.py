"""Tree attention in paged attention: each node sees the prefix (by its position, within a sliding window) and
its own ancestors, through a 64-bit mask per query row. Checked against dense attention with an explicit
[query, key] mask, for the torch reference and (under TRITON_INTERPRET=1) the Triton kernel."""

from __future__ import annotations

import os

import pytest
import torch
from test_kernels_triton import _attention_case

from common.token_tree import ancestor_masks, tree_depths
from kernels.paged_attention import TreeMask, paged_attention_reference, paged_attention_tensors

# a verification of a 7-node tree after 30 verified tokens, a plain verification block, a prefill chunk; and of a
# ternary tree of 64 nodes (the last one's mask has the sign bit)
SHAPES = {"7 nodes": [-1, -1, 0, 0, 1, 2, 5], "64 nodes": [-1 if i < 3 else (i - 3) // 3 for i in range(64)]}


def _case(gen, dtype, parents):
    n = len(parents)
    prefix = 30
    q_lens, ctx_lens = [n + 1, 4, 9], [prefix + n, 21, 9]
    query, k_cache, v_cache, tables, qs = _attention_case(gen, 8, 2, 32, 16, q_lens, ctx_lens, dtype)
    # row 0 of the tree sequence is its last verified token (index 29); node i sits at index 30 + i
    masks = [-1, *ancestor_masks(parents), -1, -1, -1, -1, *[-1] * 9]
    positions = [prefix - 1, *[prefix + d for d in tree_depths(parents)], *range(17, 21), *range(9)]
    tree = TreeMask(torch.tensor([prefix, 21, 9], dtype=torch.int32), torch.tensor(masks, dtype=torch.int64),
                    torch.tensor(positions, dtype=torch.int64))
    return query, k_cache, v_cache, tables, qs, ctx_lens, tree


def _dense(query, k_cache, v_cache, tables, qs, ctx_lens, tree, scale, window):
    """Every row against every key of its sequence, with an explicit boolean mask."""
    out = torch.empty(query.shape[0], query.shape[1], v_cache.shape[3])
    kv_heads = k_cache.shape[2]
    group = query.shape[1] // kv_heads
    for s, table in enumerate(tables):
        ctx = ctx_lens[s]
        k = k_cache[table].reshape(-1, kv_heads, k_cache.shape[3])[:ctx].float().repeat_interleave(group, 1)
        v = v_cache[table].reshape(-1, kv_heads, v_cache.shape[3])[:ctx].float().repeat_interleave(group, 1)
        start = int(tree.starts[s])
        key_pos = [i if i < start else None for i in range(ctx)]
        for r in range(qs[s], qs[s + 1]):
            index = ctx - (qs[s + 1] - qs[s]) + (r - qs[s])
            pos, mask = int(tree.positions[r]), int(tree.masks[r])
            allowed = torch.tensor([
                (key_pos[i] is not None and i <= index and (window is None or key_pos[i] > pos - window))
                or (key_pos[i] is None and i <= index and bool((mask >> (i - start)) & 1))
                for i in range(ctx)])
            scores = torch.einsum("hd,khd->hk", query[r].float(), k) * scale
            scores[:, ~allowed] = float("-inf")
            out[r] = torch.einsum("hk,khd->hd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize("shape,window", [("7 nodes", None), ("7 nodes", 12), ("64 nodes", None)])
def test_reference_tree_attention_equals_dense_masked_attention(shape, window):
    query, k_cache, v_cache, tables, qs, ctx_lens, tree = _case(torch.Generator().manual_seed(3), torch.float32,
                                                                SHAPES[shape])
    ref = paged_attention_reference(query, k_cache, v_cache, tables, qs, ctx_lens, 0.2, window, tree=tree)
    dense = _dense(query, k_cache, v_cache, tables, qs, ctx_lens, tree, 0.2, window)
    torch.testing.assert_close(ref, dense, atol=2e-5, rtol=2e-5)
    # the mask matters: without it the nodes would see their siblings' branches
    plain = paged_attention_reference(query, k_cache, v_cache, tables, qs, ctx_lens, 0.2, window)
    assert not torch.allclose(plain[2:8], dense[2:8], atol=1e-3)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("shape,window", [("7 nodes", None), ("7 nodes", 12), ("64 nodes", None)])
def test_triton_tree_attention_equals_dense_masked_attention(shape, window):
    query, k_cache, v_cache, tables, qs, ctx_lens, tree = _case(torch.Generator().manual_seed(4), torch.float32,
                                                                SHAPES[shape])
    width = max(len(t) for t in tables)
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    out = paged_attention_tensors(query, k_cache, v_cache, table_t, torch.tensor(qs, dtype=torch.int32),
                                  torch.tensor(ctx_lens, dtype=torch.int32), max(b - a for a, b in zip(qs, qs[1:], strict=False)),
                                  0.2, window, tree=tree)
    dense = _dense(query, k_cache, v_cache, tables, qs, ctx_lens, tree, 0.2, window)
    torch.testing.assert_close(out, dense, atol=2e-5, rtol=2e-5)
